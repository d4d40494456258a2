"""Benchmark: step time against gradient bucket size (the curve of Li et al., VLDB 2020, Fig. 7) with fdp.

The 25.27M-parameter MLP of ``netsim_multinode.py`` (25 x 1024 hidden on digits, 32 samples
per rank, Adam), mean allreduce, trained by the user's path ``recipes/train.py`` on two ranks:

* ``loopback``: ``world=local2`` (the recipe starts both ranks on this host, gloo on ``lo``);
* ``1gbit``: two simulated nodes (``benchmarks/netsim``, veth, 1 Gbit/s per node and
  direction), ``world=torchrun`` in each; the network is taken down at the end, on an
  error, on Ctrl-C and on SIGTERM/SIGHUP.

For every bucket cap (``trainer.bucket_cap_mb`` = ``trainer.first_bucket_cap_mb``, as DDP
does once ``bucket_cap_mb`` is given) and every schedule (``trainer.schedule=after``: reduce
all buckets after the backward pass, fdp's default on gloo; ``overlap``: launch each bucket
from the backward pass as it fills), the median step time over the steps after the first
two. Caps are run in an interleaved order (small, large, small, ...) so that a drift in
the load from other jobs does not draw a trend; every run is repeated (``--reps``, default 2)
with the order reversed. One tensor is never split: each 1024 x 1024 weight is 4 MiB, so caps
below that all give about one bucket per weight.

    python benchmarks/bucket_size.py            # full (root for the 1 Gbit/s half), ~35-45 min
    python benchmarks/bucket_size.py --quick    # 4 caps, schedule after, few steps
    python benchmarks/bucket_size.py --networks loopback   # no root needed

Writes ``benchmarks/results/bucket_size.{md,json,png}`` after every run (``--quick``: beside
its logs in ``benchmarks/runs/bucket_size/<date-time>/`` unless ``--write``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _netsim as N  # noqa: E402

CAPS = [0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 200]
QUICK_CAPS = [0.25, 5, 25, 200]
NETWORKS = ["loopback", "1gbit"]
SCHEDULES = ["after", "overlap"]


def interleave(caps: list[float]) -> list[float]:
    """0.25, 200, 0.5, 100, ...: neighbours in size are far apart in time."""
    s, out = sorted(caps), []
    while s:
        out.append(s.pop(0))
        if s:
            out.append(s.pop())
    return out


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--caps", help="comma list of MiB (default " + ",".join(map(str, CAPS)) + ")")
    p.add_argument("--networks", help="comma list of loopback and netsim rates, e.g. loopback,1gbit")
    p.add_argument("--schedules", help="comma list of after,overlap (default both; --quick after)")
    p.add_argument("--steps", type=int, help="steps per run (default 12; --quick 6)")
    p.add_argument(
        "--reps",
        type=int,
        help="repetitions of every run, the caps' order reversed each time "
        "(default 2; --quick 1); the table merges the timed steps of all",
    )
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument(
        "--force", action="store_true", help="rebuild the simulated cluster even if its fdpsim-* namespaces exist"
    )
    p.add_argument("--write", action="store_true", help="with --quick: write into benchmarks/results")
    p.add_argument("--out", help="results directory (default benchmarks/results)")
    a = p.parse_args()
    a.caps = [float(c) for c in (a.caps.split(",") if a.caps else (QUICK_CAPS if a.quick else CAPS))]
    a.networks = (a.networks or ",".join(NETWORKS)).split(",")
    a.schedules = (a.schedules or ("after" if a.quick else ",".join(SCHEDULES))).split(",")
    a.steps = a.steps or (6 if a.quick else 12)
    a.reps = a.reps or (1 if a.quick else 2)
    return a


def _cap(c: float) -> str:
    return f"{c:g}"


def merged(raw: dict) -> dict:
    return {
        net: {sch: {c: N.merge_reps(rs) for c, rs in caps.items()} for sch, caps in schs.items()}
        for net, schs in raw.items()
    }


def write_report(raw: dict, meta: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bucket_size.json").write_text(json.dumps({"meta": meta, "results": raw}, indent=1))
    results = merged(raw)
    cols = [(net, sch) for net in results for sch in meta["schedules"]]
    caps = sorted({float(c) for net in results.values() for sch in net.values() for c in sch})
    lines = [
        f"# Step time vs bucket size, fdp, 25.27M MLP, 2 ranks ({meta['date']})",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, {meta['cpus']} CPU cores shared with other jobs; "
        "gloo, 1 torch thread per rank. `recipes/train.py` with `model.hidden=1024 model.depth=25` on digits "
        "(32 samples per rank), Adam 1e-3, `hooks=allreduce`, `trainer.bucket_cap_mb = trainer.first_bucket_cap_mb "
        "= cap`. loopback: `world=local2`; 1gbit: netsim veth, 1 Gbit/s per node and direction, one rank per node, "
        "`world=torchrun`.",
        f"Median step time over steps 3..{meta['steps']} of rank 0 and over {meta['reps']} repetition(s), IQR in "
        "brackets; buckets = fdp's plan. Caps were run interleaved (small, large, small, ...; reversed in every other "
        "repetition; the two schedules alternate which goes first). The gradient is 101.07 MB; each 1024x1024 weight "
        "is 4 MiB and is never split, so every cap below 4 MiB gives about one bucket per weight (49-50 buckets).",
        f"Command: `{meta['command']}`.",
        "",
        "| cap MiB | buckets | " + " | ".join(f"{net} {sch} ms" for net, sch in cols) + " |",
        "|---:|---:|" + "---:|" * len(cols),
    ]
    for c in caps:
        key = _cap(c)
        buckets = next(
            (
                r.get("buckets")
                for net in results.values()
                for sch in net.values()
                for k, r in sch.items()
                if k == key and r.get("buckets")
            ),
            "",
        )
        cells = []
        for net, sch in cols:
            r = results.get(net, {}).get(sch, {}).get(key)
            if not r:
                cells.append("")
            elif "error" in r:
                cells.append("failed")
            else:
                cells.append(f"{r['median_ms']:.0f} ({r['q1_ms']:.0f}-{r['q3_ms']:.0f})")
        lines.append(f"| {key} | {buckets} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Load during the runs (1-min load average at run start→end, CPU cores other processes took), "
        "and fdp's median communication wait per step:",
        "",
        "| network | schedule | load range | others' cores (median) | comm wait ms (min-max over caps) |",
        "|---|---|---|---:|---|",
    ]
    import statistics

    for net, sch in cols:
        rs = [r for rs_ in raw.get(net, {}).get(sch, {}).values() for r in rs_ if "load" in r]
        if not rs:
            continue
        loads = [r["load"]["load_start"] for r in rs] + [r["load"]["load_end"] for r in rs]
        others = statistics.median(r["load"]["others_cores"] for r in rs)
        waits = [r["comm_wait_ms"] for r in rs if "comm_wait_ms" in r]
        lines.append(
            f"| {net} | {sch} | {min(loads):.1f}-{max(loads):.1f} | {others:.2f} | {min(waits):.0f}-{max(waits):.0f} |"
        )
    for net, sch in cols:
        rs = {c: r for c, r in results.get(net, {}).get(sch, {}).items() if "median_ms" in r}
        if len(rs) >= 2:
            best = min(rs, key=lambda c: rs[c]["median_ms"])
            worst = max(rs, key=lambda c: rs[c]["median_ms"])
            lines.append(
                f"\n{net} {sch}: fastest at {best} MiB ({rs[best]['median_ms']:.0f} ms), slowest at {worst} MiB "
                f"({rs[worst]['median_ms']:.0f} ms): {rs[worst]['median_ms'] / rs[best]['median_ms']:.2f}x."
            )
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in meta["notes"]]
    lines += [
        "",
        f"Load average (1 min) at start {meta['load_start']:.2f}; at the last write {os.getloadavg()[0]:.2f}. "
        f"Elapsed {meta.get('elapsed_s', 0):.0f} s. Every step's time is in `bucket_size.json`.",
        "",
    ]
    (out_dir / "bucket_size.md").write_text("\n".join(lines))


def plot(raw: dict, meta: dict, out_dir: Path) -> None:
    results = merged(raw)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    nets = [n for n in results if results[n]]
    if not nets:
        return
    fig, axes = plt.subplots(1, len(nets), figsize=(6.5 * len(nets), 4.3), squeeze=False)
    for ax, net in zip(axes[0], nets):
        for sch, marker in zip(meta["schedules"], "os^"):
            rs = sorted(((float(c), r) for c, r in results[net].get(sch, {}).items() if "median_ms" in r))
            if not rs:
                continue
            xs = [c for c, _ in rs]
            ys = [r["median_ms"] for _, r in rs]
            err = [[y - r["q1_ms"] for y, (_, r) in zip(ys, rs)], [r["q3_ms"] - y for y, (_, r) in zip(ys, rs)]]
            ax.errorbar(xs, ys, yerr=err, marker=marker, capsize=3, label=f"schedule={sch}")
            if sch == meta["schedules"][0]:
                for c, r in rs:
                    if r.get("buckets"):
                        ax.text(
                            c,
                            0.02,
                            str(r["buckets"]),
                            transform=ax.get_xaxis_transform(),
                            ha="center",
                            fontsize=7,
                            color="gray",
                        )
        ax.set_xscale("log")
        ax.set_xlabel("bucket cap (MiB, log); gray numbers: buckets in the plan")
        ax.set_ylabel("median step ms (IQR bars)")
        ax.set_title(f"{net}: fdp allreduce, 25.27M MLP, 2 ranks")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "bucket_size.png", dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    N.install_signal_handlers()
    import torch

    work = N.work_dir("bucket_size")
    out_dir = Path(args.out) if args.out else (work if args.quick and not args.write else N.RESULTS)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "command": "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "steps": args.steps,
        "reps": args.reps,
        "schedules": args.schedules,
        "caps": args.caps,
        "load_start": os.getloadavg()[0],
        "work_dir": N.shown(work),
        "notes": [],
    }
    order = interleave(args.caps)
    total = len(args.networks) * len(order) * len(args.schedules) * args.reps
    print(f"bucket_size: {total} runs; logs in {work}; results -> {out_dir}", flush=True)
    results: dict = {}
    t0, done = time.perf_counter(), 0

    def save() -> None:
        if results:
            write_report(results, meta, out_dir)
            plot(results, meta, out_dir)
        print(f"bucket_size: results in {out_dir}", flush=True)

    with N.keeping_partial_results("bucket_size", meta, t0, save):
        with ExitStack() as stack:
            net = None
            for network in args.networks:
                netsim = network != "loopback"
                if netsim:
                    if net is None:
                        net = stack.enter_context(N.Cluster(nodes=2, force=args.force))
                    print(net.up(network), flush=True)
                sequence = [(rep, cap) for rep in range(args.reps) for cap in (order if rep % 2 == 0 else order[::-1])]
                for i, (rep, cap) in enumerate(sequence):
                    # alternate which schedule goes first, so neither always follows the other
                    schedules = args.schedules if i % 2 == 0 else args.schedules[::-1]
                    for sch in schedules:
                        done += 1
                        tag = f"[{done}/{total}] {network} cap {cap:g} MiB schedule={sch} rep {rep + 1}"
                        print(f"{tag} ...", flush=True)
                        extra = [
                            f"trainer.bucket_cap_mb={cap:g}",
                            f"trainer.first_bucket_cap_mb={cap:g}",
                            f"trainer.schedule={sch}",
                        ]
                        try:
                            with N.LoadMeter() as lm:
                                r = N.fdp_run(
                                    "mlp",
                                    "allreduce",
                                    args.steps,
                                    work / f"{network}-{sch}-cap{cap:g}-rep{rep}",
                                    netsim,
                                    args.timeout,
                                    extra=extra,
                                )
                            r["load"] = lm.as_dict()
                            print(
                                f"{tag}: {r['median_ms']:.0f} ms/step (IQR {r['q1_ms']:.0f}-{r['q3_ms']:.0f}), "
                                f"{r.get('buckets')} buckets, comm wait {r.get('comm_wait_ms', 0):.0f} ms, "
                                f"load {lm.load0:.1f}→{lm.load1:.1f}, others {lm.others_cores:.2f} cores, "
                                f"{lm.wall:.0f} s",
                                flush=True,
                            )
                        except (RuntimeError, TimeoutError) as error:
                            r = {"error": str(error)}
                            print(f"{tag}: FAILED: {error}", flush=True)
                        results.setdefault(network, {}).setdefault(sch, {}).setdefault(_cap(cap), []).append(r)
                        meta["elapsed_s"] = time.perf_counter() - t0
                        write_report(results, meta, out_dir)
                        plot(results, meta, out_dir)
    print((out_dir / "bucket_size.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
