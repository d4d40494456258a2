"""Evaluation on the validation or the test split: the mean loss, and accuracy where it applies."""

from __future__ import annotations

from typing import Callable

import torch

from fdp.comm import Comm
from fdp.data import Dataset, MapData, eval_batches
from fdp.data.batches import pieces
from fdp.model.functional import FunctionalModel
from fdp.model.losses import Criterion, cross_entropy, eval_metrics
from fdp.model.precision import Precision
from fdp.procs.devices import batch_to_device, device_of

__all__ = ["evaluate", "metric_names"]


def metric_names(accuracy: bool, split: str = "test") -> tuple[str, ...]:
    """The metrics ``evaluate`` returns on ``split``, by name: the mean loss, and the accuracy where it applies
    (``fdp.model.losses.scores_accuracy``). What a monitor may watch is checked against these before step 1.

    >>> metric_names(True, "val"), metric_names(False)
    (('val_loss', 'val_acc'), ('test_loss',))
    """
    return (f"{split}_loss", f"{split}_acc") if accuracy else (f"{split}_loss",)


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
    together: Comm | None = None,
    split: str = "test",
) -> dict:
    """Mean loss over (up to ``max_batches`` batches of) the test split, or ``split`` (``val``), and accuracy
    where it applies: ``<split>_loss``, ``<split>_acc``.

    ``fits``: the most samples one forward pass may take (a run passes its training micro-batch,
    which is known to fit its memory); each batch is evaluated in pieces of that many, with the
    same result as whole. ``wrap(model.apply)`` runs the model where given (what ``Update.evaluating``
    hands over: ZeRO stage 3 gathers the params around each forward). ``together``: the ranks that
    evaluate with this one, each every world-th piece, as many forwards on each (a forward is
    collective where the params are gathered), their sums added up: every rank returns the figures.

    Accuracy applies to class scores ``(..., classes)`` for integer targets ``(...)``. Runs on
    the params' device, in ``precision`` (scored in float32).

    >>> from fdp import functionalize
    >>> from fdp.data import load_digits
    >>> model, params, buffers = functionalize(torch.nn.Linear(64, 10))
    >>> sorted(evaluate(model, params, buffers, load_digits(), max_batches=1))
    ['test_acc', 'test_loss']
    """
    device = device_of(params)
    rank, world = (together.rank, together.world_size) if together is not None else (0, 1)
    sums, done, seen, last = [0.0, 0, 0, 0], 0, 0, None  # loss, weight, hits, scored
    every = (
        p
        for batch in eval_batches(data, batch_size, max_batches, num_workers=num_workers, split=split)
        for p in pieces(batch, fits or batch_size)
    )
    for index, piece in enumerate(every):
        if index % world == rank:
            figures = eval_metrics(model, criterion, params, buffers, batch_to_device(piece, device), precision, wrap)
            sums = [total + figure for total, figure in zip(sums, figures)]
            done += 1
        seen, last = index + 1, piece
    if together is not None:
        if done < -(-seen // world):  # a forward fewer than the first ranks: it still takes part in their gathers
            eval_metrics(model, criterion, params, buffers, batch_to_device(last, device), precision, wrap)
        # On the params' device: where the world's collectives run (NCCL takes no CPU tensors).
        sums = together.allreduce(torch.tensor(sums, dtype=torch.float64, device=device)).wait().tolist()
    total_loss, count, correct, scored = sums
    return dict(zip(metric_names(bool(scored), split), (total_loss / count, correct / scored if scored else None)))
