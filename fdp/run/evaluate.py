"""Evaluation on the test split: the mean loss, and accuracy where it applies."""

from __future__ import annotations

from typing import Callable

import torch

from fdp.data import Dataset, MapData, eval_batches
from fdp.data.batches import pieces
from fdp.dist.devices import batch_to_device, device_of
from fdp.model.functional import FunctionalModel
from fdp.model.losses import Criterion, cross_entropy, eval_metrics
from fdp.model.precision import Precision

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(
    model: FunctionalModel,
    params,
    buffers,
    data: Dataset | MapData,
    max_batches: int,
    batch_size: int = 256,
    criterion: Criterion = cross_entropy,
    num_workers: int = 0,
    precision: Precision = Precision(),
    fits: int | None = None,
    wrap: Callable[[Callable], Callable] | None = None,
) -> dict:
    """Mean loss over (up to ``max_batches`` batches of) the test split, and accuracy where it applies.

    ``fits``: the most samples one forward pass may take (a run passes its training micro-batch,
    which is known to fit its memory); each batch is evaluated in pieces of that many, with the
    same result as whole. ``wrap(model.apply)`` runs the model where given (what ``Update.evaluating``
    hands over: ZeRO stage 3 gathers the params around each forward).

    Accuracy applies to class scores ``(..., classes)`` for integer targets ``(...)``. Runs on
    the params' device, in ``precision`` (scored in float32).

    >>> from fdp import functionalize
    >>> from fdp.data import load_digits
    >>> model, params, buffers = functionalize(torch.nn.Linear(64, 10))
    >>> sorted(evaluate(model, params, buffers, load_digits(), max_batches=1))
    ['test_acc', 'test_loss']
    """
    device = device_of(params)
    total_loss, count, correct, scored = 0.0, 0, 0, 0
    for batch in eval_batches(data, batch_size, max_batches, num_workers=num_workers):
        for piece in pieces(batch, fits or batch_size):
            piece = batch_to_device(piece, device)
            loss, weight, hits, n = eval_metrics(model, criterion, params, buffers, piece, precision, wrap)
            total_loss, count, correct, scored = total_loss + loss, count + weight, correct + hits, scored + n
    metrics = {"test_loss": total_loss / count}
    if scored:
        metrics["test_acc"] = correct / scored
    return metrics
