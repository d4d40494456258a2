"""A sweep from the shell (fdp.run.sweep): refused whole before its first job, run to its end past a job that fails,
and ended by a table of its jobs with the worst exit status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import _recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.hidden=8", "trainer.max_steps=2", "trainer.eval_batches=1", "trainer.progress=false"]


def _sweep(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    # Forked from the preloaded server (tests/_recipe.py): a sweep's own start-up is mostly the imports.
    return _recipe.run([sys.executable, str(ROOT / "recipes" / "train.py"), "-m", *overrides, *TINY], env, cwd)


def test_a_sweep_with_a_job_that_would_be_refused_runs_no_job(tmp_path):
    proc = _sweep(tmp_path, "optim.lr=0.1,-1")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines == [
        "error: sweep job 1 (optim.lr=-1): optim.lr=-1.0: expected a learning rate > 0; no job of the 2 was run"
    ]
    assert not list(tmp_path.iterdir())  # no multirun/ directory either


def test_a_sweep_runs_past_a_job_refused_once_started_and_ends_with_a_table(tmp_path):
    # loss=causal_lm on digits' class labels is refused by the first batch, which only a started job sees.
    proc = _sweep(tmp_path, "loss=causal_lm,cross_entropy")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
        "error: model=mlp does not fit data=digits with loss=causal_lm: shift=1: targets of shape (64,) have no "
        "sequence dimension; expected (batch, length) (first batch: inputs (64, 64) float32, targets (64,) int64)"
    ]
    table = proc.stdout.splitlines()[-4:]
    assert table[0].split(" | ")[:6] == ["job", "overrides         ", "status ", "loss  ", "test_loss", "test_acc"]
    refused, done = ([cell.strip() for cell in row.split("|")] for row in table[2:])
    assert refused[:3] == ["0", "loss=causal_lm", "refused"] and refused[-1] == "-"
    assert done[:3] == ["1", "loss=cross_entropy", "done"] and float(done[3]) > 0 and 0 <= float(done[5]) <= 1
    assert (Path(done[-1]) / "metrics.jsonl").is_file()


def test_a_sweep_whose_launcher_runs_jobs_in_processes_of_their_own_still_ends_with_its_table(tmp_path):
    """Under submitit_local each job runs (and Hydra calls on_job_end) in a process of its own: the table is
    made from the rows those processes wrote (it was missing)."""
    proc = _sweep(tmp_path, "hydra/launcher=submitit_local", "hooks=allreduce,fp16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.splitlines()[-4:]
    assert table[0].startswith("job | overrides       | status | loss"), proc.stdout[-3000:]
    rows = [[cell.strip() for cell in row.split("|")] for row in table[2:]]
    assert [row[:3] for row in rows] == [["0", "hooks=allreduce", "done"], ["1", "hooks=fp16", "done"]]
    assert all((Path(row[-1]) / "metrics.jsonl").is_file() and float(row[3]) > 0 for row in rows)
