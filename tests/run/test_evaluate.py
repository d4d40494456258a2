"""Evaluation on the test split (fdp.run.evaluate), alone and shared between ranks."""

from __future__ import annotations

import pytest
import torch

from fdp import functionalize
from fdp.comm import Comm
from fdp.data import load_digits
from fdp.run.evaluate import evaluate


def _model():
    torch.manual_seed(0)
    return functionalize(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)))


def _shared(rank: int, world: int) -> tuple[dict, int]:
    """This rank's figures of an evaluation shared by the world in pieces of 7 samples, and its forwards."""
    model, params, buffers = _model()
    forwards = []

    def counting(forward):
        def counted(*args, **kwargs):
            forwards.append(1)
            return forward(*args, **kwargs)

        return counted

    figures = evaluate(model, params, buffers, load_digits(), max_batches=2, fits=7, wrap=counting, together=Comm())
    return figures, len(forwards)


def test_ranks_sharing_the_pieces_run_as_many_forwards_and_give_one_process_figures(run_ranks):
    world_size = 3
    model, params, buffers = _model()
    alone = evaluate(model, params, buffers, load_digits(), max_batches=2, fits=7)
    results = run_ranks(_shared, world_size=world_size)
    pieces = sum(-(-n // 7) for n in (256, len(load_digits().test_y) - 256))  # two batches, in pieces of 7
    assert pieces % world_size  # the last rank has a piece fewer: it still runs a forward
    assert [forwards for _, forwards in results] == [-(-pieces // world_size)] * world_size
    for figures, _ in results:
        assert figures["test_acc"] == alone["test_acc"]
        assert figures["test_loss"] == pytest.approx(alone["test_loss"], rel=1e-6)
