"""Stopping a run cleanly on a signal: at a step boundary, every rank at the same step.

* In each rank, ``StopSignals`` turns SIGINT, SIGTERM (and, under SLURM, the signal SLURM
  sends before a time limit or a preemption, ``world.requeue_signal``) into a flag. The
  run loop asks ``agreed()`` after every step; about every 0.1 s of training the ranks
  all-reduce (max) their flags on a small gloo group of their own, so a signal seen by
  one rank stops all of them after the same step. Each all-reduce is read at the next
  such step (it has long finished by then), so no step waits for it; a run stops within
  about 0.2 s of the signal. The loop then saves a checkpoint of that step and returns;
  the recipe prints one line and exits ``128 + signal`` (130 for SIGINT, 143 for SIGTERM).
* In the process that starts a local world, ``relay_to_workers`` blocks those signals
  before the workers start (a blocked signal stays blocked across ``fork`` and ``exec``,
  so a worker still importing holds a Ctrl-C pending instead of dying with a traceback;
  ``StopSignals.install`` unblocks it once its handler is in place). A thread of the
  launcher waits for them: the first is passed on to the workers, a second one kills
  them at once (``StoppedAtOnce``; the last checkpoint is whole, checkpoints being
  written atomically). The workers are found however they started: spawned or forked
  (the launcher's children) or from its forkserver (the forkserver's children).
* A burst of signals is one request (``Burst``): a terminal's Ctrl-C reaches every process
  of the foreground group, and a wrapper around the run (GNU ``timeout``, ``srun``, a
  shell ``trap``) relays what it gets to its child, so one key press arrives twice within
  milliseconds. Only a signal at least ``GRACE_S`` after the first stops at once.
* ``requeue_job`` asks SLURM to requeue the job (``scontrol requeue``) once the
  checkpoint is written, as Lightning's SLURM environment does for batch jobs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from fdp.comm import Watch, wait_watched
from fdp.procs.launchers import launcher_of

__all__ = [
    "StopSignals",
    "StoppedAtOnce",
    "check_requeue_signal",
    "exit_code",
    "relay_to_workers",
    "requeue_job",
    "stop_signal_names",
]

STOP_SIGNALS = ("SIGINT", "SIGTERM")
CHECK_EVERY_S = 0.1  # how often (in training time) the ranks compare their stop flags
MAX_CHECK_STEPS = 1000
GRACE_S = 1.0  # signals within this long of the first are the same request (a group's Ctrl-C relayed by a wrapper)
_AGENT_SIGNALS = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # read by torch's elastic agent when it starts workers
_TRACKER_QUIET = "ignore::UserWarning:multiprocessing.resource_tracker"
# Children of the launcher that are not workers: how multiprocessing starts its helpers (when their pids are unknown).
_HELPERS = (b"from multiprocessing.resource_tracker import", b"from multiprocessing.forkserver import")
_AGENT_DEFAULT = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


class StoppedAtOnce(KeyboardInterrupt):
    """A second signal stopped the run without waiting for a step boundary."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame


def check_requeue_signal(name: str) -> str:
    """``world.requeue_signal``: a signal name SLURM may send before the end (``none``: not handled).

    >>> check_requeue_signal("SIGUSR1")
    'SIGUSR1'
    >>> check_requeue_signal("USR2")
    Traceback (most recent call last):
    ...
    ValueError: requeue_signal='USR2': expected none or a signal name such as SIGUSR1 (as in sbatch --signal=USR1@90)
    """
    catchable = name in signal.Signals.__members__ and name not in _UNCATCHABLE + STOP_SIGNALS
    if name != "none" and not catchable:
        raise ValueError(
            f"requeue_signal={name!r}: expected none or a signal name such as SIGUSR1 (as in sbatch --signal=USR1@90)"
        )
    return name


def stop_signal_names(launcher: str, requeue_signal: str) -> tuple[str, ...]:
    """The signals a rank stops on: SIGINT and SIGTERM, and under SLURM the requeue signal.

    >>> stop_signal_names("slurm", "SIGUSR1"), stop_signal_names("none", "SIGUSR1")
    (('SIGINT', 'SIGTERM', 'SIGUSR1'), ('SIGINT', 'SIGTERM'))
    """
    return STOP_SIGNALS + launcher_of(launcher).requeue_signals(requeue_signal)


def exit_code(signame: str) -> int:
    """The shell's status for a process ended by ``signame``: 128 + its number.

    >>> exit_code("SIGINT"), exit_code("SIGTERM")
    (130, 143)
    """
    return 128 + int(signal.Signals[signame])


class Burst:
    """The first stop signal and whether a later one asks to stop at once: one that came ``grace_s`` or more
    after the first (sooner, it is the same Ctrl-C seen twice: from the terminal and relayed by a wrapper).

    >>> burst = Burst(grace_s=60)
    >>> burst.see("SIGINT"), burst.see("SIGINT"), burst.first
    (False, False, 'SIGINT')
    """

    def __init__(self, grace_s: float = GRACE_S):
        self.grace_s = grace_s
        self.first: str | None = None
        self._at = 0.0

    def see(self, name: str) -> bool:
        """Note signal ``name``; whether it is a second request (stop at once)."""
        now = time.monotonic()
        if self.first is None:
            self.first, self._at = name, now
            return False
        return now - self._at >= self.grace_s

    def left(self) -> float:
        """Seconds until a signal would be a second request (0 before the first, or once past the window)."""
        return max(0.0, self._at + self.grace_s - time.monotonic()) if self.first is not None else 0.0


class StopSignals:
    """This rank's stop flag, set by a signal handler and agreed on by every rank at step boundaries.

    ``repeat_stops_at_once``: a second signal, ``GRACE_S`` or more after the first (``Burst``),
    raises ``StoppedAtOnce`` (a process that is alone; in a local world the launcher
    escalates instead, and a worker may see one Ctrl-C twice: from the terminal and passed
    on by the launcher).

    >>> stop = StopSignals(("SIGTERM",)).install()
    >>> os.kill(os.getpid(), signal.SIGTERM)
    >>> stop.received, stop.agreed()
    ('SIGTERM', 'SIGTERM')
    >>> stop.restore()
    """

    def __init__(self, names: tuple[str, ...] = STOP_SIGNALS, repeat_stops_at_once: bool = False):
        self.names, self.repeat_stops_at_once = tuple(names), repeat_stops_at_once
        self.received: str | None = None
        self._burst = Burst()
        self._previous: dict[int, object] = {}
        self._group = None
        self._watch: Watch | None = None
        self._pending: tuple | None = None
        self._countdown, self._last_steps, self._since = 0, 1, time.perf_counter()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        again = self._burst.see(name)
        self.received = self._burst.first
        if again and self.repeat_stops_at_once:
            self.restore()
            raise StoppedAtOnce(name)

    def install(self) -> "StopSignals":
        """Handle the signals from here on (in the main thread only: elsewhere Python cannot)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        numbers = [signal.Signals[name] for name in self.names]
        for number in numbers:
            self._previous[number] = signal.signal(number, self._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, numbers)  # one held pending by the launcher arrives now
        return self

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def join(self, world_size: int, watch: Watch | None = None) -> "StopSignals":
        """Make the flag's own group (every rank calls it, at the same point; nothing with one rank).

        ``watch``: asked while the flag's all-reduce is waited for (``fdp.comm.wait_watched``).
        """
        self._watch = watch
        if world_size > 1:
            from fdp._torch import group_timeout

            # gloo on the CPU whatever the world's backend: reading the flag never waits for a GPU.
            self._group = dist.new_group(list(range(world_size)), timeout=group_timeout(), backend="gloo")
        return self

    def rejoin(self, world_size: int, watch: Watch | None = None) -> "StopSignals":
        """Join a new world (``fdp.procs.shrink``): the old group is gone; a flag already raised is kept."""
        self._group, self._pending, self._countdown, self._last_steps = None, None, 0, 1
        self._since = time.perf_counter()
        return self.join(world_size, watch)

    def agreed(self) -> str | None:
        """The signal every rank stops on after this step (``None``: go on). Call it on every rank after every step.

        The ranks compare flags at agreed steps only, about every ``CHECK_EVERY_S`` seconds
        of training: each comparison's all-reduce also carries every rank's proposal for
        the steps until the next one (from its own step times; the smallest wins), and is
        read at that next one. So no step waits for it, its cost is one small all-reduce
        per ``CHECK_EVERY_S``, and a run stops within two such intervals of a signal.
        """
        if self._group is None:
            return self.received
        self._countdown -= 1
        if self._countdown > 0:
            return None
        now = time.perf_counter()
        verdict, steps = None, 1
        if self._pending is not None:
            work, flag = self._pending
            wait_watched(work, self._watch)
            number, steps = int(flag[0]), -int(flag[1])
            verdict = signal.Signals(number).name if number else None
        per_step = (now - self._since) / max(1, self._last_steps)
        proposal = max(1, min(MAX_CHECK_STEPS, int(CHECK_EVERY_S / max(per_step, 1e-6))))
        mine = signal.Signals[self.received].value if self.received else 0
        flag = torch.tensor([mine, -proposal], dtype=torch.int64)  # max: any signal; and the fewest steps proposed
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        self._countdown, self._last_steps, self._since = steps, steps, now
        return verdict

    def close(self, finished: bool = True) -> None:
        """Wait for the flag in flight (``finished``: every rank reached this point) and restore the handlers.

        A process alone (``repeat_stops_at_once``) stopped by a signal keeps them until the signal's window has
        passed: a wrapper relays the terminal's Ctrl-C a moment later (``Burst``), and that copy must not reach the
        handler before fdp's (Python's raises ``KeyboardInterrupt`` wherever the exiting process is). A world's
        ranks do not wait here: they leave their world together, and its store goes with rank 0.
        """
        if self._pending is not None and finished:
            wait_watched(self._pending[0], self._watch)
        self._pending = None
        if self._group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._group)
            self._group = None
        if self.repeat_stops_at_once:
            time.sleep(self._burst.left())
        self.restore()


def _parents() -> dict[int, int]:
    """Every process's parent: pid -> ppid (from /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _helpers(children: list[int]) -> set[int]:
    """Which of this process's ``children`` are multiprocessing's helpers (its resource tracker, its forkserver).

    Known by the pids multiprocessing keeps, and else by a helper's command line where it differs from this
    process's own: a helper is a fresh interpreter, while a forked worker keeps its parent's command line, which
    is a helper's when the parent itself came from a forkserver (a worker must not pass for a helper).
    """
    from multiprocessing import forkserver, resource_tracker

    known = {
        getattr(resource_tracker._resource_tracker, "_pid", None),
        getattr(forkserver._forkserver, "_forkserver_pid", None),
    }
    mine = _cmdline(os.getpid())
    return {
        pid
        for pid in children
        if pid in known or ((line := _cmdline(pid)) != mine and any(h in line for h in _HELPERS))
    }


def _workers() -> list[int]:
    """The workers this process started: its children but multiprocessing's helpers, and the helpers' children
    (the workers its forkserver forked for it: ``start_method="forkserver"``)."""
    me, parents = os.getpid(), _parents()
    children = [pid for pid, ppid in parents.items() if ppid == me]
    helpers = _helpers(children)
    return [pid for pid, ppid in parents.items() if (ppid == me or ppid in helpers) and pid not in helpers]


def _send(pids: list[int], number: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, number)


class Relay:
    """What the launcher saw: the first signal (passed on to the workers), and a second one that killed them
    (one ``GRACE_S`` or more after the first: ``Burst``)."""

    def __init__(self, grace_s: float = GRACE_S):
        self.received: str | None = None
        self._burst = Burst(grace_s)
        self.stopped_at_once: str | None = None
        self.agent_signals = ",".join(_AGENT_DEFAULT)  # the signals torch's agent may still take
        self._lock = threading.RLock()
        self._sent: dict[int, int] = {}  # pid -> the signal it was sent

    def on_signal(self, number: int, frame=None) -> None:
        with self._lock:
            name = signal.Signals(number).name
            again = self._burst.see(name)
            self.received = self._burst.first
            if again and self.stopped_at_once is None:
                self.stopped_at_once = name
        self.pass_on()

    def pass_on(self) -> None:
        """Send each worker what it has not had yet: the first signal, or SIGKILL after a second one."""
        with self._lock:
            if self.received is None:
                return
            first, kill = signal.Signals[self.received], self.stopped_at_once is not None
            for pid in _workers():
                sent = self._sent.get(pid)
                if sent is None or (kill and sent != signal.SIGKILL):
                    self._sent[pid] = signal.SIGKILL if kill else first
                    _send([pid], self._sent[pid])


@contextlib.contextmanager
def relay_to_workers(names: tuple[str, ...] = STOP_SIGNALS) -> Iterator[Relay]:
    """Around starting and running a local world's workers: hold the stop signals for them (see the module).

    The signals are blocked in this thread (the workers it starts inherit that) and taken
    by a thread that waits for them; a thread that started earlier and does not block
    them may still be the one the kernel picks, so a handler does the same. Outside the
    main thread (no handler can be set there) it does nothing.
    """
    relay = Relay()
    if threading.current_thread() is not threading.main_thread():
        yield relay
        return
    numbers = {signal.Signals[name] for name in names}
    # torch's elastic agent would take these signals for itself (raising SignalException in
    # the launcher and killing the workers): it is told to leave them to this relay.
    agent_signals = os.environ.get(_AGENT_SIGNALS)
    os.environ[_AGENT_SIGNALS] = relay.agent_signals = ",".join(n for n in _AGENT_DEFAULT if n not in names)
    previous = {number: signal.signal(number, relay.on_signal) for number in numbers}
    # Workers killed by a second signal leave multiprocessing semaphores that the resource
    # tracker (started below, with this process's warning options) unlinks at exit, with a
    # warning about them: the clean-up is done, the warning is noise after a one-line stop.
    quieted = _TRACKER_QUIET not in sys.warnoptions
    if quieted:
        sys.warnoptions.append(_TRACKER_QUIET)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, numbers)
    done = threading.Event()

    def wait_for_signals() -> None:
        while not done.is_set():
            info = signal.sigtimedwait(numbers, 0.1)
            if info is not None:
                relay.on_signal(info.si_signo)
            relay.pass_on()  # to workers started since the signal came

    thread = threading.Thread(target=wait_for_signals, name="fdp-signals", daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        done.set()
        thread.join()
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for number, handler in previous.items():
            signal.signal(number, handler)
        if quieted:
            sys.warnoptions.remove(_TRACKER_QUIET)
        if agent_signals is None:
            os.environ.pop(_AGENT_SIGNALS, None)
        else:
            os.environ[_AGENT_SIGNALS] = agent_signals


def requeue_job(env: Mapping[str, str] = os.environ) -> str:
    """Requeue this SLURM batch job (``scontrol requeue <job>``); return what was done, for the run's last line.

    An array task is requeued as ``<array job>_<task>``. Interactive allocations (``salloc``,
    ``srun --pty``: job name ``bash`` or ``interactive``) are not requeued.
    """
    job = env.get("SLURM_JOB_ID")
    if not job:
        return "not a SLURM job: not requeued"
    if env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return f"SLURM job {job} is interactive: not requeued"
    if env.get("SLURM_ARRAY_JOB_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '')}"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"requeue of SLURM job {job} failed: {error}"
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"requeue of SLURM job {job} failed: {reason}"
    return f"SLURM job {job} requeued"
