"""Benchmark: ZeRO stage 3 compiled (``trainer.compile=true``) against stage 3 uncompiled, and on a GPU against FSDP2.

On the CPU (the default), one process (stage 3 on a world of one still gathers and
releases every bucket through its hooks), a ``CharTransformer`` (vocab 65, d_model 128, 4
layers, 4 heads, batch 8 x 64 tokens, dropout 0), SGD with momentum, buckets of 1 MiB so
the model is gathered bucket by bucket. Two sides, built in this process one after the
other and then stepped in turns (one step of each, round after round), so a machine shared
with other jobs slows them alike:

* ``eager``: ``make_train_step(..., zero_stage=3)``;
* ``regions``: the same with ``compile=True``: each block one compiled region, the gathers
  and reduce-scatters outside (``fdp.step.compiled.compiled_regions``).

(The other way, the whole forward compiled with the gather's hooks as graph breaks, is not
a side: set up in this script it split the forward at every module holding params and its
compiled block frames read a bucket the gather had released; see ``fdp.step.compiled``.)

Reported: the first step (with its compile), the median of the timed steps, its ratio to
``eager``, the graphs compiled, and the largest difference of the params from ``eager``'s.

With ``--gpu``: GPT-2 124M (``benchmarks/gpu_gpt2.py``'s model and batch: vocab 50304, 12
layers, batch 8 x 1024, bf16 autocast, AdamW) on one GPU, a world of one: fdp stage 3
uncompiled and compiled, against FSDP2 (``fully_shard`` per block and the root) uncompiled
and with ``torch.compile`` per block (as torchtitan compiles it); step time (CUDA events)
and peak memory (``max_memory_allocated`` over the timed steps), through ``gpu_gpt2.measure``.

    python benchmarks/compile_stage3.py [--steps 10] [--warmup 2]         # CPU: results/compile_stage3.md
    python benchmarks/compile_stage3.py --gpu [--steps 10] [--warmup 3]   # GPU: results/compile_stage3_gpu.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
CPU_SPEC = {"vocab": 65, "seq": 64, "d_model": 128, "n_layer": 4, "n_head": 4, "batch": 8}


# -- CPU: compiled regions against the whole forward compiled, against eager ------------------------
def _cpu_side(side: str, spec: dict):
    """``(step() -> loss, whole_params() -> dict)`` of one side, built in this process."""
    from fdp import cross_entropy_loss, make_train_step, planner_loss
    from fdp.comm import Comm
    from fdp.model.builtin import CharTransformer
    from fdp.model.functional import functionalize
    from fdp.optim import sgd
    from fdp.plan import plan_buckets
    from fdp.update import zero

    torch.manual_seed(0)
    module = CharTransformer(spec["vocab"], spec["seq"], spec["d_model"], spec["n_layer"], spec["n_head"])
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch, bucket_cap_mb=1, first_bucket_cap_mb=1)
    optimizer, comm = sgd(0.1, momentum=0.9), Comm()
    train_step = make_train_step(
        loss_fn, optimizer, plan, comm=comm, zero_stage=3, model=model, compile=side != "eager"
    )
    state = [zero.init_state(params, buffers, optimizer, plan, comm, stage=3)]

    def step() -> float:
        state[0], metrics = train_step(state[0], batch)
        return float(metrics["loss"])

    return step, lambda: zero.whole_params(state[0], plan, comm), len(plan)


def run_cpu(warmup: int, steps: int, spec: dict = CPU_SPEC) -> tuple[list[dict], dict]:
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    sides = ["eager", "regions"]
    built, rows = {}, {}
    for side in sides:
        graphs_before = counters["stats"]["unique_graphs"]
        step, whole, buckets = _cpu_side(side, spec)
        t0 = time.perf_counter()
        first_loss = step()
        first_s = time.perf_counter() - t0
        for _ in range(warmup):
            step()
        built[side] = (step, whole)
        graphs = counters["stats"]["unique_graphs"] - graphs_before
        rows[side] = {"side": side, "first_s": first_s, "first_loss": first_loss, "graphs": graphs, "times": []}
        print(f"{side}: first step {first_s:.1f} s, {graphs} graphs, {buckets} buckets", flush=True)
    for _ in range(steps):  # in turns: a shared machine's load falls on every side alike
        for side in sides:
            t0 = time.perf_counter()
            built[side][0]()
            rows[side]["times"].append(time.perf_counter() - t0)
    reference = built["eager"][1]()
    for side in sides:
        row = rows[side]
        row["step_ms"] = statistics.median(row.pop("times")) * 1e3
        params = built[side][1]()
        row["max_diff"] = max((params[n] - reference[n]).abs().max().item() for n in reference)
    for side in sides:
        rows[side]["ratio"] = rows[side]["step_ms"] / rows["eager"]["step_ms"]
    meta = {"warmup": warmup, "steps": steps, "spec": spec, "buckets": buckets}
    return list(rows.values()), meta


def cpu_table(rows: list[dict], meta: dict, load: tuple[float, float], wall_s: float) -> str:
    spec = meta["spec"]
    lines = [
        f"# ZeRO stage 3 compiled against uncompiled, on the CPU ({datetime.date.today()})",
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores shared with other jobs, 1 torch thread; load average (1 min) before "
        f"{load[0]:.1f}, after {load[1]:.1f}. One process (world of one: every bucket still gathered and "
        f"released through the hooks), CharTransformer {spec}, {meta['buckets']} buckets of at most 1 MiB, "
        f"SGD (lr 0.1, momentum 0.9). Sides built one after the other, then {meta['steps']} timed steps each "
        f"in turns after {meta['warmup']} warm-up steps; medians. Wall {wall_s:.0f} s. "
        "`python benchmarks/compile_stage3.py`.",
        "",
        "| side | first step s (compiles) | graphs | step ms | vs eager | max param diff vs eager | first loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['side']} | {r['first_s']:.1f} | {r['graphs']} | {r['step_ms']:.1f} | {r['ratio']:.2f}x | "
            f"{r['max_diff']:.1e} | {r['first_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


# -- GPU: GPT-2 124M, fdp stage 3 against FSDP2, each uncompiled and compiled -------------------------
def _fdp_stage3(spec: dict, batch, device: torch.device, compile: bool):
    from gpu_gpt2 import LR, _module

    from fdp import cross_entropy_loss, make_train_step, planner_loss
    from fdp.comm import Comm
    from fdp.data.batches import head
    from fdp.model.functional import functionalize
    from fdp.model.precision import Precision
    from fdp.optim import adamw
    from fdp.plan import plan_buckets
    from fdp.procs.devices import to_device
    from fdp.update import zero

    precision = Precision("bf16-mixed")
    model, params, buffers = functionalize(_module(spec, "sdpa", device), keep_module_weights=False)
    params, buffers = to_device(params, device), to_device(buffers, device)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(planner_loss(precision.wrap(loss_fn), buffers), params, head(batch, 2))
    optimizer, comm = adamw(LR), Comm()
    train_step = make_train_step(
        loss_fn,
        optimizer,
        plan,
        comm=comm,
        donate=True,
        precision=precision,
        zero_stage=3,
        model=model,
        compile=compile,
    )
    state = [zero.init_state(params, buffers, optimizer, plan, comm, stage=3)]
    del params

    def step() -> torch.Tensor:
        state[0], metrics = train_step(state[0], batch)
        return metrics["loss"]

    return step


def _fsdp2(spec: dict, batch, device: torch.device, compile: bool):
    import torch.nn.functional as F
    from gpu_gpt2 import LR, _module
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    module = _module(spec, "sdpa", device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in module.transformer.h:
        if compile:  # torchtitan's order: each block compiled, then sharded (its gathers outside the graph)
            block.compile()
        fully_shard(block, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, fused=True)
    x, y = batch

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        logits = module(x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def run_gpu(warmup: int, steps: int) -> list[dict]:
    import torch.distributed as dist
    from gpu_gpt2 import SPEC, _batch, measure

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():  # FSDP2 needs a process group, and fdp's Comm takes the default one
        dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = True
    batch = _batch(SPEC, device)
    sides = [
        ("fdp stage 3", _fdp_stage3, False),
        ("FSDP2", _fsdp2, False),
        ("fdp stage 3 compile", _fdp_stage3, True),
        ("FSDP2 + compile per block", _fsdp2, True),
    ]
    rows = []
    for name, make, jit in sides:
        row = measure(name, lambda make=make, jit=jit: make(SPEC, batch, device, jit), warmup, steps)
        rows.append(row)
    by_name = {r["variant"]: r for r in rows}
    for r in rows:
        base = by_name["FSDP2 + compile per block" if "compile" in r["variant"] else "FSDP2"]
        r["time_ratio"], r["peak_ratio"] = r["step_ms"] / base["step_ms"], r["peak_gib"] / base["peak_gib"]
    return rows


def gpu_table(rows: list[dict]) -> str:
    from gpu_gpt2 import SPEC

    lines = [
        f"# ZeRO stage 3 compiled, GPT-2 124M on one GPU, against FSDP2 ({datetime.date.today()})",
        "",
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}; a world of one (NCCL). GPT-2 from its config "
        f"(vocab {SPEC['vocab']}, {SPEC['n_layer']} layers, dropout 0.1), batch {SPEC['batch']} x {SPEC['seq']}, "
        "bf16 params gathered and float32 gradients on both sides, AdamW. `python benchmarks/compile_stage3.py --gpu`.",
        "",
        "| side | step ms | step peak GiB | steady GiB | vs FSDP2 alike (time / peak) | first loss |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['step_ms']:.1f} | {r['peak_gib']:.2f} | {r['steady_gib']:.2f} | "
            f"{r['time_ratio']:.2f} / {r['peak_ratio']:.2f} | {r['first_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="GPT-2 124M against FSDP2 on one CUDA GPU")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="print only")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    if args.gpu:
        if not torch.cuda.is_available():
            print("benchmarks/compile_stage3.py --gpu: needs a CUDA GPU; none is visible", file=sys.stderr)
            sys.exit(2)
        text, out = gpu_table(run_gpu(args.warmup, args.steps)), RESULTS / "compile_stage3_gpu.md"
    else:
        load_before, t0 = os.getloadavg()[0], time.perf_counter()
        rows, meta = run_cpu(args.warmup, args.steps)
        text = cpu_table(rows, meta, (load_before, os.getloadavg()[0]), time.perf_counter() - t0)
        out = RESULTS / "compile_stage3.md"
    print(text)
    if not args.quick:
        out.write_text(text)


if __name__ == "__main__":
    main()
