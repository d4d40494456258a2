"""Benchmark: bytes that leave a node per step, flat ZeRO against hybrid sharding (HSDP), on 2 nodes x 2 ranks.

Four gloo ranks on loopback stand for two nodes of two (ranks 0-1 and 2-3). Each runs a
char transformer (d_model 128, 4 layers, vocab 64; batch 4 x 32 tokens per rank, Adam)
for a few steps at ZeRO stages 1, 2 and 3, once flat (the state split over all four
ranks) and once hybrid (``fdp.update.zero.hybrid``: split inside each node, replicated across);
then one DiLoCo run, flat (every rank a replica) and over hybrid-sharded replicas at stages 1-3
(``fdp.update.zero.replicas``: each node one replica, syncing slice to slice).

Counted per rank and step: the bytes this rank hands to collectives (``Comm``'s payload
counter) whose group spans both nodes, and to those that stay inside its node. Every
collective of a flat world spans the nodes; a hybrid world's spanning ones are the slices'
reduction across the replicas, its reduce-scatter and all-gathers (stage 3's param gathers
included) stay inside. What a collective's algorithm actually routes over the link
depends on the backend (a ring of 4 over 2 nodes crosses twice); the payload is the figure
both share.

    python benchmarks/hsdp_bytes.py [--steps 3]

Writes ``benchmarks/results/hsdp_bytes.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make ``fdp`` and this module importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fdp import cross_entropy_loss, make_train_step, planner_loss  # noqa: E402
from fdp.comm import Comm  # noqa: E402
from fdp.model.builtin import CharTransformer  # noqa: E402
from fdp.model.functional import functionalize  # noqa: E402
from fdp.optim import adam  # noqa: E402
from fdp.plan import plan_buckets  # noqa: E402
from fdp.procs.launch import WorldLayout, init_distributed, spawn  # noqa: E402
from fdp.run.config import DiLoCoConfig  # noqa: E402
from fdp.step.outer import init_outer_state, make_outer_step  # noqa: E402
from fdp.step.outer_spec import check_outer  # noqa: E402
from fdp.update import zero  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
NODE, WORLD = 2, 4
OUTER_STEPS, SYNC_EVERY = 16, 8


@dataclass
class CountingComm(Comm):
    """A ``Comm`` that also keeps a running total of its payload (``take_counters`` does not reset it)."""

    total: int = field(default=0)

    def _count(self, tensor: torch.Tensor) -> None:
        super()._count(tensor)
        self.total += tensor.numel() * tensor.element_size()


def _setup(rank: int):
    torch.manual_seed(0)
    model, params, buffers = functionalize(
        CharTransformer(vocab_size=64, block_size=32, d_model=128, n_layer=4, n_head=4)
    )
    loss_fn = cross_entropy_loss(model)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 64, (4, 33), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch, bucket_cap_mb=0.25, first_bucket_cap_mb=0.25)
    return model, params, buffers, loss_fn, batch, plan


def _measure(rank: int, world: int, steps: int) -> dict:
    model, params, buffers, loss_fn, batch, plan = _setup(rank)
    made = zero.shard_groups(NODE)
    groups = zero.ShardGroups(CountingComm(made.shard.group), CountingComm(made.replicas.group))
    out = {"params": sum(p.numel() for p in params.values())}
    for stage in (1, 2, 3):
        for mode in ("flat", "hsdp"):
            comm = CountingComm()
            update = zero.update_for(
                stage, adam(1e-3), plan, comm, model=model, groups=groups if mode == "hsdp" else None
            )
            step = make_train_step(loss_fn, adam(1e-3), plan, comm=comm, update=update, donate=True, model=model)
            state = update.first_state(params, buffers, None, comm)
            state, _ = step(state, batch)  # warm-up: stage 3 records its gathers on the first step
            before = (comm.total, groups.shard.total, groups.replicas.total)
            for _ in range(steps):
                state, _ = step(state, batch)
            world_bytes, inside, across = (
                (after - start) / steps
                for after, start in zip((comm.total, groups.shard.total, groups.replicas.total), before)
            )
            spanning = world_bytes + across  # the world comm spans both nodes
            out[(stage, mode)] = (spanning, inside)
    for stage in (0, 1, 2, 3):  # DiLoCo: every rank a replica (flat, stage 0), or every node's group one (hsdp)
        out[("diloco", stage)] = _outer_run(stage, params, buffers, loss_fn, batch, plan, model, made)
    return out


def _outer_run(stage: int, params, buffers, loss_fn, batch, plan, model, made: zero.ShardGroups) -> tuple:
    """One DiLoCo run of OUTER_STEPS steps (a sync every SYNC_EVERY): the bytes across nodes and inside, in all."""
    comm = CountingComm()
    groups = zero.ShardGroups(CountingComm(made.shard.group), CountingComm(made.replicas.group))
    spec = check_outer(dataclasses.asdict(DiLoCoConfig(sync_every=SYNC_EVERY)))
    update = zero.update_for(stage, adam(1e-3), plan, comm, model=model, groups=groups if stage else None)
    state = update.first_state(params, buffers, None, comm)
    replica = update.replica()
    state = state._replace(outer=init_outer_state(spec, replica.pieces(state.params), replica.plan))
    before = (comm.total, groups.shard.total, groups.replicas.total)  # the first state's checks are not the run's
    step = make_outer_step(loss_fn, adam(1e-3), plan, spec, comm=comm, donate=True, update=update, model=model)
    for _ in range(OUTER_STEPS):
        state, _ = step(state, batch)
    world_bytes, inside, across = (
        after - start for after, start in zip((comm.total, groups.shard.total, groups.replicas.total), before)
    )
    return world_bytes + across, inside


def _rank(steps: int, layout: WorldLayout) -> dict:
    comm = init_distributed(layout)
    torch.set_num_threads(1)
    try:
        return _measure(comm.rank, comm.world_size, steps)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    layout = WorldLayout("elastic", nproc_per_node=WORLD, backend="gloo", timeout_s=120.0)
    results = spawn(_rank, (args.steps, layout), layout)
    rows = results[0]
    mib = 2**20
    lines = [
        f"# Bytes leaving a node per step: flat ZeRO vs hybrid sharding (2 nodes x {NODE} gloo ranks)",
        "",
        f"Char transformer, {rows['params']:,} parameters (fp32), Adam, {args.steps} steps after one warm-up;",
        "per rank (rank 0), the payload handed to collectives whose group spans both nodes, and to those",
        "inside the node (`python benchmarks/hsdp_bytes.py`).",
        "",
        "| stage | world | across nodes (MiB/step) | inside the node (MiB/step) | across / flat |",
        "|---|---|---|---|---|",
    ]
    for stage in (1, 2, 3):
        flat = rows[(stage, "flat")][0]
        for mode in ("flat", "hsdp"):
            across, inside = rows[(stage, mode)]
            lines.append(f"| {stage} | {mode} | {across / mib:.3f} | {inside / mib:.3f} | {across / flat:.3f} |")
    lines += [
        "",
        f"DiLoCo, one run of {OUTER_STEPS} steps with a sync every {SYNC_EVERY} (`outer=diloco`): flat, every rank",
        "a replica (stage 0); hsdp, each node's group one (`world.hierarchical=true`, the stage's",
        "steps inside the node, each rank syncing its slices across); against the per-step runs above.",
        "",
        "| stage | world | across nodes (MiB/run) | inside the node (MiB/run) | across / flat DiLoCo |",
        "|---|---|---|---|---|",
    ]
    flat = rows[("diloco", 0)][0]
    for stage in (0, 1, 2, 3):
        across, inside = rows[("diloco", stage)]
        mode = "hsdp" if stage else "flat"
        lines.append(f"| {stage} | {mode} | {across / mib:.3f} | {inside / mib:.3f} | {across / flat:.3f} |")
    for stage in (1, 2, 3):
        across = rows[(stage, "flat")][0] * OUTER_STEPS
        lines.append(f"| {stage} | flat, every step | {across / mib:.3f} | - | {across / flat:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hsdp_bytes.md").write_text(text)


if __name__ == "__main__":
    main()
