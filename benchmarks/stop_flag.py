"""What agreeing on a stop flag after every step costs (fdp.procs.interrupt.StopSignals.agreed).

Two gloo ranks train a small MLP (the step of the recipe's default run: a few ms, where a
per-step cost shows most) three ways, interleaved in one run:

* ``none``: the train step alone;
* ``blocking``: the step, then a blocking all-reduce (max) of a one-element flag;
* ``pipelined``: the step, then an all-reduce started after step ``s`` and read after
  step ``s + 1``, every step (what a first version did);
* ``fdp``: the step, then ``StopSignals.agreed()`` (what ``fdp.run.trainer`` does): a
  pipelined all-reduce about every ``CHECK_EVERY_S`` seconds of training;
* ``none again``: the step alone once more, for the noise between two identical runs.

Prints ms per step (the median of interleaved rounds) and the ratios to ``none``, and
writes the table to ``benchmarks/results/stop_flag.md``.

    python -m benchmarks.stop_flag [--steps 200] [--rounds 7]   # from the repo root
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fdp
from fdp.procs.interrupt import StopSignals
from fdp.procs.launch import WorldLayout, init_distributed, spawn

RESULTS = Path(__file__).resolve().parent / "results" / "stop_flag.md"
WAYS = ("none", "blocking", "pipelined", "fdp", "none again")  # the last: the noise floor


def _rank(steps: int, rounds: int, hidden: int, layout: WorldLayout) -> dict:
    comm = init_distributed(layout)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, params, buffers = fdp.functionalize(nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10)))
    loss_fn = fdp.cross_entropy_loss(model)
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    plan = fdp.plan_buckets(fdp.planner_loss(loss_fn, buffers), params, batch)
    step = fdp.make_train_step(loss_fn, fdp.sgd(0.01), plan, comm=comm, schedule="overlap", donate=True)
    state = fdp.setup_state(params, buffers, fdp.sgd(0.01), plan, comm=comm)
    stop = StopSignals(()).join(comm.world_size)  # no handler: the flag stays down, only its cost is measured
    flag = torch.zeros(1, dtype=torch.int32)
    group = fdp.comm.new_group([0, 1])
    pending = None
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                state, _ = step(state, batch)
                if way == "blocking":
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                elif way == "pipelined":
                    if pending is not None:
                        pending.wait()
                    pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
                elif way == "fdp":
                    stop.agreed()
            times[way].append((time.perf_counter() - t0) / steps)
    pending.wait()
    stop.close()
    dist.destroy_process_group()
    return {way: statistics.median(t) * 1e3 for way, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    layout = WorldLayout("elastic", nproc_per_node=2, backend="gloo", timeout_s=120)
    results = spawn(_rank, (args.steps, args.rounds, args.hidden, layout), layout)
    ms = {way: max(results[r][way] for r in results) for way in WAYS}  # the slower rank's
    load = os.getloadavg()[0]
    rows = [f"| {way} | {ms[way]:.3f} | {ms[way] / ms['none']:.3f} |" for way in WAYS]
    table = "\n".join(
        [
            "# Stop-flag agreement per step (fdp.procs.interrupt)",
            "",
            f"2 gloo ranks, one thread each, MLP 64-{args.hidden}-10, batch 32 per rank, {args.steps} steps x "
            f"{args.rounds} interleaved rounds (median); torch {torch.__version__}; load average {load:.1f} at the "
            "end.",
            "",
            "| way | ms per step | / none |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )
    print(table)
    RESULTS.write_text(table)


if __name__ == "__main__":
    main()
