"""The first-batch check: what does not fit is one line naming it, whatever the model or loss raises."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fdp.errors import ConfigError
from fdp.model.fit import Names, check_first_batch
from fdp.model.functional import functionalize
from fdp.model.losses import TokenCrossEntropy, cross_entropy, mse

NAMES = Names("model._target_='my.Net'", "data._target_='my.data'", "loss=cross_entropy", "+model.num_classes")
BATCH = (torch.randn(8, 4), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]))


class _Hidden(nn.Module):
    """Returns what a model without a head returns: no scores to read."""

    def __init__(self, returns):
        super().__init__()
        self.linear, self.returns = nn.Linear(4, 10), returns

    def forward(self, x):
        return self.returns(self.linear(x))


def _check(module, criterion=cross_entropy, batch=BATCH, names=NAMES, declared=None):
    model, params, buffers = functionalize(module)
    with pytest.raises(ConfigError) as caught:
        check_first_batch(model, criterion, params, buffers, batch, names, declared)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def _reads_reshape(outputs, targets):  # a loss written for tensors, given a ModelOutput: AttributeError
    return F.cross_entropy(outputs.reshape(-1, 10), targets)


def test_an_output_the_loss_cannot_read_is_named_with_the_way_out():
    from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithCrossAttentions

    message = _check(_Hidden(lambda h: BaseModelOutput(last_hidden_state=h)))
    assert message == (
        "loss=cross_entropy: the model returns a BaseModelOutput with no logits (entries: last_hidden_state); the "
        "built-in losses read a tensor of scores, a ModelOutput, dict or dataclass with logits, or a tuple whose "
        "first element is the logits: set loss._target_ to a function (outputs, targets) -> scalar that reads this "
        "output"
    )
    custom = NAMES._replace(loss="loss._target_='my.loss'")
    message = _check(_Hidden(lambda h: CausalLMOutputWithCrossAttentions(logits=h)), _reads_reshape, names=custom)
    assert message == (
        "loss._target_='my.loss' cannot read what the model returns, a CausalLMOutputWithCrossAttentions: "
        "AttributeError: 'CausalLMOutputWithCrossAttentions' object has no attribute 'reshape'; expected a loss "
        "that reads it (outputs.logits), or a built-in one (loss=cross_entropy reads the logits)"
    )
    message = _check(_Hidden(lambda h: {"features": h}), _reads_reshape, names=custom)
    assert message.startswith("loss._target_='my.loss' cannot read what the model returns, a dict: AttributeError: ")
    assert message.endswith(
        "expected a loss that reads it (loss._target_=my_pkg.losses.f, a function (outputs, targets) -> scalar)"
    )


def test_whatever_the_forward_raises_is_one_line_with_the_first_batch():
    def broken(h):
        raise KeyError("no such layer")

    message = _check(_Hidden(broken))
    assert message == (
        "model._target_='my.Net' does not fit data._target_='my.data' with loss=cross_entropy: KeyError: "
        "'no such layer' (first batch: inputs (8, 4) float32, targets (8,) int64)"
    )
    message = _check(nn.Linear(5, 10))
    assert message.startswith(
        "model._target_='my.Net' does not fit data._target_='my.data' with loss=cross_entropy: mat1 and mat2"
    )


def test_class_scores_must_cover_the_labels_and_the_classes_the_data_declares():
    """A 1000-class head on 10-class data (torchvision's default) is refused, not trained."""
    assert _check(nn.Linear(4, 1000), declared=10) == (
        "model._target_='my.Net' does not fit data._target_='my.data' with loss=cross_entropy: the model outputs 1000 "
        "class scores but data._target_='my.data' has 10 classes; expected +model.num_classes=10"
    )
    assert _check(nn.Linear(4, 6)) == (
        "model._target_='my.Net' does not fit data._target_='my.data' with loss=cross_entropy: the first batch has "
        "label 7 but the model outputs 6 class scores; expected +model.num_classes=8"
    )
    # The same for torch's cross-entropy by its path or as a class, and for shifted token labels (padding not counted).
    assert "outputs 6 class scores" in _check(nn.Linear(4, 6), functools.partial(F.cross_entropy, label_smoothing=0.1))
    assert "outputs 6 class scores" in _check(nn.Linear(4, 6), nn.CrossEntropyLoss())
    tokens = (torch.randint(0, 5, (2, 4)), torch.tensor([[9, 1, 2, -100], [1, 1, -100, -100]]))
    model, params, buffers = functionalize(nn.Embedding(5, 5))
    check_first_batch(model, TokenCrossEntropy(shift=1), params, buffers, tokens, NAMES, None)  # 9 is never a target
    assert "label 9" in _check(nn.Embedding(5, 5), TokenCrossEntropy(shift=0), tokens)


def test_losses_of_ones_own_and_regression_are_not_held_to_classes():
    ids = (torch.randn(8, 4), torch.arange(8))  # integer targets scored against embeddings
    model, params, buffers = functionalize(nn.Linear(4, 3))
    check_first_batch(model, lambda out, t: out.pow(2).mean() + 0 * t.sum(), params, buffers, ids, NAMES, 10)
    model, params, buffers = functionalize(nn.Linear(4, 1))
    check_first_batch(model, mse, params, buffers, (torch.randn(8, 4), torch.randn(8, 1)), NAMES, None)


def _charlm(vocab):
    from fdp.model.builtin import CharTransformer

    torch.manual_seed(0)
    return CharTransformer(vocab_size=vocab, block_size=8, d_model=16, n_layer=1, n_head=2)


def test_a_loss_that_shifts_refuses_targets_the_data_has_shifted_already():
    from fdp.data import global_batch, load_stdlib_text, targets_shifted

    data = load_stdlib_text(block_size=8, max_chars=5000)
    batch = global_batch(data, step=0, global_batch_size=4, seed=0)
    names = Names("model=charlm", "data=stdlib_text", "loss=causal_lm")
    model, params, buffers = functionalize(_charlm(data.num_classes))
    check_first_batch(model, cross_entropy, params, buffers, batch, names, data.num_classes, targets_shifted(data))
    for said in (True, None):  # what the data says, and what its batch shows where it says nothing
        with pytest.raises(ConfigError) as caught:
            check_first_batch(model, TokenCrossEntropy(shift=1), params, buffers, batch, names, data.num_classes, said)
        assert str(caught.value) == (
            "loss=causal_lm scores position t against the target at t + 1, but data=stdlib_text's targets are "
            "already the next tokens (its inputs shifted by one): the model would learn the token 2 ahead; expected "
            "loss=cross_entropy, or data whose targets are its input ids"
        )


def test_labels_equal_to_the_input_ids_need_a_loss_that_shifts():
    ids = torch.randint(0, 20, (4, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 5:] = -100  # padding is not counted
    batch = (ids, labels)  # what a Hugging Face causal LM's collator makes, as a pair
    names = Names("model=charlm", "data._target_='my.data'", "loss=cross_entropy")
    model, params, buffers = functionalize(_charlm(20))
    check_first_batch(model, TokenCrossEntropy(shift=1), params, buffers, batch, names)
    for loss in (cross_entropy, TokenCrossEntropy(shift=0)):
        with pytest.raises(
            ConfigError,
            match=r"^data._target_='my.data''s targets are its input ids, but loss=cross_entropy "
            r"scores each position against its own token: the model would learn to copy its "
            r"input; expected loss=causal_lm \(position t against the token at t \+ 1\)$",
        ):
            check_first_batch(model, loss, params, buffers, batch, names)
    # Inputs that repeat one token are both their own shift and themselves: nothing to tell, nothing refused.
    same = (torch.full((2, 8), 3), torch.full((2, 8), 3))
    check_first_batch(model, TokenCrossEntropy(shift=1), params, buffers, same, names)


class Checkpointed(nn.Module):
    """A model that recomputes its hidden layer with torch.utils.checkpoint (either form)."""

    def __init__(self, in_features: int = 64, num_classes: int = 10, use_reentrant: bool = False):
        super().__init__()
        self.a, self.b, self.use_reentrant = nn.Linear(in_features, 16), nn.Linear(16, num_classes), use_reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.b(checkpoint(lambda h: torch.relu(self.a(h)), x, use_reentrant=self.use_reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_utils_checkpoint_in_a_model_is_one_line_naming_the_setting_to_use(reentrant, recwarn):
    from fdp.comm import Comm
    from fdp.run.build import build_run
    from fdp.run.config.compose import compose

    cfg = compose(
        "model=custom", f"model._target_={__name__}.Checkpointed", f"+model.use_reentrant={str(reentrant).lower()}"
    )
    with pytest.raises(ConfigError) as caught:
        build_run(cfg, Comm())
    assert str(caught.value) == (
        f"model._target_='{__name__}.Checkpointed': its forward calls torch.utils.checkpoint, which fdp's torch.func "
        "gradients do not run; expected a forward without it, and trainer.activation_checkpointing=blocks to recompute "
        "activations instead"
    )
    assert not [w for w in recwarn if "checkpoint" in str(w.filename)]  # nor torch's warning from the first-batch probe
