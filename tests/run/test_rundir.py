"""A run directory has one owner (fdp.run.rundir): a second run is refused naming the first,
a dead run's lock is taken over saying so, and a refused run adds nothing to a directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import _recipe
import pytest
from _saved import saved

from fdp.errors import ConfigError
from fdp.run.checkpoint import last_of
from fdp.run.rundir import LOCK, RankStatus, RunDirInUse, own_run_dir, owner_of

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.hidden=16", "data.global_batch_size=16", "trainer.eval_every=0", "trainer.progress=false"]


def recipe(run_dir, *overrides, wait=True, fresh=False):
    """The recipe's command, forked from the preloaded server unless ``fresh`` (tests/_recipe.py); once it is
    done (``wait``), ``.returncode``, ``.out`` and ``.err``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "recipes" / "train.py"), *TINY, *overrides, f"hydra.run.dir={run_dir}"]
    started = _recipe.start(command, env=env, cwd=ROOT, fresh=fresh)
    if not wait:
        return started
    done = started.result(timeout=180)
    done.out, done.err = done.stdout, done.stderr
    return done


def lines(text):
    return [line for line in text.splitlines() if line.strip()]


def listing(run_dir):
    """Every path under ``run_dir``, with each file's modification time."""
    return {
        str(p.relative_to(run_dir)): p.stat().st_mtime_ns if p.is_file() else None
        for p in sorted(Path(run_dir).rglob("*"))
    }


def test_one_owner_per_run_directory_and_a_dead_owners_lock_is_taken_over(tmp_path):
    # The first from a fresh interpreter: the lock's owner is the process the shell started.
    first = recipe(tmp_path, "trainer.max_steps=1000000", "trainer.checkpoint_every=5", wait=False, fresh=True)
    deadline = time.monotonic() + 120
    while RankStatus.read(tmp_path, 0).get("step", 0) < 12:
        assert first.poll() is None and time.monotonic() < deadline, first.result(timeout=60).stderr[-3000:]
        time.sleep(0.05)
    host = socket.gethostname()
    assert owner_of(tmp_path) | {"since": "-"} == {"pid": str(first.pid), "host": host, "since": "-"}

    # A second run into the same directory, while the first is alive: refused, naming it.
    second = recipe(tmp_path, "trainer.max_steps=5")
    assert second.returncode == 2, second.err[-3000:]
    assert lines(second.err) == [
        f"error: hydra.run.dir={tmp_path}: in use by another run (pid {first.pid} on {host}); expected a directory no "
        "live run is writing to (wait for that run, stop it, or choose another hydra.run.dir)"
    ]
    assert not (tmp_path / ".hydra" / "resume-1").exists()  # it wrote nothing there

    # The first dies without a word (SIGKILL): its lock file stays, but the kernel freed the lock.
    first.kill()
    first.result(timeout=60)
    assert owner_of(tmp_path)["pid"] == str(first.pid)
    last = int(max(p.name for p in (tmp_path / "checkpoints").glob("step_*.pt"))[5:13])
    third = recipe(tmp_path, "trainer.resume=true", f"trainer.max_steps={last + 3}")
    assert third.returncode == 0, third.err[-3000:]
    note = (
        f"fdp: hydra.run.dir={tmp_path} was locked by pid {first.pid} on {host}, which is gone; this run takes it over"
    )
    assert lines(third.err) == [note]
    assert note in (tmp_path / "train.log").read_text()
    assert f"steps={last + 3} " in third.out and not (tmp_path / LOCK).exists()

    # A resume refused once the checkpoint is read leaves the run exactly as it was.
    before = listing(tmp_path)
    fourth = recipe(tmp_path, "trainer.resume=true", "model.hidden=32", f"trainer.max_steps={last + 6}")
    assert fourth.returncode == 2 and "another bucket plan" in fourth.err, fourth.err[-3000:]
    assert listing(tmp_path) == before


def test_a_resume_refused_on_two_ranks_is_one_line_every_time_and_changes_nothing(tmp_path):
    """A world=local2 PowerSGD run resumed with hooks=allreduce: both ranks refuse its hook state. Every try
    ends the same way: the same one line (no rank named: they agree), exit 2, the run exactly as it was.
    Two tries: the second also finds the directory as the first refusal left it."""
    world = ["world=local2", "world.backend=gloo", "world.timeout_s=60"]
    first = recipe(tmp_path, *world, "hooks=powersgd", "trainer.max_steps=3")
    assert first.returncode == 0, first.err[-3000:]
    before = listing(tmp_path)
    entries = len(saved(tmp_path)["ranks"][0]["hook_state"])
    expected = [
        f"error: checkpoint {last_of(tmp_path / 'checkpoints')}: hook state has {entries} entries, this run "
        "expects 0 (different optimizer, hooks or bucket plan?)"
    ]
    for attempt in range(2):
        refused = recipe(tmp_path, *world, "hooks=allreduce", "trainer.resume=true", "trainer.max_steps=6")
        assert (attempt, refused.returncode, lines(refused.err)) == (attempt, 2, expected), refused.err[-3000:]
        assert listing(tmp_path) == before, attempt  # no .hydra/resume-1, no log line, nothing rewritten


def test_ownership_in_one_process_is_reentrant_and_a_refusal_rolls_back(tmp_path):
    run_dir = tmp_path / "run"
    with own_run_dir(run_dir) as outer:
        with own_run_dir(run_dir) as inner:  # the recipe and fdp.run.trainer.run both ask
            assert inner is outer
        assert (run_dir / LOCK).exists()  # still held by the outer block
        other = subprocess.run(
            [sys.executable, "-c", f"from fdp.run.rundir import own_run_dir\nwith own_run_dir({str(run_dir)!r}): pass"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ},
        )
        assert "RunDirInUse" in other.stderr and f"pid {os.getpid()} on" in other.stderr
    assert not run_dir.joinpath(LOCK).exists()
    with pytest.raises(ConfigError):
        with own_run_dir(run_dir):
            (run_dir / "plan.txt").write_text("made by a run that is then refused")
            (run_dir / "ranks").mkdir()
            raise ConfigError("refused")
    assert not run_dir.exists()  # it was empty before: nothing is left
    assert issubclass(RunDirInUse, ConfigError)
