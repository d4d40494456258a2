"""Stopping a run with a signal: real signals to real recipe processes (fdp.procs.interrupt).

Each run is the tiny MLP on digits with a step budget it never reaches; the test waits
until the ranks are training (``ranks/rank<N>.txt``), signals them as a terminal, a
scheduler or SLURM would, and checks the one line, the exit status, the checkpoint of
the step every rank stopped at, and that no process of the run is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import _recipe
import pytest
from _saved import saved

from fdp.procs.interrupt import GRACE_S, Burst, StoppedAtOnce, StopSignals, check_requeue_signal, exit_code, requeue_job
from fdp.run.checkpoint import last_of
from fdp.run.rundir import RankStatus

pytestmark = pytest.mark.heavy  # run first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
LONG = [
    "model.hidden=16",
    "data.global_batch_size=16",
    "trainer.max_steps=1000000",
    "trainer.eval_every=0",
    "trainer.checkpoint_every=0",
    "trainer.log_every=1",
    "trainer.progress=false",
]


def start(run_dir, *overrides, env=None, wrapper=(), workers="spawn"):
    """The recipe in a session of its own (so the test can signal its process group as a terminal's Ctrl-C does),
    under ``wrapper`` (a command that runs it as its child: ``timeout``, ``srun``) from a fresh interpreter, else
    forked from the preloaded server (tests/_recipe.py): a real process all the same, that takes the signals.
    ``workers``: how its local worlds start their workers (fdp.spawn's ``start_method``)."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FDP_TEST_TAG": tag, **(env or {})}
    command = [
        *wrapper,
        sys.executable,
        str(ROOT / "recipes" / "train.py"),
        *LONG,
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    if wrapper:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    else:
        # Its local worlds spawn their workers unless told, as from the shell: a terminal's Ctrl-C reaches them in
        # the group.
        proc = _recipe.start(command, env=env, cwd=ROOT, workers=workers)
    proc.tag = tag
    return proc


def wait_training(proc, run_dir, ranks=(0,), steps=5, timeout=120):
    deadline = time.monotonic() + timeout
    while not all(RankStatus.read(run_dir, r).get("step", 0) > steps for r in ranks):
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate()
            raise AssertionError(f"never trained (exit {proc.returncode}): {err[-3000:]}")
        time.sleep(0.05)


def tagged(tag):
    """Processes whose environment carries ``tag`` (every process the run started; the run's own too where it
    started from a fresh interpreter: a forked one's /proc environ is the server's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if f"FDP_TEST_TAG={tag}".encode() in entry.joinpath("environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    deadline = time.monotonic() + 5
    while tagged(proc.tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tagged(proc.tag), f"processes left behind: {tagged(proc.tag)}"
    return out, err


def lines(text):
    return [line for line in text.splitlines() if line.strip()]


def checkpoint_step(run_dir):
    return saved(Path(run_dir))["step"]


def interrupted_line(step, signame, run_dir):
    return (
        f"fdp: interrupted at step {step} by {signame}; checkpoint {last_of(Path(run_dir) / 'checkpoints')}; "
        f"resume with trainer.resume=true hydra.run.dir={run_dir}"
    )


def test_ctrl_c_on_one_process_stops_at_a_step_with_a_checkpoint_and_one_line(tmp_path):
    """SIGINT to the process group (a terminal's Ctrl-C) of a one-process run, in bf16 on this CPU:
    the start-up says bf16 is slow here, once, and the run ends with one line and status 130."""
    proc = start(tmp_path, "trainer.precision=bf16-mixed")
    wait_training(proc, tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    slow, stop = lines(err)
    assert slow.startswith("fdp: trainer.precision=bf16-mixed on ") and "slower than 32-true" in slow
    step = checkpoint_step(tmp_path)
    assert stop == interrupted_line(step, "SIGINT", tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-2]["step"] == step and records[-1]["summary"] and records[-1]["interrupted"] == "SIGINT"
    log = (tmp_path / "train.log").read_text()  # what the run printed is in Hydra's train.log too
    assert slow in log and stop in log and "[rank0] mlp: " in log


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_every_rank_of_a_local_world_stops_at_the_same_step(tmp_path, how):
    """world=local2: Ctrl-C reaches the launcher and both workers; SIGTERM (a scheduler's
    kill) reaches the launcher alone, which passes it on. Both ranks stop after the same
    step, which is checkpointed (a save every rank joins), and the run exits 130 or 143."""
    proc = start(tmp_path, "world=local2", "world.backend=gloo", "world.timeout_s=30")
    wait_training(proc, tmp_path, ranks=(0, 1))
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    out, err = finish(proc)
    signame = "SIGINT" if how == "ctrl-c" else "SIGTERM"
    assert proc.returncode == exit_code(signame) == (130 if how == "ctrl-c" else 143), err[-3000:]
    step = checkpoint_step(tmp_path)
    assert lines(err) == [interrupted_line(step, signame, tmp_path)]
    assert [RankStatus.read(tmp_path, r)["step"] for r in (0, 1)] == [step, step]  # the step each rank computed last
    assert interrupted_line(step, signame, tmp_path) in (tmp_path / "train.log").read_text()


@pytest.mark.parametrize("workers", ["spawn", "fork", "forkserver"])
def test_a_second_signal_stops_a_stuck_local_world_at_once(tmp_path, workers):
    """Rank 1 is stopped (SIGSTOP), so no step boundary comes: the first SIGTERM waits, the
    second signal kills the workers and the run ends with one line naming the last checkpoint.
    Whatever started the workers: spawned (a script), forked (a notebook, ``python -c``: the launcher's
    children with its command line, here a forkserver's as the launcher came from one) or from the launcher's
    forkserver (its grandchildren)."""
    proc = start(
        tmp_path,
        "world=local2",
        "world.backend=gloo",
        "world.timeout_s=60",
        "trainer.checkpoint_every=5",
        workers=workers,
    )
    wait_training(proc, tmp_path, ranks=(0, 1), steps=7)
    # Two ranks write sharded checkpoints in the background: step 5's complete (named by last) before rank 1 stops.
    while not (tmp_path / "checkpoints" / "last").exists():
        assert proc.poll() is None
        time.sleep(0.05)
    os.kill(RankStatus.read(tmp_path, 1)["pid"], signal.SIGSTOP)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(GRACE_S + 0.3)  # a second signal sooner would be the same request (test_a_burst_of_signals...)
    assert proc.poll() is None  # waiting for a step boundary that cannot come
    os.kill(proc.pid, signal.SIGINT)
    second = time.monotonic()
    out, err = finish(proc, timeout=30)
    assert time.monotonic() - second < 10, f"{time.monotonic() - second:.1f} s after the second signal"
    assert proc.returncode == 130, err[-3000:]
    step = checkpoint_step(tmp_path)
    assert step % 5 == 0 and lines(err) == [
        f"fdp: stopped at once by a second SIGINT; the last checkpoint is step {step} "
        f"({last_of(tmp_path / 'checkpoints')})"
    ]


@pytest.mark.parametrize("world", ["single", "local2"])
def test_ctrl_c_through_a_relaying_wrapper_is_one_request(tmp_path, world):
    """setsid timeout -s KILL 300 python recipes/train.py ... and Ctrl-C (SIGINT to the whole group): the
    launcher and every rank get the signal from the terminal and again from timeout, which relays it to its
    child and to its group. That burst is one request: every try stops at a step boundary with a checkpoint
    and the one interrupted line (exit 130), never 'stopped at once'. Two tries on one process, one on two
    (the burst's timing itself is tried 20 times in one process: test_a_burst_of_signals_is_one_request...).
    The two tries run side by side, each in its own session: their fresh interpreters start at once."""
    overrides = ["world=local2", "world.backend=gloo", "world.timeout_s=30"] if world == "local2" else []
    ranks = (0, 1) if world == "local2" else (0,)
    attempts = range(2 if world == "single" else 1)
    procs = [start(tmp_path / str(a), *overrides, wrapper=("timeout", "-s", "KILL", "300")) for a in attempts]
    try:
        for attempt, proc in zip(attempts, procs):
            run_dir = tmp_path / str(attempt)
            wait_training(proc, run_dir, ranks=ranks)
            os.killpg(proc.pid, signal.SIGINT)
            out, err = finish(proc)
            assert proc.returncode == 130, (attempt, err[-3000:])
            step = checkpoint_step(run_dir)
            assert lines(err) == [interrupted_line(step, "SIGINT", run_dir)], attempt
            assert [RankStatus.read(run_dir, r)["step"] for r in ranks] == [step] * len(ranks)
    finally:
        for proc in procs:  # a try left running by a failure before its turn
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def test_a_burst_of_signals_is_one_request_and_a_later_one_stops_at_once():
    """Signals within GRACE_S of the first are the same request; one after it is a second (stop at once)."""
    for _ in range(20):
        stop = StopSignals(("SIGUSR2",), repeat_stops_at_once=True).install()
        try:
            for _ in range(3):  # the terminal's, the wrapper's to its child, the wrapper's to its group
                os.kill(os.getpid(), signal.SIGUSR2)
            assert stop.agreed() == "SIGUSR2"
        finally:
            stop.restore()
    stop = StopSignals(("SIGUSR2",), repeat_stops_at_once=True).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(GRACE_S)
        with pytest.raises(StoppedAtOnce):
            os.kill(os.getpid(), signal.SIGUSR2)
    finally:
        stop.restore()
    burst = Burst(grace_s=0.2)
    assert [burst.see("SIGTERM"), burst.see("SIGINT")] == [False, False] and burst.first == "SIGTERM"
    time.sleep(0.2)
    assert burst.see("SIGINT")


_LATE_COPY = """
import os, signal, threading, time
from fdp.procs.interrupt import StopSignals
stop = StopSignals(("SIGINT",), repeat_stops_at_once=True).install().join(1)  # a process alone
os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C
threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()  # the wrapper's copy, a moment later
stop.close()  # the run stopped at once, before the copy came
time.sleep(0.5)
print(stop.received)
"""


def test_a_relayed_copy_arriving_after_the_run_stopped_is_still_the_same_request():
    """A one-process run that stops faster than a wrapper relays its Ctrl-C exits with one line, not a
    KeyboardInterrupt's traceback from wherever the copy found the exiting interpreter."""
    proc = subprocess.run([sys.executable, "-c", _LATE_COPY], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "SIGINT", "")


def _fake_scontrol(bin_dir: Path, record: Path) -> None:
    """An ``scontrol`` on PATH that records how it was called (this machine has no SLURM)."""
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_slurms_warning_signal_stops_both_tasks_checkpoints_and_requeues_the_job(tmp_path):
    """Two tasks with the variables srun gives a batch job's tasks; SIGUSR1 (sbatch --signal=USR1@90)
    reaches one of them: both stop after the same step, rank 0 requeues the job, both exit 138."""
    bin_dir, record, run_dir = tmp_path / "bin", tmp_path / "scontrol.log", tmp_path / "run"
    bin_dir.mkdir()
    _fake_scontrol(bin_dir, record)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_TASKS_PER_NODE": "2",
            "SLURM_JOB_NODELIST": "127.0.0.1",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NUM_NODES": "1",
            "SLURM_JOB_NAME": "train.sbatch",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        }
        procs.append(start(run_dir, "world=slurm", "world.timeout_s=30", env=env))
    for proc in procs:
        wait_training(proc, run_dir, ranks=(0, 1))
    os.kill(procs[1].pid, signal.SIGUSR1)
    (_, err0), (_, err1) = finish(procs[0]), finish(procs[1])
    assert [p.returncode for p in procs] == [138, 138], (err0[-2000:], err1[-2000:])
    step = checkpoint_step(run_dir)
    assert lines(err0) == [interrupted_line(step, "SIGUSR1", run_dir) + "; SLURM job 4242 requeued"]
    assert lines(err1) == [interrupted_line(step, "SIGUSR1", run_dir)]
    assert record.read_text() == "requeue 4242\n"
    assert [RankStatus.read(run_dir, r)["step"] for r in (0, 1)] == [step, step]


def test_stop_signals_and_requeue_in_one_process(tmp_path):
    """The pieces on their own: a handled signal is a flag; requeue's command."""
    stop = StopSignals(("SIGUSR2",)).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.agreed() == "SIGUSR2"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    assert check_requeue_signal("none") == "none"
    for bad in ("SIGKILL", "SIGTERM", "USR1"):
        with pytest.raises(ValueError, match=re.escape(f"requeue_signal='{bad}': expected none or a signal name")):
            check_requeue_signal(bad)
    bin_dir, record = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    _fake_scontrol(bin_dir, record)
    env = {"PATH": str(bin_dir), "SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "3"}
    old_path = os.environ["PATH"]
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{old_path}"
    try:
        assert requeue_job(env) == "SLURM job 5_3 requeued"
        assert requeue_job({**env, "SLURM_JOB_NAME": "interactive"}) == "SLURM job 7 is interactive: not requeued"
        assert requeue_job({}) == "not a SLURM job: not requeued"
    finally:
        os.environ["PATH"] = old_path
    assert record.read_text() == "requeue 5_3\n"
