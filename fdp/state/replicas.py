"""The ranks' replicas of one model, made consistent and kept so.

* ``setup_state``: the first ``TrainState``, consistent on every rank: the ranks' bucket
  plans, seeds and buffers are compared (a difference stops every rank, named), rank 0's
  params and buffers become everyone's (``agreed_start``), and each rank's RNG (dropout)
  is derived from the one seed. What the trainer does before step 1 (through each ZeRO
  stage's ``fdp.update.base.Update.first_state``), for Python callers.
* ``sync_buffers``: buffers that training updates (BatchNorm running statistics) across
  ranks, once per step before the forward (``make_train_step(..., sync_buffers=...)``).
  Gradients are averaged, so params stay identical; buffers are updated from each rank's
  own batch, so they drift apart unless synchronised:

  - ``"broadcast"`` (the default): rank 0's buffers, as DDP does by default
    (``broadcast_buffers=True``). Every rank computes from the same statistics and a
    checkpoint of rank 0's buffers is the run's.
  - ``"average"``: the mean over ranks of floating-point buffers (integer ones, such as
    ``num_batches_tracked``, are rank 0's): statistics of more data, closer to what one
    process on the whole batch would keep.
  - ``"local"``: each rank keeps its own (no communication); a checkpoint stores each
    rank's, and evaluation on rank 0 sees rank 0's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fdp.comm import Comm, wait_watched
from fdp.errors import check_choice
from fdp.model.functional import Buffers, Params
from fdp.plan import BucketPlan
from fdp.procs.launch import broadcast_from_rank0, check_same_plan
from fdp.state.train_state import init_train_state

__all__ = ["BUFFER_SYNC", "agreed_start", "check_sync_buffers", "rank_seed", "setup_state", "sync_buffers"]

BUFFER_SYNC = ("broadcast", "average", "local")


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s generator (dropout masks differ between ranks, as their data do).

    >>> rank_seed(7, 0), rank_seed(7, 3)
    (7, 10)
    """
    return seed + rank


def _signature(seed: int, buffers: Buffers) -> dict[str, Any]:
    return {"seed": seed, "buffers": {name: (tuple(b.shape), str(b.dtype)) for name, b in buffers.items()}}


def _check_same_seed_and_buffers(seed: int, buffers: Buffers, comm: Comm) -> None:
    # Checked before any broadcast: a broadcast of mismatched shapes would hang or corrupt.
    if comm.world_size == 1:
        return
    mine = _signature(seed, buffers)
    every = [None] * comm.world_size
    dist.all_gather_object(every, mine, group=comm.group)
    for rank, other in enumerate(every[1:], start=1):
        if other["seed"] != every[0]["seed"]:
            raise ValueError(
                f"seed differs between ranks (rank 0: {every[0]['seed']}, rank {rank}: {other['seed']}): "
                "pass the same seed on every rank; each rank's own generator is derived from it"
            )
        if other["buffers"] != every[0]["buffers"]:
            names = sorted(set(other["buffers"]) ^ set(every[0]["buffers"])) or sorted(
                n for n in every[0]["buffers"] if other["buffers"][n] != every[0]["buffers"][n]
            )
            raise ValueError(f"buffers differ between rank 0 and rank {rank} (different models?): {names[:5]}")


def agreed_start(params: Params, buffers: Buffers, plan: BucketPlan, comm: Comm, seed: int) -> tuple[Params, Buffers]:
    """Rank 0's ``params`` and ``buffers`` on every rank of ``comm``, once their plans, seeds and buffers agree.

    A difference in the plans, the seeds or the buffers' shapes raises on every rank,
    naming it (checked before any broadcast: mismatched shapes would hang or corrupt).
    The inputs are left untouched.

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (2,), "float32", "cpu")])
    >>> agreed_start({"w": torch.ones(2)}, {}, plan, Comm(), seed=0)[0]["w"]
    tensor([1., 1.])
    """
    check_same_plan(plan, comm)
    _check_same_seed_and_buffers(seed, buffers, comm)
    return broadcast_from_rank0(params, comm), broadcast_from_rank0(buffers, comm)


def setup_state(
    params: Params,
    buffers: Buffers,
    optimizer,
    plan: BucketPlan,
    hook=None,
    comm: Comm | None = None,
    seed: int = 0,
    precision=None,
):
    """``init_train_state`` made consistent across the ranks of ``comm``; call it on every rank.

    Compares the ranks' plans, seeds and buffer shapes (a difference raises on every
    rank, naming it), takes rank 0's ``params`` and ``buffers`` (so ranks that built
    their models from different random states still start equal), and seeds each
    rank's generator with ``rank_seed(seed, rank)``. The inputs are left untouched.

    >>> import torch
    >>> from fdp import functionalize, plan_buckets, planner_loss, cross_entropy_loss, sgd
    >>> model, params, buffers = functionalize(torch.nn.Linear(4, 3))
    >>> batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    >>> plan = plan_buckets(planner_loss(cross_entropy_loss(model), buffers), params, batch)
    >>> setup_state(params, buffers, sgd(0.1), plan, seed=0).step
    0
    """
    comm = comm or Comm()
    params, buffers = agreed_start(params, buffers, plan, comm, seed)
    return init_train_state(
        params, buffers, optimizer, plan, hook, seed=rank_seed(seed, comm.rank), precision=precision
    )


def _groups(buffers: Buffers) -> dict[tuple, list[str]]:
    groups: dict[tuple, list[str]] = {}
    for name, b in buffers.items():
        groups.setdefault((b.dtype, b.device), []).append(name)
    return groups


def check_sync_buffers(how: str) -> str:
    """How buffers agree across ranks: ``broadcast`` rank 0's (DDP's default), ``average``, or keep them ``local``."""
    return check_choice("sync_buffers", how, BUFFER_SYNC)


def sync_buffers(buffers: Buffers, comm: Comm, how: str = "broadcast") -> Buffers:
    """``buffers`` as ``how`` (one of ``BUFFER_SYNC``) makes them agree across ranks: new tensors.

    One collective per dtype and device (the buffers of a group travel as one flat
    tensor, as DDP coalesces them). A world of one, ``how="local"`` and a model without
    buffers cost nothing. The input is never modified.

    >>> sync_buffers({"running_mean": torch.zeros(3)}, Comm(), "average")["running_mean"]
    tensor([0., 0., 0.])
    """
    check_sync_buffers(how)
    world = comm.world_size
    if how == "local" or world == 1 or not buffers:
        return buffers
    out = dict(buffers)
    for (dtype, _), names in _groups(buffers).items():
        flat = torch.cat([buffers[name].reshape(-1) for name in names])  # a new tensor: the collective writes into it
        # Waited as the step's own collectives are (a world that may shrink ends the wait early).
        if how == "average" and dtype.is_floating_point:
            wait_watched(dist.all_reduce(flat, group=comm.group, async_op=True), comm.watch)
            flat.div_(world)
        else:
            source = dist.get_global_rank(comm.group, 0) if comm.group is not None else 0
            wait_watched(dist.broadcast(flat, src=source, group=comm.group, async_op=True), comm.watch)
        for name, part in zip(names, flat.split([buffers[name].numel() for name in names])):
            out[name] = part.view(buffers[name].shape)
    return out
