"""What a world that can shrink costs while nothing is lost: a pure step, the ZeRO-1 mirror, per-sample streams.

Under ``world.on_rank_loss=shrink`` the trainer once ran the step with ``donate=False`` (the
state before a step stays intact, so the survivors can go back to it; ``donate=True``
updates params and optimizer state in place with torch's fused kernels); it now donates and keeps a copy of
the state before each step (``fdp.state.kept``: one multi-tensor copy into the same buffers), ZeRO stage 1
also steps the next rank's slices of the optimizer state (``TrainState.mirror``), and
dropout draws each sample's masks from its own stream (``fdp.model.streams``; on in every run
of the trainer, so it is measured against each rank's generator, ``sample_seed=None``). The eager step
takes the streams from a function mode (``fdp.model.streams_functions.by_function``: a Python call per
random function); the dispatch mode it replaced (``SampleStreams.wrap``: a Python call per op, the same
masks) is measured beside it, each step's keys queued by hand as the step does.

Gloo ranks (two unless ``--ranks``) train a char transformer (dropout 0.1, Adam) with ``make_train_step``,
each variant on a state of its own, interleaved over rounds (median ms per step of the
slower rank, and the CPU time of the rank's process per step, the host's own work):

* ``stage 0 donate``: what ``restart`` runs; ``stage 0 pure``: what ``shrink`` runs;
* ``stage 1 donate``; ``stage 1 pure``; ``stage 1 pure + mirror``: what ``shrink`` runs at ZeRO stage 1;
* ``stage 0 donate, dispatch streams``, ``stage 0 pure, dispatch streams``: the streams as a dispatch mode;
* ``stage 0 donate, rank generators``: dropout from each rank's generator (no streams), the plain step
  every other row is also given against;
* ``stage 0 donate + kept``, ``stage 1 donate + mirror + kept``: what ``shrink`` runs now, a donated step with the
  state before it copied into buffers refreshed in place (``fdp.state.kept``);
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
from fdp.model.streams import SampleStreams
from fdp.procs.launch import WorldLayout, init_distributed, spawn
from fdp.state.kept import KeptState
from fdp.update import zero

RESULTS = Path(__file__).resolve().parent / "results" / "shrink_overhead.md"
VARIANTS = {  # name: (zero stage, donate, mirror, sample streams: by function, dispatch mode or none)
    "stage 0 donate": (0, True, False, "function"),
    "stage 0 pure": (0, False, False, "function"),
    "stage 1 donate": (1, True, False, "function"),
    "stage 1 pure": (1, False, False, "function"),
    "stage 1 pure + mirror": (1, False, True, "function"),
    "stage 0 donate, dispatch streams": (0, True, False, "dispatch"),
    "stage 0 pure, dispatch streams": (0, False, False, "dispatch"),
    "stage 0 donate, rank generators": (0, True, False, None),
    "stage 0 donate + kept": (0, True, False, "function"),
    "stage 1 donate + mirror + kept": (1, True, True, "function"),
    "stage 0 donate again": (0, True, False, "function"),
}
PLAIN = "stage 0 donate, rank generators"
# What shrink runs since the loop keeps the state before each step by a copy (fdp.state.kept): donated steps.
KEPT = {"stage 0 donate + kept", "stage 1 donate + mirror + kept"}


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
        queued = SampleStreams(0) if streams == "dispatch" else None  # its keys queued here, as the step does
        step = fdp.make_train_step(
            queued.wrap(loss_fn) if queued else loss_fn,
            optimizer,
            plan,
            comm=comm,
            donate=donate,
            zero_stage=stage,
            sample_seed=0 if streams == "function" else None,
            schedule="overlap",
        )
        if stage:
            state = zero.init_state(params, buffers, optimizer, plan, comm, stage=stage, mirror=mirror)
        else:
            state = fdp.setup_state(params, buffers, optimizer, plan, comm=comm)
        step = _queueing(step, queued, comm.rank) if queued else step
        runs[name] = [_keeping(step) if name in KEPT else step, state]
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, (step, state) in runs.items():
            state, _ = step(state, batches[0])  # a warm step, not timed
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for batch in batches:
                state, _ = step(state, batch)
            times[name].append((time.perf_counter() - t0) / steps)
            cpu[name].append((time.process_time() - c0) / steps)
            runs[name][1] = state
    dist.destroy_process_group()
    return {name: (statistics.median(times[name]) * 1e3, statistics.median(cpu[name]) * 1e3) for name in VARIANTS}


def _keeping(step):
    """``step`` with the state before it kept, as the loop of a world that may shrink keeps it (``KeptState``)."""
    kept = KeptState(copies=True)

    def keeping_step(state, batch):
        kept.keep(state)
        return step(state, batch)

    return keeping_step


def _queueing(step, streams: SampleStreams, rank: int):
    """``step`` whose forwards take their samples' keys from ``streams``, queued before each step."""

    def queued_step(state, batch):
        streams.begin(state.step + 1, rank * len(batch[0]), [len(batch[0])])
        return step(state, batch)

    return queued_step


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
    ms = {name: max(results[r][name][0] for r in results) for name in VARIANTS}
    cpu = {name: max(results[r][name][1] for r in results) for name in VARIANTS}
    base = {
        "stage 0 pure": "stage 0 donate",
        "stage 1 pure": "stage 1 donate",
        "stage 1 pure + mirror": "stage 1 donate",
        "stage 0 donate, dispatch streams": "stage 0 donate",
        "stage 0 pure, dispatch streams": "stage 0 pure",
        "stage 0 donate, rank generators": "stage 0 donate",
        "stage 0 donate + kept": "stage 0 donate",
        "stage 1 donate + mirror + kept": "stage 1 donate",
        "stage 0 donate again": "stage 0 donate",
    }
    rows = [
        f"| {name} | {ms[name]:.1f} | "
        + (f"{ms[name] / ms[base[name]]:.3f} (/ {base[name]})" if name in base else "")
        + f" | {ms[name] / ms[PLAIN]:.3f} | {cpu[name]:.1f} | {cpu[name] / cpu[PLAIN]:.3f} |"
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
            "end (2-core machine). The plain step: stage 0 donate, rank generators. CPU: the rank's process time "
            "per step (the host's work, less the machine's other load than the wall time).",
            "",
            "| variant | ms per step | ratio | / plain step | CPU ms per step | CPU / plain step |",
            "|---|---|---|---|---|---|",
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
