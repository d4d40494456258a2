"""What a mirror of the next rank's slices would cost a flat ZeRO stage 2 or 3 world that may shrink.

Stage 1 survives a lost rank because each rank also steps the next rank's slices of the
optimizer state (``TrainState.mirror``) from the whole reduced gradient it holds. At stages 2
and 3 a rank receives only its slice of the reduced gradient: a mirror needs the next rank's
slice too (one more reduce-scatter leg per bucket, or each owner sending its reduced slice on
to the rank before it), the optimizer's elementwise work twice (stage 1's mirror: +2.2% per
step, ``results/shrink_overhead.md``), and the mirror's own state. Counted here, not timed
(deterministic on a shared machine), for gloo ranks that build a char transformer (Adam):

* the bytes of the state each rank holds at stages 2 and 3, without and with a mirror (the
  mirror holds the next rank's optimizer-state slices, and at stage 3 its param slices too:
  stage 1's mirror, measured, plus the param slices counted);
* the bytes each rank sends per step at stages 2 and 3 (the step's ``bytes_sent``, as NCCL
  sends them: a reduce-scatter and an all-gather of ``(N - 1) / N`` of each bucket), and what
  a mirror adds: one more reduce-scatter leg, or the reduced slice sent on (``1 / N``).

    python -m benchmarks.zero_mirror [--ranks 4] [--d-model 128]   # from the repo root; ~1 min
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import fdp
from fdp.data import global_batch, load_stdlib_text, rank_share
from fdp.model.builtin import CharTransformer
from fdp.procs.launch import WorldLayout, init_distributed, spawn
from fdp.update import zero

RESULTS = Path(__file__).resolve().parent / "results" / "zero_mirror.md"


def _rank(d_model: int, layout: WorldLayout) -> dict:
    comm = init_distributed(layout)
    torch.set_num_threads(1)
    data = load_stdlib_text(block_size=64, max_chars=200_000)
    torch.manual_seed(0)
    model, params, buffers = fdp.functionalize(CharTransformer(data.num_classes, 64, d_model, 2, 4, dropout=0.1))
    batch = rank_share(global_batch(data, 0, 32, 0), comm.rank, comm.world_size)
    plan = fdp.plan_buckets(fdp.planner_loss(fdp.cross_entropy_loss(model), buffers), params, batch)
    optimizer = fdp.adam(1e-3)
    held = {
        "stage 1": zero.state_nbytes(zero.init_state(params, buffers, optimizer, plan, comm, stage=1)),
        "stage 1 + mirror": zero.state_nbytes(
            zero.init_state(params, buffers, optimizer, plan, comm, stage=1, mirror=True)
        ),
    }
    for stage in (2, 3):
        held[f"stage {stage}"] = zero.state_nbytes(zero.init_state(params, buffers, optimizer, plan, comm, stage=stage))
    world = comm.world_size
    padded = sum(
        zero.slice_range(b, 0, world)[1] * world * b.torch_dtype.itemsize for b in plan.buckets
    )  # bytes, all buckets
    return {"held": held, "bucket_bytes": padded, "world": world, "params": sum(p.numel() for p in params.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    layout = WorldLayout("elastic", nproc_per_node=args.ranks, backend="gloo", timeout_s=300)
    result = spawn(_rank, (args.d_model, layout), layout)[0]
    held, world, bucket = result["held"], result["world"], result["bucket_bytes"]
    mirror_opt = held["stage 1 + mirror"] - held["stage 1"]  # the next rank's optimizer-state slices
    param_slice = bucket / world  # the next rank's param slices (stage 3)
    mib = 2**20
    leg = bucket * (world - 1) / world  # a reduce-scatter (or all-gather) of every bucket, per rank
    rows_held = [
        f"| 2 | {held['stage 2'] / mib:.2f} | {(held['stage 2'] + mirror_opt) / mib:.2f} | "
        f"+{mirror_opt / held['stage 2']:.0%} |",
        f"| 3 | {held['stage 3'] / mib:.2f} | {(held['stage 3'] + mirror_opt + param_slice) / mib:.2f} | "
        f"+{(mirror_opt + param_slice) / held['stage 3']:.0%} |",
    ]
    table = "\n".join(
        [
            "# What a mirror of the next rank's slices would cost flat ZeRO stages 2 and 3 (benchmarks/zero_mirror.py)",
            "",
            f"{world} ranks, char transformer d_model {args.d_model} x 2 layers ({result['params']:,} params, fp32), "
            f"Adam; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}. Counted, not timed.",
            "",
            "| stage | state per rank, MiB | with a mirror | more |",
            "|---|---|---|---|",
            *rows_held,
            "",
            "| bytes each rank sends per step (NCCL's collectives) | MiB | more |",
            "|---|---|---|",
            f"| stage 2 (reduce-scatter, all-gather of the params) | {2 * leg / mib:.2f} | |",
            f"| + one more reduce-scatter leg (the next rank's slice) | {3 * leg / mib:.2f} | +50% |",
            f"| + the reduced slice sent on by its owner instead | {(2 * leg + bucket / world) / mib:.2f} | "
            f"+{bucket / world / (2 * leg):.0%} |",
            f"| stage 3 (+ the params gathered for forward and backward) | {4 * leg / mib:.2f} | |",
            f"| + one more reduce-scatter leg | {5 * leg / mib:.2f} | +25% |",
            "",
            "And the optimizer's elementwise work twice (stage 1's mirror: 56.6 against 55.4 ms per step, "
            "`results/shrink_overhead.md`).",
            "",
            f"`python -m benchmarks.zero_mirror --ranks {args.ranks} --d-model {args.d_model}`",
            "",
        ]
    )
    print(table)
    args.out.write_text(table)


if __name__ == "__main__":
    main()
