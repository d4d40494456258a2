"""A loop callback of one's own (fdp.run.callbacks): export the params at the best evaluation."""

from __future__ import annotations

import os

import torch

from fdp import Callback


class ExportBest(Callback):
    """Writes the params, whole, to ``<run dir>/best.pt`` each time ``metric`` improves (``mode``: min or max).

    It runs on every rank: at ZeRO stage 3 each rank holds a slice of the params, and gathering them whole takes
    every rank (``event.whole_params()``); rank 0 writes. The best value so far is its state: checkpointed, so a
    resumed run exports only what beats it.
    """

    every_rank = True

    def __init__(self, metric: str = "val_loss", mode: str = "min"):
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}: expected min or max")
        self.metric, self.mode, self.best = metric, mode, None

    def on_evaluation_end(self, event):
        value = event.metrics[self.metric]
        if self.best is not None and (value >= self.best if self.mode == "min" else value <= self.best):
            return
        self.best = value
        params = event.whole_params()  # every rank calls it (at stage 3 a collective)
        if event.rank == 0:
            whole = {name: t.detach().cpu().clone() for name, t in params.items()}
            tmp = event.run_dir / "best.pt.tmp"
            torch.save({"step": event.step, self.metric: value, "params": whole}, tmp)
            os.replace(tmp, event.run_dir / "best.pt")

    def state_dict(self):
        return {"best": self.best}

    def load_state_dict(self, state):
        self.best = state["best"]
