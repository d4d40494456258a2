"""Starting ranks and joining them into a process group, on PyTorch's own launchers.

* ``single``: one process, no process group (a ``Comm`` over a world of one).
* local worlds (``local2``, ``local4``): the recipe starts N workers on this machine
  with PyTorch's elastic launcher, so one command trains on N processes and there is
  one config and one output directory.
* ``torchrun``: each process was started by ``torchrun`` (or SLURM via Hydra) and reads
  its rank, world size and rendezvous from the environment.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import socket
import uuid
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from fdp.comm import Comm
from fdp.plan import BucketPlan

LOOPBACK = "127.0.0.1"
LAUNCHERS = ("none", "elastic", "torchrun")
BACKENDS = ("auto", "gloo", "nccl")


class WorldLayout(NamedTuple):
    """How many processes run, where, and how they find each other."""

    launcher: str = "none"  # none | elastic | torchrun
    nnodes: int = 1
    nproc_per_node: int = 1
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0
    max_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn(entry: Callable[..., Any], args: tuple, layout: WorldLayout) -> dict[int, Any]:
    """Run ``entry(*args)`` on ``layout.nproc_per_node`` local workers; return each rank's result.

    The rendezvous binds to 127.0.0.1 only. A worker that raises makes the whole launch
    raise (``ChildFailedError`` carries the rank and its traceback); with
    ``max_restarts > 0`` the group is restarted that many times first.

    >>> spawn(my_worker, (cfg,), WorldLayout("elastic", nproc_per_node=2))   # doctest: +SKIP
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=layout.nproc_per_node,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=f"{LOOPBACK}:{free_port()}",
        rdzv_configs={"timeout": int(layout.timeout_s)},
        max_restarts=layout.max_restarts,
        local_addr=LOOPBACK,
        monitor_interval=0.1,
        start_method="spawn",
    )
    return elastic_launch(config, entry)(*args)


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"world.backend={backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def init_distributed(layout: WorldLayout) -> Comm:
    """Join this process to the world ``layout`` describes; return its ``Comm``.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``,
    which both the elastic launcher and ``torchrun`` set. Every collective of the group
    times out after ``layout.timeout_s`` seconds instead of hanging.
    """
    if layout.launcher == "none":
        return Comm()
    backend = resolve_backend(layout.backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    else:
        # Ranks on one machine share its cores; more threads each only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=layout.timeout_s))
    expected = int(os.environ.get("WORLD_SIZE", layout.world_size))
    if layout.launcher == "elastic" and expected != layout.world_size:
        raise RuntimeError(f"world has {expected} processes, layout expects {layout.world_size}")
    return Comm()


def device_for(backend: str) -> torch.device:
    """The device this rank computes on."""
    if backend == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def tune_allocator() -> None:
    """Keep freed gradient-sized blocks in glibc's heap instead of returning them to the OS.

    A pure step allocates new parameter and gradient tensors every step; with glibc's
    defaults each large block is mmap-ed and unmapped again, paying page faults on every
    step. Raising the mmap and trim thresholds lets the heap reuse them.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 * 2**20)  # glibc's ceiling for this setting
    libc.mallopt(m_trim_threshold, 2**30)


def check_same_plan(plan: BucketPlan, comm: Comm) -> None:
    """Stop every rank with a named difference if any rank planned other buckets."""
    if comm.world_size == 1:
        return
    plans = [None] * comm.world_size
    dist.all_gather_object(plans, plan.to_dict())
    reference = BucketPlan.from_dict(plans[0])
    for rank, other in enumerate(plans[1:], start=1):
        difference = reference.first_difference(BucketPlan.from_dict(other))
        if difference:
            raise RuntimeError(f"bucket plans differ between rank 0 and rank {rank} (different models?): {difference}")


def broadcast_from_rank0(tensors: dict[str, torch.Tensor], comm: Comm) -> dict[str, torch.Tensor]:
    """Rank 0's values for every tensor (new tensors; the inputs are untouched)."""
    if comm.world_size == 1:
        return tensors
    out = {name: t.clone() for name, t in tensors.items()}
    for t in out.values():
        dist.broadcast(t, src=0)
    return out
