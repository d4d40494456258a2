"""Host time of a train step on the CPU: fdp against eager PyTorch and DDP, where compute is negligible.

With one torch thread and tiny widths a step's time is its host time: Python, dispatch,
autograd's bookkeeping, the optimizer's loop over tensors. The structures are those of
``gpu.py`` and one more, at widths of a few units:

* ``charlm100``: ``gpu.py``'s 25M char transformer (8 layers, 100 tensors), d_model 8, batch 1 x 8;
* ``small28``: ``gpu.py``'s small char transformer (2 layers, 28 tensors), same widths;
* ``convnet``: ``fdp.model.builtin.ConvNet`` with BatchNorm (8 tensors, 6 buffers), width 2, batch 2;
* ``mlp500``: 249 hidden Linear layers of width 4 (500 tensors), batch 2.

Variants, each stepping with AdamW through torch's fused kernel, one bucket cap of 25 MiB
(first 1 MiB), a mean allreduce:

* ``eager``: the ``nn.Module``, ``zero_grad``, forward, ``backward``, ``AdamW(fused=True)``;
* ``ddp``: ``DistributedDataParallel`` over gloo, the same optimizer;
* ``fdp``: ``make_train_step`` as the trainer runs it (``donate=True``; ``after`` on one
  rank, ``overlap`` on two);
* ``fdp compiled``: the same with ``compile=True`` (one rank; its compile time apart).

A world of 1 (eager, DDP, fdp, fdp compiled) and one of 2 processes (DDP, fdp), each a
launch of ``fdp.procs.launch.spawn``. Variants run in alternating blocks (the order rotates each
repetition); each step is timed alone (``perf_counter``); medians of rank 0's steps.
Then, on one rank, the breakdown of fdp's step, from counters around the functions that
do each part (the rest is the step's own code: metrics, RNG, micro-batches, checks) and
of eager's (forward, backward, optimizer, ``zero_grad``), and the aten ops one step
issues (profiler events named ``aten::``).

    python benchmarks/host_cost.py [--quick] [--no-compile] [--fdp PATH] [--out FILE] [--before FILE]

``--fdp PATH`` measures the fdp found at PATH (another checkout) with this script;
``--before FILE`` adds that earlier run's table (its JSON) to the markdown. The full run
writes ``benchmarks/results/host_cost.{md,json}``; the last line printed is
``fdp/eager host time: X`` (the worst structure, one rank).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LR = 1e-3
BUCKET_CAP_MB, FIRST_BUCKET_CAP_MB = 25.0, 1.0
STRUCTURES = {
    "charlm100": {"kind": "charlm", "vocab": 32, "seq": 8, "d_model": 8, "n_layer": 8, "n_head": 2, "batch": 1},
    "small28": {"kind": "charlm", "vocab": 32, "seq": 8, "d_model": 8, "n_layer": 2, "n_head": 2, "batch": 1},
    "convnet": {"kind": "convnet", "width": 2, "batch": 2},
    "mlp500": {"kind": "mlp", "width": 4, "depth": 249, "batch": 2},
}
GOAL = 1.10  # fdp's host time per step against eager's (1 rank) and DDP's (2 ranks)


def _use_fdp(path: Path) -> None:
    # The fdp measured comes first on the path, here and in the workers; this script's package after it.
    sys.path[:0] = [str(path), str(REPO)]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), str(REPO), os.environ.get("PYTHONPATH")]))


def module_for(spec: dict):
    import torch

    from fdp.model.builtin import MLP, CharTransformer, ConvNet

    torch.manual_seed(0)
    if spec["kind"] == "charlm":
        return CharTransformer(spec["vocab"], spec["seq"], spec["d_model"], spec["n_layer"], spec["n_head"])
    if spec["kind"] == "convnet":
        return ConvNet(width=spec["width"])
    return MLP(spec["width"], spec["width"], spec["depth"], spec["width"])


def batch_for(spec: dict, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    if spec["kind"] == "charlm":
        tokens = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if spec["kind"] == "convnet":
        return torch.randn(spec["batch"], 1, 8, 8, generator=g), torch.randint(0, 10, (spec["batch"],), generator=g)
    return torch.randn(spec["batch"], spec["width"], generator=g), torch.randint(
        0, spec["width"], (spec["batch"],), generator=g
    )


def _loss(logits, y):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _torch_step(module, batch, parts: dict | None = None):
    import torch

    opt = torch.optim.AdamW(module.parameters(), lr=LR, fused=True)
    x, y = batch
    clock = time.perf_counter

    def step():
        t0 = clock()
        opt.zero_grad(set_to_none=True)
        t1 = clock()
        loss = _loss(module(x), y)
        t2 = clock()
        loss.backward()
        t3 = clock()
        opt.step()
        if parts is not None:
            t4 = clock()
            for name, dt in (
                ("zero_grad", t1 - t0),
                ("forward", t2 - t1),
                ("backward", t3 - t2),
                ("optimizer", t4 - t3),
            ):
                parts[name] += dt
        return loss.detach()

    return step


def _fdp_step(spec: dict, batch, world: int, compile: bool, optimizer=None):
    from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
    from fdp.comm import Comm
    from fdp.hooks import allreduce
    from fdp.model.functional import functionalize
    from fdp.optim import adamw
    from fdp.plan import plan_buckets

    model, params, buffers = functionalize(module_for(spec), keep_module_weights=False)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers),
        params,
        batch,
        bucket_cap_mb=BUCKET_CAP_MB,
        first_bucket_cap_mb=FIRST_BUCKET_CAP_MB,
    )
    optimizer = optimizer or adamw(LR)
    schedule = "overlap" if world > 1 and not compile else "after"  # what the trainer picks
    train_step = make_train_step(
        loss_fn, optimizer, plan, allreduce(), Comm(), schedule=schedule, donate=True, compile=compile
    )
    state = [init_train_state(params, buffers, optimizer, plan, allreduce())]

    def step():
        state[0], metrics = train_step(state[0], batch)
        return metrics["loss"]

    return step


def build(variant: str, spec: dict, batch, world: int, parts: dict | None = None):
    if variant == "eager":
        return _torch_step(module_for(spec), batch, parts)
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return _torch_step(DistributedDataParallel(module_for(spec), bucket_cap_mb=BUCKET_CAP_MB), batch)
    return _fdp_step(spec, batch, world, compile=variant == "fdp compiled")


# ------------------------------------------------------------------------ fdp's breakdown

# (module, attribute, part): the functions that do each part of fdp's step. A name this
# fdp lacks (an older checkout) is skipped; its time falls to "rest of the step".
TIMED = [
    ("fdp.model.functional", "FunctionalModel.apply", "forward (functional call)"),
    ("fdp.model.functional", "swap_into", "reparametrisation"),
    ("fdp.model.functional", "swap_back", "reparametrisation"),
    ("fdp.step.reduce", "GradReducer.backward", "gradient (torch.func)"),
    ("fdp.step.reduce", "GradReducer._store", "bucket copies"),
    ("fdp.step.reduce", "GradReducer._store_flat", "bucket copies"),
    ("fdp.step.reduce", "_write", "bucket copies"),
    ("fdp.step.reduce", "GradReducer.grad_views", "gradient views"),
    ("fdp.update.base", "slot_views", "gradient views"),
    ("fdp.plan.buckets", "views_in", "param views of the flat buffers"),
    ("fdp.step.chains", "Reduction.start", "hook chains (start)"),
    ("fdp.step.chains", "Reduction._resume", "hook chains (resume)"),
    ("fdp.update.base", "finite_flag", "finiteness flags"),
    ("fdp.step.verdicts", "DeferredVerdicts.record", "finiteness flags"),
    ("fdp.update.base", "apply_gradients", "optimizer"),
]
# part -> the part it runs inside of (whose time it is taken out of)
NESTED = {
    "reparametrisation": "forward (functional call)",
    "forward (functional call)": "gradient (torch.func)",
    "param views of the flat buffers": "gradient (torch.func)",
    "bucket copies": "gradient (torch.func)",
    "hook chains (start)": "gradient (torch.func)",
}


def _timed(fn, part: str, acc: dict):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[part] += time.perf_counter() - t0

    return run


def _instrument(acc: dict) -> list:
    """Wrap the functions of TIMED to add their time to ``acc``; return what undoes it."""
    import importlib

    undo = []
    for module_name, qualname, part in TIMED:
        owner = importlib.import_module(module_name)
        *path, name = qualname.split(".")
        for attr in path:
            owner = getattr(owner, attr, None)
        if owner is None or not hasattr(owner, name):
            continue
        original = getattr(owner, name)
        setattr(owner, name, _timed(original, part, acc))
        undo.append((owner, name, original))
    return undo


def _per_step_medians(step, acc: dict, own, steps: int) -> dict:
    """Median microseconds per step of each part (``own(acc)`` after each step), and of the whole step."""
    for _ in range(5):
        step()
    rows = []
    for _ in range(steps):
        acc.clear()
        t0 = time.perf_counter()
        step()
        rows.append({**own(acc), "total": time.perf_counter() - t0})
    parts = {part for row in rows for part in row} - {"total"}
    rest = [r["total"] - sum(v for k, v in r.items() if k != "total") for r in rows]
    medians = {part: 1e6 * statistics.median(r.get(part, 0.0) for r in rows) for part in parts}
    medians["rest of the step"] = 1e6 * statistics.median(rest)
    # The parts' medians add up to a typical step; a median of whole steps would take the load of other jobs in.
    return {**medians, "total": sum(medians.values())}


def _own_times(acc: dict) -> dict:
    # A part nested in another is taken out of that one, so the parts add up to the step.
    own = dict(acc)
    for inner, outer in NESTED.items():
        if inner in acc and outer in acc:
            own[outer] -= acc[inner]
    if "gradient (torch.func)" in own:
        own["backward and transform"] = own.pop("gradient (torch.func)")
    return own


def _fdp_breakdown(spec: dict, batch, steps: int) -> dict:
    """Each part of fdp's step, from counters around the functions that do it."""
    from fdp.optim import adamw

    acc: dict = collections.defaultdict(float)
    opt = adamw(LR)
    timed_opt = opt._replace(update_inplace=_timed(opt.update_inplace, "optimizer", acc))
    undo = _instrument(acc)
    try:
        return _per_step_medians(_fdp_step(spec, batch, 1, compile=False, optimizer=timed_opt), acc, _own_times, steps)
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


def _eager_breakdown(spec: dict, batch, steps: int) -> dict:
    parts: dict = collections.defaultdict(float)
    return _per_step_medians(_torch_step(module_for(spec), batch, parts), parts, dict, steps)


def _aten_ops(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


# ------------------------------------------------------------------------------- ranks


def worker(
    layout, structures: list[str], variants: list[str], reps: int, steps: int, warmup: int, breakdown_steps: int
) -> dict:
    import torch

    from fdp.procs.launch import init_distributed

    comm = init_distributed(layout)
    torch.set_num_threads(1)
    rank, world = comm.rank, comm.world_size
    out = {}
    for name in structures:
        spec = STRUCTURES[name]
        batch = batch_for(spec, rank)
        built, compile_s = {}, {}
        for v in variants:
            t0 = time.perf_counter()
            built[v] = build(v, spec, batch, world)
            built[v]()  # the first step (a compiled variant compiles here)
            compile_s[v] = time.perf_counter() - t0
        first_loss = {v: built[v]().item() for v in variants}
        times = {v: [] for v in variants}
        for rep in range(reps):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for v in order:
                for _ in range(warmup):
                    built[v]()
                for _ in range(steps):
                    t0, c0 = time.perf_counter(), time.process_time()
                    built[v]()
                    times[v].append((time.perf_counter() - t0, time.process_time() - c0))
        result = {
            "times": times,
            "first_loss": first_loss,
            "first_step_s": compile_s,
            "tensors": sum(1 for _ in module_for(spec).parameters()),
        }
        if world == 1 and breakdown_steps:
            result["breakdown"] = {
                "fdp": _fdp_breakdown(spec, batch, breakdown_steps),
                "eager": _eager_breakdown(spec, batch, breakdown_steps),
            }
            result["aten_ops"] = {v: _aten_ops(built[v]) for v in ("eager", "fdp") if v in built}
        out[name] = result
        del built
    return out if rank == 0 else {}


def _run_world(world: int, structures, variants, args) -> dict:
    from fdp.procs.launch import WorldLayout, spawn

    layout = WorldLayout("elastic", nproc_per_node=world, backend="gloo", timeout_s=900.0)
    import importlib

    entry = importlib.import_module("benchmarks.host_cost").worker  # pickled by module name
    breakdown = args.breakdown_steps if world == 1 else 0
    return spawn(entry, (layout, structures, variants, args.reps, args.steps, args.warmup, breakdown), layout)[0]


# ------------------------------------------------------------------------------ tables


def summarise(one: dict, two: dict) -> dict:
    rows = {}
    for name in one:
        timed = {f"{v} 1": ts for v, ts in one[name]["times"].items()}
        timed.update({f"{v} 2": ts for v, ts in two.get(name, {}).get("times", {}).items()})
        # CPU time (the process's, all its threads) is the host's work; the wall time adds waits and other jobs.
        med = {v: 1e3 * statistics.median(cpu for _, cpu in ts) for v, ts in timed.items()}
        wall = {v: 1e3 * statistics.median(w for w, _ in ts) for v, ts in timed.items()}
        row = {
            "tensors": one[name]["tensors"],
            "ms": med,
            "wall_ms": wall,
            "fdp/eager": med["fdp 1"] / med["eager 1"],
            "fdp/ddp 1": med["fdp 1"] / med["ddp 1"],
            "wall fdp/eager": wall["fdp 1"] / wall["eager 1"],
        }
        if "fdp 2" in med:
            row["fdp/ddp 2"] = med["fdp 2"] / med["ddp 2"]
            row["wall fdp/ddp 2"] = wall["fdp 2"] / wall["ddp 2"]
        if "fdp compiled 1" in med:
            row["compiled/eager"] = med["fdp compiled 1"] / med["eager 1"]
            row["compile_s"] = one[name]["first_step_s"]["fdp compiled"]
        row["breakdown"] = one[name].get("breakdown")
        row["aten_ops"] = one[name].get("aten_ops")
        rows[name] = row
    return rows


def _fmt(x) -> str:
    return "" if x is None else f"{x:.2f}"


def markdown(rows: dict, meta: str, before: dict | None) -> str:
    head = (
        "| structure | tensors | eager | DDP (1) | fdp (1) | fdp/eager (1) | fdp/DDP (1) | DDP (2) | fdp (2) "
        "| fdp/DDP (2) | fdp compiled | compiled/eager | wall: fdp/eager (1) | wall: fdp/DDP (2) |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        ms = r["ms"]
        lines.append(
            f"| {name} | {r['tensors']} | {ms['eager 1']:.2f} | {ms['ddp 1']:.2f} | {ms['fdp 1']:.2f} | "
            f"{r['fdp/eager']:.2f} | {r['fdp/ddp 1']:.2f} | {_fmt(ms.get('ddp 2'))} | {_fmt(ms.get('fdp 2'))} | "
            f"{_fmt(r.get('fdp/ddp 2'))} | "
            f"{_fmt(ms.get('fdp compiled 1'))} | {_fmt(r.get('compiled/eager'))} | {_fmt(r.get('wall fdp/eager'))} | "
            f"{_fmt(r.get('wall fdp/ddp 2'))} |"
        )
    out = [
        "# Host time per step on the CPU: fdp, eager PyTorch and DDP at tiny widths",
        "",
        meta,
        "",
        "CPU milliseconds per step (the process's CPU time, all its threads: the host's work, which other jobs on the "
        "machine inflate far less than the wall time); ratios of those; the last two columns are ratios of wall times.",
        "",
        *lines,
        "",
    ]
    if before:
        out += [
            "Before (the same script on the fdp of the `--before` run):",
            "",
            "| structure | fdp/eager (1) before | after | fdp/DDP (2) before | after | fdp ms (1) before | after |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in rows.items():
            b = before["rows"].get(name)
            if b:
                out.append(
                    f"| {name} | {b['fdp/eager']:.2f} | {r['fdp/eager']:.2f} | {_fmt(b.get('fdp/ddp 2'))} | "
                    f"{_fmt(r.get('fdp/ddp 2'))} | {b['ms']['fdp 1']:.2f} | {r['ms']['fdp 1']:.2f} |"
                )
        out += ["", f"Before: {before['meta']}", ""]
    parts = sorted({p for r in rows.values() if r["breakdown"] for p in r["breakdown"]["fdp"]} - {"total"})
    if parts:
        out += [
            "Where fdp's step spends its host time (microseconds per step, one rank; counters around the functions "
            "that do each part; medians over the steps; the total is their sum):",
            "",
            "| part | " + " | ".join(rows) + " |",
            "|---|" + "---:|" * len(rows),
        ]
        for p in [*parts, "total"]:
            out.append(
                f"| {p} | " + " | ".join(f"{r['breakdown']['fdp'].get(p, 0.0):.0f}" for r in rows.values()) + " |"
            )
        out += [
            "",
            "Eager PyTorch's step, the same way:",
            "",
            "| part | " + " | ".join(rows) + " |",
            "|---|" + "---:|" * len(rows),
        ]
        for p in ["zero_grad", "forward", "backward", "optimizer", "rest of the step", "total"]:
            out.append(
                f"| {p} | " + " | ".join(f"{r['breakdown']['eager'].get(p, 0.0):.0f}" for r in rows.values()) + " |"
            )
        out += [
            "",
            "aten ops per step (profiler events named `aten::`): "
            + "; ".join(
                f"{n} eager {r['aten_ops']['eager']}, fdp {r['aten_ops']['fdp']}"
                for n, r in rows.items()
                if r["aten_ops"]
            ),
            "",
        ]
    out += [
        "What of this is torch.func's own, reproduced in plain torch: `func_overhead.md` (`python "
        "benchmarks/func_overhead.py`).",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="2 repetitions of 10 steps, no compiled variant; prints only"
    )
    parser.add_argument("--no-compile", action="store_true", help="leave out fdp compiled")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--breakdown-steps", type=int, default=200)
    parser.add_argument("--structures", default=",".join(STRUCTURES))
    parser.add_argument("--fdp", type=Path, default=REPO, help="the checkout whose fdp is measured")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON to write (default: results/host_cost.json on a full run)"
    )
    parser.add_argument("--before", type=Path, default=None, help="an earlier run's JSON, shown beside this one")
    args = parser.parse_args()
    _use_fdp(args.fdp.resolve())
    import torch

    if args.quick:
        args.reps, args.steps, args.breakdown_steps, args.no_compile = 2, 10, 50, True
    structures = args.structures.split(",")
    one_rank = ["eager", "ddp", "fdp"] + ([] if args.no_compile else ["fdp compiled"])
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    one = _run_world(1, structures, one_rank, args)
    two = _run_world(2, structures, ["ddp", "fdp"], args)
    rows = summarise(one, two)
    load_after = os.getloadavg()
    meta = (
        f"`python benchmarks/host_cost.py{' --no-compile' if args.no_compile and not args.quick else ''}`: "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}, 1 thread per "
        f"rank; fdp from `{os.path.relpath(args.fdp.resolve(), REPO)}`; {args.reps} repetitions x ({args.warmup} "
        "warm-up + "
        f"{args.steps} timed steps) per variant, medians; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after ({os.cpu_count()} cores); {time.perf_counter() - t0:.0f} s"
    )
    before = json.loads(args.before.read_text()) if args.before else None
    text = markdown(rows, meta, before)
    print(text)
    out = args.out or (None if args.quick else RESULTS / "host_cost.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        if out == RESULTS / "host_cost.json":
            (RESULTS / "host_cost.md").write_text(text)
    worst = max(r["fdp/eager"] for r in rows.values())
    worst_two = max((r.get("fdp/ddp 2", 0.0) for r in rows.values()), default=0.0)
    print(f"goal fdp/eager (1 rank) <= {GOAL}: worst {worst:.2f}; fdp/DDP (2 ranks) <= {GOAL}: worst {worst_two:.2f}")
    print(f"fdp/eager host time: {worst:.2f}")


if __name__ == "__main__":
    main()
