"""A rank that joins a running world takes the train state from the ranks that have it (``fdp.procs.grow``).

Ranks ``0 .. senders - 1`` of the new world hold the state (the survivors); the others
join. What every survivor holds alike (the step, params, buffers, optimizer state, loss
scale, outer-loop state, the ZeRO-1 mirror) travels over the new process group: rank 0
broadcasts its structure (shapes, dtypes and the non-tensor leaves, with ``extra``: what
the loop needs beside the state), then each tensor comes from one survivor in turn, so
a large state is sent by all of them, each sending a part (under an outer loop, where
ranks differ between syncs, all of it from rank 0). Nothing is read from disk.

Under hybrid sharding (``fdp.update.zero.hybrid``) the survivors' states differ (each holds its
slices) and whole groups join (``fdp.procs.shrink.whole_groups``): ``share_replicas`` gives each
joiner the state of its replica, the survivor at its place in the first group, over the
replicas' group.

What is per rank is not sent: the joiner's hook state starts empty as a fresh rank's
does (error feedback), and its generators start from the seed as rank ``r``'s would
(``fdp.state.replicas.rank_seed``). A ZeRO-1 state is split again afterwards by the
update's own ``reshard`` (the joiner holds no slice; the survivors send theirs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fdp._torch import tree_flatten, tree_unflatten
from fdp.comm import Comm, new_group, wait_watched
from fdp.plan import BucketPlan
from fdp.plan.buckets import crosses_flat, lay_out
from fdp.procs.devices import seeded_cuda_rng
from fdp.state.replicas import rank_seed
from fdp.state.train_state import TrainState

__all__ = ["PER_RANK", "fresh_rank_parts", "share_replicas", "share_state"]

PER_RANK = ("hook_state", "rng", "cuda_rng")  # never sent: each rank's own


class _Slot:
    """A tensor leaf's place in the structure rank 0 broadcasts: its shape, dtype and whether it is on the device."""

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype, self.on_device = tuple(tensor.shape), tensor.dtype, tensor.device.type != "cpu"


def _laid_out(
    state: TrainState, extra: Any, comm: Comm, joining: bool, device: torch.device
) -> tuple[list, Any, list, Any]:
    """On every rank of ``comm`` (a collective): rank 0's layout of the shared fields of ``state`` (its tree spec,
    each leaf a ``_Slot`` where it is a tensor) and its ``extra``; the leaves to send or receive (a joiner's made
    empty, in that layout). ``(leaves, spec, skeleton, rank 0's extra)``."""
    shared = {name: getattr(state, name) for name in TrainState._fields if name not in PER_RANK}
    leaves, spec = tree_flatten(shared)
    box: list[Any] = [None]
    if comm.rank == 0:
        box = [(spec, [_Slot(t) if isinstance(t, torch.Tensor) else t for t in leaves], extra)]
    dist.broadcast_object_list(box, group=comm.group, group_src=0)
    spec, skeleton, sent_extra = box[0]
    if joining:
        leaves = [
            torch.empty(s.shape, dtype=s.dtype, device=device if s.on_device else "cpu") if isinstance(s, _Slot) else s
            for s in skeleton
        ]
    return leaves, spec, skeleton, sent_extra


def share_state(
    state: TrainState, extra: Any, comm: Comm, senders: int, device: torch.device
) -> tuple[TrainState, Any]:
    """On every rank of ``comm`` (a collective): the survivors' state and ``extra`` (rank 0's) on the joiners (ranks
    ``senders`` and up; their own per-rank fields kept); the survivors' own, unchanged, on them.

    >>> state = TrainState(3, {"w": torch.ones(2)}, {}, (), (), torch.empty(0))
    >>> share_state(state, {"x": 1}, Comm(), 1, torch.device("cpu"))[1]
    {'x': 1}
    """
    if comm.world_size <= senders:
        return state, extra
    joining = comm.rank >= senders
    leaves, spec, skeleton, extra = _laid_out(state, extra, comm, joining, device)
    joiners = list(range(senders, comm.world_size))
    # One group per survivor with the joiners: a survivor's own tensors are never overwritten by another's.
    groups = [new_group([sender, *joiners]) for sender in range(senders)]
    slots = [i for i, s in enumerate(skeleton) if isinstance(s, _Slot)]
    # Under an outer loop the survivors' params and inner optimizer states differ between syncs: all from rank 0,
    # so a joiner is one rank's state (as a checkpoint resumed on more ranks gives it), not a mix of several.
    spread = 1 if state.outer else senders
    works = []
    for turn, index in enumerate(slots):
        sender = turn % spread
        if comm.rank == sender or joining:
            works.append(dist.broadcast(leaves[index], src=sender, group=groups[sender], async_op=True))
    for work in works:
        wait_watched(work, comm.watch)
    if not joining:
        return state, extra
    return state._replace(**tree_unflatten(leaves, spec)), extra


def share_replicas(
    state: TrainState, extra: Any, replicas: Comm, senders: int, device: torch.device
) -> tuple[TrainState, Any]:
    """On every rank (a collective of each replicas' group ``replicas``: the ranks holding the same slices, one per
    group, the survivors' groups first): the state and ``extra`` of replica 0 on the joiners (replicas ``senders``
    and up; their own per-rank fields kept); the survivors' own on them.

    >>> state = TrainState(3, {"w": torch.ones(2)}, {}, (), (), torch.empty(0))
    >>> share_replicas(state, {"x": 1}, Comm(), 1, torch.device("cpu"))[1]
    {'x': 1}
    """
    if replicas.world_size <= senders:
        return state, extra
    joining = replicas.rank >= senders
    leaves, spec, _, sent_extra = _laid_out(state, extra, replicas, joining, device)
    # Replica 0 sends every tensor; the other survivors receive what they hold already (replicas are equal).
    held = [t if joining or replicas.rank == 0 else t.clone() for t in leaves if isinstance(t, torch.Tensor)]
    works = [dist.broadcast(t, group=replicas.group, group_src=0, async_op=True) for t in held]
    for work in works:
        wait_watched(work, replicas.watch)
    if not joining:
        return state, extra
    return state._replace(**tree_unflatten(leaves, spec)), sent_extra


def fresh_rank_parts(state: TrainState, plan: BucketPlan, seed: int, rank: int, sharded: bool = False) -> TrainState:
    """A joiner's ``state`` (sent whole, ``share_state``) with what a fresh rank ``rank`` starts with: its generators
    from the seed, and its params laid out as the step takes them (one flat buffer per bucket where it does; never
    ``sharded`` ones, which keep ZeRO's layout)."""
    rng = torch.Generator().manual_seed(rank_seed(seed, rank)).get_state()
    params = state.params
    if crosses_flat(plan) and not sharded:
        params = lay_out(plan, params)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    return state._replace(params=params, rng=rng, cuda_rng=seeded_cuda_rng(rank_seed(seed, rank), device))
