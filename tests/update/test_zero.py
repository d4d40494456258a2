"""ZeRO stages 1, 2 and 3 on the bucket plan: equal to stage 0 (and stage 3 to torch's FSDP2), reshardable
checkpoints, refusals."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _configs import quiet as _cfg
from _saved import saved

from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
from fdp.comm import Comm
from fdp.errors import ConfigError
from fdp.hooks import noop, topk
from fdp.model.builtin import MLP, CharTransformer
from fdp.model.functional import functionalize
from fdp.optim import adam, chain, clip_by_global_norm
from fdp.optim import sgd as momentum_sgd
from fdp.plan import pack_into_buckets, plan_buckets
from fdp.run.config import register_configs
from fdp.run.config.validate import validate
from fdp.run.trainer import run
from fdp.update import zero

register_configs()

STEPS = 12  # every step compared: a wrong slice, reduction or update shows in the first
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
    """The MLP of ``MODEL``, this rank's batches and the bucket plan:
    ``(loss_fn, params, buffers, batches, plan, model)``."""
    torch.manual_seed(0)
    model, params, buffers = functionalize(MLP(*MODEL))
    loss_fn = cross_entropy_loss(model)
    batches = _batches(rank, world, accum)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB
    )
    return loss_fn, params, buffers, batches, plan, model


def _transformer_and_plan(rank, world, accum):
    """A two-block char transformer (tied embedding and head) and this rank's share of 20 token batches."""
    torch.manual_seed(0)
    model, params, buffers = functionalize(
        CharTransformer(vocab_size=11, block_size=8, d_model=16, n_layer=2, n_head=2)
    )
    loss_fn = cross_entropy_loss(model)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(20):
        tokens = torch.randint(0, 11, (4 * world, 9), generator=g)[rank * 4 : (rank + 1) * 4]
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=CAP_MB * 8, first_bucket_cap_mb=CAP_MB
    )
    return loss_fn, params, buffers, batches, plan, model


def _train(rank, world, stage, optimizer, accum, donate, schedule, reshard=True, setup=_model_and_plan, steps=None):
    loss_fn, params, buffers, batches, plan, model = setup(rank, world, accum)
    batches = batches[:steps]
    comm = Comm()
    step = make_train_step(
        loss_fn,
        optimizer,
        plan,
        comm=comm,
        accum_steps=accum,
        schedule=schedule,
        donate=donate,
        zero_stage=stage,
        model=model,
        reshard_after_forward=reshard,
    )
    if stage:
        state = zero.init_state(params, buffers, optimizer, plan, comm, stage=stage)
    else:
        state = init_train_state(params, buffers, optimizer, plan)
    for batch in batches:
        state, metrics = step(state, batch)
    return plan, state._replace(params=zero.whole_params(state, plan, comm)), metrics


VARIANTS = {
    "adam_per_bucket": (lambda: adam(1e-2), 1, True, "overlap"),
    "adam_accumulated_pure": (lambda: adam(1e-2, weight_decay=0.1), 2, False, "after"),
    "clipped_adam": (lambda: chain(clip_by_global_norm(0.05), adam(1e-2)), 2, True, "overlap"),
}


# (stage, reshard_after_forward) compared with stage 0.
STAGES = ((1, True), (2, True), (3, True), (3, False))


def _compare_stages(rank, world):
    out = {}
    for name, (make_opt, accum, donate, schedule) in VARIANTS.items():
        plan, reference, m0 = _train(rank, world, 0, make_opt(), accum, donate, schedule)
        for stage, reshard in STAGES:
            _, state, m = _train(rank, world, stage, make_opt(), accum, donate, schedule, reshard)
            diff = max((state.params[n] - reference.params[n]).abs().max().item() for n in reference.params)
            out[(name, stage, reshard)] = (diff, m["state_mib"] / m0["state_mib"])
    # Attention's key bias gets no gradient (softmax ignores it): Adam divides its ~1e-9 noise by its own
    # size and moves it by ~lr a step, in a direction the last bits decide, and torch's Adam kernels round a
    # tensor's tail elements differently from its body, so flat slices and per-parameter tensors (whose tails
    # differ) part there by ~lr/1000 a step. At lr 1e-3 that stays below 1e-5 over 20 steps
    # (12 here).
    transformer = dict(setup=_transformer_and_plan, steps=STEPS)
    _, reference, _ = _train(rank, world, 0, adam(1e-3), 1, True, "overlap", **transformer)
    for stage, reshard in ((3, True), (3, False)):
        _, state, _ = _train(rank, world, stage, adam(1e-3), 1, True, "overlap", reshard, **transformer)
        out[("transformer", stage, reshard)] = (
            max((state.params[n] - reference.params[n]).abs().max().item() for n in reference.params),
            None,
        )
    uneven = [b.numel % world for b in plan.buckets]
    inside = any(
        0 < zero.slice_range(b, r, world)[0] - s.offset < s.numel
        for b in plan.buckets
        for r in range(world)
        for s in b.slots
    )
    return out, uneven, inside


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_stage_equals_stage_zero(run_ranks, world_size):
    """12 Adam steps (per-bucket in place, accumulated and pure, clipped by global norm) of the MLP and of
    a transformer with a tied head, on every rank, at stages 1, 2 and 3 (with and without resharding)."""
    results = run_ranks(_compare_stages, world_size=world_size)
    for out, uneven, inside in results:
        assert any(uneven) and inside  # the layout really splits parameters and pads
        for (name, stage, reshard), (diff, ratio) in out.items():
            assert diff <= (1e-5 if name == "transformer" else 1e-6), (name, stage, reshard, diff)
        # Adam: params 1, moments 2, gradients 1 (in units of the params): stage 1 keeps
        # params and gradients whole, stage 2 only the params, stage 3 nothing whole.
        for name in VARIANTS:
            assert out[(name, 3, True)][1] < out[(name, 2, True)][1] < out[(name, 1, True)][1] < 1.0
        assert out[("adam_per_bucket", 1, True)][1] == pytest.approx((2 + 2 / world_size) / 4, rel=0.1)
        assert out[("adam_per_bucket", 2, True)][1] == pytest.approx((1 + 2 / world_size) / 4, rel=0.1)
        assert out[("adam_per_bucket", 3, True)][1] == pytest.approx((3 / world_size) / 4, rel=0.15)


def _fsdp2_and_stage_three(rank, world):
    """Ten Adam steps of the transformer with torch's FSDP2 (a unit per block, and the root) and with fdp's stage 3.

    torch's fused Adam rounds a few operations differently from its multi-tensor one (at lr 1e-2
    that reaches 4e-5 after ten steps), so each side runs both: fdp's donated step uses the fused
    kernel, its pure step the multi-tensor ops' sequence.
    """
    from torch.distributed.fsdp import fully_shard

    _, _, _, batches, _, _ = _transformer_and_plan(rank, world, 1)
    out = {}
    for fused in (True, False):
        torch.manual_seed(0)
        module = CharTransformer(vocab_size=11, block_size=8, d_model=16, n_layer=2, n_head=2)
        for block in module.blocks:
            fully_shard(block)
        fully_shard(module)
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-2, fused=fused)
        for x, y in batches[:10]:
            loss = torch.nn.functional.cross_entropy(module(x).reshape(-1, 11), y.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        theirs = {name: p.full_tensor() for name, p in module.named_parameters()}
        _, state, _ = _train(rank, world, 3, adam(1e-2), 1, fused, "overlap", setup=_transformer_and_plan, steps=10)
        assert sorted(theirs) == sorted(state.params)
        out[fused] = max((state.params[name] - theirs[name]).abs().max().item() for name in theirs)
    return out


def test_stage_three_equals_torch_fsdp2(run_ranks):
    for diffs in run_ranks(_fsdp2_and_stage_three):
        assert all(diff <= 1e-5 for diff in diffs.values()), diffs


def _hooks_and_precision(rank, world):
    """Ten steps with int8 and bf16 reduction, and in bf16-mixed and bf16-true precision, at stages 0, 2 and 3."""
    from fdp.hooks import bf16, int8
    from fdp.model.precision import Precision

    out = {}
    for name, options in (
        ("int8", {"hook": int8()}),
        ("bf16", {"hook": bf16()}),
        ("bf16-mixed", {"precision": Precision("bf16-mixed")}),
        ("bf16-true", {"precision": Precision("bf16-true")}),
    ):
        finals = {}
        for stage in (0, 2, 3):
            loss_fn, params, buffers, batches, plan, model = _model_and_plan(rank, world, 1)
            precision = options.get("precision", Precision())
            params, buffers = precision.cast(params), precision.cast(buffers)
            plan = plan_buckets(
                planner_loss(loss_fn, buffers),
                params,
                precision.cast(batches[0]),
                bucket_cap_mb=CAP_MB,
                first_bucket_cap_mb=CAP_MB,
            )
            comm, hook = Comm(), options.get("hook")
            step = make_train_step(
                loss_fn, adam(1e-2), plan, hook, comm, donate=True, zero_stage=stage, model=model, precision=precision
            )
            state = (
                zero.init_state(params, buffers, adam(1e-2), plan, comm, hook, stage=stage)
                if stage
                else init_train_state(params, buffers, adam(1e-2), plan, hook)
            )
            for batch in batches[:10]:
                state, metrics = step(state, batch)
            finals[stage] = zero.whole_params(state, plan, comm)
        out[name] = {
            stage: max((finals[stage][n].float() - finals[0][n].float()).abs().max().item() for n in finals[0])
            for stage in (2, 3)
        }
    return out


def test_stages_two_and_three_take_the_shardable_hooks_and_low_precision(run_ranks):
    """int8 (summed in int32 by an all-to-all of slices), bf16 compression, bf16-mixed and bf16-true at stages 2
    and 3 give stage 0's params: to float rounding in float32, to a few bf16 steps in bf16-true."""
    for out in run_ranks(_hooks_and_precision):
        for name, diffs in out.items():
            for stage, diff in diffs.items():
                assert diff <= (2e-2 if name == "bf16-true" else 1e-5), (name, stage, diff)


def _compressing_hooks(rank, world):
    """Ten steps of each compressing hook at stages 0, 2 and 3: the largest difference from stage 0, and the bytes
    each rank sent in the last step (stage 0, stage 2)."""
    from fdp.hooks import allreduce, batched_powersgd, lowbit, powersgd

    hooks = {
        "allreduce": allreduce,  # what stages 2 and 3 send besides the reduction: their params' all-gathers
        "powersgd": lambda: powersgd(rank=2, start_iter=2),
        "batched_powersgd": lambda: batched_powersgd(rank=2, start_iter=2),
        "topk": lambda: topk(ratio=0.3),
        # Blocks of 3 and 4: slice boundaries fall inside blocks (and, for fp4, inside a byte of two codes).
        "lowbit_fp4": lambda: lowbit("fp4", block=3),
        "lowbit_int8": lambda: lowbit("int8", block=4),
    }
    out = {}
    for name, make in hooks.items():
        finals, sent = {}, {}
        for stage in (0, 2, 3):
            loss_fn, params, buffers, batches, plan, model = _model_and_plan(rank, world, 1)
            comm, hook = Comm(), make()
            step = make_train_step(loss_fn, adam(1e-2), plan, hook, comm, donate=True, zero_stage=stage, model=model)
            state = (
                zero.init_state(params, buffers, adam(1e-2), plan, comm, hook, stage=stage)
                if stage
                else init_train_state(params, buffers, adam(1e-2), plan, hook)
            )
            for batch in batches[:10]:
                state, metrics = step(state, batch)
            finals[stage], sent[stage] = zero.whole_params(state, plan, comm), metrics["bytes_sent"]
        diffs = {
            stage: max((finals[stage][n] - finals[0][n]).abs().max().item() for n in finals[0]) for stage in (2, 3)
        }
        out[name] = diffs, sent
    return out


def test_stages_two_and_three_reduce_through_powersgd_topk_and_lowbit_as_stage_zero(run_ranks):
    """PowerSGD (whole low-rank factors, each rank keeping its slice of the approximation), top-k (gathered entries
    summed into the rank's slice) and low-bit codes (an all-to-all of each slice's codes and scales) give stage 0's
    params at stages 2 and 3, sending about what stage 0 sends."""
    for out in run_ranks(_compressing_hooks):
        for name, (diffs, sent) in out.items():
            for stage, diff in diffs.items():
                assert diff <= 1e-6, (name, stage, diff)
            # The reduction sends what it sends at stage 0 (low-bit codes: a block more per slice boundary).
            assert sent[2] - sent[0] <= out["allreduce"][1][2] - out["allreduce"][1][0] + 16, (name, sent)


class _Gained(torch.nn.Module):
    """``MODEL``'s MLP times a learnt one-element gain: with a small cap, a bucket of one element."""

    def __init__(self):
        super().__init__()
        self.net = MLP(*MODEL)
        self.gain = torch.nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        return self.net(x) * self.gain


def _int8_with_a_one_element_bucket(rank, world):
    """Ten int8 steps at stages 0 and 2 of a model whose gain is a bucket of one element: the largest difference.

    int8 gathers each bucket's 1-element maximum: a comm that took any tensor as long as a bucket for that
    bucket would reduce-scatter the maxima too, and the ranks would round with different scales.
    """
    from fdp.hooks import int8

    finals, sizes = {}, None
    for stage in (0, 2):
        torch.manual_seed(0)
        model, params, buffers = functionalize(_Gained())
        loss_fn = cross_entropy_loss(model)
        batches = _batches(rank, world, 1)[:10]
        plan = plan_buckets(
            planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=4 / 2**20, first_bucket_cap_mb=4 / 2**20
        )
        sizes = sorted(b.numel for b in plan.buckets)
        comm, hook = Comm(), int8()
        step = make_train_step(loss_fn, adam(1e-2), plan, hook, comm, donate=True, zero_stage=stage, model=model)
        state = (
            zero.init_state(params, buffers, adam(1e-2), plan, comm, hook, stage=stage)
            if stage
            else init_train_state(params, buffers, adam(1e-2), plan, hook)
        )
        for batch in batches:
            state, _ = step(state, batch)
        finals[stage] = zero.whole_params(state, plan, comm)
    return sizes, max((finals[2][n] - finals[0][n]).abs().max().item() for n in finals[0])


def test_int8_at_stage_two_with_a_one_element_bucket_equals_stage_zero(run_ranks):
    for sizes, diff in run_ranks(_int8_with_a_one_element_bucket):
        assert sizes[0] == 1  # the gain's bucket
        assert diff <= 1e-5, diff


def _save_at_stage_three(rank, world, directory):
    """Three stage-3 steps on 2 ranks, then a checkpoint: the whole params it should hold."""
    from fdp.run.checkpoint import save_checkpoint

    loss_fn, params, buffers, batches, plan, model = _model_and_plan(rank, world, 1)
    comm = Comm()
    step = make_train_step(loss_fn, adam(1e-2), plan, comm=comm, donate=True, zero_stage=3, model=model)
    state = zero.init_state(params, buffers, adam(1e-2), plan, comm, stage=3)
    for batch in batches[:3]:
        state, _ = step(state, batch)
    whole = zero.gather_state(state, plan, comm)
    save_checkpoint(directory, whole, plan, comm)
    return {n: p.clone() for n, p in whole.params.items()}, plan.to_dict()


def test_a_stage_three_checkpoint_restores_whole_params_bit_for_bit(run_ranks, tmp_path):
    """Saved from 2 ranks at stage 3; loaded into a one-process stage-0 state and into a stage-3 one of 1 rank."""
    from fdp.plan import BucketPlan
    from fdp.run.checkpoint import load_checkpoint

    saved, layout = run_ranks(_save_at_stage_three, tmp_path)[0]
    plan = BucketPlan.from_dict(layout)
    loss_fn, params, buffers, _, _, _ = _model_and_plan(0, 1, 1)
    stage0 = load_checkpoint(tmp_path, init_train_state(params, buffers, adam(1e-2), plan), plan)
    assert all(torch.equal(stage0.params[n], saved[n]) for n in saved)
    sharded = zero.init_state(params, buffers, adam(1e-2), plan, Comm(), stage=3)
    restored = load_checkpoint(tmp_path, zero.unsharded_template(sharded, adam(1e-2), plan), plan)
    resharded = zero.shard_state(restored, plan, Comm(), stage=3)
    assert list(resharded.params) == [zero.slice_key(b.index) for b in plan.buckets]
    whole = zero.whole_params(resharded, plan, Comm())
    assert all(torch.equal(whole[n], saved[n]) for n in saved)


class _Reached(torch.nn.Module):
    """Notes in ``events`` when backward reaches its input (here: the first layer's output)."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def forward(self, x):
        if x.requires_grad:  # not in the no-grad forward stage 3 learns its gathers from
            x.register_hook(lambda grad: self.events.append("backward reached the first layer"))
        return x


def _slices_stepped_in_backward(rank, world):
    """One stage-3 step of a five-layer MLP, a bucket per tensor, SGD with momentum stepping each slice in place:
    the order in which backward reached the first layer and the optimizer stepped the slices."""
    torch.manual_seed(0)
    events = []
    layers = [torch.nn.Linear(6, 16), _Reached(events), torch.nn.Tanh()]
    for _ in range(3):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    model, params, buffers = functionalize(torch.nn.Sequential(*layers, torch.nn.Linear(16, 3)))
    loss_fn = cross_entropy_loss(model)
    batch = (torch.randn(4, 6), torch.randint(0, 3, (4,)))
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch, bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)
    sgd = momentum_sgd(0.1, momentum=0.9)

    def stepping(grads, state, params, **kwargs):
        events.append("slice stepped")
        return sgd.update_inplace(grads, state, params, **kwargs)

    optimizer = sgd._replace(update_inplace=stepping)
    comm = Comm()
    step = make_train_step(loss_fn, optimizer, plan, comm=comm, donate=True, zero_stage=3, model=model)
    state = zero.init_state(params, buffers, optimizer, plan, comm, stage=3)
    step(state, batch)
    return len(plan.buckets), events


def test_stage_three_steps_each_slice_as_its_reduction_ends_inside_backward(run_ranks):
    """An elementwise optimizer on a donated state steps each bucket's slice once its reduce-scatter is done, while
    backward still runs: a rank never holds every bucket's gradient slice at once (ZeRO stage 3's params are the
    gathered copies backward reads, never the slices stepped)."""
    for buckets, events in run_ranks(_slices_stepped_in_backward):
        assert buckets >= 5 and events.count("slice stepped") == buckets
        reached = len(events) - 1 - events[::-1].index("backward reached the first layer")  # the step's backward
        assert events.index("slice stepped") < reached, events


def _nonfinite_at_step_3(rank, world, stage, nonfinite):
    """Rank 1's batch of step 3 holds an inf:
    ``(steps taken, metrics["skipped"] per step, error or None, step 3 kept the params)``."""
    loss_fn, params, buffers, batches, plan, model = _model_and_plan(rank, world, 1)
    batches = batches[:5]
    if rank == 1:
        x, y = batches[2]
        batches[2] = (x.clone().fill_(float("inf")), y)
    comm = Comm()
    step = make_train_step(
        loss_fn, adam(1e-2), plan, comm=comm, donate=True, nonfinite=nonfinite, zero_stage=stage, model=model
    )
    state, skipped, kept = zero.init_state(params, buffers, adam(1e-2), plan, comm, stage=stage), [], None
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


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_nonfinite_gradient_raises_or_skips_on_every_rank_alike(run_ranks, stage):
    raised = run_ranks(_nonfinite_at_step_3, stage, "raise")
    for steps, skipped, error, _ in raised:
        assert steps == 2 and skipped == [0, 0], (steps, skipped)
        assert error is not None and error.startswith("non-finite gradient at step 3 in "), error
        assert error.endswith("(set trainer.nonfinite=skip to skip such steps)")
    went_on = run_ranks(_nonfinite_at_step_3, stage, "skip")
    assert went_on == [(5, [0, 0, 1, 0, 0], None, True)] * 2


def _grad_norms(rank, world):
    """``metrics["grad_norm"]`` of 5 steps at every stage, and the norms ``clip_grad_norm_`` returns for torch's
    own training of the same MLP on the union batches (torch.optim.Adam, clipped at the same norm)."""
    torch.manual_seed(0)
    module = MLP(*MODEL)
    reference, norms = torch.optim.Adam(module.parameters(), lr=1e-2), []
    for x, y in _union_batches(world)[:5]:
        reference.zero_grad()
        torch.nn.functional.cross_entropy(module(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), 0.05)))
        reference.step()
    out = {}
    for stage in (0, 1, 2, 3):
        for donate, accum in ((True, 1), (False, 2)):
            loss_fn, params, buffers, batches, plan, model = _model_and_plan(rank, world, accum)
            optimizer, comm = chain(clip_by_global_norm(0.05), adam(1e-2)), Comm()
            step = make_train_step(
                loss_fn,
                optimizer,
                plan,
                comm=comm,
                accum_steps=accum,
                donate=donate,
                zero_stage=stage,
                model=model,
                schedule="overlap",
            )
            state = (
                zero.init_state(params, buffers, optimizer, plan, comm, stage=stage)
                if stage
                else init_train_state(params, buffers, optimizer, plan)
            )
            out[(stage, donate)] = []
            for batch in batches[:5]:
                state, metrics = step(state, batch)
                out[(stage, donate)].append(metrics["grad_norm"].item())
    return norms, out


def _union_batches(world):
    g = torch.Generator().manual_seed(0)  # as _batches draws them, before it splits them over the ranks
    return [
        (torch.randn(8 * world, MODEL[0], generator=g), torch.randint(0, MODEL[-1], (8 * world,), generator=g))
        for _ in range(STEPS)
    ]


def test_grad_norm_is_the_union_batch_norm_before_clipping_at_every_stage(run_ranks):
    """The logged norm is that of the averaged gradient before clipping, on every rank, at every stage (the slices'
    norms summed at 2 and 3), stepped per bucket or at once: torch's clip_grad_norm_ on one process says the same."""
    results = run_ranks(_grad_norms)
    for norms, out in results:
        assert max(norms) > 0.05  # clipping changed the trajectory: a norm after clipping would read 0.05
        for key, got in out.items():
            assert got == pytest.approx(norms, rel=1e-5), key
    assert results[0][1] == results[1][1]  # bit for bit the same on both ranks


def test_clipping_sees_the_global_norm_across_slices():
    """Clipping two shards, each completing its norm with the other's, equals clipping the whole."""
    g = torch.Generator().manual_seed(0)
    whole = {"a": torch.randn(5, generator=g), "b": torch.randn(3, generator=g)}
    clip = clip_by_global_norm(0.5)
    expected, _ = clip.update(whole, clip.init(whole), None)
    for mine, other in (("a", "b"), ("b", "a")):
        got, _ = clip.update(
            {mine: whole[mine]}, clip.init({}), None, sum_across=lambda t: t + whole[other].square().sum()
        )
        torch.testing.assert_close(got[mine], expected[mine], rtol=1e-6, atol=0)
        own, _ = clip.update({mine: whole[mine]}, clip.init({}), None)
        assert not torch.allclose(own[mine], expected[mine])  # a slice's own norm would clip differently


@pytest.mark.parametrize("stage", [2, 3])
def test_an_optimizer_with_no_state_steps_at_every_stage_as_at_stage_zero(stage):
    """SGD without momentum keeps nothing per param: its empty state is taken as sliced, not refused as whole."""
    from fdp.optim import sgd

    torch.manual_seed(0)
    model, params, buffers = functionalize(MLP(6, 8, 1, 3))
    loss_fn = cross_entropy_loss(model)
    batch = (torch.randn(4, 6), torch.randint(0, 3, (4,)))
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    trained = {}
    for s in (0, stage):
        update = zero.update_for(s, sgd(0.1), plan, Comm(), model=model)
        step = make_train_step(loss_fn, sgd(0.1), plan, comm=Comm(), update=update, model=model)
        state = update.first_state({k: v.clone() for k, v in params.items()}, buffers, None, Comm())
        for _ in range(2):
            state, _ = step(state, batch)
        trained[s] = zero.whole_params(state, plan, update.comm)
    for name, value in trained[0].items():
        torch.testing.assert_close(trained[stage][name], value, rtol=0, atol=1e-7)


def test_slices_cover_every_bucket_once_and_round_trip():
    plan = pack_into_buckets(
        [("a", (3,), "float32", "cpu"), ("b", (2, 2), "float32", "cpu"), ("c", (5,), "float32", "cpu")],
        bucket_cap_mb=7 * 4 / 2**20,
        first_bucket_cap_mb=7 * 4 / 2**20,
    )
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
            flat = torch.cat(pieces[zero.slice_key(bucket.index)])
            assert flat.numel() % world == 0 and flat.numel() - bucket.numel < world
            expected = torch.cat([named[s.name].reshape(-1) for s in bucket.slots])
            assert torch.equal(flat[: bucket.numel], expected)
            assert not flat[bucket.numel :].any()  # padding is zero


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match=r"^zero_stage=4: expected 0, 1, 2 or 3$"):
        zero.check_zero_stage(4)
    with pytest.raises(ConfigError, match=r"^trainer.zero_stage=7: expected 0, 1, 2, 3 or auto \(the lowest stage "):
        validate(_cfg("trainer.zero_stage=7"))
    validate(_cfg("trainer.zero_stage=3", "trainer.compile=true"))  # compiled in regions (tests/test_compiled.py)
    for stage in (1, 2, 3):  # every hook at every stage
        for hook in ("powersgd", "batched_powersgd", "topk", "lowbit"):
            validate(_cfg(f"trainer.zero_stage={stage}", f"hooks={hook}"))
    torch.manual_seed(0)
    model, params, buffers = functionalize(MLP(*MODEL))
    loss_fn = cross_entropy_loss(model)
    batch = _batches(0, 1, 1)[0]
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    step = make_train_step(loss_fn, adam(1e-2), plan, hook=noop(), zero_stage=2)  # a chain that sends nothing: accepted
    assert step(zero.init_state(params, buffers, adam(1e-2), plan, Comm()), batch)[0].step == 1
    step = make_train_step(loss_fn, adam(1e-2), plan, zero_stage=1)
    with pytest.raises(ValueError, match="optimizer state is not sharded"):
        step(init_train_state(params, buffers, adam(1e-2), plan), batch)


def _last(run_dir):
    return saved(Path(run_dir))


def test_checkpoints_reshard_across_world_sizes_and_stages(tmp_path):
    """A stage-1 run on 2 ranks stopped at step 10 resumes on 1 rank (stage 0) and on 4 (stage 2) like the run that
    went on."""
    common = [
        "optim=adam",
        "model.hidden=24",
        "trainer.max_steps=20",
        "data.global_batch_size=16",
        "trainer.bucket_cap_mb=0.01",
        "trainer.first_bucket_cap_mb=0.002",
        "trainer.checkpoint_every=10",
        "trainer.checkpoint_format=whole",  # resharded from one file (test_sharded_checkpoint: from pieces)
    ]
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


def test_stage_three_checkpoints_resume_at_any_stage_and_world_size(tmp_path):
    """A stage-3 run on 4 ranks stopped at step 10 resumes on 2 ranks at stage 3, on 2 at stage 0 and on 1, like the
    run that went on; its trace shows each bucket's gathers."""
    common = [
        "optim=adam",
        "model.hidden=24",
        "trainer.max_steps=20",
        "data.global_batch_size=16",
        "trainer.bucket_cap_mb=0.01",
        "trainer.first_bucket_cap_mb=0.002",
        "trainer.checkpoint_every=10",
        "trainer.checkpoint_format=whole",  # resharded from one file (test_sharded_checkpoint: from pieces)
    ]
    run(_cfg(*common, "world=local4", "trainer.zero_stage=3", "trainer.trace=true"), tmp_path / "straight")
    trace = json.loads((tmp_path / "straight" / "trace" / "rank1.json").read_text())["traceEvents"]
    gathered = {e["args"]["bucket"] for e in trace if e.get("cat") == "gather" and e["ph"] == "b"}
    scattered = {e["args"]["bucket"] for e in trace if e.get("cat") == "bucket" and e["name"].startswith("collective")}
    buckets = len(json.loads((tmp_path / "straight" / "plan.json").read_text())["buckets"])
    assert gathered == scattered == set(range(buckets)) and buckets >= 2  # every bucket gathered and reduce-scattered
    stopped = tmp_path / "stopped"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "straight" / "checkpoints" / "step_00000010.pt", stopped / "checkpoints" / "last.pt")
    saved = _last(stopped)
    assert saved["step"] == 10 and all(p.dim() >= 1 for p in saved["params"].values())  # whole params, by name
    for world, stage in (("local2", 3), ("local2", 0), ("single", 0)):
        resumed = tmp_path / f"{world}_stage{stage}"
        shutil.copytree(stopped, resumed)
        run(_cfg(*common, f"world={world}", f"trainer.zero_stage={stage}", "trainer.resume=true"), resumed)
        a, b = _last(tmp_path / "straight"), _last(resumed)
        assert a["step"] == b["step"] == 20
        diff = max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"])
        assert diff <= 1e-5, (world, stage, diff)


@pytest.mark.parametrize("stage, checkpoint_format", [(2, "whole"), (3, "sharded")])
def test_powersgd_state_resumes_exactly_at_stages_two_and_three(tmp_path, stage, checkpoint_format):
    """hooks=powersgd on 2 ranks stopped at step 5 and resumed ends at step 10 with the params, and each rank's error
    feedback and warm-start Q, of the run that went on: to the bit."""
    from fdp.run.checkpoint.consolidate import consolidate

    common = [
        "optim=adam",
        "model.hidden=24",
        "world=local2",
        "trainer.max_steps=10",
        "data.global_batch_size=16",
        "trainer.bucket_cap_mb=0.01",
        "trainer.first_bucket_cap_mb=0.002",
        "trainer.checkpoint_every=5",
        f"trainer.checkpoint_format={checkpoint_format}",
        f"trainer.zero_stage={stage}",
        "hooks=powersgd",
        "hooks.rank=2",
        "hooks.start_iter=2",
    ]
    run(_cfg(*common), tmp_path / "straight")
    run(_cfg(*common, "trainer.stop_at=5"), tmp_path / "resumed")
    run(_cfg(*common, "trainer.resume=true"), tmp_path / "resumed")
    last = _last if checkpoint_format == "whole" else consolidate
    a, b = last(tmp_path / "straight"), last(tmp_path / "resumed")
    assert a["step"] == b["step"] == 10
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    for mine, theirs in zip(a["ranks"], b["ranks"], strict=True):
        hook_state = [t for t in mine["hook_state"] if isinstance(t, torch.Tensor)]
        assert len(hook_state) >= 4 and any(t.abs().sum() > 0 for t in hook_state)  # errors and Qs, once compressed
        for x, y in zip(mine["hook_state"], theirs["hook_state"], strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


# -- the mirror of the next rank's slices (a world that may shrink, fdp.procs.shrink) ----------------------------
def _mirrored_steps(rank, world):
    """Stage 1 with a mirror, clipped Adam (a cross-rank norm): each rank's opt state and mirror after 6 steps."""
    loss_fn, params, buffers, batches, plan, _ = _model_and_plan(rank, world, 1)
    optimizer = chain(clip_by_global_norm(0.05), adam(1e-2))
    comm = Comm()
    state = zero.init_state(params, buffers, optimizer, plan, comm, stage=1, mirror=True)
    step = make_train_step(loss_fn, optimizer, plan, comm=comm, zero_stage=1)
    for batch in batches[:6]:
        state, _ = step(state, batch)
    return state.opt_state, state.mirror


def test_each_rank_mirrors_the_next_ranks_optimizer_slices_exactly(run_ranks):
    results = run_ranks(_mirrored_steps, world_size=3)
    keys = zero.slice_key
    for rank, (_, mirror) in enumerate(results):
        owner_state = results[(rank + 1) % 3][0]
        mine, theirs = mirror[1].mu, owner_state[1].mu  # the Adam member of the chain
        assert mine.keys() == theirs.keys() and len(mine) > 1, sorted(mine)
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), (rank, key)
            assert torch.equal(mirror[1].nu[key], owner_state[1].nu[key]), (rank, key)
    assert keys(0) in results[0][1][1].mu
