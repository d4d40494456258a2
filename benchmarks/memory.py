"""Benchmark: a training step's peak memory over its steady state, and the largest batch under a memory cap.

Both sides in one run, each variant in a fresh launch of its own processes (so its memory
is its own): eager torch (one process, ``loss.backward()`` and ``torch.optim.Adam``),
torch's ``DistributedDataParallel`` (2 ranks), fdp's ``make_train_step`` at ZeRO stages
0 to 3 (2 ranks, ``donate=True`` and the ``overlap`` schedule, as fdp's trainer runs it),
and fdp with activation checkpointing (``checkpoint_modules="blocks"``, ``fdp.model.remat``) at
stages 0 and 3. Two models, each in training mode with dropout 0.1: fdp's char
transformer and a Hugging Face GPT-2 built from its config (``transformers.GPT2LMHeadModel``,
nothing downloaded); sizes in ``MODELS``. Adam (lr 1e-3) everywhere, the same weights and
batches on every side, gloo on loopback, one torch thread per rank.

What is measured, per variant (the larger rank):

* ``steady MiB``: what the process holds between steps (params, optimizer state, the
  step's kept buffers, and torch itself); ``peak over steady MiB``: what the step adds at
  its peak, the figure activation checkpointing and fdp's memory work move. On CUDA (when
  present) these are ``torch.cuda.memory_allocated`` before the step and
  ``max_memory_allocated`` during it. On the CPU they are the process's RSS right after
  ``malloc_trim`` (glibc would otherwise keep the last step's freed memory resident) and
  its peak RSS during the step (``VmHWM``, reset before it through
  ``/proc/self/clear_refs``): the median over the timed steps.
* ``step ms``: the median step time (rank 0).
* ``largest batch``: the most sequences per rank whose steps run under
  ``world.memory_per_rank_mb`` (``--budget-mb``; ``fdp.procs.budget.limit_memory``, what fdp's
  trainer applies: on the CPU a limit on the process's data segment counted from before
  the model is built), found by doubling the batch and then bisecting, each try a fresh
  launch of two steps.

    python benchmarks/memory.py [--quick] [--models charlm gpt2] [--budget-mb 1000] [--no-search]
                                [--search-variants ...] [--search-only] [--time]

Writes ``benchmarks/results/memory.md`` and ``memory.json`` (``--quick``: 1 warm-up and 2
timed steps per variant, no batch search, prints only).
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

RESULTS = REPO / "benchmarks" / "results"
LR = 1e-3
MODELS = {
    # fdp.model.builtin.CharTransformer: ~1.2M parameters; a step's activations (attention with dropout over 256
    # tokens, the 4x MLP) are several times its state, as on a GPU at a real model's batch.
    "charlm": {"kind": "charlm", "vocab": 256, "seq": 256, "d_model": 128, "n_layer": 6, "n_head": 4, "batch": 8},
    # transformers.GPT2LMHeadModel from a config: GPT-2's structure (n_embd 768, 12 layers, vocab 50257 at
    # full size) shrunk to run on two CPU cores; ~4.7M parameters.
    "gpt2": {"kind": "gpt2", "vocab": 4096, "seq": 256, "d_model": 256, "n_layer": 6, "n_head": 8, "batch": 8},
}
# The step-time comparison (--time) also runs each model at width 512 (4 blocks): at width 128 a CPU step's
# time is mostly per-op host work, which recomputation repeats in full; at 512 it is mostly arithmetic, as on a GPU.
WIDE = {f"{name} wide": {**spec, "d_model": 512, "n_layer": 4, "n_head": 8} for name, spec in MODELS.items()}
VARIANTS = {  # name: (ranks, zero stage or None for torch, checkpoint the blocks)
    "eager torch": (1, None, False),
    "DDP": (2, None, False),
    "fdp stage 0": (2, 0, False),
    "fdp stage 1": (2, 1, False),
    "fdp stage 2": (2, 2, False),
    "fdp stage 3": (2, 3, False),
    "fdp stage 0 + checkpointing": (2, 0, True),
    "fdp stage 3 + checkpointing": (2, 3, True),
}


def _module(spec: dict):
    torch.manual_seed(0)
    if spec["kind"] == "charlm":
        from fdp.model.builtin import CharTransformer

        return CharTransformer(
            spec["vocab"], spec["seq"], spec["d_model"], spec["n_layer"], spec["n_head"], dropout=0.1
        )
    from fdp.model.builtin import hf_model

    return hf_model(
        "transformers.GPT2LMHeadModel",
        vocab_size=spec["vocab"],
        n_positions=spec["seq"],
        n_embd=spec["d_model"],
        n_layer=spec["n_layer"],
        n_head=spec["n_head"],
    )


def _batch(spec: dict, batch: int, rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, spec["vocab"], (batch, spec["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _torch_step(spec: dict, batch, ddp: bool):
    module = _module(spec).to(_device())
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(module)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)
    x, y = batch

    def step(_):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(_logits(module(x)).reshape(-1, spec["vocab"]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return None, time.perf_counter() - t0

    return step, None


def _fdp_step(spec: dict, batch, stage: int, checkpoint: bool, comm):
    from fdp import (
        adam,
        cross_entropy_loss,
        functionalize,
        init_train_state,
        make_train_step,
        plan_buckets,
        planner_loss,
        zero,
    )
    from fdp.comm import Comm

    module = _module(spec).to(_device())
    model, params, buffers = functionalize(module, keep_module_weights=False)
    loss_fn = cross_entropy_loss(model)
    # Planning traces one backward without checkpointing: on one sample, so that its peak is not the step's.
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, tuple(t[:1] for t in batch))
    optimizer = adam(LR)
    train_step = make_train_step(
        loss_fn,
        optimizer,
        plan,
        comm=Comm(),
        schedule="overlap",
        donate=True,
        zero_stage=stage,
        model=model,
        checkpoint_modules="blocks" if checkpoint else (),
    )
    state = (
        zero.init_state(params, buffers, optimizer, plan, comm, stage=stage)
        if stage
        else init_train_state(params, buffers, optimizer, plan)
    )
    del params, buffers

    def step(state):
        t0 = time.perf_counter()
        state, _ = train_step(state, batch)
        return state, time.perf_counter() - t0

    return step, state


def _held_mib(device: torch.device) -> float:
    """What the process holds now: allocated GPU memory, or RSS once glibc has handed back what is free."""
    from fdp.procs.allocator import release_free_memory

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    release_free_memory()
    reset_peak()
    return status_mib("VmRSS")


def _peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
    return status_mib("VmHWM")


def worker(model_name: str, variant: str, batch_size: int, warmup: int, steps: int, budget_mb: float) -> dict:
    """One rank: build the variant, warm up, and measure each timed step's peak over what it held before it."""
    from fdp.procs.allocator import tune_allocator
    from fdp.procs.budget import limit_memory

    ranks, stage, checkpoint = VARIANTS[variant]
    tune_allocator(sharded_params=stage == 3)  # fdp's trainer's allocator policy, the torch sides under it too
    from fdp.procs.launch import WorldLayout, init_distributed

    comm = init_distributed(WorldLayout("elastic", nproc_per_node=ranks, backend="gloo", timeout_s=600))
    torch.set_num_threads(1)
    device = _device()
    limit_memory(budget_mb, device)
    spec = MODELS[model_name]
    batch = tuple(t.to(device) for t in _batch(spec, batch_size, comm.rank))
    if stage is None:
        step, state = _torch_step(spec, batch, ddp=ranks > 1)
    else:
        step, state = _fdp_step(spec, batch, stage, checkpoint, comm)
    for _ in range(warmup):
        state, _ = step(state)
    held, peaks, times = [], [], []
    for _ in range(steps):
        before = _held_mib(device)
        state, seconds = step(state)
        held.append(before)
        peaks.append(_peak_mib(device) - before)
        times.append(seconds)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return {
        "steady_mib": statistics.median(held),
        "peak_mib": statistics.median(peaks),
        "ms": 1e3 * statistics.median(times),
        "device": device.type,
    }


def _launch(model_name: str, variant: str, batch: int, warmup: int, steps: int, budget_mb: float = 0.0) -> list[dict]:
    from fdp.procs.launch import WorldLayout, spawn

    ranks = VARIANTS[variant][0]
    layout = WorldLayout("elastic", nproc_per_node=ranks, backend="gloo", timeout_s=600)
    results = spawn(worker, (model_name, variant, batch, warmup, steps, budget_mb), layout)
    return [results[r] for r in range(ranks)]


def _fits(model_name: str, variant: str, batch: int, budget_mb: float) -> bool:
    from fdp.procs.launch import WorkerFailedError

    try:
        _launch(model_name, variant, batch, warmup=1, steps=1, budget_mb=budget_mb)
        return True
    except WorkerFailedError as error:
        from fdp.procs.budget import is_out_of_memory

        if is_out_of_memory(RuntimeError(str(error))) or "MemoryError" in str(error):
            return False
        raise


def largest_batch(model_name: str, variant: str, budget_mb: float, start: int, limit: int = 512) -> int:
    """The most sequences per rank that step under ``budget_mb``: doubling from ``start``, then bisecting."""
    low, high = 0, None
    batch = start
    while high is None and batch <= limit:
        if _fits(model_name, variant, batch, budget_mb):
            low, batch = batch, batch * 2
        else:
            high = batch
    if high is None:
        return low
    while high - low > max(1, low // 4):  # to within a quarter of the answer
        middle = (low + high) // 2
        if _fits(model_name, variant, middle, budget_mb):
            low = middle
        else:
            high = middle
    return low


def interleaved_times(model_name: str, steps: int) -> dict:
    """fdp's step with and without checkpointing, alternated in one process (one rank): median ms of each.

    Separate launches on a shared machine meet different load; alternating the two steps
    on the same model and batch puts the same load on both.
    """
    from fdp import (
        adam,
        cross_entropy_loss,
        functionalize,
        init_train_state,
        make_train_step,
        plan_buckets,
        planner_loss,
    )
    from fdp.procs.allocator import tune_allocator

    tune_allocator()
    torch.set_num_threads(1)
    spec = {**MODELS, **WIDE}[model_name]
    batch = _batch(spec, spec["batch"], 0)
    module = _module(spec)
    model, params, buffers = functionalize(module, keep_module_weights=False)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    sides = {}
    for name, modules in (("without", ()), ("with", "blocks")):
        step = make_train_step(loss_fn, adam(LR), plan, model=model, checkpoint_modules=modules)
        sides[name] = [step, init_train_state(params, buffers, adam(LR), plan), []]
    for i in range(steps + 1):
        for name in ("without", "with") if i % 2 else ("with", "without"):
            step, state, times = sides[name]
            t0 = time.perf_counter()
            sides[name][1], _ = step(state, batch)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(side[2]) for name, side in sides.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--budget-mb", type=float, default=1000.0, help="world.memory_per_rank_mb for the batch search")
    parser.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    parser.add_argument(
        "--search-variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        help="the variants whose largest batch is searched (each try is a launch)",
    )
    parser.add_argument(
        "--search-only",
        action="store_true",
        help="only the largest-batch search, its table in memory_batch.md (alongside a measuring run)",
    )
    parser.add_argument(
        "--time",
        action="store_true",
        help="only fdp's step time with and without checkpointing, alternated in one process (memory_time.md)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    search = not (args.quick or args.no_search)
    rows = []
    meta = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "warmup": warmup,
        "steps": steps,
        "budget_mb": args.budget_mb if search else None,
        "load_before": os.getloadavg()[0],
    }
    t0 = time.time()

    name = "memory_batch" if args.search_only else "memory"

    def write() -> str:
        meta.update(load_after=os.getloadavg()[0], wall_s=round(time.time() - t0))
        table = _batch_table(rows, meta) if args.search_only else _table(rows, meta)
        if not args.quick:  # after every row: a run cut short keeps what it measured
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / f"{name}.md").write_text(table)
            (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "models": MODELS, "rows": rows}, indent=1))
        return table

    if args.time:
        lines = ["| model | step ms without checkpointing | with | ratio |", "|---|---:|---:|---:|"]
        for model_name in [m for name in args.models for m in (name, f"{name} wide")]:
            ms = interleaved_times(model_name, args.steps)
            ratio = ms["with"] / ms["without"]
            lines.append(f"| {model_name} | {ms['without']:.0f} | {ms['with']:.0f} | {ratio:.2f} |")
            print(lines[-1], flush=True)
        head = (
            f"# fdp's step time with and without activation checkpointing ({meta['date']})\n\n"
            f"One process, fdp stage 0, Adam, the models of memory.md at their batch, and each at width 512 with 4 "
            f"blocks (`wide`); the two steps alternated "
            f"(order flipped every round) for {args.steps} rounds after one warm-up, medians. "
            f"torch {meta['torch']}, "
            f"{meta['cpus']} CPU cores shared with other jobs (load {meta['load_before']:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after).\n\n"
        )
        (RESULTS / "memory_time.md").write_text(head + "\n".join(lines) + "\n")
        return
    if args.search_only:
        rows += [{"model": m, "variant": v} for m in args.models for v in args.variants]
    for model_name in [] if args.search_only else args.models:
        for variant in args.variants:
            ranks = _launch(model_name, variant, MODELS[model_name]["batch"], warmup, steps)
            row = {
                "model": model_name,
                "variant": variant,
                "ranks": len(ranks),
                "steady_mib": max(r["steady_mib"] for r in ranks),
                "peak_mib": max(r["peak_mib"] for r in ranks),
                "ms": ranks[0]["ms"],
                "device": ranks[0]["device"],
            }
            rows.append(row)
            print(_line(row, rows), flush=True)
            write()
    # The batch search last (each try is a launch), the variants in the order asked, model by model.
    for variant in args.search_variants if search else ():
        for row in [r for r in rows if r["variant"] == variant]:
            row["largest_batch"] = largest_batch(row["model"], variant, args.budget_mb, MODELS[row["model"]]["batch"])
            print(row, flush=True)
            write()
    print(write())


def _reference(row: dict, rows: list[dict], variant: str) -> dict | None:
    return next((r for r in rows if r["model"] == row["model"] and r["variant"] == variant), None)


def _line(row: dict, rows: list[dict]) -> str:
    eager = _reference(row, rows, "eager torch")
    plain = _reference(row, rows, row["variant"].replace(" + checkpointing", ""))
    ratio = f"{row['peak_mib'] / eager['peak_mib']:.2f}" if eager and eager["peak_mib"] > 0 else "-"
    vs_plain = (
        f"{row['peak_mib'] / plain['peak_mib']:.2f}" if plain and plain is not row and plain["peak_mib"] > 0 else "-"
    )
    time_vs_plain = f"{row['ms'] / plain['ms']:.2f}" if plain and plain is not row else "-"
    batch = row.get("largest_batch")
    plain_batch = plain.get("largest_batch") if plain and plain is not row else None
    batch_vs_plain = f"{batch / plain_batch:.2f}" if batch and plain_batch else "-"
    spec = MODELS[row["model"]]
    name = (
        f"{row['model']} (d {spec['d_model']}, {spec['n_layer']} layers, vocab {spec['vocab']}, "
        f"{spec['batch']} x {spec['seq']} tokens)"
    )
    shown = batch if batch is not None else "-"
    return (
        f"| {name} | {row['variant']} | {row['ranks']} | {row['steady_mib']:.0f} | {row['peak_mib']:.0f} | "
        f"{ratio} | {vs_plain} | {row['ms']:.0f} | {time_vs_plain} | {shown} | {batch_vs_plain} |"
    )


def _batch_table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# The largest batch under world.memory_per_rank_mb={meta['budget_mb']:g} ({meta['date']})",
        "",
        f"torch {meta['torch']}, {meta['cpus']} CPU cores shared with other jobs "
        f"(load {meta['load_before']:.1f} before, "
        f"{meta['load_after']:.1f} after); on {meta['device']}. Sequences per rank whose steps run under the budget "
        "(fdp.procs.budget.limit_memory from before the model is built; doubling from the measured batch, then "
        f"bisecting to within a quarter; a fresh launch of 1 warm-up + 1 step per try). Wall {meta['wall_s']} s.",
        "",
        "| model | variant | largest batch | vs without checkpointing |",
        "|---|---|---:|---:|",
    ]
    for row in rows:
        if "largest_batch" not in row:
            continue
        plain = _reference(row, rows, row["variant"].replace(" + checkpointing", ""))
        ratio = (
            f"{row['largest_batch'] / plain['largest_batch']:.2f}"
            if plain is not row and plain and plain.get("largest_batch")
            else "-"
        )
        lines.append(f"| {row['model']} | {row['variant']} | {row['largest_batch']} | {ratio} |")
    return "\n".join(lines) + "\n"


def _table(rows: list[dict], meta: dict) -> str:
    where = (
        "peak allocated GPU memory over what was allocated before the step"
        if meta["device"] == "cuda"
        else "peak RSS during the step (VmHWM) over the RSS before it, after malloc_trim"
    )
    search = (
        "`largest batch`: sequences per rank whose steps run under "
        f"world.memory_per_rank_mb={meta['budget_mb']:g} "
        "(fdp.procs.budget.limit_memory from before the model is built; doubling, then bisecting to within a quarter; "
        "a fresh launch per try)."
        if meta["budget_mb"]
        else "No largest-batch search in this run."
    )
    lines = [
        f"# A step's peak memory over its steady state ({meta['date']})",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, {meta['machine']}, {meta['cpus']} CPU cores shared "
        "with other "
        f"jobs (load {meta['load_before']:.1f} before, {meta['load_after']:.1f} after); on {meta['device']}; gloo on "
        f"loopback, 1 torch thread per rank. Each row a fresh launch: {meta['warmup']} warm-up + {meta['steps']} timed "
        f"steps, medians; the larger rank. Adam lr {LR}, dropout 0.1, training mode. Wall {meta['wall_s']} s.",
        f"`steady MiB`: held between steps; `peak over steady MiB`: {where}. `vs eager`: that peak over eager torch's; "
        "`vs without`: a checkpointed row's peak and step time over the same stage without checkpointing. " + search,
        "",
        "| model | variant | ranks | steady MiB | peak over steady MiB | vs eager | vs without | step ms | time vs "
        "without | largest batch | vs without |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_line(row, rows) for row in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
