"""Benchmark: static bucket planning, and pack/unpack against a naive cat + split copy.

Run ``python benchmarks/plan_and_pack.py`` (full, writes
``benchmarks/results/plan_and_pack.md``) or ``--quick`` (smaller trees, fewer repeats,
prints only). Every measurement runs in a fresh subprocess with one torch thread, so peak
memory is the process's own: ``VmHWM`` (reset through ``/proc/self/clear_refs``) minus
the resident size before the measured steps; tracemalloc cannot see torch's allocator.
The one-time import that the first ``torch.func`` transform triggers is timed apart.

Planning: a ``nn.Sequential`` of 5,000 ``Linear(4, 4)`` (10,000 tensors), loss =
MSE of the output, example batch of 2 rows; timed per ``trace`` mode of
``gradient_ready_order`` (``auto`` is what ``plan_buckets`` does by default), and the pure
packing step alone.

Packing: ~25M float32 parameters as 24 ``Linear(1024, 1024)`` (48 tensors), plus the
10,000-tensor tree, per step: ``fdp.plan.buckets.pack`` + ``unpack`` into buffers allocated once,
against ``flat = torch.cat([g.reshape(-1) ...]); flat.split(numels)`` + ``view`` (a new
flat buffer every step, what a plan-less implementation does). A third row packs with
``torch.cat(..., out=buffer)`` instead of fdp's cached slot aliases + ``_foreach_copy_``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "plan_and_pack.md"
MiB = 2**20
if str(REPO) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(REPO))

from benchmarks._proc import reset_peak, status_mib  # noqa: E402

# ----------------------------------------------------------------------------- children


def _child_plan(args: dict) -> dict:
    import torch
    from torch import nn

    from fdp.model.functional import functionalize
    from fdp.plan import gradient_ready_order, pack_into_buckets, plan_buckets

    torch.set_num_threads(1)
    n_layers, mode = args["layers"], args["mode"]
    # The first torch.func transform in a process imports torch._dynamo (seconds). The
    # training step pays that anyway, so it is timed apart from planning.
    t0 = time.perf_counter()
    torch.func.grad(lambda x: (x * x).sum())(torch.ones(2))
    result = {"func_import_s": time.perf_counter() - t0}
    model, params, buffers = functionalize(nn.Sequential(*[nn.Linear(4, 4) for _ in range(n_layers)]))

    def loss_fn(p, batch):
        out, _ = model.apply(p, buffers, batch[0])
        return nn.functional.mse_loss(out, batch[1])

    batch = (torch.randn(2, 4), torch.randn(2, 4))
    result["tensors"] = len(params)
    order = [(n, tuple(t.shape), t.dtype, t.device) for n, t in reversed(params.items())]
    run = {
        "plan_buckets": lambda: plan_buckets(loss_fn, params, batch),
        "meta": lambda: gradient_ready_order(loss_fn, params, batch, trace="meta"),
        "real": lambda: gradient_ready_order(loss_fn, params, batch, trace="real"),
        "pack_only": lambda: pack_into_buckets(order),
        "grad_floor": lambda: torch.func.grad(loss_fn)(params, batch),
    }[mode]
    times = []
    for _ in range(args["repeats"]):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    if mode == "plan_buckets":
        result["buckets"] = len(out)
        # plan_buckets traces with trace="auto": meta first. Say whether meta succeeded.
        try:
            gradient_ready_order(loss_fn, params, batch, trace="meta")
            result["meta_ok"] = True
        except Exception as e:  # noqa: BLE001 - reported, not handled
            result["meta_ok"] = f"no: {type(e).__name__}"
    return {**result, "first_s": times[0], "best_s": min(times)}


def _child_pack(args: dict) -> dict:
    import torch

    from fdp.plan import pack_into_buckets
    from fdp.plan.buckets import allocate, pack, unpack

    torch.set_num_threads(1)
    shapes = []
    for _ in range(args["layers"]):
        shapes += [(args["width"],), (args["width"], args["width"])]
    names = [f"{i // 2}.{'bias' if i % 2 == 0 else 'weight'}" for i in range(len(shapes))]
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(s, generator=gen) for n, s in zip(names, shapes)}
    numels = [math.prod(s) for s in shapes]
    plan = pack_into_buckets([(n, s, torch.float32, "cpu") for n, s in zip(names, shapes)])
    impl = args["impl"]
    flats = allocate(plan) if impl != "naive" else None

    def fdp_step():
        return unpack(plan, pack(plan, grads, flats))

    def cat_out_step():
        with torch.no_grad():
            for b, f in zip(plan.buckets, flats):
                torch.cat([grads[n].reshape(-1) for n in b._layout[0]], out=f)
        return unpack(plan, flats)

    def naive_step():
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        return {n: v.view(s) for n, v, s in zip(grads, flat.split(numels), shapes)}

    step = {"fdp": fdp_step, "cat_out": cat_out_step, "naive": naive_step}[impl]
    out = step()  # first call: builds the cached slot aliases (fdp), checks results
    assert all(torch.equal(out[n], grads[n]) for n in grads)
    del out
    rss_before = status_mib("VmRSS")
    reset_peak()
    times, kept = [], None
    for _ in range(args["repeats"]):
        t0 = time.perf_counter()
        kept = step()  # keep the result alive like a training loop does until the next step
        times.append(time.perf_counter() - t0)
    peak = status_mib("VmHWM") - rss_before
    return {
        "params": sum(numels),
        "tensors": len(shapes),
        "buckets": len(plan),
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "peak_extra_mib": peak,
        "persistent_mib": sum(f.numel() * 4 for f in flats) / MiB if flats else 0.0,
        "kept": len(kept),
    }


def _run_child(task: str, args: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", task, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {task} {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small trees, few repeats, print only")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        task, args = ns.child
        print(json.dumps({"plan": _child_plan, "pack": _child_pack}[task](json.loads(args))))
        return

    quick = ns.quick
    plan_layers = 500 if quick else 5000
    plan_repeats = 2 if quick else 3
    big = dict(layers=4, width=512) if quick else dict(layers=24, width=1024)
    pack_repeats = 5 if quick else 20
    lines = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    emit("# Bucket planning and packing")
    emit()
    emit(
        f"{'QUICK run, not the reference figures. ' if quick else ''}"
        f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs, torch threads = 1, "
        f"Python {platform.python_version()}. Each figure comes from a fresh subprocess."
    )
    emit()
    emit(f"## Planning: `nn.Sequential` of {plan_layers:,} `Linear(4, 4)` ({2 * plan_layers:,} tensors), batch of 2")
    emit()
    emit("| what | path | first call (s) | best of later calls (s) |")
    emit("|---|---|---:|---:|")
    rows = [
        ('`plan_buckets(...)` (default, trace="auto")', "plan_buckets"),
        ('`gradient_ready_order(trace="meta")`', "meta"),
        ('`gradient_ready_order(trace="real")`', "real"),
        ("`pack_into_buckets` alone (given the order)", "pack_only"),
        ("floor: one `torch.func.grad` of the loss, no hooks", "grad_floor"),
    ]
    meta_ok, imports = None, []
    for label, mode in rows:
        r = _run_child("plan", dict(layers=plan_layers, mode=mode, repeats=plan_repeats))
        imports.append(r["func_import_s"])
        if mode == "plan_buckets":
            meta_ok = r["meta_ok"]
            path = "meta" if meta_ok is True else "real (meta failed)"
        else:
            path = {"meta": "meta", "real": "real", "pack_only": "-", "grad_floor": "real"}[mode]
        emit(f"| {label} | {path} | {r['first_s']:.3f} | {r['best_s']:.3f} |")
    emit()
    emit(
        f"Meta path used by the default: {'yes' if meta_ok is True else meta_ok}. Goal: < 0.5 s for 10,000 tensors. "
        f"Not included above: the first `torch.func` transform of a process imports `torch._dynamo` "
        f"({min(imports):.1f}-{max(imports):.1f} s here), which the training step pays anyway; each child "
        f"warms it up on a toy function first."
    )
    emit()
    n_params = big["layers"] * (big["width"] ** 2 + big["width"])
    emit("## pack + unpack per step, float32, default caps (25 MiB, first 1 MiB)")
    emit()
    emit(
        "| tree | implementation | median ms/step | best ms/step | peak extra RSS per step (MiB) | buffers held (MiB) "
        "| speed-up vs naive (median / best) |"
    )
    emit("|---|---|---:|---:|---:|---:|---:|")
    trees = [
        (
            f"{big['layers']} x Linear({big['width']}, {big['width']}): {n_params / 1e6:.1f}M params, "
            f"{2 * big['layers']} tensors",
            big,
        ),
        (
            f"{plan_layers:,} x Linear(4, 4): {plan_layers * 20:,} params, {2 * plan_layers:,} tensors",
            dict(layers=plan_layers, width=4),
        ),
    ]
    for tree_label, shape in trees:
        res = {
            impl: _run_child("pack", dict(**shape, impl=impl, repeats=pack_repeats))
            for impl in ("naive", "fdp", "cat_out")
        }
        labels = {
            "naive": "naive `torch.cat` + `split`/`view` (new flat each step)",
            "fdp": "`fdp.plan.buckets.pack` + `unpack` (cached aliases, `_foreach_copy_`)",
            "cat_out": "alternative: `torch.cat(out=buffer)` + `unpack`",
        }
        for impl, r in res.items():
            ratio_med = res["naive"]["median_ms"] / r["median_ms"]
            ratio_min = res["naive"]["min_ms"] / r["min_ms"]
            emit(
                f"| {tree_label} ({r['buckets']} buckets) | {labels[impl]} | {r['median_ms']:.2f} | {r['min_ms']:.2f} "
                f"| {r['peak_extra_mib']:.1f} | {r['persistent_mib']:.1f} | {ratio_med:.2f}x / {ratio_min:.2f}x |"
            )
    emit()
    emit(
        "Peak extra RSS is the high-water mark during the timed steps over the resident size just before "
        "them, with the previous step's result kept alive (as a training loop does). fdp's buffers are "
        "allocated once before the timed steps (column 'buffers held'); the naive copy allocates a new "
        "flat tensor every step. Times vary by tens of percent on this shared machine."
    )
    if not quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("\n".join(lines) + "\n")
        print(f"\nwrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
