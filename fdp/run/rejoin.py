"""A rank of a run that joins its running world (``fdp.procs.grow``) and the heal every rank of a world that grew does.

The trainer (``fdp.run.trainer``) builds a joining rank's pieces alone, then ``enter_world``
takes it into the running world, healed from its ranks; the ranks already there call
``heal`` at the boundary they admit it at.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from fdp.comm import Comm
from fdp.hooks.base import init_hook_states
from fdp.procs.grow import GrowingWorld
from fdp.procs.shrink import launched_world, shrink_store
from fdp.run.build import RunParts, node_size_of, regrouped
from fdp.state.heal import fresh_rank_parts, share_replicas, share_state
from fdp.state.train_state import TrainState

__all__ = ["Joining", "RunEnded", "enter_world", "heal"]


class RunEnded(Exception):
    """A rank that was to join found the run over first (its keeper returns the run's summary)."""


class Joining:
    """A rank that joins a running world, before it has one (``world``, once joined).

    >>> Joining(2, "gloo").close()
    """

    def __init__(self, me: int, backend: str):
        self.me, self.backend, self.world = me, backend, None

    def close(self) -> None:
        if self.world is not None:
            self.world.close()


def heal(
    cfg: DictConfig,
    world: GrowingWorld,
    parts: RunParts,
    state: TrainState,
    comm: Comm,
    device: torch.device,
    extra: dict | None = None,
) -> tuple[RunParts, TrainState, dict]:
    """Every rank of a world that grew: its parts for the larger world (``world.hierarchical``'s groups,
    ``regrouped``); the joiners take the survivors' state (and ``extra``, rank 0's), with their own per-rank
    parts; then the update splits it again over the larger world (ZeRO-1's slices). Under hybrid sharding each
    joiner takes its replica's state (``share_replicas``) and starts its hook state afresh for its slices."""
    parts = regrouped(cfg, parts, comm)
    groups = getattr(parts.update, "groups", None)
    if groups is None:
        state, extra = share_state(state, extra, comm, len(world.before), device)
    else:  # whole groups joined: the survivors' groups are replicas 0 .. before // node_size - 1
        state, extra = share_replicas(
            state, extra, groups.replicas, len(world.before) // groups.shard.world_size, device
        )
    if world.me in world.joined:
        state = fresh_rank_parts(state, parts.plan, cfg.seed, comm.rank, sharded=groups is not None)
        if groups is not None:
            state = state._replace(hook_state=init_hook_states(parts.update.reduction_hook(parts.hook), parts.plan))
    return parts, parts.update.reshard(state, world.before, world.members, comm), extra


def enter_world(
    cfg: DictConfig, joining: Joining, parts: RunParts, state: TrainState, device: torch.device
) -> tuple[GrowingWorld, Comm, RunParts, TrainState, dict]:
    """A rank built alone, into the running world at its next boundary: the world, its comm, its parts for that
    world (``regrouped``), the healed state and
    what the loop takes from the world's rank 0 (``controls``: the loop's own state; ``compile``). ``RunEnded``
    when the run ended first."""
    w = cfg.world
    world = GrowingWorld.join(
        shrink_store(w.timeout_s),
        joining.me,
        joining.backend,
        w.timeout_s,
        w.min_ranks,
        max_ranks=w.max_ranks or launched_world(w.launcher).world_size,
        group=node_size_of(cfg),
    )
    if world is None:
        raise RunEnded()
    joining.world = world
    comm = world.comm()
    parts, state, extra = heal(cfg, world, parts, state, comm, device)
    return world, comm, parts, state, extra
