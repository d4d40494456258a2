"""What a sharded step does the same at every stage: per-bucket finite flags, the verdict
over every rank's slices, and the cross-rank sums a non-elementwise optimizer asks for.

``fdp.zero.sharded`` (stages 1 and 2) and ``fdp.zero.params`` (stage 3) build their step
on ``SliceStep``; the time spent waiting on these collectives is kept in ``wait_s``.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from fdp.update import describe_bucket


class SliceStep:
    """The bookkeeping one sharded step shares across stages.

    ``sliced``: each rank sees only its slices of the reduced gradients (stages 2 and 3),
    so a bucket that is finite here may not be finite on another rank.
    """

    def __init__(self, owner: Any, sliced: bool):
        self.owner, self.sliced = owner, sliced
        self.rank, self.world = owner.comm.rank, owner.comm.world_size
        self.flags: list[torch.Tensor | None] = [None] * len(owner.plan.buckets)
        self.wait_s = 0.0

    def verdict(self) -> torch.Tensor:
        """``[True]`` where every bucket's gradient is finite on every rank that saw it."""
        ok = torch.stack(self.flags).all()
        if self.sliced and self.world > 1:
            ok = self._sum_across((~ok).to(torch.float32).reshape(1))[0] == 0
        return ok.reshape(1)

    def nonfinite_where(self, late: bool) -> str:
        bad = [index for index, ok in enumerate(self.flags) if ok is not None and not bool(ok)]
        return describe_bucket(self.owner.plan, bad[0]) if bad else "a bucket of another rank's slice"

    def _sum_across(self, tensor: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        total = self.owner.comm.allreduce(tensor.clone()).wait()
        self.wait_s += time.perf_counter() - t0
        return total
