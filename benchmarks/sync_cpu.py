"""Benchmark: how much of this host one sync between two simulated nodes takes.

An overlapped outer sync (``outer.overlap``) hides the sync's wall time behind inner
steps only if moving the bytes costs the steps nothing. Between two simulated nodes
(``benchmarks/netsim``) the "network" is this host's kernel (TCP through veth and tbf)
and gloo's threads, on the same cores the ranks compute on. This measures one allreduce
of the charmlp model's pseudo-gradient (19.85M values, bf16 and fp32) with nothing else
running: its wall time, each rank's CPU (all its threads, user + system), the CPU the
whole host was busy for (all cores, the kernel's network work included) and the time the
hypervisor held the host's cores (steal). Host CPU over wall time is the share of the
host's cores a sync in flight takes from the steps that hide it; steal adds to it.

    python benchmarks/sync_cpu.py                     # 1 Gbit/s and 100 Mbit/s
    python benchmarks/sync_cpu.py --rates 1gbit --repeats 5

Writes ``benchmarks/results/sync_cpu.{md,json}``. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _netsim as N  # noqa: E402

VALUES = 19_850_000  # the charmlp model's parameters (benchmarks/models.py)


def worker(args) -> None:
    """One rank: allreduce the pseudo-gradient ``--repeats`` times per dtype; rank 0 writes ``--out``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        values = torch.ones(VALUES, dtype=dtype)
        dist.all_reduce(torch.ones(8))  # connections made before timing
        for _ in range(args.repeats):
            dist.barrier()
            wall, cpu, busy, steal = time.perf_counter(), time.process_time(), N.busy_seconds(), N.steal_seconds()
            dist.all_reduce(values)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            busy, steal = N.busy_seconds() - busy, N.steal_seconds() - steal
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "mb": values.numel() * values.element_size() / 1e6,
                    "wall_s": wall,
                    "rank_cpu_s": cpu,
                    "host_busy_s": busy,
                    "steal_s": steal,
                }
            )
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def summarise(rate: str, rows: list[dict]) -> list[dict]:
    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == dtype]
        median = {
            key: statistics.median(r[key] for r in mine) for key in ("wall_s", "rank_cpu_s", "host_busy_s", "steal_s")
        }
        out.append(
            {
                "rate": rate,
                "dtype": dtype,
                "mb": mine[0]["mb"],
                "repeats": len(mine),
                **median,
                "host_cores": median["host_busy_s"] / median["wall_s"],
            }
        )
    return out


def write(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = [
        "# CPU one sync takes between two simulated nodes",
        "",
        f"Command: `{results['meta']['command']}`; links of MTU {results['meta']['mtu']}; {os.cpu_count()} cores on "
        "this host; nothing else running. "
        "Medians of the repeats.",
        "",
        "| rate | pseudo-gradient | MB | wall s | rank 0 CPU s | host CPU s (all cores) | host cores busy during the "
        "sync | steal s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['rate']} | {r['dtype']} | {r['mb']:.0f} | {r['wall_s']:.3f} | {r['rank_cpu_s']:.3f} | "
            f"{r['host_busy_s']:.3f} | {r['host_cores']:.2f} | {r['steal_s']:.3f} |"
        )
    lines += [
        "",
        "Host CPU (user, system and interrupt time of all cores) is what the sync takes from ranks that "
        "compute meanwhile (an overlapped sync): the kernel's TCP, veth and tbf work for both simulated nodes "
        "and both ranks' gloo threads. Steal is time the hypervisor held this VM's cores (not counted as host CPU): "
        "it follows the bytes moved, not the sync's wall time (the same at both rates), and a core held there "
        "computes nothing either; an idle second shows about 0.01 s of it.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1gbit,100mbit")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mtu", type=int, default=1500, help="the simulated links' MTU (9000: jumbo frames)")
    p.add_argument("--name", default="sync_cpu", help="result file name in benchmarks/results")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--force", action="store_true", help="rebuild netsim namespaces that already exist")
    p.add_argument("command", nargs="?", choices=["worker"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.command == "worker":
        return worker(args)
    N.install_signal_handlers()
    work = N.work_dir("sync_cpu")
    meta = {"command": " ".join(["python benchmarks/sync_cpu.py", *sys.argv[1:]]), "mtu": args.mtu}
    results = {"meta": meta, "rows": []}
    out = N.RESULTS / args.name
    with N.Cluster(nodes=2, force=args.force) as net:
        for rate in args.rates.split(","):
            print(net.up(rate, mtu=args.mtu), flush=True)
            raw = work / f"{rate}.json"
            argv = [
                N.PYTHON,
                str(Path(__file__).resolve()),
                "worker",
                "--out",
                str(raw),
                "--repeats",
                str(args.repeats),
                "--timeout",
                str(args.timeout),
            ]
            logs = [work / f"{rate}.rank{k}.log" for k in range(2)]
            codes = N.run_ranks(argv, logs, args.timeout, True)
            if any(codes) or not raw.exists():
                raise RuntimeError(f"sync_cpu at {rate} failed (exit codes {codes}); log {logs[0]}:\n{N.tail(logs[0])}")
            for row in summarise(rate, json.loads(raw.read_text())):
                results["rows"].append(row)
                print(
                    f"{rate} {row['dtype']} {row['mb']:.0f} MB: {row['wall_s']:.3f} s, host {row['host_busy_s']:.3f} "
                    f"core-s ({row['host_cores']:.2f} cores busy)",
                    flush=True,
                )
    write(results, out)
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
