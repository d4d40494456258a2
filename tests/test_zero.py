"""ZeRO stages 1 and 2 on the bucket plan: equal to stage 0, reshardable checkpoints, refusals."""
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from fdp import zero
from fdp.comm import Comm
from fdp.config import ConfigError, register_configs, validate
from fdp.functional import functionalize
from fdp.hooks import noop, topk
from fdp.models import MLP
from fdp.optim import across_shards, adam, chain, clip_by_global_norm
from fdp.plan import pack_into_buckets, plan_buckets
from fdp.train import cross_entropy_loss, init_train_state, make_train_step, planner_loss
from fdp.trainer import run

CONF = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()

STEPS = 30
# Odd layer sizes and a tiny cap: several buckets whose sizes do not divide by 2 or 4, so
# slices start and end inside parameters and the last rank's slice runs into padding.
MODEL = (13, 7, 2, 5)
CAP_MB = 60 * 4 / 2**20


def _batches(rank, world, accum):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(8 * world, MODEL[0], generator=g), torch.randint(0, MODEL[-1], (8 * world,), generator=g)
        out.append((x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]))
    return out


def _model_and_plan(rank, world, accum):
    """The MLP of ``MODEL``, this rank's batches and the bucket plan: ``(loss_fn, params, buffers, batches, plan)``."""
    torch.manual_seed(0)
    model, params, buffers = functionalize(MLP(*MODEL))
    loss_fn = cross_entropy_loss(model)
    batches = _batches(rank, world, accum)
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    return loss_fn, params, buffers, batches, plan


def _train(rank, world, stage, optimizer, accum, donate, schedule):
    loss_fn, params, buffers, batches, plan = _model_and_plan(rank, world, accum)
    comm = Comm()
    step = make_train_step(loss_fn, optimizer, plan, comm=comm, accum_steps=accum, schedule=schedule,
                           donate=donate, zero_stage=stage)
    if stage:
        state = zero.init_state(params, buffers, optimizer, plan, comm)
    else:
        state = init_train_state(params, buffers, optimizer, plan)
    for batch in batches:
        state, metrics = step(state, batch)
    return plan, state, metrics


VARIANTS = {
    "adam_per_bucket": (lambda: adam(1e-2), 1, True, "overlap"),
    "adam_accumulated_pure": (lambda: adam(1e-2, weight_decay=0.1), 2, False, "after"),
    "clipped_adam": (lambda: chain(clip_by_global_norm(0.05), adam(1e-2)), 2, True, "overlap"),
}


def _compare_stages(rank, world):
    out = {}
    for name, (make_opt, accum, donate, schedule) in VARIANTS.items():
        plan, reference, m0 = _train(rank, world, 0, make_opt(), accum, donate, schedule)
        for stage in (1, 2):
            _, state, m = _train(rank, world, stage, make_opt(), accum, donate, schedule)
            diff = max((state.params[n] - reference.params[n]).abs().max().item() for n in reference.params)
            out[(name, stage)] = (diff, m["state_mib"] / m0["state_mib"])
    uneven = [b.numel % world for b in plan.buckets]
    inside = any(0 < zero.shard_range(b, r, world)[0] - s.offset < s.numel
                 for b in plan.buckets for r in range(world) for s in b.slots)
    return out, uneven, inside


@pytest.mark.parametrize("world_size", [2, 4])
def test_stages_one_and_two_equal_stage_zero(run_ranks, world_size):
    """30 Adam steps (per-bucket in place, accumulated and pure, clipped by global norm) on every rank."""
    results = run_ranks(_compare_stages, world_size=world_size)
    for out, uneven, inside in results:
        assert any(uneven) and inside  # the layout really splits parameters and pads
        for (name, stage), (diff, ratio) in out.items():
            assert diff <= 1e-6, (name, stage, diff)
        # Adam: params 1, moments 2, gradients 1 (in units of the params): stage 1 keeps
        # params and gradients whole, stage 2 only the params.
        for name in VARIANTS:
            assert out[(name, 2)][1] < out[(name, 1)][1] < 1.0
        assert out[("adam_per_bucket", 1)][1] == pytest.approx((2 + 2 / world_size) / 4, rel=0.1)
        assert out[("adam_per_bucket", 2)][1] == pytest.approx((1 + 2 / world_size) / 4, rel=0.1)


def _nonfinite_at_step_3(rank, world, stage, nonfinite):
    """Rank 1's batch of step 3 holds an inf: ``(steps taken, metrics["skipped"] per step, error or None, step 3 kept the params)``."""
    loss_fn, params, buffers, batches, plan = _model_and_plan(rank, world, 1)
    batches = batches[:5]
    if rank == 1:
        x, y = batches[2]
        batches[2] = (x.clone().fill_(float("inf")), y)
    comm = Comm()
    step = make_train_step(loss_fn, adam(1e-2), plan, comm=comm, donate=True, nonfinite=nonfinite, zero_stage=stage)
    state, skipped, kept = zero.init_state(params, buffers, adam(1e-2), plan, comm), [], None
    try:
        for batch in batches:
            before = {n: p.clone() for n, p in state.params.items()}
            state, metrics = step(state, batch)
            skipped.append(metrics["skipped"])
            if state.step == 3:
                kept = all(torch.equal(state.params[n], p) for n, p in before.items())
    except FloatingPointError as error:
        return state.step, skipped, str(error), kept
    return state.step, skipped, None, kept


@pytest.mark.parametrize("stage", [1, 2])
def test_a_nonfinite_gradient_raises_or_skips_on_every_rank_alike(run_ranks, stage):
    raised = run_ranks(_nonfinite_at_step_3, stage, "raise")
    for steps, skipped, error, _ in raised:
        assert steps == 2 and skipped == [0, 0], (steps, skipped)
        assert error is not None and error.startswith("non-finite gradient at step 3 in "), error
        assert error.endswith("(set trainer.nonfinite=skip to skip such steps)")
    went_on = run_ranks(_nonfinite_at_step_3, stage, "skip")
    assert went_on == [(5, [0, 0, 1, 0, 0], None, True)] * 2


def test_clipping_sees_the_global_norm_across_slices():
    """Clipping two shards, each completing its norm with the other's, equals clipping the whole."""
    g = torch.Generator().manual_seed(0)
    whole = {"a": torch.randn(5, generator=g), "b": torch.randn(3, generator=g)}
    clip = clip_by_global_norm(0.5)
    expected, _ = clip.update(whole, clip.init(whole), None)
    for mine, other in (("a", "b"), ("b", "a")):
        with across_shards(lambda t: t + whole[other].square().sum()):
            got, _ = clip.update({mine: whole[mine]}, clip.init({}), None)
        torch.testing.assert_close(got[mine], expected[mine], rtol=1e-6, atol=0)
        own, _ = clip.update({mine: whole[mine]}, clip.init({}), None)
        assert not torch.allclose(own[mine], expected[mine])  # a slice's own norm would clip differently


def test_slices_cover_every_bucket_once_and_round_trip():
    plan = pack_into_buckets([("a", (3,), "float32", "cpu"), ("b", (2, 2), "float32", "cpu"), ("c", (5,), "float32", "cpu")],
                             bucket_cap_mb=7 * 4 / 2**20, first_bucket_cap_mb=7 * 4 / 2**20)
    named = {n: torch.randn(*s.shape) for b in plan.buckets for s in b.slots for n in [s.name]}
    template = SimpleNamespace(params=named, opt_state=({"mu": named},), _replace=lambda **kw: SimpleNamespace(**kw))
    for world in (1, 2, 3, 4):
        pieces = {}
        for rank in range(world):
            comm = SimpleNamespace(rank=rank, world_size=world)
            sharded = zero.shard_state(template, plan, comm)
            for key, piece in sharded.opt_state[0]["mu"].items():
                pieces.setdefault(key, []).append(piece)
        for bucket in plan.buckets:
            flat = torch.cat(pieces[zero.shard_key(bucket.index)])
            assert flat.numel() % world == 0 and flat.numel() - bucket.numel < world
            expected = torch.cat([named[s.name].reshape(-1) for s in bucket.slots])
            assert torch.equal(flat[: bucket.numel], expected)
            assert not flat[bucket.numel :].any()  # padding is zero


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match=r"^zero_stage=3: expected 0, 1 or 2$"):
        zero.check_zero_stage(3)
    with pytest.raises(ConfigError, match=r"^trainer.zero_stage=2: hooks 'topk' need the whole reduced bucket"):
        validate(_cfg("trainer.zero_stage=2", "hooks=topk"))
    with pytest.raises(ConfigError, match=r"^trainer.zero_stage=7: expected 0, 1 or 2$"):
        validate(_cfg("trainer.zero_stage=7"))
    validate(_cfg("trainer.zero_stage=1", "hooks=powersgd"))  # stage 1 reduces whole buckets: accepted
    # Through the Python API the chain itself is refused when it asks for more than the bucket.
    torch.manual_seed(0)
    model, params, buffers = functionalize(MLP(*MODEL))
    loss_fn = cross_entropy_loss(model)
    batch = _batches(0, 1, 1)[0]
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    step = make_train_step(loss_fn, adam(1e-2), plan, hook=topk(0.5), zero_stage=2)
    with pytest.raises(ValueError, match=r"zero_stage=2: the hook chain needs the whole reduced bucket"):
        step(zero.init_state(params, buffers, adam(1e-2), plan, Comm(), hook=topk(0.5)), batch)
    step = make_train_step(loss_fn, adam(1e-2), plan, hook=noop(), zero_stage=2)  # a chain that sends nothing: accepted
    assert step(zero.init_state(params, buffers, adam(1e-2), plan, Comm()), batch)[0].step == 1
    step = make_train_step(loss_fn, adam(1e-2), plan, zero_stage=1)
    with pytest.raises(ValueError, match="optimizer state is not sharded"):
        step(init_train_state(params, buffers, adam(1e-2), plan), batch)


def _cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=["trainer.progress=false", "trainer.eval_every=0", *overrides])


def _last(run_dir):
    return torch.load(Path(run_dir) / "checkpoints" / "last.pt", weights_only=True)


def test_checkpoints_reshard_across_world_sizes_and_stages(tmp_path):
    """A stage-1 run on 2 ranks stopped at step 10 resumes on 1 rank (stage 0) and on 4 (stage 2) like the run that went on."""
    common = ["optim=adam", "model.hidden=24", "trainer.max_steps=20", "data.global_batch_size=16",
              "trainer.bucket_cap_mb=0.01", "trainer.first_bucket_cap_mb=0.002", "trainer.checkpoint_every=10"]
    summary = run(_cfg(*common, "world=local2", "trainer.zero_stage=1"), tmp_path / "straight")
    assert summary["state_mib"] > 0
    # The run as it stood at step 10: its checkpoint of that step as the last one.
    stopped = tmp_path / "stopped"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "straight" / "checkpoints" / "step_00000010.pt", stopped / "checkpoints" / "last.pt")
    saved = _last(tmp_path / "stopped")
    shapes = {n: p.shape for n, p in saved["params"].items()}
    moments = [t for t in saved["opt_state"] if isinstance(t, torch.Tensor)]
    assert [t.shape for t in moments] == [*shapes.values(), *shapes.values()]  # whole per-parameter mu and nu
    for world, stage in (("single", 0), ("local4", 2)):
        resumed = tmp_path / f"{world}_stage{stage}"
        shutil.copytree(tmp_path / "stopped", resumed)
        run(_cfg(*common, f"world={world}", f"trainer.zero_stage={stage}", "trainer.resume=true"), resumed)
        a, b = _last(tmp_path / "straight"), _last(resumed)
        assert a["step"] == b["step"] == 20
        diff = max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"])
        assert diff <= 1e-5, (world, stage, diff)
        for x, y in zip(a["opt_state"], b["opt_state"]):
            if isinstance(x, torch.Tensor):
                assert x.shape == y.shape and (x - y).abs().max().item() <= 1e-5
            else:
                assert x == y
