"""Benchmark: fdp vs DDP on two simulated nodes with shaped links (netsim), per comm hook.

Two network namespaces (``benchmarks/netsim``: veth links, tbf at RATE per node and
direction, no added delay), one rank per node, gloo over ``nsim0``. For each rate
(1 Gbit/s and 100 Mbit/s), each model and each hook:

* fdp: ``python recipes/train.py world=torchrun ...`` in each node, the user's path
  (``hooks=noop|allreduce|fp16|powersgd|topk``; PowerSGD rank 1 and 4 compress from step 3);
* DDP: the same model, data, initial weights, batches and optimizer under
  ``DistributedDataParallel`` with torch's hook: ``noop_hook``, ``allreduce_hook``,
  ``fp16_compress_hook``, ``powerSGD_hook`` (rank 1 / 4, start iteration 2, wrapped to
  ``wait()`` inside the hook: unwrapped it races on gloo with several buckets). Top-k has no
  DDP hook in torch, so it is fdp only.

Models (see ``_netsim.MODELS``): the 25.27M MLP (25 x 1024 hidden, digits, 32 per rank)
and the 15.85M char transformer (d_model 512, 5 layers, stdlib text, 4 x 64 tokens per
rank); Adam 1e-3 on both sides. Per run: median step time over the steps after the first
two (fdp's own convention), the bytes each rank hands to collectives per step (fdp's
``bytes_sent``; the DDP worker counts the same at ``dist.all_reduce``), and the training
loss at the last step (mean over ranks, the batch of that step, as fdp logs it). The
``noop`` rows are the no-communication floor.

    python benchmarks/netsim_multinode.py            # full run (root), ~45-60 min on 2 busy cores
    python benchmarks/netsim_multinode.py --quick    # MLP, 3 hooks, few steps (~5 min)

Writes ``benchmarks/results/netsim_multinode.{md,json}`` and ``netsim_multinode*.png``
after every run; ``--quick`` writes them beside its logs, in
``benchmarks/runs/netsim_multinode/<date-time>/``, unless ``--write``. The network is taken
down at the end, on an error, on Ctrl-C and on SIGTERM/SIGHUP.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _netsim as N  # noqa: E402

RATES = ["1gbit", "100mbit"]
FDP_VARIANTS = ["noop", "allreduce", "fp16", "powersgd1", "powersgd4", "topk"]
UNCOMPRESSED = {"allreduce", "fp16"}
GOAL_VARIANTS = {
    "noop",
    "allreduce",
    "powersgd4",
}  # repeated --goal-reps times at 1 Gbit/s  # ~100 MB / 50 MB a step: few steps at 100 Mbit
LABELS = {
    "noop": "noop",
    "allreduce": "allreduce",
    "fp16": "fp16",
    "powersgd1": "PowerSGD r1",
    "powersgd4": "PowerSGD r4",
    "topk": "top-k 1%",
}
TORCH_HOOK = {
    "noop": "noop_hook",
    "allreduce": "allreduce_hook",
    "fp16": "fp16_compress_hook",
    "powersgd1": "powerSGD_hook r1 (+wait)",
    "powersgd4": "powerSGD_hook r4 (+wait)",
    "topk": "none in torch",
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="MLP only, noop/allreduce/powersgd4, few steps")
    p.add_argument("--rates", help=f"comma list (default {','.join(RATES)})")
    p.add_argument("--models", help="comma list of mlp,transformer")
    p.add_argument("--variants", help=f"comma list of {','.join(FDP_VARIANTS)}")
    p.add_argument("--steps", type=int, help="steps per run (default 20; --quick 6)")
    p.add_argument(
        "--steps-uncompressed", type=int, help="steps for allreduce/fp16 below 1 Gbit/s (default 6; --quick 4)"
    )
    p.add_argument("--reps", type=int, default=1, help="repeat every run, in rotated order (default 1)")
    p.add_argument(
        "--goal-reps",
        type=int,
        help="repetitions of the runs the goals compare (1 Gbit/s: noop, allreduce, PowerSGD r4, both "
        "sides), interleaved with the others (default 3; --quick 1)",
    )
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    p.add_argument(
        "--force", action="store_true", help="rebuild the simulated cluster even if its fdpsim-* namespaces exist"
    )
    p.add_argument("--write", action="store_true", help="with --quick: write into benchmarks/results")
    p.add_argument("--out", help="results directory (default benchmarks/results)")
    p.add_argument("--name", default="netsim_multinode", help="stem of the result files (default netsim_multinode)")
    a = p.parse_args()
    q = a.quick
    a.rates = (a.rates or ",".join(RATES)).split(",")
    a.models = (a.models or ("mlp" if q else "mlp,transformer")).split(",")
    a.variants = (a.variants or ("noop,allreduce,powersgd4" if q else ",".join(FDP_VARIANTS))).split(",")
    a.steps = a.steps or (6 if q else 20)
    a.steps_uncompressed = a.steps_uncompressed or (4 if q else 6)
    a.goal_reps = a.goal_reps or (1 if q else 3)
    for m in a.models:
        if m not in N.MODELS:
            p.error(f"unknown model {m!r}")
    for v in a.variants:
        if v not in FDP_VARIANTS:
            p.error(f"unknown variant {v!r}")
    return a


def steps_for(rate: str, variant: str, args) -> int:
    if variant in UNCOMPRESSED and rate_bps(rate) < 1e9:
        return min(args.steps, args.steps_uncompressed)
    return args.steps


def rate_bps(rate: str) -> float:
    r = rate.lower()
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if r.endswith(suffix):
            return float(r[: -len(suffix)]) * mult
    return float("inf")


# ----------------------------------------------------------------------------- reporting
def _fmt_ms(r: dict | None) -> str:
    if not r:
        return ""
    if r.get("error"):
        return "failed"
    return f"{r['median_ms']:.0f} ({r['q1_ms']:.0f}-{r['q3_ms']:.0f})"


def _mb(r: dict | None) -> str:
    return f"{r['bytes_per_step'] / 1e6:.2f}" if r and "bytes_per_step" in r else ""


def _loss(r: dict | None) -> str:
    return f"{r['loss_final']:.4f}" if r and "loss_final" in r else ""


def _load(r: dict | None) -> str:
    if not r or "load" not in r:
        return ""
    if len(r.get("load_reps", [])) > 1:  # several repetitions: the range over them
        lds = r["load_reps"]
        loads = [x["load_start"] for x in lds] + [x["load_end"] for x in lds]
        others = [x["others_cores"] for x in lds]
        return f"{min(loads):.1f}-{max(loads):.1f} / {min(others):.2f}-{max(others):.2f}"
    ld = r["load"]
    return f"{ld['load_start']:.1f}→{ld['load_end']:.1f} / {ld['others_cores']:.2f}"


merge_reps = N.merge_reps


def goals(results: dict, rate: str = "1gbit") -> list[str]:
    lines = []
    for model, sides in results.get(rate, {}).items():
        fdp = {v: merge_reps(r) for v, r in sides.get("fdp", {}).items()}
        ddp = {v: merge_reps(r) for v, r in sides.get("ddp", {}).items()}
        p4, noop, ar = fdp.get("powersgd4"), fdp.get("noop"), fdp.get("allreduce")
        d_ar = ddp.get("allreduce")
        ok = lambda r: r is not None and "median_ms" in r  # noqa: E731

        def paired(a: dict, b: dict) -> str:
            # the same ratio within each repetition (runs of one repetition are close in time)
            ra, rb = a.get("rep_medians_ms", []), b.get("rep_medians_ms", [])
            if len(ra) < 2 or len(ra) != len(rb):
                return ""
            return "; per repetition " + ", ".join(f"{x / y:.2f}x" for x, y in zip(ra, rb))

        if ok(p4) and ok(noop):
            x = p4["median_ms"] / noop["median_ms"]
            lines.append(
                f"- {model} @ {rate}: fdp PowerSGD r4 / fdp no-comm step = {p4['median_ms']:.0f} / "
                f"{noop['median_ms']:.0f} ms = **{x:.2f}x** (goal ≤ 1.5x: {'met' if x <= 1.5 else 'NOT met'}"
                f"{paired(p4, noop)})"
            )
        if ok(p4) and ok(d_ar):
            x = d_ar["median_ms"] / p4["median_ms"]
            bound = (
                f"; the ceiling with zero-cost communication is DDP allreduce / fdp no-comm = "
                f"{d_ar['median_ms'] / noop['median_ms']:.2f}x"
                if ok(noop)
                else ""
            )
            lines.append(
                f"- {model} @ {rate}: DDP allreduce / fdp PowerSGD r4 = {d_ar['median_ms']:.0f} / "
                f"{p4['median_ms']:.0f} ms = **{x:.2f}x** faster (goal ≥ 5x: {'met' if x >= 5 else 'NOT met'}"
                f"{bound}{paired(d_ar, p4)})"
            )
        if ok(p4) and ok(ar) and p4["steps"] == ar["steps"]:
            d = (p4["loss_final"] - ar["loss_final"]) / ar["loss_final"]
            d5 = (p4["loss_last5"] - ar["loss_last5"]) / ar["loss_last5"]
            lines.append(
                f"- {model} @ {rate}: loss after {p4['steps']} steps, fdp PowerSGD r4 vs fdp allreduce: "
                f"{p4['loss_final']:.4f} vs {ar['loss_final']:.4f} = **{100 * d:+.2f}%** "
                f"(mean of the last 5 steps {100 * d5:+.2f}%) (goal within ±2%: "
                f"{'met' if abs(d) <= 0.02 else 'NOT met'})"
            )
        if ok(ar):
            moved = abs(ar["losses"][0] - ar["losses"][-1]) / ar["losses"][0]
            lines.append(
                f"- {model} @ {rate}: fdp allreduce training loss step 1 → {ar['steps']}: "
                f"{ar['losses'][0]:.4f} → {ar['losses'][-1]:.4f} (how far training moved in the run"
                + (
                    "; under 1%: the loss barely moved, so the loss comparison above says little for this model)"
                    if moved < 0.01
                    else ")"
                )
            )
        if ok(ar) and ok(d_ar) and ar["steps"] == d_ar["steps"]:
            same = max(abs(a - b) for a, b in zip(ar["losses"], d_ar["losses"]))
            lines.append(
                f"- {model} @ {rate}: fdp allreduce vs DDP allreduce, largest per-step loss difference "
                f"over {ar['steps']} steps: {same:.2e}"
            )
    return lines


def write_report(results: dict, meta: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    name = meta["name"]
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [
        f"# fdp vs DDP on two simulated nodes (netsim), {meta['date']}",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, {meta['cpus']} CPU cores shared with other jobs. "
        "netsim veth back-end: 2 network namespaces, one rank each, tbf at RATE per node and direction, "
        "MTU 1500, no added delay; gloo over `nsim0`; 1 torch thread per rank (both nodes share the host's cores).",
        f"Models: {meta['models']}. Adam lr 1e-3 on both sides (torch's fused kernel; DDP's side with fused=True "
        "since 2026-11-22). fdp buckets 25 MiB (first 1 MiB), DDP defaults "
        "(the same caps). PowerSGD: compression from step 3 (`hooks.start_iter=2`, `start_powerSGD_iter=2`), "
        "error feedback and warm start on. DDP's PowerSGD hook waits inside the hook (gloo races otherwise), "
        "which serialises its buckets. Top-k: ratio 0.01 (values + int32 positions, two allgathers); torch has no "
        "top-k DDP hook.",
        f"Step time: median over the steps after the first {N.WARMUP_STEPS} of rank 0 (IQR in brackets; rows with "
        "steps `N ×K`: over the timed steps of K repetitions run interleaved with the other rows); steps per run "
        f"{meta['steps']} ({meta['steps_uncompressed']} for allreduce/fp16 below 1 Gbit/s). Bytes: what each rank "
        "hands to collectives per step (payload, not wire bytes). Loss: training loss of the last step (mean over "
        "ranks); "
        "both sides see the same batches from the same initial weights. Load: 1-min load average at start→end of "
        "the fdp run / CPU cores other processes took during it (rows ×K: ranges over the repetitions).",
        f"Commands: `{meta['command']}`; fdp side per node: `recipes/train.py world=torchrun <overrides>` (in the "
        "JSON).",
        "",
        "| rate | model | hook (torch hook) | steps | fdp ms | DDP ms | DDP/fdp | fdp × no-comm | fdp comm wait ms "
        "| fdp MB/step | DDP MB/step | fdp loss | DDP loss | load fdp / others' cores |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for rate, models in results.items():
        for model, sides in models.items():
            fdp = {v: merge_reps(r) for v, r in sides.get("fdp", {}).items()}
            ddp = {v: merge_reps(r) for v, r in sides.get("ddp", {}).items()}
            floor = fdp.get("noop", {}).get("median_ms")
            for v in FDP_VARIANTS:
                f, d = fdp.get(v), ddp.get(v)
                if not f and not d:
                    continue
                ratio = (
                    f"{d['median_ms'] / f['median_ms']:.2f}"
                    if f and d and "median_ms" in f and "median_ms" in d
                    else ""
                )
                vs_floor = f"{f['median_ms'] / floor:.2f}" if f and floor and "median_ms" in f else ""
                wait = f"{f['comm_wait_ms']:.0f}" if f and "comm_wait_ms" in f else ""
                steps = (f or d).get("steps", "")
                if max((f or {}).get("reps", 1), (d or {}).get("reps", 1)) > 1:
                    steps = f"{steps} ×{max((f or {}).get('reps', 1), (d or {}).get('reps', 1))}"
                params = (f or d).get("params")
                mname = f"{model} ({params / 1e6:.2f}M)" if params else model
                lines.append(
                    f"| {rate} | {mname} | {LABELS[v]} ({TORCH_HOOK[v]}) | {steps} | {_fmt_ms(f)} | "
                    f"{_fmt_ms(d) if v != 'topk' else 'n/a'} | {ratio} | {vs_floor} | {wait} | {_mb(f)} | "
                    f"{_mb(d) if v != 'topk' else 'n/a'} | {_loss(f)} | {_loss(d) if v != 'topk' else 'n/a'} | "
                    f"{_load(f)} |"
                )
    lines += ["", "## Goals (1 Gbit/s)", ""] + (goals(results) or ["(no 1 Gbit/s results yet)"])
    lines += [
        "",
        "How to read these: a step is compute + the part of the communication not hidden behind it + the hook's own "
        "compute. Even with free communication a hook cannot beat the no-comm step, so DDP allreduce / fdp no-comm "
        "(printed above) bounds any hook's speed-up over DDP allreduce. fdp runs `trainer.schedule=auto`: since "
        "2026-11-22 that is `overlap` for more than one process (each bucket's reduction starts inside backward, as "
        "DDP's do, and its params are updated as soon as it is reduced); tables taken before then ran `after` (reduce "
        "once backward is done), which on a slow link hides nothing. PowerSGD's own compute (matrix products, "
        "error feedback and reconstruction over the whole gradient, memory-bound on this CPU) is the gap between the "
        "no-comm row and the PowerSGD rows, whose communication wait is only tens of ms. The runs share 2 cores "
        "with other jobs: compare rows of similar load, and the per-repetition ratios.",
    ]
    failures = [
        f"- {rate} {model} {side} {v}: {r[-1]['error'].splitlines()[0]}"
        for rate, models in results.items()
        for model, sides in models.items()
        for side, vs in sides.items()
        for v, r in vs.items()
        if r and "error" in r[-1]
    ]
    if failures:
        lines += ["", "## Failed runs", ""] + failures
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in meta["notes"]]
    lines += [
        "",
        f"Load average (1 min) at start {meta['load_start']:.2f}; now {os.getloadavg()[0]:.2f}. "
        f"Elapsed {meta.get('elapsed_s', 0):.0f} s. Per-run details (every step's time and loss, "
        f"compute/comm-wait split, load) are in `{name}.json`.",
        "",
    ]
    (out_dir / f"{name}.md").write_text("\n".join(lines))


def plot(results: dict, meta: dict, out_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rates = list(results)
    models = sorted({m for r in results.values() for m in r})
    if not rates or not models:
        return
    fig, axes = plt.subplots(len(rates), len(models), figsize=(6.5 * len(models), 4.2 * len(rates)), squeeze=False)
    for i, rate in enumerate(rates):
        for j, model in enumerate(models):
            ax = axes[i][j]
            sides = results[rate].get(model, {})
            fdp = {v: merge_reps(r) for v, r in sides.get("fdp", {}).items()}
            ddp = {v: merge_reps(r) for v, r in sides.get("ddp", {}).items()}
            vs = [v for v in FDP_VARIANTS if v in fdp or v in ddp]
            xs = range(len(vs))
            fv = [fdp[v]["median_ms"] if v in fdp and "median_ms" in fdp[v] else 0 for v in vs]
            dv = [ddp[v]["median_ms"] if v in ddp and "median_ms" in ddp[v] else 0 for v in vs]
            ax.bar([x - 0.2 for x in xs], fv, 0.4, label="fdp (recipe)", color="tab:blue")
            ax.bar([x + 0.2 for x in xs], dv, 0.4, label="DDP (torch hook)", color="tab:orange")
            for x, a, b in zip(xs, fv, dv):
                if a:
                    ax.text(x - 0.2, a, f"{a:.0f}", ha="center", va="bottom", fontsize=7)
                if b:
                    ax.text(x + 0.2, b, f"{b:.0f}", ha="center", va="bottom", fontsize=7)
            if "noop" in fdp and "median_ms" in fdp["noop"]:
                ax.axhline(fdp["noop"]["median_ms"], color="tab:blue", ls="--", lw=0.8)
                ax.axhline(1.5 * fdp["noop"]["median_ms"], color="tab:green", ls=":", lw=0.8, label="1.5 × fdp no-comm")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([LABELS[v] for v in vs], rotation=20, fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel("median step ms (log)")
            ax.set_title(f"{model} @ {rate}")
            ax.legend(fontsize=7)
    fig.suptitle("fdp vs DDP, 2 simulated nodes (netsim), step time per hook")
    fig.tight_layout()
    fig.savefig(out_dir / f"{meta['name']}.png", dpi=110)
    plt.close(fig)

    # Loss curves at the first rate that has them, per model.
    rate = next((r for r in rates if results[r]), None)
    if rate is None:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4), squeeze=False)
    for j, model in enumerate(models):
        ax = axes[0][j]
        sides = results[rate].get(model, {})
        for side, style in (("fdp", "-"), ("ddp", "--")):
            for v, reps in sides.get(side, {}).items():
                r = reps[-1]
                if "losses" in r:
                    ax.plot(range(1, len(r["losses"]) + 1), r["losses"], style, label=f"{side} {LABELS[v]}", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (mean over ranks)")
        ax.set_title(f"{model} @ {rate}: same data and initial weights")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / f"{meta['name']}_loss.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- driver
def main() -> None:
    args = parse_args()
    N.install_signal_handlers()
    import torch

    quick_scratch = args.quick and not args.write and not args.out
    work = N.work_dir(args.name)
    out_dir = Path(args.out) if args.out else (work if quick_scratch else N.RESULTS)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "command": "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "models": "; ".join(f"{m}: {' '.join(o)}" for m, o in N.MODELS.items() if m in args.models),
        "steps": args.steps,
        "steps_uncompressed": args.steps_uncompressed,
        "load_start": os.getloadavg()[0],
        "work_dir": N.shown(work),
        "notes": [],
        "name": args.name,  # stem of the result files
    }
    results: dict = {}
    plan = []
    for rate in args.rates:
        for model in args.models:
            runs = []
            for v in args.variants:
                reps = max(args.reps, args.goal_reps if rate == "1gbit" and v in GOAL_VARIANTS else 1)
                runs.append(("fdp", v, reps))
                if not args.no_ddp and v in N.DDP_HOOKS:
                    runs.append(("ddp", v, reps))
            plan.append((rate, model, runs))
    total = sum(reps for _, _, runs in plan for _, _, reps in runs)
    print(f"netsim_multinode: {total} runs; logs and run directories in {work}; results -> {out_dir}", flush=True)
    t_start, done = time.perf_counter(), 0

    def save() -> None:
        if results:
            write_report(results, meta, out_dir)
            plot(results, meta, out_dir)
        print(f"netsim_multinode: results in {out_dir}", flush=True)

    with N.keeping_partial_results("netsim_multinode", meta, t_start, save):
        with N.Cluster(nodes=2, force=args.force) as net:
            for rate, model, runs in plan:
                print(net.up(rate), flush=True)
                for rep in range(max(reps for _, _, reps in runs)):
                    shift = rep % len(runs)
                    for side, v, reps in runs[shift:] + runs[:shift]:
                        if rep >= reps:
                            continue
                        done += 1
                        steps = steps_for(rate, v, args)
                        tag = f"[{done}/{total}] {rate} {model} {side} {v} ({steps} steps)"
                        print(f"{tag} ...", flush=True)
                        name = f"{rate}-{model}-{side}-{v}-rep{rep}"
                        try:
                            with N.LoadMeter() as lm:
                                if side == "fdp":
                                    r = N.fdp_run(model, v, steps, work / name, True, args.timeout)
                                else:
                                    r = N.ddp_run(model, v, steps, work / name, args.timeout)
                            r["load"] = lm.as_dict()
                            print(
                                f"{tag}: {r['median_ms']:.0f} ms/step (IQR {r['q1_ms']:.0f}-{r['q3_ms']:.0f}), "
                                f"{r['bytes_per_step'] / 1e6:.2f} MB/step, loss {r['loss_final']:.4f}, "
                                f"load {lm.load0:.1f}→{lm.load1:.1f}, others {lm.others_cores:.2f} cores, "
                                f"{lm.wall:.0f} s",
                                flush=True,
                            )
                        except (RuntimeError, TimeoutError) as error:
                            r = {"error": str(error), "steps": steps}
                            print(f"{tag}: FAILED: {error}", flush=True)
                        results.setdefault(rate, {}).setdefault(model, {}).setdefault(side, {}).setdefault(
                            v, []
                        ).append(r)
                        meta["elapsed_s"] = time.perf_counter() - t_start
                        write_report(results, meta, out_dir)
                plot(results, meta, out_dir)
    print("\n".join(["", *goals(results)]), flush=True)
    print((out_dir / f"{args.name}.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
