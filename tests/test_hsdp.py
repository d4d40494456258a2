"""Hybrid sharding (HSDP, ``world.hierarchical=true`` with a ZeRO stage) on two groups of two gloo ranks: equal to
flat ZeRO at the same stage and to one process on the union batch, a fraction of flat's bytes across the groups,
and checkpoints that move between hybrid and flat worlds."""

import math
import shutil
from pathlib import Path

import pytest
import torch
from _saved import saved
from hydra import compose, initialize_config_dir

from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
from fdp.comm import Comm
from fdp.hooks import allreduce, int8
from fdp.hooks.base import init_hook_states
from fdp.hooks.compress import reduced_in
from fdp.model.builtin import MLP
from fdp.model.functional import functionalize
from fdp.optim import adam, chain, clip_by_global_norm
from fdp.plan import plan_buckets
from fdp.run.config import ConfigError, register_configs
from fdp.run.consolidate import consolidate
from fdp.run.trainer import run
from fdp.run.validate import validate
from fdp.step.chains import Reduction
from fdp.update import zero
from fdp.update.zero.scatter import ScatterComm

CONF = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()

STEPS = 4
MODEL = (13, 7, 2, 5)  # odd sizes and a tiny cap: buckets that do not split evenly over 2 or 4 ranks
CAP_MB = 60 * 4 / 2**20
NODE = 2


def _union_batches(world):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(8 * world, MODEL[0], generator=g), torch.randint(0, MODEL[-1], (8 * world,), generator=g))
        for _ in range(STEPS)
    ]


def _setup(rank, world):
    torch.manual_seed(0)
    model, params, buffers = functionalize(MLP(*MODEL))
    loss_fn = cross_entropy_loss(model)
    batches = [(x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]) for x, y in _union_batches(world)]
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB
    )
    return loss_fn, params, buffers, batches, plan, model


def _optimizer():
    return chain(clip_by_global_norm(0.05), adam(1e-2))  # the clip's norm sums every rank's slices


def _train(rank, world, stage, groups):
    loss_fn, params, buffers, batches, plan, model = _setup(rank, world)
    comm = Comm()
    update = zero.update_for(stage, _optimizer(), plan, comm, model=model, groups=groups)
    step = make_train_step(loss_fn, _optimizer(), plan, comm=comm, update=update, donate=True, model=model)
    state = update.first_state(params, buffers, None, comm)
    norms = []
    for batch in batches:
        state, metrics = step(state, batch)
        norms.append(float(metrics["grad_norm"]))
    held = sum(p.numel() for p in state.params.values())  # stage 3: this rank's slices alone
    whole = zero.whole_params(state, plan, update.comm)  # stage 3: gathered inside the group
    return {name: p.detach().clone() for name, p in whole.items()}, norms, held


def _reduce(hook, comm, plan, grads):
    reduction = Reduction(hook, comm, init_hook_states(hook, plan), plan)
    for flat in grads:
        reduction.start(flat.clone())
    out = [None] * len(plan.buckets)
    for index, bucket in reduction.finished():
        out[index] = bucket.buffer.clone()
    return out, reduction.stats().bytes_sent


def _hybrid_ranks(rank, world):
    groups = zero.shard_groups(NODE)
    trained = {stage: (_train(rank, world, stage, None), _train(rank, world, stage, groups)) for stage in (1, 2, 3)}
    # One reduction of random buckets: flat ZeRO's reduce-scatter against the hybrid one's two legs.
    plan = _setup(rank, world)[4]
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(b.numel, generator=g) for b in plan.buckets]
    mean, _ = _reduce(allreduce(), Comm(), plan, grads)
    _, flat_bytes = _reduce(allreduce(), ScatterComm(Comm(), plan), plan, grads)
    hybrid, hybrid_bytes = _reduce(zero.across_replicas(allreduce(), groups, plan), Comm(), plan, grads)
    bf16 = zero.across_replicas(reduced_in(torch.bfloat16, allreduce()), groups, plan)
    _, bf16_bytes = _reduce(bf16, Comm(), plan, grads)
    slices = [zero.padded_slice(m, *zero.shard_range(b, groups.shard.rank, NODE)) for m, b in zip(mean, plan.buckets)]
    # int8 keeps error feedback in its state: made for the slice, and the slice's mean within a rounding step.
    quantised = zero.across_replicas(int8(), groups, plan)
    errors = [state[0].error.numel() for state in init_hook_states(quantised, plan)]
    coarse, _ = _reduce(quantised, Comm(), plan, grads)
    # A replica's scale is its group's largest mean / 127, within twice the world's; the sum is off by half of it.
    step = max(s.abs().max().item() for s in slices) / 127
    int8_ok = errors == [s.numel() for s in slices] and all(
        (c - s).abs().max().item() <= step for c, s in zip(coarse, slices)
    )
    return trained, [b.numel for b in plan.buckets], slices, hybrid, flat_bytes, hybrid_bytes, bf16_bytes, int8_ok


def test_hybrid_sharding_equals_flat_zero_and_one_process(run_ranks):
    """Stages 1-3 on 2 groups x 2 ranks, 4 clipped Adam steps: equal to flat ZeRO at the same stage (<= 1e-5) and to
    one process on the union batch; each rank's slice of a reduction is its share of the world's mean, and what it
    sends across the groups is 1/2 of a flat rank's reduction (1/4 with trainer.reduce_dtype=bfloat16)."""
    world = 4
    results = run_ranks(_hybrid_ranks, world_size=world)
    loss_fn, params, buffers, _, plan, model = _setup(0, 1)
    step = make_train_step(loss_fn, _optimizer(), plan)
    state = init_train_state(params, buffers, _optimizer(), plan)
    reference_norms = []
    for batch in _union_batches(world):
        state, metrics = step(state, batch)
        reference_norms.append(float(metrics["grad_norm"]))
    for trained, numels, slices, hybrid, flat_bytes, hybrid_bytes, bf16_bytes, int8_ok in results:
        assert int8_ok
        assert any(n % NODE for n in numels) and len(numels) >= 3  # slices that pad and split parameters
        (_, _, flat_held), (_, _, hsdp_held) = trained[3]
        assert (flat_held, hsdp_held) == tuple(sum(math.ceil(n / k) for n in numels) for k in (world, NODE))
        for stage, ((flat, _, _), (hsdp, hsdp_norms, _)) in trained.items():
            assert max((flat[n] - hsdp[n]).abs().max().item() for n in flat) <= 1e-5, stage
            assert max((state.params[n] - hsdp[n]).abs().max().item() for n in flat) <= 1e-5, stage
            assert hsdp_norms == pytest.approx(reference_norms, rel=1e-5), stage
        for got, want in zip(hybrid, slices):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert flat_bytes == sum(numels) * 4
        assert hybrid_bytes == sum(math.ceil(n / NODE) for n in numels) * 4
        assert bf16_bytes == hybrid_bytes // 2


def _cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=["trainer.progress=false", "trainer.eval_every=0", *overrides])


COMMON = [
    "optim=adam",
    "model.hidden=24",
    "trainer.max_steps=6",
    "data.global_batch_size=16",
    "trainer.bucket_cap_mb=0.01",
    "trainer.first_bucket_cap_mb=0.002",
    "trainer.checkpoint_every=3",
    "trainer.ema_decay=0.9",  # at stage 3 the average is sharded as the params are
]
HYBRID = ["world=local4", "world.hierarchical=true", f"world.node_size={NODE}"]


def _params(payload):
    return payload["params"]


def _diff(a, b):
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_checkpoints_move_between_hybrid_and_flat_worlds(tmp_path):
    """Stage 3 on 2 groups x 2 ranks trains as flat stage 3 on 4 (with the params' moving average); its whole-file
    checkpoint of step 3 resumes flat on 2 ranks at stage 2 and hybrid on 4 groups of 1 at stage 2, and flat's
    sharded one resumes hybrid at stage 3, each ending where the run that went on did. A hybrid sharded checkpoint
    has its slices written by group 0 alone, and consolidates whole."""
    hybrid, flat = tmp_path / "hybrid", tmp_path / "flat"
    run(_cfg(*COMMON, *HYBRID, "trainer.zero_stage=3", "trainer.checkpoint_format=whole"), hybrid)
    run(_cfg(*COMMON, "world=local4", "trainer.zero_stage=3", "trainer.checkpoint_format=sharded"), flat)
    hybrid_saved, flat_saved = saved(hybrid), consolidate(flat)
    hybrid_end, flat_end = _params(hybrid_saved), _params(flat_saved)
    assert _diff(hybrid_end, flat_end) <= 1e-5
    assert _diff(hybrid_saved["ema"], flat_saved["ema"]) <= 1e-5

    to_flat = tmp_path / "to_flat"
    run(
        _cfg(*COMMON, "world=local2", "trainer.zero_stage=2", f"trainer.resume={hybrid}/checkpoints/step_00000003.pt"),
        to_flat,
    )
    assert _diff(_params(saved(to_flat)), hybrid_end) <= 1e-5

    to_single_rank_nodes = tmp_path / "to_single_rank_nodes"  # 4 groups of 1: every rank holds every slice
    run(
        _cfg(
            *COMMON,
            "world=local4",
            "world.hierarchical=true",
            "world.node_size=1",
            "trainer.zero_stage=2",
            f"trainer.resume={hybrid}/checkpoints/step_00000003.pt",
        ),
        to_single_rank_nodes,
    )
    resumed = saved(to_single_rank_nodes)
    assert _diff(_params(resumed), hybrid_end) <= 1e-5

    to_hybrid = tmp_path / "to_hybrid"
    run(
        _cfg(
            *COMMON,
            *HYBRID,
            "trainer.zero_stage=3",
            "trainer.checkpoint_format=sharded",
            f"trainer.resume={flat}/checkpoints/step_00000003",
        ),
        to_hybrid,
    )
    written = consolidate(to_hybrid / "checkpoints" / "step_00000006")
    assert _diff(_params(written), flat_end) <= 1e-5 and _diff(written["ema"], flat_saved["ema"]) <= 1e-5
    # Params and Adam's moments are all slices at stage 3: written by group 0 (ranks 0, 1) alone.
    files = [to_hybrid / "checkpoints" / "step_00000006" / f"__{rank}_0.distcp" for rank in range(4)]
    sizes = [path.stat().st_size if path.exists() else 0 for path in files]
    assert min(sizes[:2]) > 10 * max(sizes[2:]), sizes
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["hooks=powersgd", "trainer.zero_stage=1"],
            "hooks 'powersgd' need the whole reduced bucket, which hybrid sharding",
        ),
        (
            ["trainer.zero_stage=0", "trainer.precision=bf16-mixed", "trainer.reduce_dtype=bfloat16"],
            "trainer.reduce_dtype='bfloat16': expected float32 with world.hierarchical=true at trainer.zero_stage=0",
        ),
    ],
)
def test_what_hybrid_sharding_cannot_take_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(_cfg(*HYBRID, *overrides))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_hybrid_sharding_takes_a_reduce_dtype():
    validate(_cfg(*HYBRID, "trainer.zero_stage=3", "trainer.precision=bf16-mixed", "trainer.reduce_dtype=bfloat16"))


def test_int8_error_feedback_moves_between_hybrid_and_flat_worlds(tmp_path):
    """hooks=int8 keeps its error feedback per slice in a hybrid world and per bucket in a flat one: a checkpoint
    of one resumes in the other, the moved residual started again (as a rank new to a world starts it)."""
    common = [*COMMON, "hooks=int8", "trainer.zero_stage=2", "trainer.max_steps=3"]
    run(_cfg(*common, *HYBRID, "trainer.checkpoint_format=whole"), tmp_path / "hybrid")
    summary = run(
        _cfg(
            *common,
            "world=local2",
            f"trainer.resume={tmp_path}/hybrid/checkpoints/step_00000003.pt",
            "trainer.max_steps=5",
        ),
        tmp_path / "flat",
    )
    assert summary["steps"] == 5 and math.isfinite(summary["loss"])
