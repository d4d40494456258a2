"""Callbacks the tests name in configs (``_target_: _loop_callbacks.Recorder``) and hand from Python: importable,
so that a local world's ranks can build or unpickle them (tests/run/test_callbacks.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fdp.run.callbacks.base import Callback


class Recorder(Callback):
    """Appends a JSON line per event to ``path``: the event, rank, step, what it was shown; keeps counts as its state.

    ``every_rank``: runs on every rank; ``whole_to``: at run end, saves ``event.whole_params()`` (every rank calls
    it) there from rank 0.
    """

    def __init__(self, path: str, every_rank: bool = False, whole_to: str = ""):
        self.path, self.every_rank, self.whole_to = path, every_rank, whole_to
        self.counts = {"step_end": 0, "evaluation_end": 0, "save": 0}
        self.loss_sum = 0.0

    def _write(self, event, name: str, **more) -> None:
        line = {"event": name, "rank": event.rank, "world": event.world_size, "step": event.step, **more}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_step_end(self, event):
        self.counts["step_end"] += 1
        self.loss_sum += float(event.metrics["loss"])
        self._write(event, "step_end", params=sorted(event.state.params))

    def on_evaluation_end(self, event):
        self.counts["evaluation_end"] += 1
        self._write(event, "evaluation_end", val_loss=event.metrics["val_loss"])

    def on_save(self, event):
        self.counts["save"] += 1
        path = event.checkpoint
        self._write(event, "save", checkpoint=str(path) if path else None, exists=bool(path and Path(path).exists()))

    def on_run_end(self, event):
        self._write(event, "run_end", steps=event.metrics["steps"], state=self.state_dict())
        if self.whole_to:
            whole = {name: t.clone() for name, t in event.whole_params().items()}
            if event.rank == 0:
                torch.save(whole, self.whole_to)

    def state_dict(self):
        return {"counts": dict(self.counts), "loss_sum": self.loss_sum}

    def load_state_dict(self, state):
        self.counts, self.loss_sum = dict(state["counts"]), state["loss_sum"]


class Fails(Callback):
    """Raises at step ``at``."""

    def __init__(self, at: int = 2):
        self.at = at

    def on_step_end(self, event):
        if event.step == self.at:
            raise ValueError(f"no good at step {event.step}")


class Writes(Callback):
    """Writes to the params it was shown, in place."""

    def on_step_end(self, event):
        next(iter(event.state.params.values())).zero_()


class KeepsWhole(Callback):
    """Keeps a copy of the params, whole, at the run's end (one process: the test reads the object itself)."""

    def on_run_end(self, event):
        self.params = {name: t.clone() for name, t in event.whole_params().items()}
        self.shown = sorted(event.state.params)


class LowersBudget(Callback):
    """After step ``at`` on rank ``rank``, lowers this process's memory budget (``RLIMIT_DATA``, what
    ``world.memory_per_rank_mb`` sets on the CPU) to what it holds then plus ``mib``: the next step finds less room,
    as on a machine whose other processes took memory meanwhile."""

    every_rank = True

    def __init__(self, at: int = 1, rank: int = 0, mib: float = 64):
        self.at, self.rank, self.mib = at, rank, mib

    def on_step_end(self, event):
        import re
        import resource

        if event.step == self.at and event.rank == self.rank:
            held = int(re.search(r"VmData:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
            hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
            resource.setrlimit(resource.RLIMIT_DATA, (held + int(self.mib * 2**20), hard))


LARGEST_FORWARD = 0  # samples a Hungry model's forward takes before it asks for more memory than a machine has


class Hungry(torch.nn.Module):
    """A small MLP whose forward, once a ``Squeezes`` callback set ``LARGEST_FORWARD`` in its process, asks for a
    tensor of 1 TiB when it gets more samples than that: a real allocation that fails, as a larger model's would."""

    def __init__(self, in_features: int, out_features: int, hidden: int = 32):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(in_features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, out_features)
        )

    def forward(self, x):
        if LARGEST_FORWARD and x.shape[0] > LARGEST_FORWARD:
            torch.empty(2**40, dtype=torch.uint8)
        return self.net(x)


class Squeezes(Callback):
    """After step ``at`` on rank ``rank``, a ``Hungry`` model there takes at most ``samples`` per forward (``at=0``:
    from the first step on; the callback is made in each rank's process before it)."""

    every_rank = True

    def __init__(self, at: int = 1, rank: int = 0, samples: int = 8):
        global LARGEST_FORWARD
        self.at, self.rank, self.samples = at, rank, samples
        if at == 0 and int(os.environ.get("RANK", 0)) == rank:
            LARGEST_FORWARD = samples

    def on_step_end(self, event):
        global LARGEST_FORWARD
        if event.step == self.at and event.rank == self.rank:
            LARGEST_FORWARD = self.samples


class Addresses(Callback):
    """Appends a JSON line per step to ``path`` (rank 0): where the state's params live, to tell a step that writes
    its state in place (donated) from one that makes new tensors."""

    def __init__(self, path: str):
        self.path = path

    def on_step_end(self, event):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": event.step, "at": [t.data_ptr() for t in event.state.params.values()]}) + "\n")
