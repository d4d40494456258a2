"""What starts a run's ranks: one class per launch environment (``world.launcher``), and their registry.

Everything that depends on how the processes were started is answered here, by the
launcher's class, instead of by comparing its name across the code:

* ``none``: this process is the whole world (a world of one, no process group);
* ``elastic``: fdp starts the ranks itself on this machine (``fdp.spawn``, torch's elastic agent);
* ``torchrun``: ``torchrun`` started one process per rank and set torch's variables;
* ``slurm``: each rank is a task of a SLURM (or submitit) job and reads its place from the job (``fdp.procs.slurm``).

A new launcher is a subclass of ``Launcher`` answering the same questions, registered by
name with ``register_launcher`` (``world.launcher=<name>`` then picks it).

>>> launcher_of("slurm").requeue_signals("SIGUSR1"), launcher_of("torchrun").requeue_signals("SIGUSR1")
(('SIGUSR1',), ())
>>> launcher_of("none").for_processes(2).name
'elastic'
"""

from __future__ import annotations

from typing import ClassVar, Mapping, NamedTuple

from fdp.errors import ConfigError, expected
from fdp.procs.slurm import job_world

__all__ = ["Launched", "Launcher", "LAUNCHERS", "launcher_of", "register_launcher"]


class Launched(NamedTuple):
    """This process's rank and world size as its launcher started it (before any shrink)."""

    rank: int
    world_size: int


class Launcher:
    """A launch environment: the questions whose answers depend on what started the ranks.

    The defaults are those of a launcher that sets torch's variables (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and leaves the rest to fdp.
    """

    name: ClassVar[str]
    # Each rank is a process the launcher started: the world size is known only there, every one
    # of them runs the start-up, and the process of a lost rank must stay until the run ends.
    starts_ranks: ClassVar[bool] = False
    # fdp starts the ranks (fdp.spawn) from the process that runs the start-up.
    spawned: ClassVar[bool] = False
    # The ranks form a process group (not a world of one).
    joins_group: ClassVar[bool] = True
    # What messages call the one that fixes the number of processes on a node.
    starter: ClassVar[str] = "the world (world.nproc_per_node)"

    def launched(self, environ: Mapping[str, str]) -> Launched:
        """This process's rank and world size as started (``rank 0 of 1`` outside a launched world)."""
        return Launched(int(environ.get("RANK", 0) or 0), int(environ.get("WORLD_SIZE", 1) or 1))

    def rank_before_joining(self, environ: Mapping[str, str]) -> int:
        """The rank of the process running the start-up (rank 0 owns the run directory)."""
        return self.launched(environ).rank if self.starts_ranks else 0

    def environ(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The variables torch's ``env://`` rendezvous and fdp read, made from the launcher's own (none to add)."""
        return {}

    def local_world_size(self, environ: Mapping[str, str], nproc_per_node: int) -> int | None:
        """How many processes the launcher started on this node (``None``: not started by it)."""
        return None

    def fixed_processes(self, nproc_per_node: int, local_world_size: int | None) -> int | None:
        """The number of processes on this node the world fixes (``None``: as many as the devices give)."""
        return local_world_size if self.starts_ranks else None

    def for_processes(self, processes: int) -> "Launcher":
        """The launcher a world of ``processes`` local processes runs on."""
        return self

    def nodes(self, environ: Mapping[str, str], nnodes: int, nproc_per_node: int) -> tuple[int, int]:
        """``(nodes, processes per node)`` of the world this process joins."""
        return nnodes, nproc_per_node

    def local_only(self, environ: Mapping[str, str]) -> bool:
        """Every rank is on this machine: the ranks talk over the loopback interface only."""
        return False

    def requeue_signals(self, requeue_signal: str) -> tuple[str, ...]:
        """The signals, beyond SIGINT and SIGTERM, on which the launcher asks the run to stop (and requeue)."""
        return ()

    def requeues(self, signame: str, requeue_signal: str) -> bool:
        """Whether a run stopped by ``signame`` asks the launcher to start it again."""
        return signame in self.requeue_signals(requeue_signal)

    def held_at_start(self, requeue_signal: str) -> bool:
        """Whether the stop signals are held from start-up until the loop's handler takes them."""
        return False

    @property
    def alone(self) -> bool:
        """Nothing between the terminal and this process: a repeated stop signal stops it at once
        (a launcher between them escalates a second signal itself, and may pass one on twice)."""
        return not self.joins_group

    @property
    def lost_rank_stays(self) -> bool:
        """The process of a lost rank stays until the run ends (the launcher would end the job when
        one of its processes does); under ``fdp.spawn`` it returns at once."""
        return self.starts_ranks

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoLauncher(Launcher):
    """``world.launcher=none``: this process is the whole world."""

    name = "none"
    joins_group = False

    def for_processes(self, processes: int) -> Launcher:
        return LAUNCHERS["elastic"] if processes > 1 else self


class Elastic(Launcher):
    """``world.launcher=elastic``: fdp starts ``world.nproc_per_node`` ranks on this machine."""

    name = "elastic"
    spawned = True

    def fixed_processes(self, nproc_per_node: int, local_world_size: int | None) -> int | None:
        return nproc_per_node

    def local_only(self, environ: Mapping[str, str]) -> bool:
        return True


class Torchrun(Launcher):
    """``world.launcher=torchrun``: each rank is a process ``torchrun`` started."""

    name = "torchrun"
    starts_ranks = True
    starter = "torchrun"

    def local_world_size(self, environ: Mapping[str, str], nproc_per_node: int) -> int | None:
        return int(environ.get("LOCAL_WORLD_SIZE", nproc_per_node))

    def nodes(self, environ: Mapping[str, str], nnodes: int, nproc_per_node: int) -> tuple[int, int]:
        return int(environ.get("WORLD_SIZE", nproc_per_node)) // max(1, nproc_per_node), nproc_per_node


class Slurm(Launcher):
    """``world.launcher=slurm``: each rank is a task of a SLURM or submitit job (``fdp.procs.slurm``).

    SLURM warns a job before its time limit or a preemption with ``world.requeue_signal``;
    the run stops on it and asks SLURM to requeue the job. Signals SLURM sends while a
    rank is still starting are held for the loop's handler.
    """

    name = "slurm"
    starts_ranks = True
    starter = "slurm"

    def launched(self, environ: Mapping[str, str]) -> Launched:
        job = job_world(environ)
        return Launched(job.rank, job.world_size)

    def environ(self, environ: Mapping[str, str]) -> dict[str, str]:
        return job_world(environ).environ()

    def local_world_size(self, environ: Mapping[str, str], nproc_per_node: int) -> int | None:
        return job_world(environ).local_world_size

    def nodes(self, environ: Mapping[str, str], nnodes: int, nproc_per_node: int) -> tuple[int, int]:
        job = job_world(environ)
        return job.world_size // job.local_world_size, job.local_world_size

    def local_only(self, environ: Mapping[str, str]) -> bool:
        return job_world(environ).local

    def requeue_signals(self, requeue_signal: str) -> tuple[str, ...]:
        return () if requeue_signal == "none" else (requeue_signal,)

    def held_at_start(self, requeue_signal: str) -> bool:
        return True


LAUNCHERS: dict[str, Launcher] = {}


def register_launcher(cls: type[Launcher]) -> type[Launcher]:
    """Make ``cls`` the launcher ``world.launcher=<cls.name>`` names (a decorator)."""
    LAUNCHERS[cls.name] = cls()
    return cls


for _cls in (NoLauncher, Elastic, Torchrun, Slurm):
    register_launcher(_cls)


def launcher_of(name: str) -> Launcher:
    """The registered launcher ``world.launcher=name`` names.

    >>> launcher_of("torchrun").starts_ranks
    True
    >>> launcher_of("mpirun")
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: world.launcher='mpirun': expected one of ('none', 'elastic', 'torchrun', 'slurm')
    """
    if name not in LAUNCHERS:
        raise ConfigError(expected("world.launcher", name, f"one of {tuple(LAUNCHERS)}"))
    return LAUNCHERS[name]
