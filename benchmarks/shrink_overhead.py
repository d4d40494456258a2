"""What a world that can shrink costs while nothing is lost: a pure step, the ZeRO-1 mirror, per-sample streams.

Under ``world.on_rank_loss=shrink`` the trainer runs the step with ``donate=False`` (the
state before a step stays intact, so the survivors can go back to it; ``donate=True``
updates params and optimizer state in place with torch's fused kernels), ZeRO stage 1
also steps the next rank's slices of the optimizer state (``TrainState.mirror``), and
dropout draws each sample's masks from its own stream (``fdp.model.streams``; on in every run
of the trainer, so it is measured against each rank's generator, ``sample_seed=None``).

Gloo ranks (two unless ``--ranks``) train a char transformer (dropout 0.1, Adam) with ``make_train_step``,
each variant on a state of its own, interleaved over rounds (median ms per step of the
slower rank):

* ``stage 0 donate``: what ``restart`` runs; ``stage 0 pure``: what ``shrink`` runs;
* ``stage 1 donate``; ``stage 1 pure``; ``stage 1 pure + mirror``: what ``shrink`` runs at ZeRO stage 1;
* ``stage 0 donate, rank generators``: dropout from each rank's generator (no streams);
* ``stage 0 donate again``: the first variant once more, for the noise between identical runs.

    python -m benchmarks.shrink_overhead [--steps 20] [--rounds 5]   # from the repo root; ~2 min
    python -m benchmarks.shrink_overhead --d-model 8 --block 8 --batch 4 --steps 30 \
        --out benchmarks/results/shrink_overhead_tiny.md               # tiny widths: the host's time
    python -m benchmarks.shrink_overhead --d-model 8 --block 8 --batch 2 --steps 30 --ranks 1 \
        --out benchmarks/results/shrink_overhead_tiny_1rank.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fdp
from fdp.data import global_batch, load_stdlib_text, rank_share
from fdp.model.builtin import CharTransformer
from fdp.procs.launch import WorldLayout, init_distributed, spawn
from fdp.update import zero

RESULTS = Path(__file__).resolve().parent / "results" / "shrink_overhead.md"
VARIANTS = {  # name: (zero stage, donate, mirror, sample streams)
    "stage 0 donate": (0, True, False, True),
    "stage 0 pure": (0, False, False, True),
    "stage 1 donate": (1, True, False, True),
    "stage 1 pure": (1, False, False, True),
    "stage 1 pure + mirror": (1, False, True, True),
    "stage 0 donate, rank generators": (0, True, False, False),
    "stage 0 donate again": (0, True, False, True),
}


def _rank(steps: int, rounds: int, d_model: int, block: int, batch: int, layout: WorldLayout) -> dict:
    comm = init_distributed(layout)
    torch.set_num_threads(1)
    data = load_stdlib_text(block_size=block, max_chars=200_000)
    torch.manual_seed(0)
    model, params, buffers = fdp.functionalize(CharTransformer(data.num_classes, block, d_model, 2, 4, dropout=0.1))
    loss_fn = fdp.cross_entropy_loss(model)
    batches = [rank_share(global_batch(data, s, batch, 0), comm.rank, comm.world_size) for s in range(steps)]
    plan = fdp.plan_buckets(fdp.planner_loss(loss_fn, buffers), params, batches[0])
    optimizer = fdp.adam(1e-3)
    runs = {}
    for name, (stage, donate, mirror, streams) in VARIANTS.items():
        step = fdp.make_train_step(
            loss_fn,
            optimizer,
            plan,
            comm=comm,
            donate=donate,
            zero_stage=stage,
            sample_seed=0 if streams else None,
            schedule="overlap",
        )
        if stage:
            state = zero.init_state(params, buffers, optimizer, plan, comm, stage=stage, mirror=mirror)
        else:
            state = fdp.setup_state(params, buffers, optimizer, plan, comm=comm)
        runs[name] = [step, state]
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, (step, state) in runs.items():
            state, _ = step(state, batches[0])  # a warm step, not timed
            dist.barrier()
            t0 = time.perf_counter()
            for batch in batches:
                state, _ = step(state, batch)
            times[name].append((time.perf_counter() - t0) / steps)
            runs[name][1] = state
    dist.destroy_process_group()
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--block", type=int, default=64, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=32, help="global batch size")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    layout = WorldLayout("elastic", nproc_per_node=args.ranks, backend="gloo", timeout_s=300)
    results = spawn(_rank, (args.steps, args.rounds, args.d_model, args.block, args.batch, layout), layout)
    ms = {name: max(results[r][name] for r in results) for name in VARIANTS}
    base = {
        "stage 0 pure": "stage 0 donate",
        "stage 1 pure": "stage 1 donate",
        "stage 1 pure + mirror": "stage 1 donate",
        "stage 0 donate, rank generators": "stage 0 donate",
        "stage 0 donate again": "stage 0 donate",
    }
    rows = [
        f"| {name} | {ms[name]:.1f} | "
        + (f"{ms[name] / ms[base[name]]:.3f} (/ {base[name]})" if name in base else "")
        + " |"
        for name in VARIANTS
    ]
    load = os.getloadavg()[0]
    table = "\n".join(
        [
            "# What a shrinkable world costs per step while nothing is lost (benchmarks/shrink_overhead.py)",
            "",
            f"{args.ranks} gloo rank{'s' if args.ranks > 1 else ''}, one thread each, char transformer d_model "
            f"{args.d_model} x 2 layers, block {args.block}, dropout 0.1, "
            f"Adam, global batch {args.batch}; {args.steps} steps x {args.rounds} interleaved rounds (median, the "
            f"slower rank); torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; load average {load:.1f} at the "
            "end (2-core machine).",
            "",
            "| variant | ms per step | ratio |",
            "|---|---|---|",
            *rows,
            "",
            f"`python -m benchmarks.shrink_overhead --steps {args.steps} --rounds {args.rounds} --d-model "
            f"{args.d_model} --block {args.block} --batch {args.batch} --ranks {args.ranks}`",
            "",
        ]
    )
    print(table)
    args.out.write_text(table)


if __name__ == "__main__":
    main()
