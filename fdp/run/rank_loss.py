"""What a lost rank does (``world.on_rank_loss``, ``world.respawn``): the one owner of that choice.

``rank_loss_of(world)`` reads the settings once into one of three values, and every part of
the run asks that value instead of reading the settings (as launchers are objects in
``fdp.procs.launchers``):

* ``Restart`` (``world.on_rank_loss=restart``, the default): a lost rank ends the world; the
  failed collective ends the run with a ``RankLostError`` naming it, and ``world.max_restarts``
  restarts the world from its last checkpoint (``fdp.procs.launch``).
* ``ShrinkWorld`` (``world.on_rank_loss=shrink``): the others go on without it (``fdp.procs.shrink``).
  A process keeps each rank (``fdp.procs.keeper``), the loop keeps a copy of the state before each step
  (a world that shrinks may go back to it: ``fdp.state.kept``), a sharded state keeps a mirror of the next
  rank's slices (``fdp.update.zero.mirror``), and the forward draws per sample so that the
  result does not depend on the world size (``fdp.model.streams``). Ranks may join it again
  (``fdp.procs.grow``).
* ``ShrinkAndRespawn`` (also ``world.respawn=true``): besides, the keeper of a lost rank starts
  it again, and it joins the world that went on.

What a lost rank is reported as is said here too: ``lost_rank_error`` after a failed collective (the ranks
the heartbeats found silent), ``lost_message`` when the world ends with it.

Its settings are validated here too (``check_rank_loss``, ``check_one_process``,
``check_rank_loss_in_world``), each rule once, naming the config key.

>>> from fdp.run.config.compose import compose
>>> rank_loss_of(compose().world)
Restart()
>>> loss = rank_loss_of(compose("world=local2", "world.on_rank_loss=shrink", "world.respawn=true").world)
>>> loss.name, loss.donates_state(), loss.keeps_before, loss.sample_streams("auto"), loss.mirrors(shards_optimizer=True)
('shrink + respawn', True, True, True, True)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from fdp.errors import ConfigError, as_config_key, check_choice, one_of, require
from fdp.model.streams import wants_sample_streams
from fdp.procs.grow import check_max_ranks, joining, respawner
from fdp.procs.heartbeat import Heartbeat
from fdp.procs.launch import RankLostError, WorkerFailedError
from fdp.procs.shrink import check_shrinkable_batch, launched_world
from fdp.run.checkpoint import saved_steps
from fdp.run.memory.micro_batch import fixed_accum
from fdp.run.rundir import RankStatus, RunDir
from fdp.update.zero import ZERO_STAGES, stage_rules

__all__ = [
    "ON_RANK_LOSS",
    "RankLoss",
    "lost_rank_error",
    "lost_message",
    "Restart",
    "ShrinkWorld",
    "ShrinkAndRespawn",
    "check_on_rank_loss",
    "check_one_process",
    "check_rank_loss",
    "check_rank_loss_in_world",
    "rank_loss_of",
    "refuses_stage",
    "check_stage_kept",
]

ON_RANK_LOSS = ("restart", "shrink")


@dataclass(frozen=True)
class RankLoss:
    """What a lost rank does, as the run asks it; the base answers as ``Restart`` does."""

    name = "restart"
    shrinks = False  # whether the world goes on without a lost rank (a bool for the modules that only ask that)

    def donates_state(self, outer_loop: bool = False) -> bool:
        """Whether the step may donate its input state (``make_train_step(..., donate=True)``): where the world never
        goes back to it, and where it does but the loop keeps a copy of it (``keeps_before``, ``fdp.state.kept``);
        not under an outer loop (``outer_loop``) in a world that shrinks, whose sync in flight writes into the state
        between steps (``fdp.step.outer``): that step keeps its input intact instead."""
        return not (self.shrinks and outer_loop)

    @property
    def keeps_before(self) -> bool:
        """Whether the loop keeps the state before each step (``fdp.state.kept``): a world that shrinks goes back to
        it on a survivor one step ahead or one whose step failed part way (``fdp.procs.shrink``)."""
        return self.shrinks

    def sample_streams(self, setting: bool | str) -> bool:
        """Whether the forward draws per sample (``trainer.sample_streams``; ``auto``: where the world may shrink)."""
        return wants_sample_streams(setting, self.shrinks)

    def mirrors(self, shards_optimizer: bool, hierarchical: bool = False) -> bool:
        """Whether a sharded state keeps the next rank's slices too (``fdp.update.zero.mirror``); a
        hierarchical world has a replica of every slice in each other group instead (``whole_groups``)."""
        return False

    def keeps_rank(self, launcher: str) -> bool:
        """Whether this process keeps its rank as a child (``fdp.procs.keeper``), to outlive its loss."""
        return False

    def respawner(self) -> Callable[[Any, list], Callable] | None:
        """What a keeper asks after its rank was lost, given the store and fence (``fdp.procs.grow.respawner``)."""
        return None

    def joins(self) -> bool:
        """Whether this process joins a world already running (``FDP_JOIN=1``, ``fdp.procs.grow``)."""
        return False

    def goes_on(self, world_size: int, joiner: bool) -> bool:
        """Whether this rank's world goes on without a lost rank (a ``GrowingWorld``); else a failed
        collective ends the run with a ``RankLostError`` naming the ranks that stopped answering."""
        return False


@dataclass(frozen=True)
class Restart(RankLoss):
    """``world.on_rank_loss=restart``: a lost rank ends the world (``world.max_restarts`` restarts it)."""


@dataclass(frozen=True)
class ShrinkWorld(RankLoss):
    """``world.on_rank_loss=shrink``: the others go on without a lost rank; ranks may join again."""

    name = "shrink"
    shrinks = True

    def mirrors(self, shards_optimizer: bool, hierarchical: bool = False) -> bool:  # noqa: D102
        return shards_optimizer and not hierarchical

    def keeps_rank(self, launcher: str) -> bool:  # noqa: D102
        return launched_world(launcher).world_size > 1

    def joins(self) -> bool:  # noqa: D102
        return joining()

    def goes_on(self, world_size: int, joiner: bool) -> bool:  # noqa: D102
        return world_size > 1 or joiner


@dataclass(frozen=True)
class ShrinkAndRespawn(ShrinkWorld):
    """``world.on_rank_loss=shrink`` with ``world.respawn=true``: a lost rank's keeper starts it again."""

    max_respawns: int = 3
    delay_s: float = 1.0
    timeout_s: float = 300.0
    name = "shrink + respawn"

    def respawner(self) -> Callable[[Any, list], Callable]:  # noqa: D102
        return lambda store, cleared: respawner(store, cleared, self.max_respawns, self.delay_s, self.timeout_s)


def check_on_rank_loss(value: str) -> str:
    """``world.on_rank_loss``: ``restart`` (the world ends, ``world.max_restarts`` restarts it) or ``shrink``.

    >>> check_on_rank_loss("ignore")
    Traceback (most recent call last):
    ...
    ValueError: on_rank_loss='ignore': expected restart or shrink
    """
    return check_choice("on_rank_loss", value, ON_RANK_LOSS)


def rank_loss_of(world: Any) -> RankLoss:
    """What a lost rank does in the world of a config's ``world`` group (refused if ``on_rank_loss`` is unknown).

    >>> from fdp.run.config.compose import compose
    >>> rank_loss_of(compose("world.on_rank_loss=shrink").world)
    ShrinkWorld()
    """
    if check_on_rank_loss(world.on_rank_loss) == "restart":
        return Restart()
    if world.respawn:
        return ShrinkAndRespawn(world.max_respawns, world.respawn_delay_s, world.timeout_s)
    return ShrinkWorld()


def _require(ok: bool, setting: str, value: Any, what: str) -> None:
    require(ok, setting, value, what, ConfigError)


def check_rank_loss(cfg: Any, kind: Any) -> None:
    """The rank-loss settings of ``cfg`` that need no world size, each refused in one line naming its key;
    ``kind`` is the launcher's class (``fdp.procs.launchers.launcher_of``).

    >>> from fdp.run.config.compose import compose
    >>> from fdp.procs.launchers import launcher_of
    >>> try:
    ...     check_rank_loss(compose("world.respawn=true"), launcher_of("none"))
    ... except ConfigError as error:
    ...     print(str(error).split(" (")[0])
    world.respawn=True: expected false unless world.on_rank_loss=shrink
    """
    w = cfg.world
    _require(w.min_ranks >= 1, "world.min_ranks", w.min_ranks, "an integer >= 1")
    if w.on_rank_loss == "shrink":
        _check_shrink(cfg)
    _check_respawn(w, kind)


def _check_respawn(w: Any, kind: Any) -> None:
    """A world that grows back (``fdp.procs.grow``): its settings, each refused in one line."""
    _require(w.max_ranks >= 0, "world.max_ranks", w.max_ranks, "an integer >= 0 (0: the starting size)")
    _require(w.respawn_delay_s >= 0, "world.respawn_delay_s", w.respawn_delay_s, "seconds >= 0")
    _require(w.max_respawns >= 0, "world.max_respawns", w.max_respawns, "an integer >= 0")
    if w.respawn:
        _require(
            w.max_respawns >= 1,
            "world.max_respawns",
            w.max_respawns,
            "an integer >= 1 with world.respawn=true (0 starts no rank again: set world.respawn=false)",
        )
        _require(
            w.on_rank_loss == "shrink",
            "world.respawn",
            w.respawn,
            "false unless world.on_rank_loss=shrink (a rank started again joins a world that went on)",
        )
        _require(
            not kind.starts_ranks,
            "world.respawn",
            w.respawn,
            "false under torchrun and SLURM (there the launcher or the job starts the replacement, with FDP_JOIN=1)",
        )


def _check_shrink(cfg: Any) -> None:
    """What a world that shrinks in place cannot do (yet): each refused in one line."""
    w, why = cfg.world, "with world.on_rank_loss=shrink"
    _require(
        w.max_restarts == 0, "world.max_restarts", w.max_restarts, f"0 {why} (a lost rank shrinks the world instead)"
    )


def check_stage_kept(w: Any, stage: int) -> None:
    """Refuse, naming ``trainer.zero_stage``, a stage the world ``w`` cannot lose a rank at (``refuses_stage``).

    >>> from fdp.run.config.compose import compose
    >>> check_stage_kept(compose("world.on_rank_loss=shrink").world, 1)
    """
    keeping = [s for s in ZERO_STAGES if stage_rules(s).refuses_mirror() is None]
    reason = refuses_stage(w, stage)
    _require(
        reason is None,
        "trainer.zero_stage",
        stage,
        f"{one_of(keeping)} with world.on_rank_loss=shrink unless world.hierarchical=true ({reason})",
    )


def refuses_stage(w: Any, stage: int) -> str | None:
    """Why the world ``w`` cannot lose a rank at ZeRO stage ``stage`` (a flat world that shrinks needs the next
    rank's slices, ``Stage.refuses_mirror``; a hierarchical one loses whole nodes, each holding a replica of every
    slice: ``fdp.procs.shrink.whole_groups``), or ``None``.

    >>> from fdp.run.config.compose import compose
    >>> refuses_stage(compose("world.on_rank_loss=shrink").world, 3).startswith("ZeRO stage 3 keeps no copy")
    True
    """
    if w.on_rank_loss != "shrink" or w.hierarchical:
        return None
    return stage_rules(stage).refuses_mirror()


def check_one_process(w: Any, world: int) -> None:
    """``world.respawn`` on a world of ``world`` processes: refused on one (no world is left to rejoin).

    >>> from fdp.run.config.compose import compose
    >>> try:
    ...     check_one_process(compose("world.on_rank_loss=shrink", "world.respawn=true").world, 1)
    ... except ConfigError as error:
    ...     print(str(error).split(" (")[0])
    world.respawn=True: expected false on one process
    """
    _require(
        not (w.respawn and world == 1),
        "world.respawn",
        w.respawn,
        "false on one process (a lost rank leaves no world to rejoin; world=local2 or more)",
    )


def check_rank_loss_in_world(cfg: Any, world: int) -> None:
    """The rank-loss settings of ``cfg`` against its world of ``world`` ranks (a world that shrinks:
    ``world.min_ranks``, ``world.max_ranks``, and a batch that splits over each size it may take).

    >>> from fdp.run.config.compose import compose
    >>> check_rank_loss_in_world(compose("world.on_rank_loss=shrink", "world.min_ranks=3"), 2)
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: world.min_ranks=3: expected at most the world's 2 ranks
    """
    w, t, d = cfg.world, cfg.trainer, cfg.data
    if w.on_rank_loss != "shrink":
        return
    _require(w.min_ranks <= world, "world.min_ranks", w.min_ranks, f"at most the world's {world} ranks")
    largest = as_config_key("world.max_ranks", lambda most: check_max_ranks(most, world), w.max_ranks)
    as_config_key(
        "data.global_batch_size",
        lambda size: check_shrinkable_batch(
            size,
            largest,
            w.min_ranks,
            fixed_accum(t.accum_steps),
            (w.node_size or w.nproc_per_node) if w.hierarchical else 1,
        ),
        d.global_batch_size,
    )


def lost_rank_error(error: RuntimeError, heartbeat: Heartbeat | None, rank: int, step: int) -> RankLostError | None:
    """After a failed collective: a ``RankLostError`` naming the ranks that stopped answering, if any."""
    lost = heartbeat.silent_ranks() if heartbeat is not None else None
    if not lost:
        return None
    # Gloo prefixes its messages with its source location: "[.../pair.cc:537] Read error ...".
    reason = re.sub(r"^\[[^\]]*\]\s*", "", (str(error).strip().splitlines() or [""])[0])
    names = ", ".join(map(str, lost))
    return RankLostError(
        f"rank {names} was lost at step {step}: it stopped answering (killed, hung or unreachable); "
        f"the collective on rank {rank} failed with: {reason}"
    )


def lost_message(run_dir: RunDir, error: WorkerFailedError) -> str:
    """What a lost rank is reported as when the world ends with it (``world.on_rank_loss=restart`` spent): the
    rank, its step, the signal, and the checkpoint to go on from."""
    step = RankStatus.read(run_dir, error.rank).get("step")
    at = f" at step {step}" if step else " before step 1"
    steps = saved_steps(run_dir.checkpoints)
    resume = (
        (
            f"the last checkpoint is step {steps[-1]} (continue with trainer.resume=true, or set "
            "world.max_restarts to restart from it automatically)"
        )
        if steps
        else "there is no checkpoint yet"
    )
    return (
        f"rank {error.rank} was lost{at}: process {error.pid} was killed by {error.signal}; "
        f"the other ranks were stopped; {resume}"
    )
