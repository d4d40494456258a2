"""A world that loses a rank and goes on with the others, in place: no restart, the same result.

``world.on_rank_loss=shrink`` (``restart``, the default, ends the step on every survivor
and lets ``world.max_restarts`` restart the world from its last checkpoint). The whole
training state is one value in every rank's memory and the result does not depend on
the world size (the global batch is split over whatever ranks there are; dropout masks
follow the samples, ``fdp.model.streams``), so when a rank dies or hangs the survivors:

1. see a collective fail (a dead peer's socket closes at once; a hung one's collective
   times out after ``world.timeout_s``), find which ranks were lost (a dead rank's keeper
   says so in the store as it dies, ``died_key``; else the heartbeats tell, over three
   beats, which ranks went silent) and say so in the store, which ends the collectives the others wait in at once
   (``ShrinkingWorld.watch``: gloo fails a collective only on the rank whose own peer is
   gone; the rest would wait for their timeout);
2. agree on the members of the next generation (the first survivor's proposal wins, in
   the store) and mark the others lost, so that their keepers (``fdp.procs.keeper``) kill a
   hung rank and tell the launcher it finished;
3. meet in the store, drop the process groups and make a new one over the survivors (a
   new key space per generation on the same store, ranks renumbered densely in their
   old order), with no process restarted; the old groups are kept alive, never freed,
   since freeing a gloo group waits for a collective still stuck in it to time out;
4. agree on the last step every survivor completed (a survivor one step ahead, or one whose
   step failed part way, goes back to the state that step began with: the loop keeps a copy
   of it, ``fdp.state.kept``, as the step donates its input) and go on from it with the
   global batch split over fewer ranks.

Under ``world.hierarchical=true`` the ranks form groups of ``world.node_size`` (a node each),
and the group is what a world loses: a lost rank's group steps out whole (``whole_groups``), so
that every group left is whole and holds, at a ZeRO stage, a replica of every slice of the
state (``fdp.update.zero.hybrid``): nothing is re-split or sent, and the world goes on with
fewer replicas.

``world.min_ranks`` ends the run when fewer ranks remain (with a checkpoint of that
step and one line naming the lost ranks). Each rank keeps its own per-rank state (hook
error feedback, its generator); a lost rank's is dropped with it.

The store is one all ranks reach and no rank holds: the launcher's (``fdp.spawn``), the
agent's (``torchrun``), or rank 0's keeper's (``slurm``); keys live under
``fdp/procs/shrink/<attempt>/``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from fdp._torch import live_groups
from fdp.comm import Comm
from fdp.procs.heartbeat import Heartbeat
from fdp.procs.keeper import LostRank, keep
from fdp.procs.launch import RankLostError
from fdp.procs.launchers import Launched, launcher_of

__all__ = [
    "END_KEY",
    "MEMBERS_KEY",
    "Shrink",
    "ShrinkingWorld",
    "check_shrinkable_batch",
    "keep_rank",
    "whole_groups",
    "launched_world",
    "shrink_store",
]

_RETIRED: list[Any] = []  # the process groups of earlier generations (see step 3 of the module docstring)
_ARRIVE_POLL_S = 0.01
_DIED_SETTLE_S = 0.05


def check_shrinkable_batch(
    global_batch_size: int, world_size: int, min_ranks: int, accum_steps: int = 1, group: int = 1
) -> None:
    """Every world a shrink can leave (``min_ranks`` to ``world_size`` ranks, whole groups of ``group`` ranks: see
    ``whole_groups``) splits the global batch evenly.

    >>> check_shrinkable_batch(12, 4, 1)
    >>> check_shrinkable_batch(8, 4, 1, group=2)  # worlds of 2 and 4 ranks
    >>> check_shrinkable_batch(10, 4, 1)
    Traceback (most recent call last):
    ...
    ValueError: data.global_batch_size=10: expected a multiple of every world size from world.min_ranks=1 to 4 \
times trainer.accum_steps=1 (e.g. 12, a multiple of 12, their least common multiple), for world.on_rank_loss=shrink
    """
    sizes = [n for n in range(max(1, min_ranks), world_size + 1) if n % group == 0] or [world_size]
    bad = [n for n in sizes if global_batch_size % (n * accum_steps)]
    if bad:
        lcm = math.lcm(*(n * accum_steps for n in sizes))
        fits = -(-global_batch_size // lcm) * lcm  # the nearest batch at least as large that every world splits
        nodes = f" in whole nodes of world.node_size={group}" if group > 1 else ""
        raise ValueError(
            f"data.global_batch_size={global_batch_size}: expected a multiple of every world size from "
            f"world.min_ranks={min_ranks} to {world_size}{nodes} "
            f"times trainer.accum_steps={accum_steps} "
            f"(e.g. {fits}, a multiple of {lcm}, their least common multiple), for world.on_rank_loss=shrink"
        )


def whole_groups(members: tuple[int, ...], lost: list[int], group: int) -> list[int]:
    """The members that leave the world when ``lost`` are lost, in groups of ``group`` consecutive members (a
    node each, ``world.hierarchical``): every member of a group that lost one; ``lost`` alone where ``group`` is 1.

    >>> whole_groups((0, 1, 2, 3), [2], 2)  # launch rank 3 steps out with rank 2's node
    [2, 3]
    >>> whole_groups((0, 1, 4, 5), [1, 5], 2), whole_groups((0, 1, 2), [1], 1)
    ([0, 1, 4, 5], [1])
    """
    hit = {members.index(rank) // group for rank in lost if rank in members}
    return sorted({*lost, *(rank for index, rank in enumerate(members) if index // group in hit)})


def shrink_store(timeout_s: float) -> dist.Store:
    """This attempt's key space for shrinking, on the store every rank of the launch reaches (``MASTER_ADDR:PORT``)."""
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"fdp/procs/shrink/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def died_key(rank: int) -> str:
    """The key by which launch rank ``rank``'s keeper says that the rank died (``keep_rank``); a rank that joins
    again clears it (``fdp.procs.grow``)."""
    return f"died/{rank}"


def fence_key(rank: int) -> str:
    """The key that says launch rank ``rank`` was declared lost (its keeper kills it)."""
    return f"lost/{rank}"


END_KEY = "end"  # the run's summary, set by the last world's rank 0
MEMBERS_KEY = "members"  # the current world, by launch rank ({"generation", "members"}), set by its rank 0
_HEARTBEATS = "heartbeat"  # where the ranks' heartbeats count, by launch rank


def launched_world(launcher: str) -> Launched:
    """The rank and world size the launcher gave this process (``rank 0 of 1`` outside a launched world).

    >>> launched_world("none").world_size >= 1
    True
    """
    return launcher_of(launcher).launched(os.environ)


def keep_rank(
    entry: Callable[..., Any],
    *args: Any,
    launcher: str,
    timeout_s: float,
    respawn: Callable[[Callable[[], dist.Store], list], Callable[[LostRank], bool]] | None = None,
) -> Any:
    """``entry(*args)`` as a rank this process keeps (``fdp.procs.keeper``), in a world that may shrink.

    ``respawn(store, cleared)``: what the keeper asks after a loss, whether to start the rank again
    (``fdp.procs.grow.respawner``); a rank started again returns the run's summary (the last
    world's rank 0's) once the run ends, whichever rank it became.

    Where no launcher holds a store all ranks reach (SLURM), rank 0's keeper holds one,
    so the store outlives any rank. Under ``torchrun`` and SLURM the process of a lost
    rank stays until the run ends and returns its summary (the process of rank 0 owns
    the run directory and prints it); under ``fdp.spawn`` it returns ``LostRank``.
    """
    kind = launcher_of(launcher)
    me = kind.launched(os.environ)
    os.environ.update(kind.environ(os.environ))
    held = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        if me.rank == 0:
            held = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # every rank joins as a client (fdp.procs.launch)
    stores: list = []

    def store() -> dist.Store:
        if not stores:
            stores.append(shrink_store(timeout_s))
        return stores[0]

    cleared = [0]  # the generation of the last fence a respawned rank was started after (fdp.procs.grow)

    def fenced() -> bool:
        try:
            key = fence_key(me.rank)
            return store().check([key]) and int(store().get(key)) > cleared[0]
        except Exception:  # not reachable (yet): nobody declared anything
            return False

    def until_the_end(lost: LostRank) -> dict:
        return _wait_for_end(store(), me.world_size, timeout_s)

    def told(lost: LostRank) -> None:  # the others need not wait for its heartbeat to stop
        with contextlib.suppress(Exception):
            store().set(died_key(lost.rank), lost.how)

    again = respawn(store, cleared) if respawn is not None else None
    try:
        result = keep(
            entry,
            *args,
            rank=me.rank,
            fenced=fenced,
            after_loss=until_the_end if kind.lost_rank_stays else None,
            respawn=again,
            told=told,
        )
        if again is not None and again.count[0] and not isinstance(result, LostRank):
            return _wait_for_end(store(), me.world_size, timeout_s)
        return result
    finally:
        del held


def _wait_for_end(store: dist.Store, world_size: int, timeout_s: float) -> dict:
    """The run's summary once the last world's rank 0 set it; ``RankLostError`` when no rank beats any more."""
    beats = dist.PrefixStore(_HEARTBEATS, store)
    keys = [Heartbeat.key(rank) for rank in range(world_size)]
    counts, changed = None, time.monotonic()
    while not store.check([END_KEY]):
        now = [beats.add(key, 0) for key in keys]
        if now != counts:
            counts, changed = now, time.monotonic()
        elif time.monotonic() - changed > 3 * timeout_s + 10:
            raise RankLostError(f"every rank was lost: none has answered for {3 * timeout_s + 10:.0f} s")
        time.sleep(0.5)
    return json.loads(store.get(END_KEY))


class Shrink(NamedTuple):
    """One shrink of the world: the step it went on from, the launch ranks lost (with the rest of their nodes under
    ``world.hierarchical``: ``whole_groups``), the new size and the seconds lost."""

    step: int
    lost: tuple[int, ...]
    world: int
    seconds_lost: float

    def record(self) -> dict:
        return {
            "step": self.step,
            "lost": list(self.lost),
            "world": self.world,
            "seconds_lost": round(self.seconds_lost, 3),
        }


class ShrinkingWorld:
    """This process's place in a world that may shrink: the members by launch rank, the generation.

    Made once every rank has joined generation 0 (``init_distributed``); ``regroup`` makes
    the next generation's process group after a failed collective.
    """

    def __init__(
        self,
        store: dist.Store,
        me: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        min_ranks: int = 1,
        beating: int = 0,
        members: tuple[int, ...] | None = None,
        generation: int = 0,
    ):
        self.store, self.me, self.backend, self.timeout_s, self.min_ranks = store, me, backend, timeout_s, min_ranks
        self.members: tuple[int, ...] = tuple(range(world_size)) if members is None else tuple(members)
        self.generation = generation
        # Every launch rank that may ever be a member beats under its own key (a world may grow back: fdp.procs.grow).
        beating = max(beating, world_size, *self.members, me + 1)
        self.heartbeat = Heartbeat(me, beating, store=dist.PrefixStore(_HEARTBEATS, store)).start()
        if members is None and me == 0:
            self._publish()

    def _publish(self) -> None:
        """Say in the store which launch ranks the world now has (what a rank that asks to join reads first)."""
        self.store.set(MEMBERS_KEY, json.dumps({"generation": self.generation, "members": list(self.members)}))

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    def comm(self) -> Comm:
        """The ``Comm`` of this generation's group, whose waits end once a member reports the world broken."""
        return Comm(watch=self.watch if self.backend == "gloo" else None)

    def report_broken(self) -> None:
        """Tell every member that this generation's world lost a rank (this rank saw it go silent)."""
        with contextlib.suppress(Exception):  # a store that does not answer: the others time out instead
            self.store.set(f"gen{self.generation}/broken", str(self.me))

    def watch(self) -> None:
        """Raise ``RuntimeError`` if a member reported this generation's world broken (asked while collectives wait)."""
        key = f"gen{self.generation}/broken"
        if self.store.check([key]):
            raise RuntimeError(
                f"rank {self.store.get(key).decode()} reported a lost rank (generation {self.generation})"
            )

    def silent(self) -> list[int] | None:
        """Members lost (launch ranks; ``None``: the store does not answer): those whose keepers said they died,
        as soon as one did, else those whose heartbeat stopped."""

        def told() -> list[int]:
            return [r for r in self.members if r != self.me and self.store.check([died_key(r)])]

        def died() -> list[int]:
            if not told():
                return []
            time.sleep(_DIED_SETTLE_S)  # others lost in the same moment (a node): their keepers tell within ms too
            return told()

        silent = self.heartbeat.silent_ranks(died)
        return None if silent is None else [r for r in silent if r in self.members]

    def regroup(self, lost: list[int], joined: tuple[int, ...] = ()) -> Comm:
        """The process group of the members but ``lost`` (and any that do not arrive), and ``joined`` after
        them (a world that grows back, ``fdp.procs.grow``); its ``Comm``.

        Raises ``RankLostError`` when this rank is no longer a member (the others went on
        without it) or no group can be formed.
        """
        dropped = set(lost)
        for _ in range(len(self.members) + len(joined)):
            generation = self.generation + 1
            proposal = [r for r in (*self.members, *joined) if r not in dropped]
            agreed = json.loads(self.store.compare_set(f"gen{generation}/members", "", json.dumps(proposal)))
            for rank in set(self.members) - set(agreed):
                self.store.set(fence_key(rank), str(generation))
            if self.me not in agreed:
                raise RankLostError(
                    f"rank {self.me} was declared lost by the other ranks (it stopped answering in time)"
                )
            self.admitting(generation, tuple(agreed))
            missing = self.enter(generation, tuple(agreed))
            if not missing:
                return self.comm()
            dropped = set(missing)
        raise RankLostError(f"rank {self.me} could not form a world with the other ranks")

    def admitting(self, generation: int, members: tuple[int, ...]) -> None:
        """Before the members of ``generation`` meet: nothing here (a growing world answers its joiners)."""

    def enter(self, generation: int, members: tuple[int, ...]) -> list[int]:
        """Leave this process's groups and join ``generation``'s (``members``, by launch rank, in order) once every
        member arrived; the members missing instead (no group made then)."""
        _RETIRED.extend(live_groups())
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        self.members, self.generation = members, generation
        missing = self._arrive(generation)
        if missing:
            return missing
        timeout = datetime.timedelta(seconds=self.timeout_s)
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"gen{generation}/group", self.store),
            rank=self.rank,
            world_size=len(members),
            timeout=timeout,
        )
        if self.rank == 0:
            self._publish()
        return []

    def _arrive(self, generation: int) -> list[int]:
        """Wait until every member arrived at ``generation`` (or a deadline passed); the members missing."""
        self.store.set(f"gen{generation}/arrived/{self.me}", "1")
        keys = {rank: f"gen{generation}/arrived/{rank}" for rank in self.members}
        # A survivor may still be inside a collective that waits for the lost rank: it arrives
        # within one collective timeout.
        deadline = time.monotonic() + 2 * self.timeout_s + 10
        while time.monotonic() < deadline:
            missing = [rank for rank, key in keys.items() if not self.store.check([key])]
            if not missing:
                return []
            time.sleep(_ARRIVE_POLL_S)
        return missing

    def agree_on_step(self, done: int, comm: Comm) -> int:
        """The last step every member completed (each tells the step its newest state completed)."""
        steps = torch.tensor([done], dtype=torch.int64)
        if comm.world_size > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.MIN)
        return int(steps[0])

    def finish(self, summary: dict) -> None:
        """Tell every keeper the run's summary (the last world's rank 0, at the end of the run)."""
        if self.rank == 0:
            with contextlib.suppress(Exception):
                self.store.set(END_KEY, json.dumps(summary, default=str))

    def close(self) -> None:
        self.heartbeat.stop()
