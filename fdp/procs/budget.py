"""A rank's memory budget (``world.memory_per_rank_mb``): the limit, what counts as running out of it, and the
part of the run a rank is in when it does.

A GPU's memory is a budget every rank has; ``limit_memory`` gives a rank one on any device, so a run that needs
more fails with an out-of-memory error (``is_out_of_memory`` tells one from any other) instead of slowing the
machine down, and ``MemoryPhase`` lets its line say where (``fdp.run.memory.out_of_memory``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import Iterator

import torch

from fdp.procs.allocator import budget_accounting


def limit_memory(budget_mib: float, device: torch.device) -> None:
    """Let this process allocate at most ``budget_mib`` more MiB from here on (``world.memory_per_rank_mb``).

    What a GPU's memory does for each rank, on any device: a run that needs more fails
    with an out-of-memory error (``is_out_of_memory``) instead of slowing the machine down.
    On a GPU it is torch's per-process fraction of the device's memory; on the CPU a
    limit on the process's data segment (``RLIMIT_DATA``, the heap and private mappings a
    process writes), counted from what it holds now, the allocator set to make that count
    what the run holds (``fdp.procs.allocator.budget_accounting``). 0 sets no limit.
    """
    if budget_mib <= 0:
        return
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_mib * 2**20 / total), device)
        return
    import resource

    held = int(re.search(r"VmData:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
    limit = held + int(budget_mib * 2**20)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    budget_accounting()


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says an allocation failed (a CUDA OOM, torch's CPU allocator, Python's ``MemoryError``,
    a system call's ``ENOMEM``: opening a file under ``RLIMIT_DATA``), or, under a data limit, that a thread could
    not start (``EAGAIN``: its stack is a private mapping the limit counts; gloo starts threads for each group); or
    was raised while one was handled (torch's ``save`` into a buffer closes it when an allocation fails, and says
    "I/O operation on closed file").

    >>> is_out_of_memory(MemoryError()), is_out_of_memory(RuntimeError("shapes do not match"))
    (True, False)
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if _says_out_of_memory(error):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _says_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    if isinstance(error, OSError):
        return error.errno == errno.ENOMEM or (error.errno == errno.EAGAIN and _data_limited())
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    no_thread = os.strerror(errno.EAGAIN) in text or "can't start new thread" in text  # C++'s, then Python's
    return "can't allocate memory" in text or "out of memory" in text or (no_thread and _data_limited())


def _data_limited() -> bool:
    """Whether this process runs under a data-segment limit (``limit_memory`` on the CPU)."""
    import resource

    return resource.getrlimit(resource.RLIMIT_DATA)[0] != resource.RLIM_INFINITY


class LateOutOfMemory(MemoryError):
    """Out of memory in a part of the run found out in another: an asynchronous checkpoint write's, raised where the
    loop waits for it. ``phase`` and ``step`` name the part that ran out (``MemoryPhase``'s names).

    >>> str(LateOutOfMemory("save", 4, "the asynchronous checkpoint write", MemoryError()))
    'the asynchronous checkpoint write: MemoryError'
    """

    def __init__(self, phase: str, step: int | None, what: str, error: BaseException):
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        super().__init__(f"{what}: {reason}")
        self.phase, self.step = phase, step


class MemoryPhase:
    """Which part of a run this rank is in, for its out-of-memory line: ``data``, ``build``, ``resume``, ``step``,
    ``evaluation`` or ``save``, the step it is at, whether this invocation has saved a checkpoint, and the
    micro-batches per step and the ZeRO stage a run that decides them is at (``accum``, ``stage``; ``None``: the
    setting's).

    ``with phase("step", 7): ...`` enters a part; one that ends normally hands back the part it was
    in, one that raises leaves the phase where it failed.

    >>> phase = MemoryPhase()
    >>> with phase("step", 7):
    ...     phase.name, phase.step
    ('step', 7)
    >>> phase.name
    'data'
    """

    def __init__(self):
        self.name, self.step, self.saved, self.accum, self.stage = "data", None, False, None, None

    @contextlib.contextmanager
    def __call__(self, name: str, step: int | None = None) -> Iterator[None]:
        before = self.name, self.step
        self.name, self.step = name, step
        yield
        self.name, self.step = before
