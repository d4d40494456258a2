"""Time lost to a killed rank at ZeRO stage 3 under HSDP: the node steps out (shrink), comes back (respawn), or
the world restarts from its last checkpoint.

``benchmarks.elastic``'s run and measures (``_fdp``: the trainer, rank 2 sent ``SIGKILL`` as it
starts step 40, 15 steps after the last checkpoint) on 4 gloo ranks in two simulated nodes
of two (``world.hierarchical=true world.node_size=2``) at ``trainer.zero_stage=3``: each
node holds a replica of every slice, sharded inside the node. Under ``shrink`` the lost
rank's node steps out whole and the other node trains on alone (nothing re-split, sent or
read from disk); with ``world.respawn=true`` both ranks of the node are started again, join
at a step boundary and heal from their replicas in the other node; under ``restart`` every
process is stopped and started again from the checkpoint.

    python -m benchmarks.elastic_hsdp [--timeout 10]   # from the repo root; ~10 min on a loaded 2-core machine
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch

from benchmarks.elastic import AT, EVERY, MODEL, MODES, RUN, STEPS, VICTIM, _fdp, _fmt, _tries

RESULTS = Path(__file__).resolve().parent / "results" / "elastic_hsdp.md"
HSDP = (
    *[o for o in RUN if not o.startswith("world.nproc_per_node")],
    "world.nproc_per_node=4",
    "world.hierarchical=true",
    "world.node_size=2",
    "trainer.zero_stage=3",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=10.0, help="world.timeout_s")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for mode in MODES:
        m = _tries(_fdp, mode, signal.SIGKILL, args.timeout, HSDP)
        print(mode, m, flush=True)
        note = "" if m["full"] else " (on 2 ranks)"
        rows.append(
            f"| {mode} | {_fmt(m['lost_s'], '.1f')}{note} | {_fmt(m['redone'], '.0f')} | {m['world']:.0f} "
            f"| {m['loss']:.3f} | {m['step_ms']:.1f} | {m['wall_s']:.1f} |"
        )
    load = os.getloadavg()[0]
    width = next(o.split("=")[1] for o in MODEL if o.startswith("model.d_model"))
    table = "\n".join(
        [
            "# Time lost to a killed rank at ZeRO stage 3 under HSDP (benchmarks/elastic_hsdp.py)",
            "",
            "4 gloo ranks in two simulated nodes of two (`world=local4 world.hierarchical=true world.node_size=2 "
            f"trainer.zero_stage=3`), char transformer d_model {width} x 2 layers, dropout 0.1, Adam, global batch 24, "
            f"{STEPS} steps, checkpoints every {EVERY}; launch rank {VICTIM} is sent SIGKILL as it starts step {AT} "
            f"and (respawn) started again at once; timeouts {args.timeout:g} s; one run each; "
            f"torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; "
            f"load average {load:.1f} at the end (2-core machine shared with others).",
            "",
            "Time lost: from the signal until the world is back at 4 ranks and completed a step there (shrink: until "
            "the node left steps again, on 2 ranks). Redone: steps done at the signal that are computed again. Step: "
            "the run's median step time (over its sizes).",
            "",
            "| way | time lost (s) | redone steps | final world | final loss | step (ms) | wall (s) |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            "`restart` is `world.on_rank_loss=restart world.max_restarts=1`; `shrink` is `world.on_rank_loss=shrink`; "
            "`grow` adds `world.respawn=true world.respawn_delay_s=0`. The final losses of shrink and grow are equal "
            "(per-sample dropout streams; restart draws from each rank's generator). torchft's HSDP recovery (FSDP2 "
            "inside a replica group under its `Manager`) is not in this table: not tried on gloo.",
            "",
            f"`python -m benchmarks.elastic_hsdp --timeout {args.timeout:g}`",
            "",
        ]
    )
    print(table)
    args.out.write_text(table)


if __name__ == "__main__":
    main()
