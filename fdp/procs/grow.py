"""A world that grows back: a new rank joins a running world at a step boundary and heals from its peers.

The mirror of ``fdp.procs.shrink`` (same store, same generations of process groups): under
``world.on_rank_loss=shrink`` a world may grow back to ``world.max_ranks`` ranks (default:
the size it started with). A rank that joins (a lost rank's process started again by its
keeper, ``world.respawn=true``; or any process started with ``FDP_JOIN=1`` beside the
launch's ``MASTER_ADDR``/``MASTER_PORT``, ``RANK`` naming its launch rank: what a torchrun
node admitted by ``--nnodes MIN:MAX`` or a SLURM task started again runs):

1. builds its model, plan and optimizer alone (no process group yet), so the running
   world never waits for that;
2. reads the current world (``MEMBERS_KEY``) and, when it is already ``world.max_ranks``
   ranks, stops there with one line (``JoinRefused``); else asks to join (``join/<n>``);
3. waits for its answer. The running world's rank 0 sees the request at a step
   boundary and schedules the join two boundaries later (two outer-loop periods under
   local SGD/DiLoCo, after steps no sync is in flight at: the ranks are at most one period
   apart; ``fdp.step.outer_spec.join_boundaries``), where every member will be
   (``GrowingWorld.due``). There the members propose the larger world in the store
   (``ShrinkingWorld.regroup`` with ``joined``), answer the joiner, and all meet in a
   new generation's group, the joiner last;
4. receives the train state from the survivors over that group (``fdp.state.heal``),
   nothing read from a checkpoint, and every rank re-splits the global batch.

A join is therefore never in the middle of a step or an outer-loop period: a request
made during one waits for the boundary. Keys live beside the shrink's, under
``fdp/procs/shrink/<attempt>/join/``.

>>> check_max_ranks(0, 3), check_max_ranks(4, 3)
(3, 4)
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from fdp._torch import preload_compiler
from fdp.procs.devices import resolve_backend, use_device
from fdp.procs.keeper import LostRank
from fdp.procs.launch import RankLostError, WorldLayout, loopback_interface
from fdp.procs.shrink import END_KEY, MEMBERS_KEY, ShrinkingWorld, died_key, fence_key

__all__ = ["JOIN_ENV", "GrowingWorld", "JoinRefused", "check_max_ranks", "joining", "prepare_joiner", "respawner"]

JOIN_ENV = "FDP_JOIN"  # "1": this process joins a running world instead of starting one
_COUNT = "join/count"  # requests made so far (each takes the next number)
_ADMITTED = "join/admitted"  # the last request answered
_POLL_S = 0.01


class JoinRefused(RuntimeError):
    """A rank asked to join a world that already has ``world.max_ranks`` ranks."""


def check_max_ranks(max_ranks: int, world_size: int) -> int:
    """``world.max_ranks``: how many ranks a world may grow back to (0: the ``world_size`` it starts with).

    >>> check_max_ranks(2, 3)
    Traceback (most recent call last):
    ...
    ValueError: world.max_ranks=2: expected 0 (the starting size) or at least the world's 3 ranks
    """
    if max_ranks and max_ranks < world_size or max_ranks < 0:
        raise ValueError(
            f"world.max_ranks={max_ranks}: expected 0 (the starting size) or at least the world's {world_size} ranks"
        )
    return max_ranks or world_size


def joining(env=os.environ) -> bool:
    """Whether this process joins a running world (``FDP_JOIN=1``) instead of starting one.

    >>> joining({"FDP_JOIN": "1"}), joining({})
    (True, False)
    """
    return env.get(JOIN_ENV, "0") == "1"


def prepare_joiner(layout: WorldLayout) -> str:
    """This process set up as ``init_distributed`` sets up a rank (its device, sockets, threads), without a
    process group yet; the backend it will join with."""
    kind = layout.kind
    os.environ.update(kind.environ(os.environ))
    use_device(layout.device(int(os.environ.get("LOCAL_RANK", 0))))
    if kind.local_only(os.environ):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
    if layout.accelerator == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
    return resolve_backend(layout.backend, [layout.device(r) for r in range(layout.nproc_per_node)])


def respawner(
    store: Callable[[], dist.Store], cleared: list[int], max_respawns: int, delay_s: float, timeout_s: float
) -> Callable[[LostRank], bool]:
    """What a keeper asks after its rank was lost (``fdp.procs.keeper.keep``'s ``respawn``): start it again?

    Yes, up to ``max_respawns`` times, once the others went on without it (its fence is in
    the store; ``cleared[0]`` becomes the fence's generation, so that the keeper's ``fenced``
    counts only a later one against the new process) and ``delay_s`` later, unless the run
    ended. The new process joins (``JOIN_ENV``).
    """
    done = [0]
    # What the rank's first step imports (torch.func's gradient pulls in dynamo; seconds on a loaded machine),
    # imported here before the first rank is forked: every process started from this one starts with it, the
    # first one included (which would import it anyway), and none imports it once a rank is lost.
    preload_compiler()

    def again(lost: LostRank) -> bool:
        if done[0] >= max_respawns:
            return False
        keys = store()
        deadline = time.monotonic() + 3 * timeout_s + 10  # the survivors regroup within a collective timeout
        while not keys.check([fence_key(lost.rank)]) or int(keys.get(fence_key(lost.rank))) <= cleared[0]:
            if keys.check([END_KEY]) or time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        cleared[0] = int(keys.get(fence_key(lost.rank)))
        time.sleep(delay_s)
        if keys.check([END_KEY]):
            return False
        done[0] += 1
        os.environ[JOIN_ENV] = "1"
        return True

    again.count = done  # how many times the rank was started again
    return again


class GrowingWorld(ShrinkingWorld):
    """A ``ShrinkingWorld`` that admits new ranks at step boundaries, up to ``max_ranks`` (module docstring).

    ``join`` makes one for a process that joins; ``joined``/``before`` then say which members it
    joined and which were there before it.
    """

    def __init__(self, *args, max_ranks: int = 0, group: int = 1, **kwargs):
        super().__init__(*args, beating=max_ranks, **kwargs)
        self.max_ranks = max_ranks or len(self.members)
        # Joiners are admitted in whole groups of this many (world.hierarchical's nodes: fdp.procs.shrink.whole_groups);
        # the others wait for theirs.
        self.group = group
        self.before: tuple[int, ...] = self.members
        self.asked_at: int | None = None
        self._plan: dict | None = None

    # -- the members' side ---------------------------------------------------------------------
    def due(self, step: int, period: int = 1, phase: int = 0) -> bool:
        """After ``step`` on every member: whether a join was scheduled for this boundary (one store
        round trip per step: rank 0 counts the requests, the others look for its schedule). The boundaries
        are the steps ``s`` with ``s % period == phase`` (``fdp.step.outer_spec.join_boundaries``)."""
        key = f"gen{self.generation}/grow"
        if self._plan is None or self._plan["generation"] != self.generation:
            self._plan = None
            if self.rank == 0:
                self._plan = self._schedule(step, period, phase, key)
            elif self.store.check([key]):
                self._plan = json.loads(self.store.get(key))
        return self._plan is not None and self._plan["at"] == step

    def _schedule(self, step: int, period: int, phase: int, key: str) -> dict | None:
        count = self.store.add(_COUNT, 0)
        admitted = int(self.store.get(_ADMITTED)) if self.store.check([_ADMITTED]) else 0
        ids = []
        for number in range(admitted + 1, count + 1):  # in order; one whose record is not written yet waits
            if not self.store.check([f"join/{number}"]):
                break
            ids.append(number)
        if not ids:
            return None
        room = self.max_ranks - len(self.members)
        ranks = [json.loads(self.store.get(f"join/{number}"))["rank"] for number in ids]
        taken, refused = [], []
        for number, rank in zip(ids, ranks):
            (
                taken
                if len(taken) < room and rank not in self.members and rank not in [r for _, r in taken]
                else refused
            ).append((number, rank))
        for number, rank in refused:
            self.store.set(f"join/{number}/answer", json.dumps({"refused": self._full(rank)}))
        # A group's first joiners wait for the rest of it.
        whole = max(0, len(taken) - (len(self.members) + len(taken)) % self.group)
        if whole < len(taken):
            waiting, taken = taken[whole:], taken[:whole]
            ids = [number for number in ids if number < waiting[0][0]]  # answered up to the first one that waits
        if not taken:
            if ids:
                self.store.set(_ADMITTED, str(ids[-1]))
            return None
        # Counted admitted at the boundary only: a world that shrinks before it schedules them again.
        plan = {
            "generation": self.generation,
            "at": ((step - phase) // period + 2) * period + phase,
            "asked": step,
            "ids": [n for n, _ in taken],
            "ranks": [r for _, r in taken],
            "last": ids[-1],
        }
        self.store.set(key, json.dumps(plan))
        return plan

    def _full(self, rank: int) -> str:
        return (
            f"world.max_ranks={self.max_ranks}: expected room for one more rank; the world already has "
            f"{len(self.members)} (launch ranks {', '.join(map(str, self.members))}), so launch rank {rank} "
            "cannot join"
        )

    def admit(self):
        """At the scheduled boundary, on every member: the larger world's ``Comm`` (``regroup``)."""
        plan, self._plan = self._plan, None
        self.before, self.asked_at = self.members, plan["asked"]
        self._answering = plan
        return self.regroup([], joined=tuple(plan["ranks"]))

    def admitting(self, generation: int, members: tuple[int, ...]) -> None:
        if self.rank == 0 and getattr(self, "_answering", None):  # answered before anyone waits for the joiners
            answer = json.dumps(
                {
                    "generation": generation,
                    "members": list(members),
                    "before": list(self.before),
                    "asked": self.asked_at,
                }
            )
            for number in self._answering["ids"]:
                self.store.set(f"join/{number}/answer", answer)
            self.store.set(_ADMITTED, str(self._answering["last"]))
        self._answering = None

    @property
    def joined(self) -> tuple[int, ...]:
        return tuple(r for r in self.members if r not in self.before)

    # -- the joiner's side -------------------------------------------------------------------------
    @classmethod
    def join(
        cls,
        store: dist.Store,
        me: int,
        backend: str,
        timeout_s: float,
        min_ranks: int = 1,
        max_ranks: int = 0,
        wait_s: float | None = None,
        group: int = 1,
    ) -> "GrowingWorld | None":
        """Ask to join the running world as launch rank ``me`` and join it at its next boundary; ``None``
        when the run ended first. ``JoinRefused`` (one line) when it has ``max_ranks`` ranks already."""
        current = _current(store, me, timeout_s)
        if current is None:
            return None
        members = current["members"]
        limit = max_ranks or len(members)
        if len(members) >= limit:
            raise JoinRefused(
                f"world.max_ranks={limit}: expected room for one more rank; the world already has {len(members)} "
                f"(launch ranks {', '.join(map(str, members))}), so launch rank {me} cannot join"
            )
        store.delete_key(died_key(me))  # a death its keeper told of, before it was started again: not this one's
        number = store.add(_COUNT, 1)
        store.set(f"join/{number}", json.dumps({"rank": me}))
        answer = _answer(store, number, wait_s)
        if answer is None:
            return None
        if "refused" in answer:
            raise JoinRefused(answer["refused"])
        world = cls(
            store,
            me,
            len(answer["before"]),
            backend,
            timeout_s,
            min_ranks,
            max_ranks=max_ranks,
            group=group,
            members=tuple(answer["before"]),
            generation=answer["generation"] - 1,
        )
        world.asked_at = answer["asked"]
        missing = world.enter(answer["generation"], tuple(answer["members"]))
        if missing:
            raise RankLostError(f"rank {me} could not join: launch ranks {missing} did not arrive")
        return world


def _current(store: dist.Store, me: int, timeout_s: float) -> dict | None:
    """The running world (``MEMBERS_KEY``) once ``me`` is not in it (a lost rank's own entry leaves as the
    others regroup); ``None`` when the run ended."""
    deadline = time.monotonic() + 3 * timeout_s + 10
    while time.monotonic() < deadline:
        if store.check([END_KEY]):
            return None
        if store.check([MEMBERS_KEY]):
            current = json.loads(store.get(MEMBERS_KEY))
            if me not in current["members"]:
                return current
        time.sleep(_POLL_S)
    raise RankLostError(f"launch rank {me} could not join: the world still lists it after {3 * timeout_s + 10:.0f} s")


def _answer(store: dist.Store, number: int, wait_s: float | None) -> dict | None:
    """Request ``number``'s answer once the world's rank 0 gave it; ``None`` when the run ended first."""
    key = f"join/{number}/answer"
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while not store.check([key]):
        if store.check([END_KEY]) or deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)
    return json.loads(store.get(key))
