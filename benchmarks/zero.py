"""Benchmark: ZeRO stages 0, 1 and 2 on 2 and 4 ranks: memory per rank and step time.

Two models of ~25M parameters: an MLP (24 x Linear(1024, 1024) + ReLU, a 10-way head;
batch 32 per rank) and a ``CharTransformer`` (d_model 512, 8 layers, 8 heads, vocab 256;
batch 4 x 64 tokens per rank). Random inputs, a fixed batch per rank. Adam (lr 1e-3),
``donate=True`` and the schedule fdp's trainer picks (``overlap``), bucket caps 25 MiB
(first 1 MiB), gloo on loopback, one torch thread per rank.

Every (model, world, stage) runs in a fresh launch of its ranks (``fdp.procs.launch.spawn``), so
its memory is its own: build, warm up, time some steps. Reported per row:

* ``state_mib``: what the step's metrics say this rank holds between steps (params,
  optimizer state, gradient buffers), and its ratio to stage 0 (ZeRO's ideal with Adam in
  fp32, 16 bytes per parameter at stage 0: ``(8 + 8/N) / 16`` at stage 1, ``(4 + 12/N) / 16``
  at stage 2 when gradients are counted as slices; fdp's stage 2 frees the bucket buffers
  between steps, so they count 0 and the stage-2 ideal is ``(4 + 8/N) / 16``);
* peak RSS per rank (``VmHWM``, the larger rank): over the whole launch, and over the
  timed steps only (reset through ``/proc/self/clear_refs`` after warm-up);
* median step time (rank 0) and its ratio to stage 0; fdp's ``comm_wait_s``; bytes this
  rank handed to collectives per step (``bytes_sent``).

gloo has no reduce-scatter of its own: torch runs ``reduce_scatter_single`` on gloo as an
all-reduce of a copy of the whole bucket (measured on the MLP at 2 ranks: +190 MiB peak RSS
per rank over stage 0, the copies of the buckets in flight). ``Comm.reduce_scatter``
all-reduces the bucket in place on gloo instead and keeps this rank's slice: the same
traffic as stage 0, without the copies. gloo's all-gather likewise stages its whole output
in a temporary (+100 MiB for 100 MiB gathered), so on gloo ``Comm.all_gather_into``
broadcasts each rank's slice in place instead. Stages 1 and 2 all-gather the updated
params on top of the reduction (``sent`` counts the all-reduced buckets plus this rank's
gathered slices).

With ``--hooks`` each (model, world, stage) runs once per reduction hook (settings in
``HOOK_SPECS``: compression from the first step, so that the timed steps compress), each
row compared with stage 0 under the same hook; the rows go to ``zero_hooks.md``. At
stage 2 a hook that reduces straight into slices (``Hook.shardable``: top-k, the
low-bit codes) makes only the rank's slice; PowerSGD makes the whole approximation and
keeps its slice, and its error feedback stays whole (``fdp.hooks.for_slices``).

    python benchmarks/zero.py [--quick] [--worlds 2 4] [--models mlp transformer] [--stages 1 2]
                              [--hooks allreduce powersgd topk lowbit]

Writes ``benchmarks/results/zero.md`` and ``zero.json`` (``zero_hooks.*`` with ``--hooks`` other than
allreduce alone; ``--quick`` prints only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make ``fdp`` and this module importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._proc import reset_peak, status_mib  # noqa: E402
from benchmarks.vs_ddp import batch_for, module_for  # noqa: E402  (the same models and batches)

RESULTS = REPO / "benchmarks" / "results"
LR = 1e-3
BUCKET_CAP_MB, FIRST_BUCKET_CAP_MB = 25.0, 1.0
MODELS = {
    "mlp": {"kind": "mlp", "width": 1024, "depth": 24, "classes": 10, "batch": 32},
    "transformer": {"kind": "charlm", "vocab": 256, "seq": 64, "d_model": 512, "n_layer": 8, "n_head": 8, "batch": 4},
}
STAGES = (0, 1, 2)
HOOK_SPECS = {
    "allreduce": {"name": "allreduce"},
    "powersgd": {"name": "powersgd", "rank": 4, "start_iter": 0},
    "topk": {"name": "topk", "ratio": 0.01},
    "lowbit": {"name": "lowbit", "format": "fp4", "block": 64},
    "int8": {"name": "int8"},
}


def worker(model_name: str, stage: int, world: int, warmup: int, steps: int, hook_name: str = "allreduce") -> dict:
    """One rank of a launch that builds one (model, stage) and times it."""
    from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
    from fdp.comm import Comm
    from fdp.hooks import build_hook
    from fdp.model.functional import functionalize
    from fdp.optim import adam
    from fdp.plan import plan_buckets
    from fdp.procs.allocator import tune_allocator
    from fdp.procs.launch import WorldLayout, init_distributed
    from fdp.step.reduce import resolve_schedule
    from fdp.update import zero

    tune_allocator()
    comm = init_distributed(WorldLayout("elastic", nproc_per_node=world, backend="gloo"))
    torch.set_num_threads(1)
    spec = MODELS[model_name]
    batch = batch_for(spec, comm.rank)
    base = status_mib("VmRSS")
    model, params, buffers = functionalize(module_for(spec), keep_module_weights=False)
    n_params = sum(p.numel() for p in params.values())
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers),
        params,
        batch,
        bucket_cap_mb=BUCKET_CAP_MB,
        first_bucket_cap_mb=FIRST_BUCKET_CAP_MB,
    )
    optimizer = adam(LR)
    schedule = resolve_schedule("auto", world)
    hook = build_hook(HOOK_SPECS[hook_name])
    step = make_train_step(
        loss_fn, optimizer, plan, hook, comm=Comm(), schedule=schedule, donate=True, zero_stage=stage
    )
    if stage:
        state = zero.init_state(params, buffers, optimizer, plan, comm, hook, stage=stage)
    else:
        state = init_train_state(params, buffers, optimizer, plan, hook)
    del params, buffers
    dist.barrier()
    for _ in range(warmup):
        state, m = step(state, batch)
    warm_peak = status_mib("VmHWM")  # build and warm-up
    reset_peak()
    times, waits, sent = [], [], []
    for _ in range(steps):
        state, m = step(state, batch)
        times.append(m["step_s"])
        waits.append(m["comm_wait_s"])
        sent.append(m["bytes_sent"])
    out = {
        "params": n_params,
        "buckets": len(plan),
        "schedule": schedule,
        "state_mib": m["state_mib"],
        "hook_mib": _nbytes(state.hook_state) / 2**20,
        "ms": [1e3 * t for t in times],
        "wait_ms": [1e3 * w for w in waits],
        "bytes_sent": statistics.median(sent),
        "timed_peak_mib": status_mib("VmHWM"),
        "base_mib": base,
        "warm_peak_mib": warm_peak,
        "loss": float(m["loss"]),
    }
    dist.destroy_process_group()
    return out


def _nbytes(tree) -> int:
    """Bytes of the tensors in ``tree`` (tuples, NamedTuples and their tensors: a hook state)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    return sum(_nbytes(t) for t in tree) if isinstance(tree, tuple) else 0


def _run(model_name: str, stage: int, world: int, warmup: int, steps: int, hook: str) -> list[dict]:
    from fdp.procs.launch import WorldLayout, spawn

    layout = WorldLayout("elastic", nproc_per_node=world, backend="gloo", timeout_s=600)
    results = spawn(worker, (model_name, stage, world, warmup, steps, hook), layout)
    return [results[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 2 timed steps, print only")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stages", type=int, nargs="+", default=list(STAGES), choices=list(STAGES))
    parser.add_argument("--hooks", nargs="+", default=["allreduce"], choices=list(HOOK_SPECS))
    args = parser.parse_args()
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    rows = []
    stages = sorted({0, *args.stages})  # every row is compared with stage 0
    for world in args.worlds:
        for model_name in args.models:
            for hook in args.hooks:
                for stage in stages:
                    ranks = _run(model_name, stage, world, warmup, steps, hook)
                    row = {"model": model_name, "world": world, "stage": stage, "hook": hook, "ranks": ranks}
                    rows.append(row)
                    print(_line(row, rows), flush=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "wall_s": time.perf_counter() - t0,
        "warmup": warmup,
        "steps": steps,
    }
    table = _table(rows, meta)
    print(table)
    if not args.quick:
        name = "zero" if args.hooks == ["allreduce"] else "zero_hooks"
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (RESULTS / f"{name}.md").write_text(table)


def _summary(row: dict, rows: list[dict]) -> dict:
    ranks = row["ranks"]
    base = next(
        r
        for r in rows
        if (r["model"], r["world"], r.get("hook"), r["stage"]) == (row["model"], row["world"], row.get("hook"), 0)
    )
    ms = statistics.median(ranks[0]["ms"])
    ms0 = statistics.median(base["ranks"][0]["ms"])
    state = max(r["state_mib"] for r in ranks)
    state0 = max(r["state_mib"] for r in base["ranks"])
    return {
        "params_m": ranks[0]["params"] / 1e6,
        "buckets": ranks[0]["buckets"],
        "state_mib": state,
        "state_ratio": state / state0,
        "hook_mib": max(r.get("hook_mib", 0.0) for r in ranks),
        "timed_peak": max(r["timed_peak_mib"] for r in ranks),
        "warm_peak": max(r["warm_peak_mib"] for r in ranks),
        "base": max(r["base_mib"] for r in ranks),
        "ms": ms,
        "ms_ratio": ms / ms0,
        "wait_ms": statistics.median(ranks[0]["wait_ms"]),
        "mb_sent": ranks[0]["bytes_sent"] / 2**20,
        "iqr": _iqr(ranks[0]["ms"]),
    }


def _iqr(values: list[float]) -> str:
    if len(values) < 4:
        return f"{min(values):.0f}-{max(values):.0f}"
    q = statistics.quantiles(values, n=4)
    return f"{q[0]:.0f}-{q[2]:.0f}"


def _line(row: dict, rows: list[dict]) -> str:
    s = _summary(row, rows)
    return (
        f"{row['model']} world {row['world']} hooks={row.get('hook', 'allreduce')} stage {row['stage']}: "
        f"state {s['state_mib']:.0f} MiB "
        f"({s['state_ratio']:.3f}x), peak RSS {s['timed_peak']:.0f} MiB, step {s['ms']:.0f} ms ({s['ms_ratio']:.2f}x), "
        f"wait {s['wait_ms']:.0f} ms, sent {s['mb_sent']:.0f} MiB"
    )


def _table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# ZeRO stages on the bucket plan ({meta['date']})",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, {meta['machine']}, {meta['cpus']} CPU cores shared with "
        "other jobs; gloo on loopback, 1 torch thread per rank (4 ranks share 2 cores). Load average (1 min) before "
        f"{meta['load_before']:.1f}, after {meta['load_after']:.1f}: the machine was busy with other work, so step "
        "times carry that noise.",
        f"Adam lr {LR}, donate=True, schedule overlap, buckets {BUCKET_CAP_MB:g} MiB (first {FIRST_BUCKET_CAP_MB:g} "
        f"MiB). Each row a fresh launch: {meta['warmup']} warm-up + {meta['steps']} timed steps; medians of rank 0. "
        f"Wall {meta['wall_s']:.0f} s.",
        "`state MiB`: params + optimizer state + gradient buffers a rank holds between steps (the step's `state_mib`, "
        "largest rank). `peak RSS`: largest rank's VmHWM over the timed steps; `incl. build`: over building and "
        "warm-up; `base`: RSS before building the model. "
        "`hook MiB`: the hook's state a rank keeps (error feedback, PowerSGD's Q), whole at every stage. "
        "`sent`: bytes this rank handed to collectives per step (at stage 2 with the all-gather of the updated "
        "params).",
        "",
        "| model | ranks | hooks | stage | state MiB/rank | vs stage 0 | hook MiB | peak RSS/rank MiB | "
        "incl. build MiB | base MiB | step ms | IQR ms | vs stage 0 | comm wait ms | sent MiB/step |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        s = _summary(row, rows)
        lines.append(
            f"| {row['model']} ({s['params_m']:.1f}M, {s['buckets']} buckets) | {row['world']} | "
            f"{row.get('hook', 'allreduce')} | {row['stage']} | "
            f"{s['state_mib']:.0f} | "
            f"{s['state_ratio']:.3f} | {s['hook_mib']:.0f} | "
            f"{s['timed_peak']:.0f} | {s['warm_peak']:.0f} | {s['base']:.0f} | {s['ms']:.0f} "
            f"| {s['iqr']} | {s['ms_ratio']:.2f} | "
            f"{s['wait_ms']:.0f} | {s['mb_sent']:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
