"""Benchmark: the memory forecast (``fdp.run.memory.forecast``) against the peak a run measures, per configuration.

Each configuration is a real run of ``recipes/train.py`` (a few steps, a whole-file checkpoint and an
evaluation at the end), started fresh: its ``train.log`` holds the forecast's line from the start
(``memory forecast: peak N MiB per rank``) and its summary the peak rank 0 measured (``peak_mib``: on the
CPU the peak resident memory over what the rank held once its data was loaded, the point
``world.memory_per_rank_mb`` counts from; on a GPU ``max_memory_allocated`` over what was allocated then).
The goal: the forecast within 10% of the measured peak, and never below it by more than 5%.

Every run has a budget it never reaches (``world.memory_per_rank_mb=65536``): what a forecast answers is whether a
run fits a budget, and under one a rank's allocator hands back each block from 64 KiB as it is freed
(``fdp.procs.allocator.budget_accounting``), so its resident memory is what it holds. Without a budget the heap
keeps what a step frees, for speed (``tune_allocator``), and the peak is what the heap grew to: the same run
measured 87-120 MiB (MLP at stage 1 on 2 ranks), by how the ranks' threads interleaved.

    python benchmarks/forecast.py [--only NAME ...] [--steps 3]

Writes ``benchmarks/results/forecast.md`` (date, command, machine load) after every row.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

CHAR = ("model=charlm", "model.d_model=256", "model.n_layer=4", "model.n_head=4")
TEXT = ("data=stdlib_text", "data.block_size=128", "data.max_chars=200000", "data.global_batch_size=16")
GPT2 = (
    "model=custom",
    "model._target_=fdp.model.builtin.hf_model",
    "+model.model_class=transformers.GPT2LMHeadModel",
    "+model.n_layer=4",
    "+model.n_embd=256",
    "+model.n_head=4",
    "+model.n_positions=128",
)
MLP = ("model=mlp", "model.hidden=1024", "model.depth=3", "data.global_batch_size=64")
NEVER_REACHED_MB = 65536  # a budget, for its allocator, that no configuration comes near
WORLD = {1: "world=single", 2: "world=local2", 4: "world=local4"}
CONFIGS = {  # name: (ranks, overrides)
    "mlp stage 0": (1, (*MLP, "optim=adam")),
    "mlp stage 1": (2, (*MLP, "optim=adam", "trainer.zero_stage=1")),
    "charlm stage 0": (2, (*CHAR, *TEXT, "optim=adamw")),
    "charlm stage 0 + ckpt": (2, (*CHAR, *TEXT, "optim=adamw", "trainer.activation_checkpointing=blocks")),
    "charlm stage 2": (2, (*CHAR, *TEXT, "optim=adamw", "trainer.zero_stage=2")),
    "charlm stage 3": (2, (*CHAR, *TEXT, "optim=adamw", "trainer.zero_stage=3")),
    "charlm stage 3 + ckpt, 4 ranks": (
        4,
        (*CHAR, *TEXT, "optim=sgd", "trainer.zero_stage=3", "trainer.activation_checkpointing=blocks"),
    ),
    # Long samples, the whole batch in one micro-batch on one rank: its activations are most of its peak (143 of 175)
    "charlm block 128, 128 samples, 1 rank, micro-batch auto": (
        1,
        (
            "model=charlm",
            "model.d_model=64",
            "model.n_layer=2",
            "data=stdlib_text",
            "data.block_size=128",
            "data.max_chars=200000",
            "data.global_batch_size=128",
            "trainer.accum_steps=auto",
        ),
    ),
    "gpt2 stage 0": (2, (*GPT2, *TEXT, "optim=adamw")),
    "gpt2 stage 3 + ckpt": (
        2,
        (*GPT2, *TEXT, "optim=adamw", "trainer.zero_stage=3", "trainer.activation_checkpointing=blocks"),
    ),
}


def run(name: str, steps: int) -> dict:
    """One configuration's run: the forecast it logged at start and the peak it measured."""
    ranks, overrides = CONFIGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            str(REPO / "recipes" / "train.py"),
            WORLD[ranks],
            *overrides,
            f"trainer.max_steps={steps}",
            f"world.memory_per_rank_mb={NEVER_REACHED_MB}",
            "trainer.eval_every=0",
            "trainer.eval_batches=2",
            "trainer.checkpoint_every=0",
            "trainer.progress=false",
            f"hydra.run.dir={tmp}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        t0 = time.time()
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp)
        log = (Path(tmp) / "train.log").read_text() if (Path(tmp) / "train.log").exists() else ""
    if proc.returncode:
        raise RuntimeError(f"{name}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    forecast = re.search(r"memory forecast: peak (\d+) MiB per rank in (\w+)", log)
    measured = re.search(r"peak_mib=([\d.]+)", log)
    return {
        "name": name,
        "ranks": ranks,
        "forecast_mib": float(forecast.group(1)),
        "phase": forecast.group(2),
        "measured_mib": float(measured.group(1)),
        "wall_s": round(time.time() - t0),
    }


def table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# The memory forecast against the measured peak ({meta['date']})",
        "",
        f"`{meta['command']}`; torch {meta['torch']}, {platform.machine()}, {meta['cpus']} CPU cores shared with "
        f"other jobs (load {meta['load_before']:.1f} before, {os.getloadavg()[0]:.1f} after); gloo on loopback. "
        "Each row a fresh run of `recipes/train.py` for a few steps, a checkpoint (whole-file on one rank, sharded "
        "and asynchronous on more) and a short evaluation at the end, under a budget it never reaches "
        f"(`world.memory_per_rank_mb={NEVER_REACHED_MB}`: "
        "the allocator as a budget sets it). `forecast`: the peak the run logged at start (`fdp.run.memory.forecast`, "
        "the worst rank); `measured`: rank 0's peak resident memory over what it held once its data was loaded "
        "(the summary's `peak_mib`). Goal: within 10%, never more than 5% below.",
        "",
        "| configuration | ranks | forecast MiB | phase | measured MiB | forecast / measured | goal |",
        "|---|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        ratio = r["forecast_mib"] / r["measured_mib"]
        ok = "yes" if 0.95 <= ratio <= 1.10 else "no"
        lines.append(
            f"| {r['name']} | {r['ranks']} | {r['forecast_mib']:.0f} | {r['phase']} | {r['measured_mib']:.0f} | "
            f"{ratio:.2f} | {ok} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "forecast.md"))
    args = parser.parse_args()
    import torch

    meta = {
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(["benchmarks/forecast.py", *sys.argv[1:]]),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0],
    }
    rows = []
    for name in args.only:
        rows.append(run(name, args.steps))
        print(rows[-1], flush=True)
        Path(args.out).write_text(table(rows, meta))
    print(table(rows, meta))


if __name__ == "__main__":
    main()
