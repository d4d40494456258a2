"""Benchmark: a model whose fp32 params alone exceed each rank's memory, trained, saved and resumed elsewhere.

A ``CharTransformer`` of ~76M parameters (d_model 512, 24 layers: 289 MiB of fp32 params), SGD with momentum, on
the stdlib text, gloo on loopback, each rank capped by ``world.memory_per_rank_mb`` (the CPU's stand-in for a
GPU's memory: ``fdp.procs.devices.limit_memory``). Every run is the recipe from the shell, as a user runs it:

1. one process, stage 0, no cap, 8 steps: the reference;
2. 4 ranks at stage 0 under the cap: refused, the whole params do not fit (the line it prints is kept);
3. 4 ranks at stage 3 under the same cap (below the params alone): built on ``meta``, each rank making its
   slices, 4 steps, a sharded checkpoint (synchronous: an asynchronous one stages a copy of the rank's
   state, which this cap leaves no room for), stopped;
4. 2 ranks at stage 3 under a cap their shares fit: resumed from that checkpoint, to step 8.

Reported: each run's outcome and wall time, and how far the resumed run's final params are from the reference's
(``fdp.run.checkpoint.consolidate``; within 1e-5 is the goal). A rank at stage 3 holds its shares of the params, their
gradients and the momentum (3 bytes per parameter at 4 ranks) plus a few buckets in flight.

    python benchmarks/beyond_one_rank.py [--layers 24 --cap 275]

Writes ``benchmarks/results/beyond_one_rank.md``.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make ``fdp`` importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
TEXT = ("data=stdlib_text", "data.block_size=8", "data.max_chars=4000", "data.global_batch_size=8")
RUN = (
    *TEXT,
    "model=charlm",
    "model.d_model=512",
    "model.n_head=8",
    "optim=sgd",
    "optim.momentum=0.9",
    "optim.lr=0.01",
    "seed=11",
    "trainer.bucket_cap_mb=4",
    "trainer.max_steps=8",
    "trainer.checkpoint_every=4",
    "trainer.checkpoint_format=sharded",
    "trainer.checkpoint_async=false",  # an asynchronous save stages a copy of the rank's state: not under this cap
    "trainer.eval_every=0",
    "trainer.progress=false",
)


def train(run_dir: Path, *overrides: str) -> tuple[int, float, str]:
    """The recipe on ``overrides``; its exit status, wall seconds and what it ended with (summary or error)."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "train.py"), *RUN, *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    said = [line for line in lines if line.startswith(("fdp:", "error:"))]  # the summary, or the one-line error
    return done.returncode, time.perf_counter() - t0, (said or lines or [""])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--cap", type=float, default=275.0, help="world.memory_per_rank_mb at 4 ranks")
    parser.add_argument("--cap2", type=float, default=500.0, help="world.memory_per_rank_mb at 2 ranks")
    args = parser.parse_args()
    from fdp.run.checkpoint.consolidate import consolidate

    rows = []
    model = f"model.n_layer={args.layers}"
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        runs = [
            ("1 process, stage 0, no cap (reference)", scratch / "one", (model,)),
            (
                f"4 ranks, stage 0, cap {args.cap:g} MiB",
                scratch / "zero0",
                (model, "world=local4", f"world.memory_per_rank_mb={args.cap}"),
            ),
            (
                f"4 ranks, stage 3, cap {args.cap:g} MiB, stopped at step 4",
                scratch / "sharded",
                (
                    model,
                    "world=local4",
                    "trainer.zero_stage=3",
                    f"world.memory_per_rank_mb={args.cap}",
                    "trainer.stop_at=4",
                ),
            ),
            (
                f"2 ranks, stage 3, cap {args.cap2:g} MiB, resumed to step 8",
                scratch / "sharded",
                (
                    model,
                    "world=local2",
                    "trainer.zero_stage=3",
                    f"world.memory_per_rank_mb={args.cap2}",
                    "trainer.resume=true",
                ),
            ),
        ]
        for name, run_dir, overrides in runs:
            status, seconds, last = train(run_dir, *overrides)
            rows.append((name, status, seconds, last))
            print(f"{name}: exit {status} in {seconds:.0f} s: {last}", flush=True)
        reference, resumed = consolidate(scratch / "one"), consolidate(scratch / "sharded")
    params = sum(p.numel() for p in reference["params"].values())
    diff = max((resumed["params"][n] - p).abs().max().item() for n, p in reference["params"].items())
    print(
        f"params {params:,} ({4 * params / 2**20:.1f} MiB fp32); steps {resumed['step']}; largest difference {diff:.2e}"
    )
    lines = [
        "# Params larger than a rank's memory: trained at stage 3 on 4 ranks, resumed on 2",
        "",
        f"`python benchmarks/beyond_one_rank.py --layers {args.layers} --cap {args.cap:g} --cap2 {args.cap2:g}`, "
        f"{datetime.date.today()}, torch {torch.__version__}, ranks sharing the machine's cores (gloo, 1 thread each). "
        f"A char transformer of {params:,} parameters: **{4 * params / 2**20:.1f} MiB of fp32 params** against a cap "
        f"of **{args.cap:g} MiB** per rank at 4 ranks. SGD with momentum, 8 steps, a sharded checkpoint at "
        "step 4 (`trainer.checkpoint_async=false`).",
        "",
        "| run | exit | wall s | what it printed last |",
        "|---|---|---|---|",
    ]
    for name, status, seconds, last in rows:
        lines.append(f"| {name} | {status} | {seconds:.0f} | `{last.replace('|', '/')[:240]}` |")
    lines += [
        "",
        f"Resumed run against the reference after step {resumed['step']}: largest difference in any param "
        f"**{diff:.2e}** (goal: within 1e-5).",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "beyond_one_rank.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
