"""Benchmark: building a run's first state at ZeRO stage 0 (every rank builds the whole model) against stage 3
(the model built on ``meta``, each rank making its own slices: ``fdp.model.deferred``, ``fdp.update.zero.built``).

A ``CharTransformer`` (d_model 768, 6 layers, 12 heads, the stdlib text's vocabulary: ~43M parameters, 164 MiB of
fp32 params), SGD with momentum, gloo on loopback, one torch thread per rank. Every (world, stage) runs in a fresh
launch of its ranks, so its memory is its own. Each rank first builds a tiny run (what the first build of a process
loads, once), then ``fdp.run.build.build_run`` is timed and its peak resident memory measured (``VmHWM`` reset
through ``/proc/self/clear_refs`` before the build). Reported: the larger rank's peak growth and the slower rank's
build time, stage 3 against stage 0, and a rank's share of the params.

    python benchmarks/sharded_build.py [--worlds 2 4]

Writes ``benchmarks/results/sharded_build.md``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make ``fdp`` and this module importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks._proc import reset_peak, status_mib  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
TEXT = ("data=stdlib_text", "data.block_size=16", "data.max_chars=20000", "data.global_batch_size=8")
MODEL = ("model=charlm", "model.d_model=768", "model.n_layer=6", "model.n_head=12", "optim=sgd", "seed=0")
TINY = ("model=charlm", "model.d_model=16", "model.n_layer=1", "model.n_head=2")


def worker(stage: int, world: int) -> dict:
    from fdp.comm import Comm
    from fdp.procs.launch import WorldLayout, init_distributed
    from fdp.run.build import build_data, build_run
    from fdp.run.config.compose import compose

    init_distributed(WorldLayout("elastic", nproc_per_node=world, backend="gloo", timeout_s=600))
    torch.set_num_threads(1)
    comm = Comm()
    build_run(compose(*TINY, *TEXT, f"trainer.zero_stage={stage}"), comm)
    cfg = compose(*MODEL, *TEXT, f"trainer.zero_stage={stage}")
    data = build_data(cfg.data)
    reset_peak()
    base = status_mib("VmRSS")
    t0 = time.perf_counter()
    parts = build_run(cfg, comm, data=data)
    seconds = time.perf_counter() - t0
    share = sum(t.numel() * t.element_size() for t in parts.state.params.values()) / 2**20
    return {"peak": status_mib("VmHWM") - base, "s": seconds, "params": 4 * parts.num_params / 2**20, "share": share}


def measure(stage: int, world: int) -> list[dict]:
    from fdp.procs.launch import WorldLayout, spawn

    layout = WorldLayout("elastic", nproc_per_node=world, backend="gloo", timeout_s=600)
    results = spawn(worker, (stage, world), layout)
    return [results[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        runs = {stage: measure(stage, world) for stage in (0, 3)}
        peak = {stage: max(r["peak"] for r in rs) for stage, rs in runs.items()}
        secs = {stage: max(r["s"] for r in rs) for stage, rs in runs.items()}
        params, share = runs[0][0]["params"], max(r["share"] for r in runs[3])
        rows.append((world, params, share, peak[0], peak[3], peak[3] / peak[0], secs[0], secs[3], secs[3] / secs[0]))
        print(
            f"world {world}: peak growth stage 0 {peak[0]:.0f} MiB, stage 3 {peak[3]:.0f} MiB "
            f"({peak[3] / peak[0]:.2f}x); build {secs[0]:.1f} s vs {secs[3]:.1f} s ({secs[3] / secs[0]:.2f}x)"
        )
    lines = [
        "# Building the first state: ZeRO stage 0 (whole build) vs stage 3 (built on meta, slices made per rank)",
        "",
        f"`python benchmarks/sharded_build.py`, {datetime.date.today()}, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, ranks sharing the machine's cores (gloo, 1 thread each).",
        "",
        "| ranks | params MiB | share MiB | peak growth stage 0 MiB | stage 3 MiB | ratio | build stage 0 s "
        "| stage 3 s | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w, p, s, p0, p3, pr, s0, s3, sr in rows:
        lines.append(f"| {w} | {p:.0f} | {s:.0f} | {p0:.0f} | {p3:.0f} | {pr:.2f}x | {s0:.1f} | {s3:.1f} | {sr:.2f}x |")
    lines += [
        "",
        "Peak growth: the larger rank's resident memory added while `build_run` ran (the params, the optimizer's "
        "momentum, and at stage 0 the module's own copy and the broadcast); build time: the slower rank's.",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sharded_build.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
