"""Losses from config, against torch written out in the test."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fdp import cross_entropy_loss
from fdp.comm import Comm
from fdp.data import split_micro_batches
from fdp.errors import ConfigError
from fdp.model.functional import functionalize
from fdp.model.losses import (
    TokenCrossEntropy,
    UnreadableOutput,
    batch_metrics,
    build_loss,
    cross_entropy,
    make_loss_fn,
    mse,
    weigh_micro_batches,
)


def test_cross_entropy_equals_the_train_step_loss_to_the_bit():
    torch.manual_seed(0)
    model, params, buffers = functionalize(torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11)))
    batch = (torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5)))  # a language model: (B, T, vocab)
    ours, _ = make_loss_fn(model, cross_entropy)(params, buffers, batch)
    reference, _ = cross_entropy_loss(model)(params, buffers, batch)
    assert torch.equal(ours, reference)


def test_mse_refuses_shapes_that_would_broadcast():
    outputs, targets = torch.randn(6, 2), torch.randn(6, 2)
    assert torch.equal(mse(outputs, targets), ((outputs - targets) ** 2).mean())
    assert torch.equal(mse(outputs, targets.double()), ((outputs - targets.float()) ** 2).mean())
    with pytest.raises(ValueError, match=r"outputs of shape \(6, 2\) and targets of shape \(6,\) differ"):
        mse(outputs, targets[:, 0])


def test_build_loss_binds_settings_and_refuses_unknown_ones():
    smoothed = build_loss(
        {"name": "cross_entropy", "_target_": "fdp.model.losses.cross_entropy", "label_smoothing": 0.2}
    )
    logits, targets = torch.randn(8, 4), torch.randint(0, 4, (8,))
    assert torch.equal(smoothed(logits, targets), F.cross_entropy(logits, targets, label_smoothing=0.2))
    custom = build_loss({"name": "custom", "_target_": "torch.nn.functional.huber_loss", "delta": 0.5})
    assert torch.equal(custom(logits, logits + 1), F.huber_loss(logits, logits + 1, delta=0.5))
    with pytest.raises(ConfigError) as caught:
        build_loss({"name": "mse", "_target_": "fdp.model.losses.mse", "margin": 1.0})
    assert str(caught.value) == "loss=mse: got an unexpected keyword argument 'margin'"
    with pytest.raises(
        ConfigError,
        match=r"^loss\._target_='torch\.nn\.functional\.nothing': module torch\.nn\.functional has no attribute",
    ):
        build_loss({"name": "custom", "_target_": "torch.nn.functional.nothing"})


def test_batch_metrics_combine_into_the_mean_over_the_split():
    torch.manual_seed(1)
    logits, labels = torch.randn(10, 3), torch.randint(0, 3, (10,))
    parts = [batch_metrics(cross_entropy, logits[a:b], labels[a:b]) for a, b in ((0, 4), (4, 7), (7, 10))]
    loss = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert loss == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-6)
    assert sum(p[2] for p in parts) == (logits.argmax(1) == labels).sum().item() and sum(p[3] for p in parts) == 10
    # Per-token for sequences; no accuracy for real-valued targets.
    seq = batch_metrics(cross_entropy, torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5)))
    assert seq[1] == 10 and seq[3] == 10
    assert batch_metrics(mse, torch.zeros(4, 3), torch.ones(4, 3))[1:] == (12, 0, 0)


# --- what models return, and losses over padded tokens ---------------------------------------------


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    hidden: torch.Tensor | None = None


def test_built_in_losses_and_metrics_read_hugging_face_outputs_dicts_dataclasses_and_tuples():
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    logits, labels = torch.randn(6, 4), torch.randint(0, 4, (6,))
    expected = F.cross_entropy(logits, labels)
    for outputs in (
        CausalLMOutputWithCrossAttentions(logits=logits),
        {"logits": logits},
        _Output(logits),
        (logits, None),
    ):
        assert torch.equal(cross_entropy(outputs, labels), expected), type(outputs)
        assert batch_metrics(cross_entropy, outputs, labels) == batch_metrics(cross_entropy, logits, labels)
    assert torch.equal(mse(_Output(logits), logits + 1), torch.tensor(1.0))
    for unreadable, what in [
        ({"last_hidden_state": logits}, "a dict with no logits (entries: last_hidden_state)"),
        (_Output(None), "a _Output with no logits field"),
        ([None], "a list whose first element is a NoneType"),
        ("text", "a str"),
    ]:
        with pytest.raises(UnreadableOutput) as caught:
            cross_entropy(unreadable, labels)
        assert str(caught.value).startswith(
            f"the model returns {what}; the built-in losses read"
        ) and "loss._target_" in str(caught.value)
        assert batch_metrics(lambda o, t: torch.tensor(0.0), unreadable, labels)[2:] == (0, 0)  # no accuracy to take


def _padded(seed, batch=6, length=7, vocab=5):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, length), generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    labels[torch.arange(length) >= lengths[:, None]] = -100
    return torch.randn(batch, length, vocab, generator=g, requires_grad=True), labels


@pytest.mark.parametrize("shift", [0, 1])
def test_token_cross_entropy_over_weighted_micro_batches_is_the_mean_over_every_counted_token(shift):
    """Micro-batches counting different numbers of tokens: the mean of their weighted losses is the one-batch mean."""
    logits, labels = _padded(0)
    scored, targets = (logits[:, :-1], labels[:, 1:]) if shift else (logits, labels)
    reference = F.cross_entropy(scored.reshape(-1, 5), targets.reshape(-1))  # ignore_index=-100
    model, params, buffers = functionalize(torch.nn.Identity())
    loss_fn = make_loss_fn(model, TokenCrossEntropy(shift=shift))
    assert torch.allclose(loss_fn(params, buffers, (logits, labels))[0], reference, atol=1e-6, rtol=0)
    for parts in (2, 3, 6):  # a world of one: the counts need no collective
        micro = weigh_micro_batches(loss_fn, split_micro_batches((logits, labels), parts), Comm())
        plain = [loss_fn(params, buffers, m)[0] for m in split_micro_batches((logits, labels), parts)]
        weighted = torch.stack([loss_fn(params, buffers, m)[0] for m in micro]).mean()
        assert torch.allclose(weighted, reference, atol=1e-6, rtol=0)
        assert not torch.allclose(torch.stack(plain).mean(), reference, atol=1e-3)  # a mean of means is not
        (grad,) = torch.autograd.grad(weighted, logits)
        assert torch.allclose(grad, torch.autograd.grad(reference, logits, retain_graph=True)[0], atol=1e-7)
    hits = (scored.argmax(-1) == targets) & (targets != -100)
    assert batch_metrics(TokenCrossEntropy(shift=shift), logits, labels)[1:] == (
        int((targets != -100).sum()),
        int(hits.sum()),
        int((targets != -100).sum()),
    )


def test_a_weighted_micro_batch_with_no_counted_token_adds_nothing():
    logits, labels = _padded(1)
    labels[:3] = -100
    model, params, buffers = functionalize(torch.nn.Identity())
    loss_fn = make_loss_fn(model, TokenCrossEntropy())
    empty, full = weigh_micro_batches(loss_fn, split_micro_batches((logits, labels), 2), Comm())
    assert loss_fn(params, buffers, empty)[0].item() == 0.0 and torch.isfinite(loss_fn(params, buffers, full)[0])


def test_build_loss_builds_a_loss_class_with_its_settings():
    built = build_loss(
        {"name": "causal_lm", "_target_": "fdp.model.losses.TokenCrossEntropy", "shift": 1, "ignore_index": -1}
    )
    assert isinstance(built, TokenCrossEntropy) and (built.shift, built.ignore_index) == (1, -1)
    smoothed = build_loss({"name": "custom", "_target_": "torch.nn.CrossEntropyLoss", "label_smoothing": 0.2})
    logits, targets = torch.randn(8, 4), torch.randint(0, 4, (8,))
    assert torch.equal(smoothed(logits, targets), F.cross_entropy(logits, targets, label_smoothing=0.2))
    with pytest.raises(
        ConfigError, match=r"^loss\._target_='torch\.nn\.CrossEntropyLoss': .*unexpected keyword argument 'shift'"
    ):
        build_loss({"name": "custom", "_target_": "torch.nn.CrossEntropyLoss", "shift": 1})
    with pytest.raises(ConfigError, match=r"^loss=causal_lm: shift=-1: expected an integer >= 0"):
        build_loss({"name": "causal_lm", "_target_": "fdp.model.losses.TokenCrossEntropy", "shift": -1})
