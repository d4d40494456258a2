"""What a sharded step does the same at every stage: per-bucket finite flags and norms, the
verdict and the gradient's global norm over every rank's slices (one all-reduce for both),
and the cross-rank sums a non-elementwise optimizer asks for.

``fdp.update.zero.sharded`` (stages 1 and 2) and ``fdp.update.zero.params`` (stage 3) build their step
on ``SliceStep``; the time spent waiting on these collectives is kept in ``wait_s``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fdp.update.bucket_stats import bucket_norm, describe_bucket, finite_flag, global_norm


class SliceStep:
    """The bookkeeping one sharded step shares across stages.

    ``sliced``: each rank sees only its slices of the reduced gradients (stages 2 and 3),
    so a bucket that is finite here may not be finite on another rank.
    """

    def __init__(self, owner: Any, sliced: bool):
        self.owner, self.sliced = owner, sliced
        self.rank, self.world = owner.comm.rank, owner.comm.world_size
        self.flags: list[torch.Tensor | None] = [None] * len(owner.plan.buckets)
        self.norms: list[torch.Tensor | None] = [None] * len(owner.plan.buckets)
        self.norm: torch.Tensor | None = None  # the global one, once the verdict has summed the slices'
        self.wait_s = 0.0
        self.steps_in_backward = False  # stage 3 may step its slices as backward runs (fdp.update.zero.params)

    def take(self, index: int, flat: torch.Tensor, counted: torch.Tensor) -> None:
        """Note bucket ``index``'s reduced gradient ``flat``; ``counted`` is the part of it this rank adds to the
        global norm (its slice where each rank holds one, else all of it), zero-padded or not."""
        self.flags[index] = finite_flag(flat)
        self.norms[index] = bucket_norm(counted)

    def verdict(self) -> torch.Tensor:
        """``[True]`` where every bucket's gradient is finite on every rank that saw it."""
        ok, norm = torch.stack(self.flags).all(), global_norm(self.norms)
        if self.sliced and self.world > 1:  # the slices' squared norms add up in the verdict's all-reduce
            total = self._sum_across(torch.stack([(~ok).to(torch.float32), norm.square()]))
            ok, norm = total[0] == 0, total[1].sqrt()
        self.norm = norm
        return ok.reshape(1)

    def grad_norm(self) -> torch.Tensor:
        """The global norm of the reduced gradient (summed across the slices by ``verdict()``)."""
        if self.norm is None:
            self.verdict()
        return self.norm

    def nonfinite_where(self, late: bool) -> str:
        bad = [index for index, ok in enumerate(self.flags) if ok is not None and not bool(ok)]
        return describe_bucket(self.owner.plan, bad[0]) if bad else "a bucket of another rank's slice"

    def _sum_across(self, tensor: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        total = self.owner.comm.allreduce(tensor.clone()).wait()
        self.wait_s += time.perf_counter() - t0
        return total
