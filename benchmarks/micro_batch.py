"""Benchmark: ``trainer.accum_steps=auto`` against the micro-batch it chose, fixed.

Each configuration runs ``recipes/train.py`` with ``trainer.accum_steps=auto`` under a budget, then with the
micro-batches per step it ended on fixed (same budget), alternately ``--repeats`` times each. From the auto run's
``metrics.jsonl``: the micro-batches it chose and the seconds each took (the forecast at start; a step that ran out
of memory, freed and done again); from both summaries the median step time (``step_ms``); and from a callback
(``StepCpu``) the CPU time of rank 0's process per step (all its threads, between one step's end and the next's:
median over the steps), which a shared machine's load moves far less than the wall time.
The goal: auto's steady step time within 2% of the fixed run's. Equal params are ``tests/test_micro_batch.py``'s.

    python benchmarks/micro_batch.py [--only NAME ...] [--steps 12] [--repeats 2]

Writes ``benchmarks/results/micro_batch.md`` (date, command, machine load).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fdp import Callback

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

MLP = ("model=mlp", "model.hidden=16384", "model.depth=1", "optim=sgd", "data.global_batch_size=512")
CHAR = (
    "model=charlm",
    "model.d_model=128",
    "model.n_layer=2",
    "model.n_head=4",
    "data=stdlib_text",
    "data.block_size=128",
    "data.max_chars=100000",
    "data.global_batch_size=64",
    "optim=adamw",
)
CONFIGS = {  # name: overrides
    "mlp, 1 rank, 105 MiB (the first micro-batch does not fit)": (*MLP, "world.memory_per_rank_mb=105"),
    # No budget: the whole share per forward, as fixed; what auto adds per step on several ranks (one flag agreed)
    "charlm, 2 ranks, stage 0, no budget": (*CHAR, "world=local2"),
    "charlm, 2 ranks, stage 3, no budget": (*CHAR, "world=local2", "trainer.zero_stage=3"),
}


class StepCpu(Callback):
    """Rank 0's process CPU time (ms) between consecutive step ends, written to ``step_cpu.json`` at the run's end."""

    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, event):
        self.ends.append(time.process_time())

    def on_run_end(self, event):
        ms = [1e3 * (b - a) for a, b in zip(self.ends, self.ends[1:])]
        (Path(event.run_dir) / "step_cpu.json").write_text(json.dumps(ms))


def _run(overrides: tuple[str, ...], steps: int) -> tuple[dict, list[dict]]:
    """One run's summary (with ``cpu_ms``: rank 0's median CPU time per step after the first) and its micro-batch
    records."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            str(REPO / "recipes" / "train.py"),
            *overrides,
            "trainer.callbacks=[{_target_: benchmarks.micro_batch.StepCpu}]",
            f"trainer.max_steps={steps}",
            "trainer.eval_every=0",
            "trainer.checkpoint_every=0",
            "trainer.progress=false",
            f"hydra.run.dir={tmp}/run",
        ]
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}  # the callback's module, in every rank
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"failed: {' '.join(overrides)}\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
        cpu_ms = statistics.median(json.loads(Path(f"{tmp}/run/step_cpu.json").read_text()))
    summary = {**next(r for r in rows if r.get("summary")), "cpu_ms": cpu_ms}
    return summary, [r for r in rows if r.get("micro_batch") is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="configurations whose name contains one of these")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    names = [n for n in CONFIGS if not args.only or any(o in n for o in args.only)]
    rows = []
    for name in names:
        auto_ms, fixed_ms, auto_cpu, fixed_cpu, choices = [], [], [], [], None
        for _ in range(args.repeats):
            summary, records = _run((*CONFIGS[name], "trainer.accum_steps=auto"), args.steps)
            auto_ms.append(summary["step_ms"])
            auto_cpu.append(summary["cpu_ms"])
            choices = choices or records
            accum = records[-1]["accum_steps"]
            summary, _ = _run((*CONFIGS[name], f"trainer.accum_steps={accum}"), args.steps)
            fixed_ms.append(summary["step_ms"])
            fixed_cpu.append(summary["cpu_ms"])
        auto, fixed = statistics.median(auto_ms), statistics.median(fixed_ms)
        cpu_auto, cpu_fixed = statistics.median(auto_cpu), statistics.median(fixed_cpu)
        path = " -> ".join(f"{c['micro_batch']}" for c in choices)
        search = sum(c["seconds"] for c in choices)
        rows.append(
            f"| {name} | {path} | {choices[0]['seconds']:.2f} | {search:.2f} | {fixed:.1f} | {auto:.1f} | "
            f"{100 * (auto / fixed - 1):+.1f}% | {cpu_fixed:.1f} | {cpu_auto:.1f} | "
            f"{100 * (cpu_auto / cpu_fixed - 1):+.1f}% |"
        )
        print(rows[-1], flush=True)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    text = "\n".join(
        [
            "# trainer.accum_steps=auto against its micro-batch fixed",
            "",
            f"{datetime.date.today()}, `python benchmarks/micro_batch.py --steps {args.steps} --repeats {args.repeats}`"
            f", {platform.machine()} CPU, {os.cpu_count()} cores, load "
            f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end (shared machine).",
            "Micro-batches: samples per forward on a rank, as chosen (the forecast's, then each halving). Search: the",
            "seconds the forecast took at start, and in all (with the steps that ran out, freed and were done again).",
            "Step ms: the summary's median step time (wall), median over the repeats. CPU ms: rank 0's process CPU",
            "time per step (all its threads, between consecutive step ends, median over the steps after the first),",
            "median over the repeats: what a step costs the host, which other processes' load moves far less.",
            "",
            "| configuration | micro-batches | forecast s | search s | fixed step ms | auto step ms | auto vs fixed "
            "| fixed CPU ms | auto CPU ms | auto vs fixed (CPU) |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    if not args.only:
        (RESULTS / "micro_batch.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
