"""``trainer.accum_steps=auto``: the largest micro-batch the forecast says fits, halved when a step runs out anyway.

The global batch never changes, only how many forwards a rank splits its share into
(``accum_steps``, a divisor of the share). At start, after a shrink and on resume the run
takes the largest micro-batch whose forecast (``fdp.run.memory.forecast``) fits the budget
(``world.memory_per_rank_mb``, or on a GPU its memory; ``fdp.run.memory.run_forecast.forecast_accum``), every rank the
smallest of theirs.
The first step confirms it. When a step's forwards and backwards run out of memory anyway
(CUDA's ``OutOfMemoryError``, the CPU budget's overrun), the step is abandoned before it
writes anything of its state (``fdp.step.train_step``'s ``after_backward``: the optimizer,
in place on a donated state too, steps the buckets only after it), what the failed step
made is freed, every rank agrees (``Agreement``: one flag each, on a group of its own, after
every step's backward; a rank waiting in one of the step's collectives for the rank that
failed is woken through the store), and the step is done again from the same state and batch
with half the micro-batch. A step is a pure function of its state and batch, so the run equals
one with the micro-batch it ends on fixed from there, bit for bit. Out of memory at a micro-batch of
one sample, or in another part of the step (the update: a smaller micro-batch does not help
there), the run fails as it would with a fixed one (``fdp.run.memory.out_of_memory``).

>>> accum_options(12)
[1, 2, 3, 4, 6, 12]
>>> first_accum(12, lambda micro: micro <= 5), halved(12, 3)
(3, 6)
"""

from __future__ import annotations

import gc
import os
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from fdp._torch import default_store
from fdp.comm import Comm
from fdp.errors import require
from fdp.procs.allocator import release_free_memory
from fdp.procs.budget import is_out_of_memory
from fdp.run.memory.forecast import MiB

__all__ = [
    "AUTO",
    "MicroBatchOutOfMemory",
    "PeerOutOfMemory",
    "Agreement",
    "check_accum_setting",
    "fixed_accum",
    "accum_options",
    "first_accum",
    "halved",
    "budget_mib",
]

AUTO = "auto"


class MicroBatchOutOfMemory(RuntimeError):
    """A step's forwards and backwards ran out of memory on some rank; every rank abandoned it, its state intact."""


class PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory in this step (raised in a collective's wait, to end it)."""


def check_accum_setting(value: Any) -> int | str:
    """``trainer.accum_steps``: an integer >= 1, or ``auto``.

    >>> check_accum_setting("auto"), check_accum_setting(4)
    ('auto', 4)
    >>> check_accum_setting("some")
    Traceback (most recent call last):
    ...
    ValueError: accum_steps='some': expected an integer >= 1 or auto (the largest micro-batch that fits)
    """
    whole = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    require(whole or value == AUTO, "accum_steps", value, "an integer >= 1 or auto (the largest micro-batch that fits)")
    return value


def fixed_accum(value: Any) -> int:
    """The micro-batches per step a setting fixes before the run decides: ``auto`` starts from the whole share.

    >>> fixed_accum("auto"), fixed_accum(3)
    (1, 3)
    """
    return 1 if value == AUTO else int(value)


def accum_options(per_rank: int) -> list[int]:
    """The micro-batches per step that split a rank's share of ``per_rank`` samples evenly, fewest first.

    >>> accum_options(8)
    [1, 2, 4, 8]
    """
    return [a for a in range(1, per_rank + 1) if per_rank % a == 0]


def first_accum(per_rank: int, fits: Callable[[int], bool]) -> int:
    """The fewest micro-batches per step whose micro-batch ``fits`` (forecasts grow with it); one sample each if none.

    >>> first_accum(8, lambda micro: micro <= 3)
    4
    """
    return next((a for a in accum_options(per_rank) if fits(per_rank // a)), per_rank)


def halved(per_rank: int, accum: int) -> int | None:
    """The fewest micro-batches per step whose micro-batch is at most half of ``per_rank // accum``; ``None`` at one.

    >>> halved(8, 1), halved(8, 8), halved(12, 2)
    (2, None, 4)
    """
    micro = per_rank // accum
    return next((a for a in accum_options(per_rank) if per_rank // a <= micro // 2), None) if micro > 1 else None


def budget_mib(cfg: Any, device: torch.device, base_mib: float) -> float:
    """The memory a rank may hold over what it held once its data was loaded (``base_mib``, what the forecast
    counts from): ``world.memory_per_rank_mb``, else on a GPU what is free and what torch holds; 0: no bound."""
    if cfg.world.memory_per_rank_mb:
        return float(cfg.world.memory_per_rank_mb)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return (free + torch.cuda.memory_reserved(device)) / MiB - base_mib
    return 0.0


class Agreement:
    """Every rank's word, after each step's backward, on whether one ran out of memory (the step's
    ``after_backward``); ``comm``: the world's. Its own group carries the word, so that a step abandoned with
    collectives in flight on the step's group leaves it undisturbed; ``step_comm`` gives each step function
    a group of its own, given up once one of its steps is abandoned, and whose waits end at once when a rank
    says in the store that it ran out (``watch``). The groups are made here, ``tries`` of them: a group made
    after a rank ran out would start its threads where memory is short (measured: ``EAGAIN``, a lost rank)."""

    def __init__(self, comm: Comm, device: torch.device, tries: int = 1):
        self.comm, self.device, self.failures = comm, device, 0
        self.together = comm.on_own_group() if comm.world_size > 1 else comm
        self.groups = [comm.on_own_group().group for _ in range(tries)] if comm.world_size > 1 else []
        self.store = default_store() if comm.world_size > 1 else None
        self.prefix = f"fdp/accum_auto/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        self.abandoned: list[Comm] = []  # groups with a failed step's collectives in flight: kept, never used again

    def _key(self) -> str:
        return f"{self.prefix}/{self.failures}"

    def watch(self) -> None:
        """Raise ``PeerOutOfMemory`` once a rank said it ran out of memory in this step."""
        if self.store is not None and self.store.check([self._key()]):
            raise PeerOutOfMemory(f"rank {self.store.get(self._key()).decode()} ran out of memory in this step")

    def step_comm(self) -> Comm:
        """A comm over the world's ranks on a group of its own for one step function (every rank calls it alike)."""
        if self.comm.world_size == 1:
            return self.comm
        outer = self.comm.watch

        def watch() -> None:
            self.watch()
            if outer is not None:
                outer()

        return Comm(self.groups.pop(0) if self.groups else self.comm.on_own_group().group, watch=watch)

    def __call__(self, failed: BaseException | None) -> None:
        """After a step's backward: return if no rank ran out of memory (or this one failed otherwise: its error
        stands); else free what the step made and raise ``MicroBatchOutOfMemory`` on every rank."""
        if failed is not None and not (is_out_of_memory(failed) or isinstance(failed, PeerOutOfMemory)):
            return
        mine = failed is not None and not isinstance(failed, PeerOutOfMemory)
        reason = (str(failed).strip().splitlines() or [type(failed).__name__])[0] if mine else ""
        if failed is not None:  # the failed forward's and backward's tensors, held by the error's frames
            traceback.clear_frames(failed.__traceback__)
            if mine and self.store is not None:
                self.store.set(self._key(), str(self.comm.rank))
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            release_free_memory()
        elif self.comm.world_size == 1:
            return
        flags = torch.zeros(self.comm.world_size, dtype=torch.int64)
        flags[self.comm.rank] = int(mine)
        if self.comm.world_size > 1:
            dist.all_reduce(flags, group=self.together.group)
        ranks = [int(r) for r in flags.nonzero().flatten()]
        if not ranks:
            return
        self.failures += 1
        raise MicroBatchOutOfMemory(
            f"rank {', '.join(map(str, ranks))} ran out of memory in forward and backward"
            + (f" ({reason})" if reason else "")
        )
