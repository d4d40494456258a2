"""Losses from config, against torch written out in the test."""
import pytest
import torch
import torch.nn.functional as F

from fdp.config import ConfigError
from fdp.functional import functionalize
from fdp.losses import batch_metrics, build_loss, cross_entropy, make_loss_fn, mse
from fdp import cross_entropy_loss


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
    smoothed = build_loss({"name": "cross_entropy", "_target_": "fdp.losses.cross_entropy", "label_smoothing": 0.2})
    logits, targets = torch.randn(8, 4), torch.randint(0, 4, (8,))
    assert torch.equal(smoothed(logits, targets), F.cross_entropy(logits, targets, label_smoothing=0.2))
    custom = build_loss({"name": "custom", "_target_": "torch.nn.functional.huber_loss", "delta": 0.5})
    assert torch.equal(custom(logits, logits + 1), F.huber_loss(logits, logits + 1, delta=0.5))
    with pytest.raises(ConfigError) as caught:
        build_loss({"name": "mse", "_target_": "fdp.losses.mse", "margin": 1.0})
    assert str(caught.value) == "loss=mse: got an unexpected keyword argument 'margin'"
    with pytest.raises(ConfigError, match=r"^loss\._target_='torch\.nn\.functional\.nothing': module torch\.nn\.functional has no attribute"):
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
