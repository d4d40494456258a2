"""Benchmark on CUDA GPUs: fdp against eager PyTorch and against DDP, same model, data and optimizer, in one run.

Two models, fp32 (TF32 off, torch's default for matmuls):

* ``charlm25m``: a ``CharTransformer`` of ~25M parameters (vocab 256, d_model 512, 8 layers,
  8 heads), batch 32 x 256 tokens per rank;
* ``small``: a ``CharTransformer`` of ~0.1M (vocab 64, d_model 64, 2 layers, 4 heads),
  batch 8 x 64 per rank, where per-step Python work and host syncs show most.

Variants, each stepping with AdamW (lr 3e-4) through torch's fused kernel, bucket caps
25 MiB (first 1 MiB), a mean allreduce:

* ``eager``: the ``nn.Module``, ``loss.backward()``, ``torch.optim.AdamW(fused=True)``; no
  process group (world of 1 only);
* ``ddp``: ``DistributedDataParallel`` over NCCL, the same optimizer;
* ``fdp``: ``fdp.make_train_step`` as fdp's trainer runs it (``donate=True``; the
  schedule the trainer picks: ``after`` on one rank, ``overlap`` on more), over NCCL.

A world of 1 (one process on GPU 0, NCCL) always; a world of every visible GPU (one
process each) when there are two or more. Variants run in alternating blocks (the order
rotates each repetition): built once, warmed up, then timed. A step's time is the
interval between CUDA events recorded on the compute stream after consecutive steps, so
it is what the GPU takes per step when the host keeps it fed: a host sync that stalls the
queue shows up as idle time in the interval. Reported: median and interquartile range
over >= 30 timed steps (rank 0), mean wall time per step over each timed block, ratios
fdp/DDP and fdp/eager, and the first step's loss of each variant (the same within float
tolerance: the same init and batch).

Then GPT-2 124M in bf16 against eager torch and ``torch.compile``, step time and peak
memory, SDPA and eager attention (``benchmarks/gpu_gpt2.py``).

    python benchmarks/gpu.py [--quick] [--reps 4] [--steps 10] [--warmup 5] [--only char|gpt2]

Without CUDA it stops at once with one line. The full run writes
``benchmarks/results/gpu.md``; the last line printed is ``fdp/ddp step time: X`` (the
25M model, world of 1).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make ``fdp`` and this module importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
LR = 3e-4
BUCKET_CAP_MB, FIRST_BUCKET_CAP_MB = 25.0, 1.0
MODELS = {
    "charlm25m": {"vocab": 256, "seq": 256, "d_model": 512, "n_layer": 8, "n_head": 8, "batch": 32},
    "small": {"vocab": 64, "seq": 64, "d_model": 64, "n_layer": 2, "n_head": 4, "batch": 8},
}
GOALS = {"charlm25m": 1.00, "small": 1.10}  # fdp/DDP step time, world of 1


def _module(spec: dict, device: torch.device):
    from fdp.model.builtin import CharTransformer

    torch.manual_seed(0)
    return CharTransformer(spec["vocab"], spec["seq"], spec["d_model"], spec["n_layer"], spec["n_head"]).to(device)


def _batch(spec: dict, rank: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def _torch_step(module, batch):
    opt = torch.optim.AdamW(module.parameters(), lr=LR, fused=True)
    x, y = batch

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        logits = module(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _build(variant: str, spec: dict, batch, device: torch.device, world: int):
    if variant == "eager":
        return _torch_step(_module(spec, device), batch)
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            _module(spec, device),
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=BUCKET_CAP_MB,
        )
        return _torch_step(ddp, batch)
    return _build_fdp(spec, batch, device, world)


def _build_fdp(spec: dict, batch, device: torch.device, world: int):
    from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
    from fdp.comm import Comm
    from fdp.hooks import allreduce
    from fdp.model.functional import functionalize
    from fdp.optim import adamw
    from fdp.plan import plan_buckets
    from fdp.procs.devices import to_device

    model, params, buffers = functionalize(_module(spec, device), keep_module_weights=False)
    params, buffers = to_device(params, device), to_device(buffers, device)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers),
        params,
        batch,
        bucket_cap_mb=BUCKET_CAP_MB,
        first_bucket_cap_mb=FIRST_BUCKET_CAP_MB,
    )
    optimizer = adamw(LR)
    schedule = "overlap" if world > 1 else "after"  # what fdp.run.trainer.schedule_for picks
    train_step = make_train_step(loss_fn, optimizer, plan, allreduce(), Comm(), schedule=schedule, donate=True)
    state = [init_train_state(params, buffers, optimizer, plan, allreduce())]

    def step() -> torch.Tensor:
        state[0], metrics = train_step(state[0], batch)
        return metrics["loss"]

    return step


def worker(layout, models: list[str], variants: list[str], reps: int, warmup: int, steps: int) -> dict:
    """One rank: every model and variant in rotating blocks; step intervals from CUDA events."""
    from fdp.procs.launch import init_distributed

    comm = init_distributed(layout)  # NCCL process group (DDP needs one even for a world of 1); the rank's GPU current
    rank, world = comm.rank, comm.world_size
    device = torch.device("cuda", torch.cuda.current_device())
    out = {}
    for m in models:
        spec = MODELS[m]
        batch = _batch(spec, rank, device)
        built = {v: _build(v, spec, batch, device, world) for v in variants}
        first_loss = {v: built[v]().item() for v in variants}  # one step each: the same init and batch
        times = {v: [] for v in variants}
        wall = {v: [] for v in variants}
        for rep in range(reps):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for v in order:
                for _ in range(warmup):
                    built[v]()
                events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                events[0].record()
                for i in range(steps):
                    built[v]()
                    events[i + 1].record()
                torch.cuda.synchronize()
                wall[v].append(1e3 * (time.perf_counter() - t0) / steps)
                times[v] += [a.elapsed_time(b) for a, b in zip(events, events[1:])]
        out[m] = {
            "times": times,
            "wall": wall,
            "first_loss": first_loss,
            "params": sum(p.numel() for p in _module(spec, torch.device("cpu")).parameters()),
        }
        del built
        torch.cuda.empty_cache()
    return out


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    i = q * (len(s) - 1)
    lo, hi = int(i), min(int(i) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def _run_world(world: int, models: list[str], variants: list[str], args) -> dict:
    from fdp.procs.launch import WorldLayout, spawn

    layout = WorldLayout(
        "elastic",
        nproc_per_node=world,
        backend="nccl",
        timeout_s=900.0,
        accelerator="gpu",
        device_ids=tuple(range(world)),
    )
    worker_fn = worker
    if __name__ == "__main__":  # the launcher pickles the entry by module name
        import importlib

        worker_fn = importlib.import_module("benchmarks.gpu").worker
    return spawn(worker_fn, (layout, models, variants, args.reps, args.warmup, args.steps), layout)[0]


def _rows(world: int, results: dict) -> list[dict]:
    rows = []
    for m, r in results.items():
        med = {v: statistics.median(ts) for v, ts in r["times"].items()}
        for v, ts in r["times"].items():
            rows.append(
                {
                    "model": m,
                    "params": r["params"],
                    "world": world,
                    "variant": v,
                    "n": len(ts),
                    "median_ms": med[v],
                    "q1_ms": _quantile(ts, 0.25),
                    "q3_ms": _quantile(ts, 0.75),
                    "wall_ms": statistics.mean(r["wall"][v]),
                    "first_loss": r["first_loss"][v],
                    "vs_ddp": med[v] / med["ddp"],
                    "vs_eager": med[v] / med["eager"] if "eager" in med else None,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="2 repetitions of 2 warm-up + 5 timed steps; no table written"
    )
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before each block")
    parser.add_argument("--only", choices=["char", "gpt2"], help="one part: the char models or GPT-2")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: needs a CUDA GPU; torch {torch.__version__} sees none", file=sys.stderr)
        sys.exit(2)
    if args.quick:
        args.reps, args.steps, args.warmup = 2, 5, 2
    elif args.reps * args.steps < 30:
        parser.error(f"--reps {args.reps} x --steps {args.steps}: expected at least 30 timed steps per variant")
    gpt2 = ""
    if args.only != "char":
        from benchmarks import gpu_gpt2

        gpt2 = gpu_gpt2.table(gpu_gpt2.run(["sdpa", "eager"], not args.quick, 2 if args.quick else 3, args.steps))
        print(gpt2, flush=True)
        if args.only == "gpt2":
            return
    models, gpus = list(MODELS), torch.cuda.device_count()
    rows = _rows(1, _run_world(1, models, ["eager", "ddp", "fdp"], args))
    if gpus > 1:
        rows += _rows(gpus, _run_world(gpus, models, ["ddp", "fdp"], args))
    header = (
        "| model | params | world | variant | median ms | IQR ms | wall ms/step | ratio to DDP | ratio to eager | "
        "first loss |"
    )
    lines = [header, "|" + "---|" * 10]
    for r in rows:
        eager = f"{r['vs_eager']:.2f}" if r["vs_eager"] is not None else ""
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['world']} | {r['variant']} | {r['median_ms']:.2f} | "
            f"{r['q1_ms']:.2f}-{r['q3_ms']:.2f} | {r['wall_ms']:.2f} | {r['vs_ddp']:.2f} | {eager} | "
            f"{r['first_loss']:.6f} |"
        )
    print("\n".join(lines))
    ratios = {r["model"]: r["vs_ddp"] for r in rows if r["variant"] == "fdp" and r["world"] == 1}
    goals = [
        f"{m}: fdp/ddp {ratios[m]:.2f} (goal <= {g:.2f}: {'met' if ratios[m] <= g else 'not met'})"
        for m, g in GOALS.items()
    ]
    print("\n".join(goals))
    if not args.quick:
        device = torch.cuda.get_device_name(0)
        meta = (
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {gpus} x {device}; torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}; fp32; {args.reps} repetitions x ({args.warmup} warm-up "
            f"+ {args.steps} timed steps) per variant"
        )
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "gpu.md").write_text(
            "# fdp vs eager PyTorch vs DDP on GPUs\n\n`python benchmarks/gpu.py`: "
            + meta
            + "\n\n"
            + "\n".join(lines)
            + "\n\n"
            + "\n".join(f"- {g}" for g in goals)
            + "\n"
            + (f"\n{gpt2}\n" if gpt2 else "")
        )
    print(f"fdp/ddp step time: {ratios['charlm25m']:.2f}")


if __name__ == "__main__":
    main()
