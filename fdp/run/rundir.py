"""A run's directory: where each of its files lives, who owns it, and what the run logs there.

::

    <run dir>/
      .lock                held by the run that owns the directory (flock), naming it
      train.log            what the run printed: start-up, warnings, the summary, errors
      metrics.jsonl        one JSON object per logged step, and the summary (rank 0)
      checkpoints/         step_<N>.pt and last, naming the newest (fdp.run.checkpoint); best/ (trainer.keep_best)
      plan.txt, plan.json  the bucket plan, as a table and as JSON
      ranks/rank<N>.txt    each rank's pid and the step it is computing (RankStatus)
      rank<N>.log          what ranks other than 0 log
      trace/rank<N>.json   Chrome traces (trainer.trace=true)
      tb/                  TensorBoard scalars (trainer.tensorboard=true)
      metrics.csv          a row per logged step (trainer.loggers=[csv], fdp.run.report.loggers)
      mlflow.db            an MLflow run (trainer.loggers=[mlflow])

>>> RunDir("outputs/run").last_checkpoint.as_posix()
'outputs/run/checkpoints/last.pt'

One owner: ``own_run_dir(run_dir)`` is held for the whole of a run (taken once, by ``fdp.run.startup.start_run``):

* It takes an exclusive ``flock`` on ``<run dir>/.lock`` and writes ``pid=<pid> host=<host>``
  into it. A second run that finds the lock held is refused in one line naming the
  directory and the owner's pid and host. The kernel drops the lock when its holder
  dies however it dies (also a SIGKILL), so a lock that can be taken is stale: the new
  run takes it over and says whose it was. On a shared file system the lock is the file
  system's (NFS forwards ``flock`` to the server), so it holds across hosts.
* It notes what the directory holds when the run takes it. If the run is then refused
  (``release(refused=True)``: a bad setting, a checkpoint that does not fit), every file
  and folder the refused run created is removed again, and so is the directory if that
  leaves it empty: a refusal leaves no run directory behind and adds nothing to a run
  it refused to continue.

Ownership is per process and re-entrant: a nested ``own_run_dir`` of a directory this
process already owns is a no-op (a caller holding the directory around ``fdp.run.trainer.run``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from fdp.errors import ConfigError, require
from fdp.run.checkpoint import CHECKPOINTS, CheckpointError, last_of, resolve

__all__ = [
    "LOCK",
    "TRAIN_LOG",
    "CHECKPOINTS",
    "RUN_LOGGER",
    "RunDir",
    "RankStatus",
    "RunDirInUse",
    "Ownership",
    "own_run_dir",
    "owner_of",
    "run_log",
    "train_log_handler",
]

LOCK = ".lock"  # held (flock) by the run that owns the directory, and names it
TRAIN_LOG = "train.log"  # what the run printed, through logging (Hydra's <job name>.log)


class RunDir(NamedTuple):
    """The paths of one run directory's files (see the module docstring)."""

    path: Path

    @property
    def metrics(self) -> Path:
        return Path(self.path) / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return Path(self.path) / CHECKPOINTS

    @property
    def last_checkpoint(self) -> Path:
        return last_of(self.checkpoints)

    @property
    def plan_table(self) -> Path:
        return Path(self.path) / "plan.txt"

    @property
    def plan_json(self) -> Path:
        return Path(self.path) / "plan.json"

    @property
    def train_log(self) -> Path:
        return Path(self.path) / TRAIN_LOG

    @property
    def tensorboard(self) -> Path:
        return Path(self.path) / "tb"

    def rank_status(self, rank: int) -> Path:
        return Path(self.path) / "ranks" / f"rank{rank}.txt"

    def rank_log(self, rank: int) -> Path:
        return Path(self.path) / f"rank{rank}.log"

    def trace(self, rank: int) -> Path:
        return Path(self.path) / "trace" / f"rank{rank}.json"

    def has_run(self) -> bool:
        """Whether a run already wrote here (metrics or checkpoints)."""
        return self.metrics.exists() or self.checkpoints.exists()

    def resume_from(self, resume: Any) -> Path | None:
        """The checkpoint ``trainer.resume`` starts the run from: ``None`` (false), this run's last (true), or
        the file a path names (a step file, or a run or checkpoints directory's last: ``fdp.run.checkpoint.resolve``).

        >>> RunDir(Path("outputs/run")).resume_from(True).as_posix()
        'outputs/run/checkpoints/last.pt'
        >>> RunDir(Path("outputs/run")).resume_from("outputs/old/checkpoints/step_00000100.pt").as_posix()
        'outputs/old/checkpoints/step_00000100.pt'
        """
        ok = isinstance(resume, bool) or (isinstance(resume, str) and resume.strip() != "")
        require(
            ok,
            "trainer.resume",
            resume,
            "true, false or the path of a checkpoint (a step_<N>.pt file, or a run directory for its last checkpoint)",
            ConfigError,
        )
        if resume is False:
            return None
        return self.last_checkpoint if resume is True else resolve(Path(resume).expanduser())


class RankStatus:
    """``<run dir>/ranks/rank<N>.txt``: ``pid=<pid> step=<step being computed>``, rewritten each step.

    It tells the launcher which step a rank that died by a signal was on, and an operator
    (or a test) which process is which rank. One ``pwrite`` per step, no fsync.
    """

    def __init__(self, run_dir: RunDir, rank: int):
        path = run_dir.rank_status(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pid = os.getpid()
        self.step = 0

    @staticmethod
    def read(run_dir: RunDir | str | os.PathLike, rank: int) -> dict[str, int]:
        """``{"pid": ..., "step": ...}`` as rank ``rank`` of the run in ``run_dir`` last wrote them (empty if never)."""
        run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        try:
            text = run_dir.rank_status(rank).read_text()
        except OSError:
            return {}
        return {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", text)}

    def update(self, step: int) -> None:
        # Within one process the line only grows (the step never decreases), so an
        # in-place write never leaves a stale tail.
        self.step = step
        os.pwrite(self._fd, f"pid={self._pid} step={step}\n".encode(), 0)

    def close(self) -> None:
        os.close(self._fd)


# -- one owner -------------------------------------------------------------------------------
_held: dict[str, "Ownership"] = {}  # real path -> this process's ownership of it


# What a local world's worker raised that refuses the run (fdp.procs.launch.WorkerFailedError.error_type).
REFUSED_TYPES = ("ConfigError", "CheckpointError", "RunDirInUse", "RunDoesNotFit")


class RunDirInUse(ConfigError):
    """Another live process owns the run directory; the message names it."""


def owner_of(run_dir: str | Path) -> dict[str, str]:
    """What ``<run dir>/.lock`` says of its owner (``{"pid": ..., "host": ...}``; empty if nothing).

    Read it from a process that does not own the directory (reading needs no lock).

    >>> import tempfile
    >>> owner_of(tempfile.mkdtemp())
    {}
    """
    try:
        text = (Path(run_dir) / LOCK).read_text()
    except OSError:
        return {}
    return dict(re.findall(r"(\w+)=(\S+)", text))


def _paths(run_dir: Path) -> set[str]:
    """Every file and folder under ``run_dir``, relative to it."""
    return {str(p.relative_to(run_dir)) for p in run_dir.rglob("*")}


class Ownership:
    """This process's hold on a run directory; ``release`` gives it up."""

    def __init__(self, run_dir: Path, fd: int | None, before: set[str], previous: dict[str, str]):
        self.run_dir, self._fd, self._before = run_dir, fd, before
        self.previous = previous  # the dead owner whose stale lock this run took over (empty: none)
        self.kept = False  # refused after it trained and saved: what it made is kept (``_roll_back``)
        self._depth = 1

    def release(self, refused: bool = False) -> None:
        """Give the directory up; ``refused=True`` first removes what this run created in it."""
        self._depth -= 1
        if self._depth or self._fd is None:
            return
        _held.pop(str(self.run_dir.resolve()), None)
        try:
            if refused:
                self._roll_back()
            with contextlib.suppress(OSError):
                os.unlink(self.run_dir / LOCK)  # while still held: a waiting run then finds no stale lock
        finally:
            os.close(self._fd)
            self._fd = None
        if refused:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()  # only if empty: a refused fresh run leaves no directory

    def _roll_back(self) -> None:
        new = sorted(_paths(self.run_dir) - self._before - {LOCK}, key=lambda p: -p.count(os.sep))
        if any(p.startswith(CHECKPOINTS + os.sep) and p.endswith(".pt") for p in new):
            self.kept = True
            return  # it trained and saved: not a refusal to undo
        for rel in new:
            path = self.run_dir / rel
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()


def _in_use(run_dir: Path, owner: dict[str, str]) -> RunDirInUse:
    who = f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}"
    return RunDirInUse(
        f"hydra.run.dir={run_dir}: in use by another run ({who}); expected a directory no live run is writing to "
        "(wait for that run, stop it, or choose another hydra.run.dir)"
    )


def _lock(path: Path) -> int:
    """An fd holding ``flock`` on ``path`` (the file at ``path`` when it returns).

    Raises ``BlockingIOError`` if held.
    """
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the owner unlinked it as we took it: lock the file that is there now
    raise OSError(errno.EAGAIN, "the lock file kept changing", str(path))


def _take(run_dir: Path) -> Ownership:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        before = _paths(run_dir)
        previous = owner_of(run_dir)
        fd = _lock(run_dir / LOCK)
    except BlockingIOError:
        raise _in_use(run_dir, owner_of(run_dir)) from None
    except OSError as error:
        raise ConfigError(
            f"hydra.run.dir={run_dir}: "
            f"expected a directory this process can create and write ({error.strerror or error})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(
        fd, f"pid={os.getpid()} host={socket.gethostname()} since={time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode(), 0
    )
    return Ownership(run_dir, fd, before, previous)


def _stale_note(run_dir: Path, previous: dict[str, str]) -> str:
    return (
        f"fdp: hydra.run.dir={run_dir} was locked by pid {previous.get('pid', '?')} on {previous.get('host', '?')}, "
        "which is gone; this run takes it over"
    )


@contextlib.contextmanager
def own_run_dir(run_dir: str | Path, say: Callable[[str], None] | None = None) -> Iterator[Ownership]:
    """Hold ``run_dir`` for the ``with`` block; a refusal raised inside rolls back what it created.

    Refusals are ``ConfigError`` (and so ``RunDirInUse``) and ``fdp.run.checkpoint.CheckpointError``;
    ``say`` reports a stale lock taken over (default: a line on stderr).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> with own_run_dir(d):
    ...     owner_of(d)["pid"] == str(os.getpid())
    True
    >>> owner_of(d)
    {}
    """
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key in _held:
        owned = _held[key]
        owned._depth += 1
    else:
        owned = _held[key] = _take(run_dir)
        if owned.previous:
            (say or (lambda line: print(line, file=sys.stderr, flush=True)))(_stale_note(run_dir, owned.previous))
    refused, why = False, None
    try:
        yield owned
    except (ConfigError, CheckpointError) as error:
        refused, why = True, error
        raise
    except BaseException as error:  # a local world's workers refused: the same as refusing here
        refused, why = getattr(error, "error_type", None) in REFUSED_TYPES, error
        raise
    finally:
        owned.release(refused=refused)
        if refused and owned.kept:  # it trained and saved first: the run stays, and its log says why it ended
            with contextlib.suppress(OSError), open(run_dir / TRAIN_LOG, "a") as log:
                log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} error: {why}\n")


# -- what the run prints, also in <run dir>/train.log ------------------------------------------
RUN_LOGGER = "fdp.run"  # the run's own lines: start-up warnings, the summary, errors, interruptions


class _Below(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def train_log_handler(run_dir: str | Path, prefix: str = "") -> logging.Handler:
    """A handler appending to ``<run dir>/train.log``, which it creates at its first line."""
    handler = logging.FileHandler(Path(run_dir) / TRAIN_LOG, delay=True)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s"))
    return handler


@contextlib.contextmanager
def run_log(run_dir: str | Path | None) -> Iterator[logging.Logger]:
    """The ``fdp.run`` logger for the ``with`` block: INFO to stdout, warnings and errors to stderr,
    all of it to ``<run dir>/train.log`` as well (created at the first line: ``None`` for no file).

    Outside such a block the logger has no handler of its own; warnings then reach stderr
    through logging's last resort.
    """
    logger = logging.getLogger(RUN_LOGGER)
    out, err = logging.StreamHandler(sys.stdout), logging.StreamHandler(sys.stderr)
    out.addFilter(_Below(logging.WARNING))
    err.setLevel(logging.WARNING)
    handlers: list[logging.Handler] = [out, err]
    if run_dir is not None:
        handlers.append(train_log_handler(run_dir))
    previous = (logger.handlers[:], logger.level, logger.propagate)
    logger.handlers[:] = handlers
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield logger
    finally:
        for handler in handlers:
            handler.flush()
            handler.close()
        logger.handlers[:], level, logger.propagate = previous[0], previous[1], previous[2]
        logger.setLevel(level)
