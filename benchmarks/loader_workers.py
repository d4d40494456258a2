"""DataLoader workers in the ranks of a local world: how fdp starts them, against the default.

A rank of ``world=local2`` is started by ``spawn``, and a DataLoader made in it inherits
that start method: each worker re-imports torch and the user's modules. Each of two gloo
ranks reads the example project's data (``examples/my_project``, ``num_workers=2``) the
way a 60-step run with an evaluation every 20 steps does (one train loader, three
evaluations of the test split), two ways in one run:

* ``default``: DataLoaders as torch makes them there (spawned workers), a new test loader
  per evaluation (what fdp did);
* ``fdp``: ``fdp.data`` (forked workers, one persistent test loader for the run).

Prints the seconds each way spent waiting for batches (the slower rank's) and the ratio,
and writes the table to ``benchmarks/results/loader_workers.md``.

    PYTHONPATH=examples python -m benchmarks.loader_workers   # from the repo root
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from fdp.data import as_map_data, eval_batches, train_batches
from fdp.data.mapped import collate
from fdp.procs.launch import WorldLayout, init_distributed, spawn

RESULTS = Path(__file__).resolve().parent / "results" / "loader_workers.md"
STEPS, EVALS, WORKERS = 60, 3, 2


def _default(data, rank: int) -> float:
    t0 = time.perf_counter()
    from fdp.data.mapped import StepSampler

    sampler = StepSampler(len(data.train), 64, 0, rank, 2, 0, STEPS)
    batches = iter(DataLoader(data.train, batch_sampler=sampler, num_workers=WORKERS, collate_fn=collate))
    for step in range(STEPS):
        next(batches)
        if (step + 1) % (STEPS // EVALS) == 0 and rank == 0:
            for _ in DataLoader(data.test, batch_size=256, num_workers=WORKERS, collate_fn=collate):
                pass
    return time.perf_counter() - t0


def _fdp(data, rank: int) -> float:
    t0 = time.perf_counter()
    batches = train_batches(data, 64, 0, rank, 2, 0, STEPS, num_workers=WORKERS)
    for step in range(STEPS):
        next(batches)
        if (step + 1) % (STEPS // EVALS) == 0 and rank == 0:
            for _ in eval_batches(data, 256, num_workers=WORKERS):
                pass
    return time.perf_counter() - t0


def _rank(layout: WorldLayout) -> dict:
    from my_project.data import make

    comm = init_distributed(layout)
    data = as_map_data("my_project.data.make", make())
    out = {"default": _default(data, comm.rank), "fdp": _fdp(data, comm.rank)}
    torch.distributed.destroy_process_group()
    return out


def main() -> None:
    layout = WorldLayout("elastic", nproc_per_node=2, backend="gloo", timeout_s=300)
    results = spawn(_rank, (layout,), layout)
    seconds = {way: max(results[r][way] for r in results) for way in ("default", "fdp")}
    table = "\n".join(
        [
            "# DataLoader workers in a local world's ranks",
            "",
            f"2 gloo ranks, examples/my_project data, num_workers={WORKERS}: {STEPS} training batches and {EVALS} "
            "evaluations of the test split (rank 0), seconds spent reading (the slower rank); torch "
            f"{torch.__version__}; load average {os.getloadavg()[0]:.1f} at the end.",
            "",
            "| way | seconds | / fdp |",
            "|---|---|---|",
            f"| default (spawned workers, a test loader per evaluation) | {seconds['default']:.2f} | "
            f"{seconds['default'] / seconds['fdp']:.1f} |",
            f"| fdp (forked workers, one persistent test loader) | {seconds['fdp']:.2f} | 1.0 |",
            "",
        ]
    )
    print(table)
    RESULTS.write_text(table)


if __name__ == "__main__":
    sys.exit(main())
