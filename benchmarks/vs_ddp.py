"""Benchmark: fdp against PyTorch DDP, same model, data, world and settings, in one run.

Two models: an MLP of ~25M parameters (24 x Linear(1024, 1024) + ReLU, a 10-way head;
batch 32 per rank) and a ``CharTransformer`` of ~16M (d_model 512, 5 layers, 8 heads,
vocab 256; batch 4 x 64 tokens per rank). Random inputs, a fixed batch per rank.

Both sides: 2 ranks started by ``fdp.procs.launch.spawn`` (PyTorch's elastic launcher), gloo,
one torch thread per rank, SGD(lr 0.01, momentum 0.9), bucket caps 25 MiB (first 1 MiB),
a mean allreduce. A step is everything: forward, backward, reduction, optimizer.

* ``ddp``: ``DistributedDataParallel`` (defaults) + ``torch.optim.SGD(fused=True)``, the
  same fused kernel fdp steps with (torch's CPU default, a loop over tensors, is slower).
* ``fdp after`` / ``fdp overlap``: ``fdp.make_train_step`` with each schedule and
  ``donate=True``, as fdp's trainer runs it (params and SGD state updated in place, each
  bucket's as soon as its reduction is done).
* no-communication lower bounds: ``fdp noop`` (``fdp.hooks.noop``) and ``ddp noop``
  (``noop_hook``).
* ``--hooks``: ``fdp fp16`` vs ``ddp fp16`` (``fp16_compress_hook``) and ``fdp powersgd``
  vs ``ddp powersgd`` (``powerSGD_hook``), both rank 1 with compression from step 3.
  torch's ``powerSGD_hook`` races on gloo with more than one bucket (the ranks interleave
  the P and Q allreduces of different buckets differently), so it runs wrapped in a hook
  that waits for its future before returning: that serialises DDP's PowerSGD buckets.

Every variant runs in blocks: built fresh (so its memory is its own), warmed up, timed for
some steps, torn down (``gc`` + ``malloc_trim``). All blocks run in one launch of 2 ranks;
they alternate between variants (the order rotates every repetition), so load from other
jobs on the machine falls on all of them alike. Reported per variant:

* median step time over all timed steps (rank 0's clock; the ranks run in lock step) and
  its interquartile range; the ratio to DDP's median;
* CPU time per step and rank (the process: compute thread and gloo's threads): the work,
  which other load on the machine inflates much less than the wall time;
* fdp's own ``comm_wait_s`` (time blocked on collectives after compute);
* peak RSS per rank during the timed steps (``VmHWM``, reset through
  ``/proc/self/clear_refs`` after warm-up; the larger rank), and how much of it the
  variant added over the RSS the rank had before building it. The full run takes it from a
  fresh launch per variant (what earlier blocks leave in a shared process shifts RSS by
  100-200 MiB); ``--quick`` reports the in-process figure (median over blocks);
* how much CPU other processes took during the run (``/proc/stat`` minus the ranks' own).

``fdp.procs.allocator.tune_allocator()`` runs in each rank first, as fdp's trainer does; it is
process-wide, so DDP runs under it too (``--allocator default`` leaves glibc alone).

    python benchmarks/vs_ddp.py [--quick] [--hooks] [--allocator tuned|default]

``--quick`` (at most 3 repetitions of 1 warm-up + 3 timed steps, cut to a 70 s budget) takes
~60-80 s on this machine, under load too.

The last line printed is ``fdp/ddp step time: X``: the worse (larger) of the two models'
ratios of fdp's step time, with the schedule fdp's trainer picks for 2 ranks, to DDP's.
The full run writes ``benchmarks/results/vs_ddp.md`` and ``vs_ddp.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import importlib.util
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
import torch.nn.functional as F  # noqa: E402

from benchmarks._proc import reset_peak, status_mib  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
NOTES_MARKER = "## Notes"
LR, MOMENTUM = 0.01, 0.9
BUCKET_CAP_MB, FIRST_BUCKET_CAP_MB = 25.0, 1.0
POWERSGD_RANK, POWERSGD_START = 1, 2

MODELS = {
    "mlp": {"kind": "mlp", "width": 1024, "depth": 24, "classes": 10, "batch": 32},
    "transformer": {"kind": "charlm", "vocab": 256, "seq": 64, "d_model": 512, "n_layer": 5, "n_head": 8, "batch": 4},
}
CORE = ["ddp", "fdp after", "fdp overlap", "ddp noop", "fdp noop"]
HOOKED = ["ddp fp16", "fdp fp16", "ddp powersgd", "fdp powersgd"]
HOOK_MODULES = ["fdp.hooks.compress", "fdp.hooks.powersgd", "fdp.hooks.registry"]


# ----------------------------------------------------------------------------- memory


def _release_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _busy_jiffies() -> int:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# ----------------------------------------------------------------------------- variants


def module_for(spec: dict):
    """The model a spec names, seeded: the same weights on every rank and every side."""
    from fdp.model.builtin import MLP, CharTransformer

    torch.manual_seed(0)
    if spec["kind"] == "mlp":
        return MLP(spec["width"], spec["width"], spec["depth"], spec["classes"])
    return CharTransformer(spec["vocab"], spec["seq"], spec["d_model"], spec["n_layer"], spec["n_head"])


def batch_for(spec: dict, rank: int):
    """Rank ``rank``'s fixed random batch for a spec (inputs, targets)."""
    g = torch.Generator().manual_seed(1000 + rank)
    if spec["kind"] == "mlp":
        return torch.randn(spec["batch"], spec["width"], generator=g), torch.randint(
            0, spec["classes"], (spec["batch"],), generator=g
        )
    tokens = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _ddp_powersgd_waiting(state, bucket):
    """torch's ``powerSGD_hook``, made safe for several buckets on gloo by waiting inside."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    fut = P.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def _build_ddp(spec: dict, batch, hook: str | None):
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(module_for(spec), bucket_cap_mb=BUCKET_CAP_MB)
    if hook == "noop":
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
    elif hook == "fp16":
        ddp.register_comm_hook(None, D.fp16_compress_hook)
    elif hook == "powersgd":
        state = P.PowerSGDState(None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=POWERSGD_START)
        ddp.register_comm_hook(state, _ddp_powersgd_waiting)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM, fused=True)  # the kernel fdp uses
    x, y = batch

    def step() -> float:
        opt.zero_grad()
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        return 0.0

    return step


def _fdp_hook(name: str):
    from fdp import hooks

    if name == "allreduce":
        return hooks.allreduce()
    if name == "noop":
        return hooks.noop()
    if name == "fp16":
        return hooks.fp16()
    if name == "powersgd":
        return hooks.powersgd(rank=POWERSGD_RANK, start_iter=POWERSGD_START)
    raise ValueError(name)


def _build_fdp(spec: dict, batch, schedule: str, hook_name: str):
    from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
    from fdp.comm import Comm
    from fdp.model.functional import functionalize
    from fdp.optim import sgd
    from fdp.plan import plan_buckets

    model, params, buffers = functionalize(module_for(spec), keep_module_weights=False)  # as the trainer does
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers),
        params,
        batch,
        bucket_cap_mb=BUCKET_CAP_MB,
        first_bucket_cap_mb=FIRST_BUCKET_CAP_MB,
    )
    hook, optimizer = _fdp_hook(hook_name), sgd(LR, momentum=MOMENTUM)
    # donate=True: the state is consumed by each step, as in fdp's trainer.
    train_step = make_train_step(loss_fn, optimizer, plan, hook, Comm(), schedule=schedule, donate=True)
    holder = [init_train_state(params, buffers, optimizer, plan, hook)]
    del params, buffers

    def step() -> float:
        holder[0], metrics = train_step(holder[0], batch)
        return metrics["comm_wait_s"]

    step.buckets = len(plan)
    return step


def _build(variant: str, spec: dict, batch):
    side, _, what = variant.partition(" ")
    if side == "ddp":
        return _build_ddp(spec, batch, what or None)
    if what in ("after", "overlap"):
        return _build_fdp(spec, batch, what, "allreduce")
    return _build_fdp(spec, batch, _fdp_default_schedule(), what)


def _fdp_default_schedule() -> str:
    """The schedule fdp's trainer picks for these 2 ranks (``trainer.schedule=auto``)."""
    from fdp.step.reduce import resolve_schedule

    return resolve_schedule("auto", world_size=2)


# ----------------------------------------------------------------------------- worker


def worker(
    models: list[str], variants: list[str], reps: int, warmup: int, steps: int, allocator: str, budget_s: float | None
) -> dict:
    """One rank: every model, every variant, in alternating blocks. Returns {model: measurements}.

    With ``budget_s``, each model gets an equal share of it, and a repetition after the first
    starts only if the last one would still fit (rank 0 decides, so the ranks agree).
    """
    from fdp.procs.allocator import tune_allocator
    from fdp.procs.launch import WorldLayout, init_distributed

    if allocator == "tuned":
        tune_allocator()
    comm = init_distributed(WorldLayout("elastic", nproc_per_node=2, backend="gloo"))
    torch.set_num_threads(1)
    share = budget_s / len(models) if budget_s else None
    results = {m: _measure_model(m, comm.rank, variants, reps, warmup, steps, share) for m in models}
    dist.destroy_process_group()
    return results


def _go_on(rank: int, elapsed: float, per_rep: float, budget: float | None) -> bool:
    if budget is None:
        return True
    flag = torch.tensor([1 if rank != 0 or elapsed + per_rep <= budget else 0])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _measure_model(
    model_name: str, rank: int, variants: list[str], reps: int, warmup: int, steps: int, budget_s: float | None = None
) -> dict:
    spec = MODELS[model_name]
    batch = batch_for(spec, rank)
    n_params = sum(p.numel() for p in module_for(spec).parameters())
    keys = ("ms", "wait_ms", "cpu_ms", "peak_mib", "build_peak_mib", "base_mib")
    out = {v: {**{k: [] for k in keys}, "buckets": None} for v in variants}
    blocks = []
    cpu0, busy0, wall0 = _own_cpu_s(), _busy_jiffies(), time.perf_counter()
    for rep in range(reps):
        elapsed = time.perf_counter() - wall0
        if rep and not _go_on(rank, elapsed, elapsed / rep, budget_s):
            break
        shift = rep % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            _release_memory()
            base = status_mib("VmRSS")
            reset_peak()
            step = _build(variant, spec, batch)
            dist.barrier()
            for _ in range(warmup):
                step()
            build_peak = status_mib("VmHWM")
            reset_peak()  # the reported peak is that of the timed (steady-state) steps
            times, waits, cpus = [], [], []
            for _ in range(steps):
                c0, t0 = time.process_time(), time.perf_counter()  # process CPU: all threads, ns clock
                waits.append(step())
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            rec = out[variant]
            rec["ms"] += [1e3 * t for t in times]
            rec["wait_ms"] += [1e3 * w for w in waits]
            rec["cpu_ms"] += [1e3 * c for c in cpus]
            rec["peak_mib"].append(status_mib("VmHWM"))
            rec["build_peak_mib"].append(build_peak)
            rec["base_mib"].append(base)
            rec["buckets"] = getattr(step, "buckets", None)
            blocks.append((variant, round(statistics.median(times) * 1e3, 1)))
            del step
            dist.barrier()
    return {
        "variants": out,
        "blocks": blocks,
        "params": n_params,
        "cpu_s": _own_cpu_s() - cpu0,
        "busy_s": (_busy_jiffies() - busy0) / os.sysconf("SC_CLK_TCK"),
        "wall_s": time.perf_counter() - wall0,
    }


# ----------------------------------------------------------------------------- driver


def rss_worker(model_name: str, variant: str, warmup: int, steps: int, allocator: str) -> tuple[float, float]:
    """One rank of a fresh launch that runs one variant: (RSS before building it, peak RSS of its timed steps)."""
    from fdp.procs.allocator import tune_allocator
    from fdp.procs.launch import WorldLayout, init_distributed

    if allocator == "tuned":
        tune_allocator()
    comm = init_distributed(WorldLayout("elastic", nproc_per_node=2, backend="gloo"))
    torch.set_num_threads(1)
    spec = MODELS[model_name]
    batch = batch_for(spec, comm.rank)
    base = status_mib("VmRSS")
    step = _build(variant, spec, batch)
    for _ in range(warmup):
        step()
    reset_peak()
    for _ in range(steps):
        step()
    peak = status_mib("VmHWM")
    dist.destroy_process_group()
    return base, peak


def _run_models(models: list[str], variants: list[str], args) -> dict:
    from fdp.procs.launch import WorldLayout, spawn

    layout = WorldLayout("elastic", nproc_per_node=2, backend="gloo", timeout_s=600.0)
    res = spawn(
        _importable_worker("worker"),
        (models, variants, args.reps, args.warmup, args.steps, args.allocator, args.budget_s),
        layout,
    )
    return {m: _summarise(res[0][m], res[1][m], variants) for m in models}


def _fresh_rss(results: dict, variants: list[str], args) -> None:
    """Replace the RSS columns by those of a fresh launch per variant.

    Memory the variants leave behind in a shared process (glibc's heap, caches) shifts the
    next one's RSS by ~100-200 MiB; the in-process figures stay in the JSON.
    """
    from fdp.procs.launch import WorldLayout, spawn

    layout = WorldLayout("elastic", nproc_per_node=2, backend="gloo", timeout_s=600.0)
    for m in results:
        for v in variants:
            r = spawn(
                _importable_worker("rss_worker"), (m, v, args.warmup, max(3, args.steps // 2), args.allocator), layout
            )
            row = results[m]["rows"][v]
            row["in_process_peak_rss_mib"], row["in_process_added_rss_mib"] = row["peak_rss_mib"], row["added_rss_mib"]
            row["peak_rss_mib"] = max(r[0][1], r[1][1])
            row["added_rss_mib"] = max(r[0][1] - r[0][0], r[1][1] - r[1][0])
            print(f"  RSS {m} {v}: {row['peak_rss_mib']:.0f} MiB", flush=True)


def _summarise(r0: dict, r1: dict, variants: list[str]) -> dict:
    # Other processes' CPU: all busy time on the machine minus both ranks' own.
    others = max(0.0, r0["busy_s"] - r0["cpu_s"] - r1["cpu_s"]) / r0["wall_s"]
    rows = {}
    for v in variants:
        a, b = r0["variants"][v], r1["variants"][v]
        ms = a["ms"]  # the ranks run in lock step; rank 0's clock is the step time
        rows[v] = {
            "median_ms": statistics.median(ms),
            "q1_ms": _quantile(ms, 0.25),
            "q3_ms": _quantile(ms, 0.75),
            "n": len(ms),
            "wait_ms": statistics.median(a["wait_ms"]),
            "cpu_ms": statistics.median(a["cpu_ms"] + b["cpu_ms"]),
            # Per block, the larger of the two ranks; then the median over the blocks.
            "peak_rss_mib": statistics.median(map(max, a["peak_mib"], b["peak_mib"])),
            "added_rss_mib": statistics.median(
                max(pa - ba, pb - bb)
                for pa, ba, pb, bb in zip(a["peak_mib"], a["base_mib"], b["peak_mib"], b["base_mib"])
            ),
            "build_peak_rss_mib": statistics.median(map(max, a["build_peak_mib"], b["build_peak_mib"])),
            "base_rss_mib": statistics.median(map(max, a["base_mib"], b["base_mib"])),
            "buckets": a["buckets"],
            "block_medians_ms": [t for name, t in r0["blocks"] if name == v],
            "block_rss_before_build_mib": [round(max(x, y)) for x, y in zip(a["base_mib"], b["base_mib"])],
        }
    return {"params": r0["params"], "rows": rows, "others_cores": others, "wall_s": r0["wall_s"]}


def _importable_worker(name: str):
    # The launcher pickles the entry point by module name; under ``python benchmarks/vs_ddp.py``
    # this module is ``__main__``, which the spawned workers cannot import by that name.
    if __name__ != "__main__":
        return globals()[name]
    import importlib

    return getattr(importlib.import_module("benchmarks.vs_ddp"), name)


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    i = q * (len(s) - 1)
    lo = int(i)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def _missing_hook_modules() -> list[str]:
    return [m for m in HOOK_MODULES if importlib.util.find_spec(m) is None]


def _pairs(rows: dict) -> dict[str, str]:
    """fdp variant -> the DDP variant it is compared with."""
    out = {v: "ddp" for v in ("fdp after", "fdp overlap") if v in rows}
    out.update({f"fdp {h}": f"ddp {h}" for h in ("fp16", "powersgd") if f"fdp {h}" in rows and f"ddp {h}" in rows})
    return out


def _ratio_rows(rows: dict) -> dict[str, float]:
    """Ratio of median step times, fdp / DDP."""
    return {v: rows[v]["median_ms"] / rows[d]["median_ms"] for v, d in _pairs(rows).items()}


def _robust_ratios(rows: dict) -> dict[str, tuple[float, float]]:
    """Two checks on the ratio that other load moves less: the median over repetitions of the
    ratio of neighbouring blocks (run within seconds of each other), and the ratio of CPU time."""
    out = {}
    for v, d in _pairs(rows).items():
        paired = [x / y for x, y in zip(rows[v]["block_medians_ms"], rows[d]["block_medians_ms"])]
        out[v] = (statistics.median(paired), rows[v]["cpu_ms"] / rows[d]["cpu_ms"])
    return out


def _table(results: dict, default: str) -> list[str]:
    lines = [
        "| model | variant | step ms (median) | IQR ms | steps | vs DDP | CPU ms/step/rank | comm wait ms | peak "
        "RSS/rank MiB | of which added by the variant |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, res in results.items():
        rows = res["rows"]
        ratios = _ratio_rows(rows)
        for v, r in rows.items():
            mark = " (default)" if v == f"fdp {default}" else ""
            ratio = f"{ratios[v]:.2f}" if v in ratios else ""
            wait = f"{r['wait_ms']:.0f}" if v.startswith("fdp") else ""
            lines.append(
                f"| {model} ({res['params'] / 1e6:.1f}M) | {v}{mark} | {r['median_ms']:.0f} | "
                f"{r['q1_ms']:.0f}-{r['q3_ms']:.0f} | {r['n']} | {ratio} | {r['cpu_ms']:.0f} | {wait} | "
                f"{r['peak_rss_mib']:.0f} | {r['added_rss_mib']:.0f} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter blocks (under 2 minutes); prints only")
    parser.add_argument(
        "--hooks", action="store_true", help="add fp16 and PowerSGD rows (fdp hooks vs DDP's torch hooks)"
    )
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--allocator", choices=("tuned", "default"), default="tuned")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--steps", type=int, help="timed steps per block")
    parser.add_argument(
        "--budget-s", type=float, help="time for the timed blocks; later repetitions are dropped to fit (--quick: 70)"
    )
    parser.add_argument(
        "--fresh-rss",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="RSS from a fresh launch per variant (default: on, off with --quick)",
    )
    parser.add_argument("--write", action="store_true", help="write the results files even with --quick")
    args = parser.parse_args()
    quick = (
        dict(reps=3, warmup=1, steps=3, budget_s=70.0) if args.quick else dict(reps=6, warmup=3, steps=8, budget_s=None)
    )
    for k, v in quick.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.fresh_rss is None:
        args.fresh_rss = not args.quick
    if args.hooks:
        missing = _missing_hook_modules()
        if missing:
            sys.exit(f"--hooks needs the fdp hook library, missing: {', '.join(missing)}")
        args.warmup = max(args.warmup, POWERSGD_START + 1)  # PowerSGD compresses in every timed step
    variants = CORE + (HOOKED if args.hooks else [])
    default = _fdp_default_schedule()

    load_before = os.getloadavg()
    started = time.perf_counter()
    results = _run_models(args.models.split(","), variants, args)
    load_after = os.getloadavg()
    elapsed = time.perf_counter() - started
    if args.fresh_rss:
        _fresh_rss(results, variants, args)

    worst = max(_ratio_rows(res["rows"])[f"fdp {default}"] for res in results.values())
    others = ", ".join(f"{m} {r['others_cores']:.2f}" for m, r in results.items())
    header = [
        f"# fdp vs DDP ({datetime.date.today().isoformat()})",
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores shared with other jobs; 2 ranks, gloo, 1 torch thread each; "
        f"allocator: {args.allocator}.",
        f"Load average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1 min); CPU taken by other "
        f"processes during the run, in cores of {os.cpu_count()}: {others}.",
        f"SGD lr {LR} momentum {MOMENTUM}, torch's fused kernel on both sides; buckets {BUCKET_CAP_MB:g} MiB (first "
        f"{FIRST_BUCKET_CAP_MB:g} MiB); "
        f"mean allreduce. Repetitions of {len(variants)} alternating variants: "
        + ", ".join(f"{m} {len(r['rows']['ddp']['block_medians_ms'])}" for m, r in results.items())
        + (f" (at most {args.reps}; a {args.budget_s:g} s budget drops the rest)" if args.budget_s else "")
        + f"; each block: fresh "
        f"build, {args.warmup} warm-up + {args.steps} timed steps. Medians over the timed steps of rank 0; "
        "CPU ms/step/rank counts the compute thread and gloo's threads.",
        (
            "Peak RSS: the larger rank, over timed steps after warm-up, in a fresh launch per variant; 'added' is "
            "that peak minus the rank's RSS before building the variant (torch, gloo and the data are the rest)."
            if args.fresh_rss
            else "Peak RSS: the larger rank, over timed steps after warm-up, within the shared timing process (what "
            "earlier blocks left in the heap shifts it by 100-200 MiB; the full run measures fresh launches)."
        ),
        f"fdp's default schedule for 2 ranks (trainer.schedule=auto): `{default}`. No-communication rows (`noop`) are "
        "the lower bound. "
        + (
            "DDP's PowerSGD hook is wrapped to wait() inside the hook (gloo races otherwise), which "
            "serialises its buckets. "
            if args.hooks
            else ""
        )
        + f"Timed part {elapsed:.0f} s.",
        "",
    ]
    lines = header + _table(results, default)
    ratio_line = "; ".join(
        f"{m}: " + ", ".join(f"{v} {x:.2f}" for v, x in _ratio_rows(r["rows"]).items()) for m, r in results.items()
    )
    robust_line = "; ".join(
        f"{m}: " + ", ".join(f"{v} {p:.2f} / {c:.2f}" for v, (p, c) in _robust_ratios(r["rows"]).items())
        for m, r in results.items()
    )
    lines += [
        "",
        f"fdp/DDP step-time ratios (medians): {ratio_line}.",
        f"Checks, median of per-repetition block ratios / CPU-time ratio: {robust_line}.",
    ]
    print("\n".join(lines))
    if not args.quick or args.write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        md = RESULTS / "vs_ddp.md"
        # Hand-written analysis below NOTES_MARKER survives a rerun; the measured part above is replaced.
        kept = md.read_text().partition(NOTES_MARKER) if md.exists() else ("", "", "")
        notes = kept[1] + kept[2] if kept[1] else ""
        md.write_text("\n".join(lines) + f"\n\nfdp/ddp step time: {worst:.2f}\n" + (f"\n{notes}" if notes else ""))
        payload = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "load_before": load_before,
            "load_after": load_after,
            "settings": {k: getattr(args, k) for k in ("reps", "warmup", "steps", "allocator", "hooks")},
            "models": MODELS,
            "results": results,
        }
        (RESULTS / "vs_ddp.json").write_text(json.dumps(payload, indent=1))
    print(f"fdp/ddp step time: {worst:.2f}")


if __name__ == "__main__":
    main()
