"""Plain ``nn.Module`` models; fdp makes them functional elsewhere (``fdp.model.functional``).

Nothing here seeds an RNG: weights come from whatever ``torch.manual_seed`` the caller
set, so one seed gives one initialisation on every rank.

>>> _ = torch.manual_seed(0)
>>> model = build_model("mlp", in_features=64, hidden=32, depth=1, out_features=10)
>>> model(torch.randn(4, 64)).shape
torch.Size([4, 10])
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from fdp.targets import locate

__all__ = ["MLP", "ConvNet", "CharTransformer", "build_model", "count_parameters", "hf_model", "MODELS"]


class MLP(nn.Module):
    """``depth`` hidden Linear+ReLU layers, then a Linear head.

    Inputs with more than two dims are flattened after the batch dim, so (B, 1, 8, 8)
    digits work as well as (B, 64).

    >>> MLP(64, 256, 2, 10)(torch.randn(5, 1, 8, 8)).shape
    torch.Size([5, 10])
    """

    def __init__(self, in_features: int, hidden: int, depth: int, out_features: int):
        super().__init__()
        if depth < 0:
            raise ValueError(f"depth={depth!r}: expected an integer >= 0")
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.flatten(1))


class ConvNet(nn.Module):
    """Small conv net for 8×8 digits: two conv-BN-ReLU-maxpool stages and a linear head.

    Shapes: (B, C, 8, 8) -> (B, width, 4, 4) -> (B, 2*width, 2, 2) -> (B, num_classes).
    It carries BatchNorm buffers on purpose, so training exercises buffer handling.

    >>> ConvNet()(torch.randn(3, 1, 8, 8)).shape
    torch.Size([3, 10])
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32):
        super().__init__()
        # No conv bias: the BatchNorm shift that follows makes it redundant.
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * 2 * 2, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:  # flattened digits (B, 64) from load_digits(flatten=True)
            side = math.isqrt(x.shape[1])
            x = x.reshape(x.shape[0], 1, side, side)
        return self.head(self.features(x).flatten(1))


class _CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"n_head={n_head!r}: expected a divisor of d_model={d_model}")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_head)
        # dropout_p is a plain float chosen from self.training: functional_call keeps
        # module mode, so this stays pure under torch.func.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.proj(rearrange(y, "b h t d -> b t (h d)")))


class _Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        # Out-of-place residuals: in-place adds on activations break autograd/torch.func.
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """GPT-style causal character LM: (B, T) int64 tokens -> (B, T, vocab_size) logits.

    Token + learned position embeddings, ``n_layer`` pre-LayerNorm blocks (causal
    self-attention, 4x GELU MLP), a final LayerNorm and an LM head. With ``tie_weights``
    the head shares the token embedding matrix, so it appears once in
    ``named_parameters()`` (as ``tok_emb.weight``).

    >>> m = CharTransformer(vocab_size=50, block_size=16, d_model=32, n_layer=2, n_head=4)
    >>> m(torch.randint(0, 50, (2, 16))).shape
    torch.Size([2, 16, 50])
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        d_model: int,
        n_layer: int,
        n_head: int,
        dropout: float = 0.0,
        tie_weights: bool = True,
    ):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(_Block(d_model, n_head, dropout) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self._init_weights(n_layer)
        if tie_weights:
            self.head.weight = self.tok_emb.weight

    def _init_weights(self, n_layer: int) -> None:
        # GPT-2 init: PyTorch's defaults (unit-variance embeddings) give huge initial
        # logits with a tied head and make the first steps unstable.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # Residual-branch outputs scaled so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        return self.head(self.ln_f(self.blocks(x)))


# Settings every transformers config has (PretrainedConfig's), left out of the hint at a misspelt one.
_HF_COMMON_SETTINGS = frozenset(
    "return_dict output_hidden_states torchscript dtype torch_dtype pruned_heads tie_word_embeddings "
    "chunk_size_feed_forward is_encoder_decoder is_decoder cross_attention_hidden_size add_cross_attention "
    "tie_encoder_decoder architectures "
    "finetuning_task id2label label2id tokenizer_class prefix bos_token_id pad_token_id eos_token_id sep_token_id "
    "decoder_start_token_id task_specific_params problem_type transformers_version model_type output_attentions".split()
)


def hf_model(
    model_class: str | type, vocab_size: int | None = None, num_classes: int | None = None, **config
) -> nn.Module:
    """A Hugging Face ``transformers`` model built from a config, randomly initialised: nothing is downloaded.

    ``model_class`` is the class or its dotted path (``transformers.GPT2LMHeadModel``,
    ``transformers.LlamaForCausalLM``, ``transformers.BertForMaskedLM``, ...); its own
    config class (``model_class.config_class``) is made of ``config`` (``n_layer=2``,
    ``hidden_size=32``, ...) and ``vocab_size``. From the command line,
    ``model._target_=fdp.model.builtin.hf_model +model.model_class=transformers.GPT2LMHeadModel
    +model.n_layer=2``; the data offers ``vocab_size`` (and ``num_classes``, taken as
    ``num_labels`` by a ``...Classification`` class). A setting its config does not have
    is refused (configs otherwise keep a misspelt one silently); ``use_cache`` is off
    unless set, since training never reuses attention keys and values; special-token ids
    of the default config that lie outside a smaller vocabulary are dropped.

    >>> m = hf_model("transformers.GPT2LMHeadModel", vocab_size=50, n_layer=1, n_embd=16, n_head=2, n_positions=32)
    >>> m(torch.randint(0, 50, (2, 8))).logits.shape
    torch.Size([2, 8, 50])
    >>> hf_model("transformers.GPT2LMHeadModel", n_layers=2)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
        ...
    ValueError: n_layers is not a setting of GPT2Config;
    expected one of its settings (vocab_size, n_positions, n_embd, n_layer, n_head, ...)
    """
    cls = locate("model.model_class", model_class) if isinstance(model_class, str) else model_class
    config_class = getattr(cls, "config_class", None)
    if not isinstance(config_class, type):
        raise ValueError(
            f"model_class={getattr(cls, '__name__', cls)!r}: expected a transformers model class (with a config_class)"
        )
    defaults = config_class()
    known = set(defaults.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    for key in config:
        # Some settings live under another name (attn_implementation as _attn_implementation).
        if key not in known and not hasattr(defaults, key) and not hasattr(defaults, f"_{key}"):
            own = [k for k in defaults.to_dict() if k not in _HF_COMMON_SETTINGS]  # this architecture's own settings
            raise ValueError(
                f"{key} is not a setting of {config_class.__name__}; "
                f"expected one of its settings ({', '.join(own[:5])}, ...)"
            )
    settings = {"use_cache": False, **config}
    if vocab_size is not None:
        settings.setdefault("vocab_size", vocab_size)
    vocab = settings.get("vocab_size", getattr(defaults, "vocab_size", None))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        default = getattr(defaults, key, None)
        if key not in config and isinstance(default, int) and isinstance(vocab, int) and default >= vocab:
            settings[key] = None  # a default id outside a smaller vocabulary (GPT-2's 50256) names no token
    if num_classes is not None and "Classification" in cls.__name__:
        settings.setdefault("num_labels", num_classes)
    return cls(config_class(**settings))


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "convnet": ConvNet,
    "charlm": CharTransformer,
}


def build_model(name: str, **kwargs) -> nn.Module:
    """Construct a model by name (``mlp``, ``convnet``, ``charlm``) with its keyword args.

    >>> type(build_model("convnet", width=8)).__name__
    'ConvNet'
    >>> build_model("resnet")
    Traceback (most recent call last):
        ...
    ValueError: unknown model 'resnet'; known models: charlm, convnet, mlp
    """
    try:
        cls = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None
    return cls(**kwargs)


def count_parameters(module: nn.Module) -> int:
    """Number of scalar parameters, counting tied (shared) tensors once.

    >>> count_parameters(nn.Linear(3, 2))
    8
    """
    return sum(p.numel() for p in module.parameters())
