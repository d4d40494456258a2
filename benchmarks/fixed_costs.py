"""Benchmark: the memory a rank holds whatever its model (``fixed per process`` in ``recipes/plan.py``'s forecast).

One fresh process, resident memory (RSS) after each first use a rank makes, in the order a rank makes them
(``fdp.run.startup``): torch and fdp imported; dynamo imported (``preload_compiler``: what ``torch.func``'s first
gradient and a first build on ``meta`` import, loaded before ``world.memory_per_rank_mb`` starts counting, so
outside the budget); the first ``meta`` operation; the first ``torch.func`` gradient; a gloo process group of one
rank; and the heap's free memory handed back (``release_free_memory``). What follows the preload is what the
forecast's ``fixed`` part measures (``fdp.run.memory.forecast.first_use_mib``).

    python benchmarks/fixed_costs.py

Writes ``benchmarks/results/fixed_costs.md``.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure() -> list[tuple[str, float]]:
    import torch
    import torch.distributed as dist

    import fdp  # noqa: F401
    from fdp._torch import preload_compiler
    from fdp.procs.allocator import release_free_memory, resident_mib

    rows = [("torch and fdp imported", resident_mib())]
    preload_compiler()
    rows.append(("dynamo imported (preload_compiler; before the budget)", resident_mib()))
    torch.empty(8, 8, device="meta").add_(1)
    rows.append(("first meta-device operation", resident_mib()))
    x = torch.ones(8, 8)
    torch.func.grad(lambda w: torch.nn.functional.linear(x, w).square().sum())(torch.ones(8, 8))
    rows.append(("first torch.func gradient", resident_mib()))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        dist.all_reduce(torch.ones(1024))
        rows.append(("gloo process group, first all-reduce", resident_mib()))
        release_free_memory()
        rows.append(("free heap memory handed back", resident_mib()))
        dist.destroy_process_group()
    return rows


def main() -> None:
    rows = measure()
    import torch

    lines = [
        f"# What a rank holds whatever its model ({datetime.date.today().isoformat()})",
        "",
        f"`python benchmarks/fixed_costs.py`; torch {torch.__version__}, {os.cpu_count()} CPU cores shared with other "
        f"jobs; one fresh process, resident memory after each first use a rank makes.",
        "",
        "| after | RSS MiB | added MiB |",
        "|---|---:|---:|",
    ]
    previous = 0.0
    for name, mib in rows:
        lines.append(f"| {name} | {mib:.1f} | {mib - previous:+.1f} |")
        previous = mib
    lines += [
        "",
        "The first meta-device operation's cost is dynamo's import (~100 MiB): a rank makes it before",
        "`world.memory_per_rank_mb` starts counting (`fdp.run.startup`), so the budget sees the rows below it only.",
        "A run's `fixed per process` in the forecast adds what its build left resident beyond its state.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if "--no-write" not in sys.argv:
        (REPO / "benchmarks" / "results" / "fixed_costs.md").write_text(text)


if __name__ == "__main__":
    main()
