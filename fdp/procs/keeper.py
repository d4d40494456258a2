"""A rank that can be lost without ending the run: the process a launcher watches keeps the rank as its child.

torch's launchers watch their worker processes all or nothing: when one worker dies,
the elastic agent (``fdp.spawn`` for local worlds, and ``torchrun``) stops every other
one (``torch.multiprocessing``'s ``ProcessContext.join`` terminates the rest, and the
agent's monitor loop then restarts or ends the group). A world that shrinks in place
(``world.on_rank_loss=shrink``, ``fdp.procs.shrink``) needs its surviving ranks to outlive a
dead peer under those launchers, without touching the agent's private internals. So
the process the launcher starts does not train: it is a keeper that forks the rank,
waits for it and reports to the launcher as a worker that finished:

* the rank's result when it returns, its exception (re-raised) when it raises: an error
  ends the run as it always did;
* ``LostRank`` when the rank died by a signal (killed, out of memory) or when the other
  ranks declared it lost (``fence``: a hung rank, which the keeper then kills), so the
  launcher sees a worker that finished and leaves the others running.

The keeper hears of its rank's death at once (the pipe from the rank closes), long before
the rank's heartbeat is seen to stop: ``told`` passes it on (``fdp.procs.shrink`` writes it in
the store, where the other ranks look first).

A keeper may start its rank again after a loss (``respawn``, ``world.respawn=true``): the new
process joins the running world at a step boundary (``fdp.procs.grow``).

The rank dies with its keeper (``PR_SET_PDEATHSIG``), so stopping the launcher still
stops it; the stop signals the launcher passes on (``fdp.procs.interrupt``) are forwarded to it.
The rank is forked, so the keeper must not have used CUDA (a forked child cannot): fdp's
keepers touch no GPU before forking, and the rank takes its GPU itself.

>>> def rank():
...     return 42
>>> keep(rank, rank=0)
42
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import select
import signal
import sys
import time
import traceback
from typing import Any, Callable, NamedTuple

__all__ = ["LostRank", "keep"]

_FORWARDED = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.1
_EXITING_POLL_S = 0.005


class LostRank(NamedTuple):
    """What a keeper reports for a rank the run went on without: its launch rank, pid and how it ended."""

    rank: int
    pid: int
    how: str  # "killed by SIGKILL", "declared lost by the other ranks", ...


def _die_with_parent() -> None:
    """Have the kernel kill this process when its parent (the keeper) dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _run_child(entry: Callable[..., Any], args: tuple, out: int) -> None:
    _die_with_parent()
    status = 0
    try:
        payload: tuple = ("result", entry(*args))
    except BaseException as error:  # handed to the keeper, which raises it again
        payload, status = ("error", error, traceback.format_exc()), 1
    try:
        data = pickle.dumps(payload)
    except Exception:  # an exception or result that does not pickle: its text
        data = pickle.dumps(("error", RuntimeError(f"{type(payload[1]).__name__}: {payload[1]}"), ""))
    with contextlib.suppress(OSError):
        view = memoryview(data)
        while view:
            view = view[os.write(out, view) :]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _how(status: int) -> str | None:
    """How a child that ended with wait status ``status`` was lost (``None``: it exited)."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(number).name}"
        except ValueError:
            return f"killed by signal {number}"
    return None


def keep(
    entry: Callable[..., Any],
    *args: Any,
    rank: int,
    fenced: Callable[[], bool] = lambda: False,
    after_loss: Callable[[LostRank], Any] | None = None,
    respawn: Callable[[LostRank], bool] | None = None,
    told: Callable[[LostRank], Any] | None = None,
) -> Any:
    """Run ``entry(*args)`` as a child of this process; return its result (see the module docstring).

    ``fenced()`` is asked every ~0.1 s: ``True`` (the other ranks declared this rank lost)
    kills the child. A lost rank is started again (forked anew) while ``respawn(LostRank(...))``
    says so; then it gives ``after_loss(LostRank(...))`` when given (a keeper that must stay
    until the run ends, under ``torchrun``), else the ``LostRank`` itself. ``told(LostRank(...))`` is
    called first, as soon as the rank is lost.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(
            "world.on_rank_loss=shrink: CUDA is already initialised in the process that keeps the rank, "
            "and a forked rank cannot use it; expected a launch that touches no GPU before the ranks start"
        )
    while True:
        outcome = _keep_once(entry, args, rank, fenced)
        if not isinstance(outcome, LostRank):
            return outcome[0]
        if told is not None:
            told(outcome)
        if respawn is None or not respawn(outcome):
            break
    return after_loss(outcome) if after_loss is not None else outcome


def _keep_once(entry: Callable[..., Any], args: tuple, rank: int, fenced: Callable[[], bool]) -> tuple | LostRank:
    """One child: ``(its result,)``, its exception re-raised, or ``LostRank``."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the rank
        os.close(read_end)
        _run_child(entry, args, write_end)
    os.close(write_end)
    previous = {number: signal.signal(number, lambda number, frame: _forward(pid, number)) for number in _FORWARDED}
    # The launcher may have held them for us. They stay unblocked after the rank: a launcher
    # that stops this process from then on (the run ended elsewhere) must reach it, or it
    # waits out its grace period before killing it.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    try:
        data, status, how = _wait(pid, read_end, fenced)
    finally:
        os.close(read_end)
        for number, handler in previous.items():
            signal.signal(number, handler)
    if how is None and data:
        payload = pickle.loads(data)
        if payload[0] == "result":
            return (payload[1],)
        error, text = payload[1], payload[2]
        if text and hasattr(error, "add_note"):
            error.add_note(f"the rank's traceback (pid {pid}):\n{text.rstrip()}")
        raise error
    return LostRank(rank, pid, how or f"exited with code {os.waitstatus_to_exitcode(status)} and no result")


def _forward(pid: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, number)


def _wait(pid: int, read_end: int, fenced: Callable[[], bool]) -> tuple[bytes, int, str | None]:
    """The child's pickled payload, wait status, and how it was lost (``None``: it ended by itself)."""
    chunks, open_end, killed = [], True, False
    while True:
        if open_end and select.select([read_end], [], [], _POLL_S)[0]:
            chunk = os.read(read_end, 1 << 20)
            chunks.append(chunk)
            open_end = bool(chunk)
        elif not open_end:  # every end of the pipe closed: the rank is exiting, reaped within moments
            time.sleep(_EXITING_POLL_S)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            while open_end and (chunk := os.read(read_end, 1 << 20)):
                chunks.append(chunk)
            # A rank the others declared lost may have ended by itself first (its collectives
            # failed once its world had gone on without it): lost all the same.
            how = "declared lost by the other ranks" if killed or fenced() else _how(status)
            return b"".join(chunks), status, how
        if not killed and fenced():
            os.kill(pid, signal.SIGKILL)  # hung (or too slow): the world went on without it
            killed = True
