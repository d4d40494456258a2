"""Benchmark: how long a save blocks the loop, and each rank's peak memory while it saves.

Sides, each in a fresh launch of its ranks (so its memory is its own), on a ZeRO stage 3 (or ``--stages``)
state of a ``CharTransformer`` with Adam (params and two moments: 12 bytes per parameter):

* ``whole-file``: fdp's single-file checkpoint (the update gathers the whole state to
  rank 0, bucket by bucket onto the CPU; rank 0 writes one ``.pt``; the loop waits for all of it);
* ``sharded sync``: ``ShardedSaver(asynchronous=False)``: each rank writes its own pieces (DCP);
* ``sharded async``: ``ShardedSaver(asynchronous=True)``: the loop waits only for the copy
  of its pieces (the staging); a thread writes them;
* ``FSDP2 + DCP async_save``: torch's ``fully_shard`` per block and the root, ``torch.optim.Adam``,
  ``get_state_dict`` and ``dcp.async_save`` over a gloo group of its own.

Per row: the time the loop is blocked per save (rank 0; the median of ``--saves`` saves,
each waited for before the next), the total time until the checkpoint is complete, bytes
on disk, the state a rank holds (its share), and the peak RSS during the save over the
RSS before it (the largest rank: ``VmHWM`` reset before each save).

    python benchmarks/checkpoint.py [--quick] [--worlds 2 4] [--models 100M 400M] [--saves 3] [--name checkpoint]
        [--sides "sharded async" "FSDP2 + DCP async_save"] [--stages 3 1 0] [--repeats 3]

fdp's sides save a state of ``--stages`` (the FSDP2 side is fully sharded whatever the stage: the same
bytes on the same world); ``--repeats`` launches each row that many times, the sides taking turns, and
reports the medians (the ratios are of those). Writes ``benchmarks/results/<name>.md`` and ``<name>.json``
(``--quick``: a ~7M model, prints only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make ``fdp`` and this module importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._proc import reset_peak, status_mib  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SIDES = ("whole-file", "sharded sync", "sharded async", "FSDP2 + DCP async_save")
MODELS = {
    "7M": {"vocab": 256, "seq": 8, "d_model": 256, "n_layer": 8, "n_head": 4},
    "100M": {"vocab": 256, "seq": 8, "d_model": 1024, "n_layer": 8, "n_head": 16},
    "400M": {"vocab": 256, "seq": 8, "d_model": 1536, "n_layer": 14, "n_head": 16},
}


def _module(spec: dict):
    from fdp.model.builtin import CharTransformer

    torch.manual_seed(0)
    return CharTransformer(spec["vocab"], spec["seq"], spec["d_model"], spec["n_layer"], spec["n_head"])


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _timed_saves(save, wait, comm, saves: int) -> dict:
    """``saves`` saves, each waited for: blocked and total seconds (medians), peak RSS over the RSS before."""
    blocked, total, extra = [], [], []
    for i in range(saves):
        dist.barrier()
        before = status_mib("VmRSS")
        reset_peak()
        t0 = time.perf_counter()
        save(i)
        blocked.append(time.perf_counter() - t0)
        wait()
        dist.barrier()  # complete on every rank
        total.append(time.perf_counter() - t0)
        extra.append(status_mib("VmHWM") - before)
    return {"blocked_s": statistics.median(blocked), "total_s": statistics.median(total), "extra_peak_mib": max(extra)}


def _fdp(spec: dict, side: str, stage: int, comm, directory: Path, saves: int) -> dict:
    from fdp import adam, cross_entropy_loss, functionalize, plan_buckets, planner_loss
    from fdp.hooks import allreduce
    from fdp.run.checkpoint import ShardedSaver, save_checkpoint
    from fdp.state.train_state import state_nbytes
    from fdp.update import zero

    tokens = torch.randint(0, spec["vocab"], (1, spec["seq"] + 1), generator=torch.Generator().manual_seed(1))
    model, params, buffers = functionalize(_module(spec), keep_module_weights=False)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, (tokens[:, :-1], tokens[:, 1:]), bucket_cap_mb=25.0)
    update = zero.update_for(stage, adam(1e-3), plan, comm, model=model)
    state = update.first_state(params, buffers, allreduce(), comm)
    del params
    share = state_nbytes(state) / 2**20
    bucket = max(b.numel * 4 for b in plan.buckets) / 2**20
    if side == "whole-file":

        def save(i):
            save_checkpoint(directory, update.to_checkpoint(state._replace(step=i), comm), plan, comm, keep=1)

        timing = _timed_saves(save, lambda: None, comm, saves)
    else:
        saver = ShardedSaver(comm, asynchronous=side == "sharded async")
        timing = _timed_saves(
            lambda i: saver.save(directory, state._replace(step=i), update, plan, keep=1), saver.wait, comm, saves
        )
    return {**timing, "share_mib": share, "bucket_mib": bucket, "params": sum(b.numel for b in plan.buckets)}


def _fsdp2(spec: dict, comm, directory: Path, saves: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    module = _module(spec)
    n_params = sum(p.numel() for p in module.parameters())
    for block in module.blocks:
        fully_shard(block)
    fully_shard(module)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # Adam's moments exist from here
    optimizer.zero_grad(set_to_none=True)
    share = 0
    for p in module.parameters():
        share += p.to_local().numel() * 4 * 3
    group = dist.new_group(backend="gloo")
    pending = [None]

    def save(i):
        model_sd, optim_sd = get_state_dict(module, optimizer)
        pending[0] = dcp.async_save(
            {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory / f"step_{i}"), process_group=group
        )

    def wait():
        result = pending[0]
        (result.result() if hasattr(result, "result") else result.upload_completion.result())

    timing = _timed_saves(save, wait, comm, saves)
    return {**timing, "share_mib": share / 2**20, "bucket_mib": 0.0, "params": n_params}


def worker(spec: dict, side: str, stage: int, world: int, saves: int, directory: str) -> dict:
    from fdp.procs.launch import WorldLayout, init_distributed

    comm = init_distributed(WorldLayout("elastic", nproc_per_node=world, backend="gloo", timeout_s=1800))
    torch.set_num_threads(1)
    directory = Path(directory)
    if side.startswith("FSDP2"):
        out = _fsdp2(spec, comm, directory, saves)
    else:
        out = _fdp(spec, side, stage, comm, directory, saves)
    dist.barrier()
    dist.destroy_process_group()
    return out


def _run(spec: dict, side: str, stage: int, world: int, saves: int) -> dict:
    from fdp.procs.launch import WorldLayout, spawn

    directory = Path(tempfile.mkdtemp(prefix="fdp-ckpt-bench-", dir=os.environ.get("FDP_BENCH_DIR")))
    try:
        layout = WorldLayout("elastic", nproc_per_node=world, backend="gloo", timeout_s=1800)
        results = spawn(worker, (spec, side, stage, world, saves, str(directory)), layout)
        ranks = [results[r] for r in range(world)]
        on_disk = _du(directory) / 2**20 / (1 if side != "FSDP2 + DCP async_save" else saves)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "side": side,
        "stage": stage,
        "world": world,
        "params": ranks[0]["params"],
        "blocked_s": ranks[0]["blocked_s"],
        "total_s": ranks[0]["total_s"],
        "disk_mib": on_disk,
        "share_mib": max(r["share_mib"] for r in ranks),
        "bucket_mib": ranks[0]["bucket_mib"],
        "extra_peak_mib": max(r["extra_peak_mib"] for r in ranks),
        "extra_peak_rank0_mib": ranks[0]["extra_peak_mib"],
    }


def _median_row(runs: list[dict]) -> dict:
    """One row of ``--repeats`` launches: the median of each figure, and every launch's blocked and total."""
    row = dict(runs[0])
    for key in ("blocked_s", "total_s", "disk_mib", "extra_peak_mib", "extra_peak_rank0_mib"):
        row[key] = statistics.median(r[key] for r in runs)
    row["blocked_runs"], row["total_runs"] = [r["blocked_s"] for r in runs], [r["total_s"] for r in runs]
    return row


def _label(row: dict) -> str:
    return row["side"] if row["side"].startswith("FSDP2") else f"{row['side']}, stage {row['stage']}"


def _table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# Checkpoint saves: the loop's blocked time and memory ({meta['date']})",
        "",
        meta["machine"],
        f"ZeRO states of CharTransformers with Adam (12 bytes per parameter; the FSDP2 side fully sharded). "
        f"{meta['saves']} saves per launch, medians of rank 0; each row a fresh launch, the median of "
        f"{meta.get('repeats', 1)} launch(es). Wall {meta['wall_s']:.0f} s. Sizes: {meta['sizes']}.",
        "`blocked`: the loop waits this long per save. `total`: until the checkpoint is complete and durable on "
        "every rank. `extra peak`: the largest rank's peak RSS during the save over its RSS before it (rank 0's in "
        "brackets). `share`: the largest state a rank holds; `bucket`: the largest bucket (fp32). Ratios against the "
        "whole-file save and against FSDP2 + DCP async_save of the same model and world (goal: blocked <= 0.25, "
        "total <= 1.0).",
        "",
        "| model | ranks | side | blocked s | total s | on disk MiB | share MiB/rank | bucket MiB | extra peak MiB "
        "| blocked vs whole-file | blocked vs FSDP2 | total vs FSDP2 |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        same = [o for o in rows if o["world"] == r["world"] and o["model"] == r["model"]]
        whole = next((o for o in same if o["side"] == "whole-file" and o["stage"] == r["stage"]), None)
        fsdp = next((o for o in same if o["side"].startswith("FSDP2")), None)
        lines.append(
            f"| {r['model']} ({r['params'] / 1e6:.0f}M) | {r['world']} | {_label(r)} | {r['blocked_s']:.3f} "
            f"| {r['total_s']:.2f} | {r['disk_mib']:.0f} | {r['share_mib']:.0f} | {r['bucket_mib']:.0f} "
            f"| {r['extra_peak_mib']:.0f} ({r['extra_peak_rank0_mib']:.0f}) "
            f"| {r['blocked_s'] / whole['blocked_s'] if whole else float('nan'):.3f} "
            f"| {r['blocked_s'] / fsdp['blocked_s'] if fsdp else float('nan'):.3f} "
            f"| {r['total_s'] / fsdp['total_s'] if fsdp else float('nan'):.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~7M model on 2 ranks, 2 saves; prints only")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=["100M", "400M"], choices=list(MODELS))
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    parser.add_argument("--stages", type=int, nargs="+", default=[3], choices=[0, 1, 2, 3], help="fdp's sides")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="launches per row (medians)")
    parser.add_argument("--name", default="checkpoint", help="results/<name>.md and .json")
    args = parser.parse_args()
    models, worlds, saves = (["7M"], [2], 2) if args.quick else (args.models, args.worlds, args.saves)
    start, load = time.perf_counter(), os.getloadavg()[0]
    rows = []
    for model in models:
        for world in worlds:
            cases = [(side, st) for side in args.sides for st in ([3] if side.startswith("FSDP2") else args.stages)]
            runs = {case: [] for case in cases}
            for _ in range(args.repeats):  # the sides take turns: a shared machine's load drifts alike for each
                for side, stage in cases:
                    run = _run(MODELS[model], side, stage, world, saves)
                    runs[side, stage].append(run)
                    print(
                        f"  {side} {stage}: blocked {run['blocked_s']:.3f} s, total {run['total_s']:.2f} s", flush=True
                    )
            for case in cases:
                row = {"model": model, **_median_row(runs[case])}
                rows.append(row)
                print(
                    f"{model} {world} ranks {_label(row)}: blocked {row['blocked_s']:.3f} s "
                    f"{[round(b, 3) for b in row['blocked_runs']]}, total {row['total_s']:.2f} s "
                    f"{[round(t, 2) for t in row['total_runs']]}, {row['disk_mib']:.0f} MiB on disk, "
                    f"extra peak {row['extra_peak_mib']:.0f} MiB (share {row['share_mib']:.0f} MiB)",
                    flush=True,
                )
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores shared with other jobs; gloo on loopback, 1 torch thread per rank, a local disk. "
        f"Load average (1 min) before {load:.1f}, after {os.getloadavg()[0]:.1f}.",
        "saves": saves,
        "repeats": args.repeats,
        "wall_s": time.perf_counter() - start,
        "sizes": ", ".join(f"{m}: {MODELS[m]}" for m in models),
    }
    table = _table(rows, meta)
    print(table)
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.name}.md").write_text(table)
        (RESULTS / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
