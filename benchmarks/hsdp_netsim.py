"""Benchmark: fdp's hybrid sharding (HSDP) against flat ZeRO-3 and FSDP2's HSDP, on two simulated nodes of two ranks.

Two network namespaces (``benchmarks/netsim``: veth links, tbf at RATE per node and
direction, no added delay), two gloo ranks in each (ranks 0-1 in node 0, 2-3 in node 1):
the two ranks of a node talk inside their namespace, unshaped; everything between the
nodes crosses the shaped link. For each rate (1 Gbit/s and 100 Mbit/s), each side in a
fresh launch of its four ranks:

* ``fdp ZeRO-3 flat``: stage 3 over all four ranks (``trainer.zero_stage=3``);
* ``fdp HSDP``: stage 3 inside each node, replicated across (``trainer.zero_stage=3
  world.hierarchical=true world.node_size=2``: ``fdp.update.zero.hybrid``);
* ``FSDP2 flat``: ``fully_shard`` per block and the root on a 1-D mesh of the four ranks;
* ``FSDP2 HSDP``: the same on a 2-D ``DeviceMesh`` (2 replicas x 2 shards: replicate across
  the nodes, shard inside).

All sides: the char transformer of ``benchmarks/fsdp.py`` (its ``_module``/``_batch``; here
d_model 256, 4 blocks, vocab 256, 4 x 64 tokens per rank, ~3.4M params), built from the same
seed on every rank, Adam lr 1e-3, one torch thread per rank (four ranks share the host's
cores). fdp: ``donate=True``, 4 MiB buckets (first 1 MiB; about one block each, FSDP2's unit),
params resharded after forward as FSDP2's defaults do for the blocks.

Per side: median step time of rank 0 over the timed steps; bytes leaving a node per step (the
``tx_bytes`` of the node's link interface, read by the node's first rank around the timed steps:
what the wire carried, headers and both ranks included; mean over the two nodes); peak RSS per
rank (``VmHWM`` over the timed steps, the largest rank); the loss of the last step (rank 0's
batch) to show both sides train the same model.

    python benchmarks/hsdp_netsim.py [--rates 1gbit 100mbit] [--steps 4] [--warmup 2]   # root

Writes ``benchmarks/results/hsdp_netsim.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make ``fdp`` and ``benchmarks`` importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._proc import reset_peak, status_mib  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PREFIX = "fdphsdp"  # its own namespaces: other netsim runs on this host keep theirs
NODES, NODE_SIZE = 2, 2
WORLD = NODES * NODE_SIZE
SIDES = ("fdp ZeRO-3 flat", "fdp HSDP", "FSDP2 flat", "FSDP2 HSDP")
LR = 1e-3
BUCKET_CAP_MB, FIRST_BUCKET_CAP_MB = 4.0, 1.0
SPEC = {"vocab": 256, "seq": 64, "d_model": 256, "n_layer": 4, "n_head": 4, "batch": 4}
TX = Path("/sys/class/net/nsim0/statistics/tx_bytes")  # this namespace's link (ip netns exec mounts its /sys)


def node_bytes_per_step(before: list[int], after: list[int], steps: int) -> float:
    """Mean over the nodes of the bytes each sent over its link per step, from each node's ``tx_bytes``.

    >>> node_bytes_per_step([100, 1000], [500, 2000], 2)
    350.0
    """
    if len(before) != len(after) or not before or steps < 1:
        raise ValueError(f"expected one counter per node before and after, and steps >= 1; got {before}, {after}")
    return statistics.mean(b - a for a, b in zip(before, after)) / steps


def _fdp_step(side: str, comm):
    from benchmarks.fsdp import _batch, _module
    from fdp import adam, cross_entropy_loss, functionalize, make_train_step, plan_buckets, planner_loss
    from fdp.update import zero

    batch = _batch(SPEC, comm.rank)
    model, params, buffers = functionalize(_module(SPEC), keep_module_weights=False)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers),
        params,
        batch,
        bucket_cap_mb=BUCKET_CAP_MB,
        first_bucket_cap_mb=FIRST_BUCKET_CAP_MB,
    )
    groups = zero.shard_groups(NODE_SIZE) if side == "fdp HSDP" else None
    update = zero.update_for(3, adam(LR), plan, comm, model=model, groups=groups)
    step = make_train_step(loss_fn, adam(LR), plan, comm=comm, update=update, donate=True, model=model)
    state = update.first_state(params, buffers, None, comm)
    del params, buffers

    def run(state):
        state, metrics = step(state, batch)
        return state, float(metrics["loss"])

    return run, state


def _fsdp2_step(side: str, comm):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from benchmarks.fsdp import _batch, _module

    x, y = _batch(SPEC, comm.rank)
    module = _module(SPEC)
    mesh = (
        init_device_mesh("cpu", (NODES, NODE_SIZE), mesh_dim_names=("replicate", "shard"))
        if side == "FSDP2 HSDP"
        else init_device_mesh("cpu", (WORLD,))
    )
    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)

    def run(state):
        logits = module(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, SPEC["vocab"]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return state, float(loss.detach())

    return run, None


def _node_counters(comm) -> list[int]:
    """Every node's ``tx_bytes`` now (read by its first rank), on every rank."""
    mine = torch.tensor([int(TX.read_text()) if comm.rank % NODE_SIZE == 0 else 0])
    every = [torch.zeros_like(mine) for _ in range(WORLD)]
    dist.all_gather(every, mine)
    return [int(t) for t in every[::NODE_SIZE]]


def worker(side: str, warmup: int, steps: int, out: str) -> None:
    """One rank of a side: build, warm up, time ``steps`` steps; rank 0 writes every rank's figures to ``out``."""
    from fdp.procs.allocator import release_free_memory, tune_allocator
    from fdp.procs.launch import WorldLayout, init_distributed

    tune_allocator(sharded_params=True)
    comm = init_distributed(WorldLayout("torchrun", backend="gloo", timeout_s=1800))
    torch.set_num_threads(1)
    base = status_mib("VmRSS")  # the interpreter, torch and the process groups, before the model
    run, state = (_fdp_step if side.startswith("fdp") else _fsdp2_step)(side, comm)
    release_free_memory()
    for _ in range(warmup):
        state, loss = run(state)
    dist.barrier()
    reset_peak()
    before = _node_counters(comm)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, loss = run(state)
        times.append(time.perf_counter() - t0)
    dist.barrier()  # every rank's traffic of the timed steps has left
    after = _node_counters(comm)
    mine = torch.tensor([status_mib("VmHWM"), status_mib("VmHWM") - base], dtype=torch.float64)
    peaks = [torch.zeros_like(mine) for _ in range(WORLD)]
    dist.all_gather(peaks, mine)
    if comm.rank == 0:
        row = {
            "side": side,
            "ms": [1e3 * t for t in times],
            "node_bytes_per_step": node_bytes_per_step(before, after, steps),
            "peak_mib": [float(p[0]) for p in peaks],
            "peak_over_base_mib": [float(p[1]) for p in peaks],
            "loss": loss,
        }
        Path(out).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def _run(side: str, warmup: int, steps: int, run_dir: Path, timeout_s: float) -> dict:
    from benchmarks._netsim import run_ranks, tail

    out = run_dir / f"{side.replace(' ', '_')}.json"
    logs = [run_dir / f"{side.replace(' ', '_')}.rank{k}.log" for k in range(WORLD)]
    argv = [sys.executable, str(Path(__file__).resolve()), "worker", side, str(warmup), str(steps), str(out)]
    t0 = time.perf_counter()
    codes = run_ranks(argv, logs, timeout_s, netsim=True, per_node=NODE_SIZE, prefix=PREFIX)
    if any(codes) or not out.exists():
        return {"side": side, "error": f"exit codes {codes}: {tail(logs[0])}"}
    return {**json.loads(out.read_text()), "wall_s": time.perf_counter() - t0}


def _table(rows: list[dict], meta: dict) -> str:
    n_params = meta["params"]
    lines = [
        f"# HSDP on two simulated nodes of two ranks: fdp against flat ZeRO-3 and FSDP2 ({meta['date']})",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, {meta['cpus']} CPU cores shared with other jobs; "
        f"**load average (1 min) {meta['load_before']:.1f} before, {meta['load_after']:.1f} after**: absolute times "
        "are rough, compare within a rate; bytes are exact to the headers.",
        "netsim veth back-end (`benchmarks/netsim`): 2 namespaces, tbf at RATE per node and direction, no added "
        "delay; 2 gloo ranks per namespace (their traffic stays inside it), 1 torch thread per rank.",
        f"CharTransformer {json.dumps(SPEC)} ({n_params / 1e6:.2f}M params, fp32), Adam lr {LR}, same seed and "
        f"batches on both sides. fdp: stage 3, donate, buckets {BUCKET_CAP_MB:g} MiB (first "
        f"{FIRST_BUCKET_CAP_MB:g}); HSDP = `trainer.zero_stage=3 world.hierarchical=true world.node_size=2`. "
        "FSDP2: `fully_shard` per block and the root; HSDP on a 2-D `DeviceMesh` (replicate 2 x shard 2).",
        f"Each row a fresh launch: {meta['warmup']} warm-up + {meta['steps']} timed steps. `step`: median of rank 0 "
        "(min-max). `MB out/node/step`: the node link's `tx_bytes` over the timed steps per step (both ranks, TCP/IP "
        "headers included), mean of the two nodes. `peak RSS`: the largest rank's VmHWM over the timed steps; "
        "`over base`: less its RSS before building the model. "
        "`loss`: rank 0's last step.",
        f"Command: `python benchmarks/hsdp_netsim.py` (root). Wall {meta['wall_s']:.0f} s.",
        "",
        "| rate | side | step ms | vs fdp flat | vs FSDP2 HSDP | MB out/node/step | vs fdp flat | peak RSS MiB/rank "
        "| over base MiB | loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rate in meta["rates"]:
        here = {r["side"]: r for r in rows if r["rate"] == rate}
        ref_flat, ref_fsdp = here.get("fdp ZeRO-3 flat"), here.get("FSDP2 HSDP")
        for side in SIDES:
            r = here.get(side)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {rate} | {side} | failed | | | | | | | |")
                continue
            ms = statistics.median(r["ms"])

            def ratio(ref, key):
                if not ref or "error" in ref:
                    return "-"
                a, b = (ms, statistics.median(ref["ms"])) if key == "ms" else (r[key], ref[key])
                return f"{a / b:.2f}"

            lines.append(
                f"| {rate} | {side} | {ms:.0f} ({min(r['ms']):.0f}-{max(r['ms']):.0f}) | {ratio(ref_flat, 'ms')} | "
                f"{ratio(ref_fsdp, 'ms')} | {r['node_bytes_per_step'] / 1e6:.1f} | "
                f"{ratio(ref_flat, 'node_bytes_per_step')} | {max(r['peak_mib']):.0f} | "
                f"{max(r['peak_over_base_mib']):.0f} | {r['loss']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        side, warmup, steps, out = sys.argv[2:6]
        worker(side, int(warmup), int(steps), out)
        return
    from benchmarks._netsim import Cluster, run_meta, work_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"])
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--name", default="hsdp_netsim", help="stem of the result files")
    args = parser.parse_args()
    from benchmarks.fsdp import _module

    run_dir = work_dir(args.name)
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    rows = []
    with Cluster(nodes=NODES, prefix=PREFIX) as net:
        for rate in args.rates:
            print(net.up(rate=rate), flush=True)
            for side in args.sides:
                row = {**_run(side, args.warmup, args.steps, run_dir, args.timeout), "rate": rate}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "peak_mib"}), flush=True)
    meta = run_meta(
        t0,
        load_before,
        warmup=args.warmup,
        steps=args.steps,
        rates=args.rates,
        params=sum(p.numel() for p in _module(SPEC).parameters()),
    )
    text = _table(rows, meta)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (RESULTS / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
