"""Benchmark: DiLoCo over hybrid-sharded replicas against flat DiLoCo and DDP, on two simulated nodes at 100 Mbit/s.

The cluster of ``benchmarks/hsdp_netsim.py`` (two netsim namespaces of two gloo ranks, the
link shaped to RATE) and its char transformer (~3.2M params), trained for STEPS steps on a
learnable synthetic stream (each sample counts up from a random token by a random stride
of 1-7, mod the vocabulary; rank r's batch at step t is the same on every side), Adam lr 1e-3:

* ``DDP``: fdp stage 0, no outer loop: every step all-reduces the gradients across the nodes;
* ``DiLoCo flat``: ``outer=diloco`` at stage 0, every rank a replica (4 replicas);
* ``DiLoCo HSDP``: ``outer=diloco trainer.zero_stage=3 world.hierarchical=true world.node_size=2``:
  each node one replica, stage 3 inside it, the sync slice to slice across the nodes;
* ``torchft DiLoCo FSDP2``: torchft 0.2.0's ``torchft.local_sgd.DiLoCo`` over the same replicas:
  FSDP2 ``fully_shard`` (per block and the root) on each node's 2 ranks, torch's Adam inside, a
  ``Manager`` per rank (``use_async_quorum=False``, as its DiLoCo requires; ``init_sync=False``:
  every replica starts from the same seed) whose gloo group all-reduces each rank's slices of the
  pseudo-gradient with the same rank of the other node, the lighthouse on node 0 (``min_replicas=2``).

DiLoCo: a sync every SYNC_EVERY steps, outer Nesterov SGD (lr 0.7, momentum 0.9). Per step, rank 0
keeps the wall time since the first step began and the loss averaged over the four ranks (an
8-byte all-reduce outside the step, on every side). Reported: time to DDP's loss (the mean of its
last 4 steps; a side reaches it when the mean of its last 4 steps falls to it), time to flat DiLoCo's
final loss, the whole run's time, and the bytes that left a node over the run (``tx_bytes`` of its link).

    python benchmarks/hsdp_diloco.py [--rate 100mbit] [--steps 40]   # root

Writes ``benchmarks/results/hsdp_diloco.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
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

from benchmarks.hsdp_netsim import LR, NODE_SIZE, NODES, PREFIX, SPEC, WORLD, _node_counters  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SIDES = ("DDP", "DiLoCo flat", "DiLoCo HSDP", "torchft DiLoCo FSDP2")
TORCHFT = "torchft DiLoCo FSDP2"
SYNC_EVERY = 8
WINDOW = 4  # steps a loss is averaged over before it is compared with a target


def stream_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: samples that count up from a random token by a random stride.

    >>> x, y = stream_batch(0, 1)
    >>> x.shape, bool(((y - x) % SPEC["vocab"] == (x[:, 1:2] - x[:, :1]) % SPEC["vocab"]).all())
    (torch.Size([4, 64]), True)
    """
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(0, SPEC["vocab"], (SPEC["batch"], 1), generator=g)
    stride = torch.randint(1, 8, (SPEC["batch"], 1), generator=g)
    tokens = (start + stride * torch.arange(SPEC["seq"] + 1)) % SPEC["vocab"]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def time_to(losses: list[float], seconds: list[float], target: float, window: int = WINDOW) -> float | None:
    """Seconds until the mean of the last ``window`` losses first falls to ``target`` (None: never).

    >>> time_to([5.0, 4.0, 3.0, 2.0], [1.0, 2.0, 3.0, 4.0], 3.0, window=2)
    4.0
    >>> time_to([5.0, 4.0], [1.0, 2.0], 1.0, window=2) is None
    True
    """
    for i in range(window - 1, len(losses)):
        if statistics.mean(losses[i - window + 1 : i + 1]) <= target:
            return seconds[i]
    return None


def _step(side: str, comm):
    from benchmarks.fsdp import _module
    from benchmarks.hsdp_netsim import BUCKET_CAP_MB, FIRST_BUCKET_CAP_MB
    from fdp import adam, cross_entropy_loss, functionalize, make_train_step, plan_buckets, planner_loss
    from fdp.run.config import DiLoCoConfig
    from fdp.step.outer import init_outer_state, make_outer_step
    from fdp.step.outer_spec import check_outer
    from fdp.update import zero

    model, params, buffers = functionalize(_module(SPEC), keep_module_weights=False)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers),
        params,
        stream_batch(0, comm.rank),
        bucket_cap_mb=BUCKET_CAP_MB,
        first_bucket_cap_mb=FIRST_BUCKET_CAP_MB,
    )
    stage = 3 if side == "DiLoCo HSDP" else 0
    groups = zero.shard_groups(NODE_SIZE) if stage else None
    update = zero.update_for(stage, adam(LR), plan, comm, model=model, groups=groups)
    state = update.first_state(params, buffers, None, comm)
    if side == "DDP":
        return make_train_step(loss_fn, adam(LR), plan, comm=comm, update=update, donate=True, model=model), state
    spec = check_outer(dataclasses.asdict(DiLoCoConfig(sync_every=SYNC_EVERY)))
    replica = update.replica()
    state = state._replace(outer=init_outer_state(spec, replica.pieces(state.params), replica.plan))
    return make_outer_step(loss_fn, adam(LR), plan, spec, comm=comm, donate=True, update=update, model=model), state


def _torchft_step(comm):
    """torchft's DiLoCo with FSDP2 inside each node: a step function like ``_step``'s (the state is unused)."""
    import datetime

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo

    from benchmarks.fsdp import _module
    from benchmarks.netsim import address
    from fdp.run.config import DiLoCoConfig

    node, group_rank = divmod(comm.rank, NODE_SIZE)
    here, store = address(node), dist.distributed_c10d._get_default_store()
    keep = []  # the lighthouse (node 0's first rank) and the node's store (its first rank) live as long as the run
    if comm.rank == 0:
        keep.append(LighthouseServer(bind="[::]:0", min_replicas=NODES))
        store.set("torchft/lighthouse", f"http://{here}:{keep[-1].address().rsplit(':', 1)[1]}")
    if group_rank == 0:
        keep.append(dist.TCPStore(here, 0, is_master=True, wait_for_workers=False))
        store.set(f"torchft/store{node}", str(keep[-1].port))
    lighthouse = store.get("torchft/lighthouse").decode()
    node_store = int(store.get(f"torchft/store{node}").decode())
    long = datetime.timedelta(seconds=1800)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=long),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=NODES,
        use_async_quorum=False,
        timeout=long,
        quorum_timeout=long,
        rank=group_rank,
        world_size=NODE_SIZE,
        store_addr=here,
        store_port=node_store,
        lighthouse_addr=lighthouse,
        replica_id=f"node_{node}",
        hostname=here,
        init_sync=False,
    )
    module = _module(SPEC)
    mesh = init_device_mesh("cpu", (NODES, NODE_SIZE), mesh_dim_names=("replicate", "shard"))["shard"]
    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    inner = torch.optim.Adam(module.parameters(), lr=LR)
    spec = DiLoCoConfig()
    outer = torch.optim.SGD(module.parameters(), lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov)
    diloco = DiLoCo(manager, [module], inner, outer, sync_every=SYNC_EVERY).__enter__()

    def step(state, batch):
        x, y = batch
        inner.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(x).reshape(-1, SPEC["vocab"]), y.reshape(-1))
        loss.backward()
        inner.step()  # DiLoCo's hook: every SYNC_EVERY steps a quorum, the pseudo-gradient all-reduced, the outer step
        return state, {"loss": loss.detach()}

    def close() -> None:
        diloco.__exit__(None, None, None)
        manager.shutdown()

    return step, {"close": close, "keep": keep}


def worker(side: str, steps: int, out: str) -> None:
    """One rank of a side: STEPS steps, timed from the first; rank 0 writes the losses and times to ``out``."""
    from fdp.procs.allocator import tune_allocator
    from fdp.procs.launch import WorldLayout, init_distributed

    tune_allocator(sharded_params=side in ("DiLoCo HSDP", TORCHFT))  # as hsdp_netsim gives its FSDP2 sides
    comm = init_distributed(WorldLayout("torchrun", backend="gloo", timeout_s=1800))
    torch.set_num_threads(1)
    step, state = _torchft_step(comm) if side == TORCHFT else _step(side, comm)
    dist.barrier()
    before = _node_counters(comm)
    losses, seconds = [], []
    t0 = time.perf_counter()
    for t in range(steps):
        state, metrics = step(state, stream_batch(t, comm.rank))
        loss = torch.tensor([float(metrics["loss"])], dtype=torch.float64)
        dist.all_reduce(loss)  # the loss over the four ranks' batches, on every side the same way
        losses.append(float(loss) / WORLD)
        seconds.append(time.perf_counter() - t0)
    dist.barrier()
    after = _node_counters(comm)
    if comm.rank == 0:
        node_bytes = statistics.mean(b - a for a, b in zip(before, after))
        Path(out).write_text(json.dumps({"side": side, "losses": losses, "seconds": seconds, "node_bytes": node_bytes}))
    dist.barrier()
    if side == TORCHFT:
        state["close"]()
    dist.destroy_process_group()


def _run(side: str, steps: int, run_dir: Path, timeout_s: float) -> dict:
    from benchmarks._netsim import run_ranks, tail

    stem = side.replace(" ", "_")
    out, logs = run_dir / f"{stem}.json", [run_dir / f"{stem}.rank{k}.log" for k in range(WORLD)]
    argv = [sys.executable, str(Path(__file__).resolve()), "worker", side, str(steps), str(out)]
    codes = run_ranks(argv, logs, timeout_s, netsim=True, per_node=NODE_SIZE, prefix=PREFIX)
    if any(codes) or not out.exists():
        return {"side": side, "error": f"exit codes {codes}: {tail(logs[0])}"}
    return json.loads(out.read_text())


def _table(rows: dict, meta: dict) -> str:
    ddp, flat = rows.get("DDP"), rows.get("DiLoCo flat")
    target = statistics.mean(ddp["losses"][-WINDOW:]) if ddp and "losses" in ddp else None
    flat_target = statistics.mean(flat["losses"][-WINDOW:]) if flat and "losses" in flat else None
    lines = [
        f"# DiLoCo over hybrid-sharded replicas against flat DiLoCo and DDP at {meta['rate']} ({meta['date']})",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, {meta['cpus']} CPU cores shared with other jobs; "
        f"**load average (1 min) {meta['load_before']:.1f} before, {meta['load_after']:.1f} after**: absolute times "
        "are rough, ratios within the table less so.",
        f"netsim (`benchmarks/netsim`): 2 namespaces of 2 gloo ranks, tbf at {meta['rate']} per node and direction. "
        f"CharTransformer {json.dumps(SPEC)}, Adam lr {LR}, {meta['steps']} steps on a learnable synthetic stream "
        "(`stream_batch`), the same batches on every side. DiLoCo: a sync every "
        f"{SYNC_EVERY} steps, outer Nesterov SGD lr 0.7 momentum 0.9. DDP: fdp stage 0, no outer loop. "
        "DiLoCo flat: stage 0, 4 replicas of one rank. DiLoCo HSDP: `trainer.zero_stage=3 world.hierarchical=true "
        "world.node_size=2`, 2 replicas of one node each. torchft DiLoCo FSDP2: torchft "
        f"{meta.get('torchft', '?')}'s `torchft.local_sgd.DiLoCo` over the same 2 replicas, FSDP2 `fully_shard` "
        "(per block and the root) on each node's 2 ranks, torch's Adam inside, the same outer SGD, its `Manager` "
        "all-reducing each rank's slices of the pseudo-gradient per parameter with the same rank of the other node "
        "(a quorum through the lighthouse on node 0 at every sync; `use_async_quorum=False`, `init_sync=False`).",
        f"`time to DDP's loss`: until the mean of the last {WINDOW} losses (over the four ranks) falls to DDP's final "
        f"one ({target if target is None else f'{target:.4f}'}); `time to flat DiLoCo's loss`: the same to flat "
        f"DiLoCo's ({flat_target if flat_target is None else f'{flat_target:.4f}'}). Times from the first step's "
        "start, build excluded. `MB out/node`: the node link's `tx_bytes` over the whole run, mean of the two nodes.",
        f"Command: `python benchmarks/hsdp_diloco.py{meta.get('args', '')}` (root). Wall {meta['wall_s']:.0f} s.",
        "",
        "| side | run s | s/step | final loss (last 4) | time to DDP's loss s | time to flat DiLoCo's loss s "
        "| MB out/node/run | vs DDP |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def when(r, tgt):
        if tgt is None:
            return "-"
        s = time_to(r["losses"], r["seconds"], tgt)
        return "not reached" if s is None else f"{s:.0f}"

    for side in SIDES:
        r = rows.get(side)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {side} | failed | | | | | | |")
            continue
        vs = f"{r['node_bytes'] / ddp['node_bytes']:.3f}" if ddp and "node_bytes" in ddp else "-"
        lines.append(
            f"| {side} | {r['seconds'][-1]:.0f} | {r['seconds'][-1] / len(r['seconds']):.2f} | "
            f"{statistics.mean(r['losses'][-WINDOW:]):.4f} | {when(r, target)} | {when(r, flat_target)} | "
            f"{r['node_bytes'] / 1e6:.1f} | {vs} |"
        )
    mine, theirs = rows.get("DiLoCo HSDP"), rows.get(TORCHFT)
    if mine and theirs and "losses" in mine and "losses" in theirs:

        def ratio(a, b):
            return "-" if a is None or b is None else f"{a / b:.2f}x"

        reach = [time_to(r["losses"], r["seconds"], target) if target is not None else None for r in (mine, theirs)]
        gap = max(abs(a - b) for a, b in zip(mine["losses"], theirs["losses"]))
        lines += [
            "",
            f"fdp DiLoCo HSDP / torchft DiLoCo FSDP2: run time {ratio(mine['seconds'][-1], theirs['seconds'][-1])}, "
            f"time to DDP's loss {ratio(*reach)}, "
            f"bytes out of a node {ratio(mine['node_bytes'], theirs['node_bytes'])}. Their step-by-step mean "
            f"losses (same model, seed and batches) differ by at most {gap:.1e} over the {len(mine['losses'])} steps.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        side, steps, out = sys.argv[2:5]
        worker(side, int(steps), out)
        return
    from benchmarks._netsim import Cluster, run_meta, work_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--name", default="hsdp_diloco", help="stem of the result files")
    args = parser.parse_args()
    run_dir = work_dir(args.name)
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    rows = {}
    with Cluster(nodes=NODES, prefix=PREFIX) as net:
        print(net.up(rate=args.rate), flush=True)
        for side in args.sides:
            rows[side] = _run(side, args.steps, run_dir, args.timeout)
            print(json.dumps(rows[side]), flush=True)
    meta = run_meta(t0, load_before, rate=args.rate, steps=args.steps)
    meta["torchft"] = importlib.metadata.version("torchft")
    meta["args"] = "".join(f" {a}" for a in sys.argv[1:])
    text = _table(rows, meta)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (RESULTS / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
