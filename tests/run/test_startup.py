"""fdp.run.startup: the shell entry and the Python API start a run the same way, once: the world resolved
once, the config validated once, the run directory checked and owned once."""

from __future__ import annotations

import json
import runpy
import sys
from collections import Counter
from pathlib import Path

import pytest

import fdp.run.config.validate
import fdp.run.rundir
import fdp.run.world
from fdp.errors import ConfigError
from fdp.run.config.compose import compose
from fdp.run.rundir import owner_of
from fdp.run.startup import start_run
from fdp.run.trainer import run

ROOT = Path(__file__).resolve().parents[2]
TINY = ["trainer.max_steps=2", "trainer.progress=false", "trainer.eval_batches=1"]


@pytest.fixture
def counted(monkeypatch):
    """How often each part of the start-up ran, wherever it was called from."""
    counts: Counter = Counter()

    def count(owner, name, label):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            counts[label] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    count(fdp.run.config.validate, "_validate_trainer", "settings validated")  # every validate() runs it
    count(fdp.run.config.validate, "_validate_run_dir", "directory checked")
    count(fdp.run.world, "resolve_world", "world resolved")
    count(fdp.run.startup, "resolve_world", "world resolved")
    count(fdp.run.rundir.Ownership, "release", "directory owned")  # once per own_run_dir, nested or not
    return counts


ONCE = {"settings validated": 1, "directory checked": 1, "world resolved": 1, "directory owned": 1}


def test_a_shell_run_starts_once(counted, tmp_path, monkeypatch):
    """Through the real shell entry, in this process: recipes/train.py as ``python recipes/train.py`` runs it."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # restored afterwards (fdp.run.cli.main sets it)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "recipes" / "train.py"), *TINY, f"hydra.run.dir={run_dir}"])
    runpy.run_path(str(ROOT / "recipes" / "train.py"), run_name="__main__")
    assert dict(counted) == ONCE
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["steps"] == 2 and (run_dir / ".hydra" / "config.yaml").exists()


def test_the_python_api_starts_once(counted, tmp_path):
    summary = run(compose(*TINY), tmp_path)
    assert summary["steps"] == 2
    assert dict(counted) == ONCE


def test_start_run_owns_the_directory_for_the_block_and_refuses_before_taking_it(tmp_path):
    with start_run(compose(*TINY), tmp_path / "run") as resolved:
        assert owner_of(tmp_path / "run")  # held, and named in the lock
        assert resolved.world.launcher == "none" and resolved.world.accelerator in ("cpu", "gpu")
    assert owner_of(tmp_path / "run") == {}
    with pytest.raises(ConfigError, match=r"^trainer\.max_steps=0: expected an integer >= 1$"):
        with start_run(compose("trainer.max_steps=0"), tmp_path / "new"):
            pass
    assert not (tmp_path / "new").exists()  # refused before anything was written


def test_a_run_in_this_process_leaves_the_fdp_logger_as_it_found_it(tmp_path, caplog):
    """A world of one trains in the caller's process (a notebook, a test): once it ends, a line logged through
    ``fdp``'s logger goes where it would have gone before (not into the run's train.log or stdout handler, which
    fail once the run directory is gone)."""
    import logging
    import shutil

    logger = logging.getLogger("fdp")
    before = (list(logger.handlers), logger.level, logger.propagate)
    run(compose(*TINY), tmp_path / "run")
    shutil.rmtree(tmp_path / "run")
    assert (list(logger.handlers), logger.level, logger.propagate) == before
    with caplog.at_level(logging.WARNING, logger="fdp"):
        logger.warning("after the run")  # through logging's own path, with no run directory to write to
    assert "after the run" in caplog.text
