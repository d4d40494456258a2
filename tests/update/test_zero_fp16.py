"""``trainer.precision=16-mixed`` at ZeRO stages 1-3: one replicated loss scale, each rank's slices unscaled, the
overflow verdict agreed across ranks, skipped steps included; sharded checkpoints keep the scale.

The reference is tests/model/test_precision.py's: DDP with ``torch.autocast`` and ``torch.amp.GradScaler``.
"""

import pytest
import torch
from torch import nn

from fdp import cross_entropy_loss, make_train_step, planner_loss
from fdp.comm import Comm
from fdp.data import global_batch, load_digits, rank_share
from fdp.hooks import allreduce
from fdp.model.builtin import MLP
from fdp.model.functional import functionalize
from fdp.model.precision import Precision
from fdp.optim import adam, sgd
from fdp.plan import plan_buckets
from fdp.run import checkpoint
from fdp.run.checkpoint import ShardedSaver, load_sharded
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.update import zero

TOL = 1e-5  # as tests/model/test_precision.py: float16 forward, float32 masters, the optimizers' rounding
DATA = load_digits()
STEPS = 12


def _batch(step):
    return global_batch(DATA, step, 32, seed=0)


def _tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _Probed(nn.Module):
    """The MLP plus a probe: a one-input linear layer on an extra input column (zero, except where a test makes it
    large, so that the probe's float16 gradient alone overflows, in one rank's slice)."""

    def __init__(self):
        super().__init__()
        self.net, self.probe = MLP(64, 64, 2, 10), nn.Linear(1, 10, bias=False)

    def forward(self, x):
        return self.net(x[:, :64]) + self.probe(x[:, 64:])


def _parts(rank, world, stage, optimizer, precision, donate=True, module=lambda: MLP(64, 64, 2, 10), example=None):
    """Stage ``stage``'s step and first state of the MLP on this rank's share: ``(step, state, update, plan, comm)``."""
    torch.manual_seed(0)
    model, params, buffers = functionalize(module())
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers),
        params,
        example or rank_share(_batch(0), rank, world),
        bucket_cap_mb=0.02,
        first_bucket_cap_mb=0.005,
    )
    comm = Comm()
    update = zero.update_for(stage, optimizer, plan, comm, model=model)
    state = update.first_state(params, buffers, allreduce(), comm, precision=precision)
    step = make_train_step(loss_fn, optimizer, plan, comm=comm, donate=donate, update=update, precision=precision)
    return step, state, update, plan, comm


def _ddp_and_stages(rank, world):
    """DDP + autocast + GradScaler (SGD with momentum), then fdp at stages 1, 2 and 3 from the same start."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(MLP(64, 64, 2, 10), bucket_cap_mb=0.02)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**36, growth_interval=2)
    ref_skips, ref_scales = [], []
    for i in range(STEPS):
        x, y = rank_share(_batch(i), rank, world)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ddp(x), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        ref_scales.append(scaler.get_scale())
        ref_skips.append(int(ref_scales[-1] < before))  # GradScaler backs off exactly on the steps it skips
    reference = {n: p.detach() for n, p in ddp.module.named_parameters()}
    out = {}
    precision = Precision("16-mixed", init_scale=2.0**36, growth_interval=2)
    for stage in (1, 2, 3):
        for donate in (True, False):
            step, state, _, plan, comm = _parts(rank, world, stage, sgd(0.1, momentum=0.9), precision, donate)
            skips, scales, untouched = [], [], True
            for i in range(STEPS):
                before = [t.clone() for t in _tensors(state.opt_state)]
                state, metrics = step(state, rank_share(_batch(i), rank, world))
                skips.append(metrics["skipped"])
                scales.append(state.loss_scale.scale.item())
                after = _tensors(state.opt_state)
                if metrics["skipped"]:  # the optimizer's slices are the step's before, to the bit
                    untouched &= all(torch.equal(a, b) for a, b in zip(before, after))
            whole = zero.whole_params(state, plan, comm)
            diff = max((whole[n] - reference[n]).abs().max().item() for n in reference)
            out[(stage, donate)] = (skips, scales, diff, untouched)
    return ref_skips, ref_scales, out


def test_16_mixed_at_stages_1_to_3_matches_ddp_with_grad_scaler_skipped_steps_included(run_ranks):
    """2**36 overflows the float16 gradients of the first steps: every stage skips the steps GradScaler skips, on
    both ranks, keeps the same scale and ends where DDP ends."""
    results = run_ranks(_ddp_and_stages)
    for ref_skips, ref_scales, out in results:
        assert sum(ref_skips) >= 3
        for key, (skips, scales, diff, untouched) in out.items():
            assert skips == ref_skips, key
            assert scales == ref_scales, key
            assert diff <= TOL, (key, diff)
            assert untouched, key
    assert results[0][2] == results[1][2]  # both ranks alike, bit for bit


def _probed_batch(step, rank, world, spike=0.0):
    x, y = rank_share(_batch(step), rank, world)
    return torch.cat([x, torch.full((len(x), 1), spike)], dim=1), y


def _overflow_in_one_slice(rank, world, stage):
    """At step 2 rank 1's probe input is 3e4: its probe gradient alone overflows float16, and lands in the one rank's
    slice that owns the probe's elements. ``(skipped, scales, owners of the probe's elements)``."""
    precision = Precision("16-mixed", init_scale=2.0**8, growth_interval=100)
    example = _probed_batch(0, rank, world)
    step, state, _, plan, _ = _parts(rank, world, stage, adam(1e-2), precision, module=_Probed, example=example)
    skipped, scales = [], []
    for i in range(4):
        state, metrics = step(state, _probed_batch(i, rank, world, 3e4 if i == 1 and rank == 1 else 0.0))
        skipped.append(metrics["skipped"])
        scales.append(state.loss_scale.scale.item())
    (bucket, slot), owners = [(b, s) for b in plan.buckets for s in b.slots if s.name == "probe.weight"][0], set()
    for r in range(world):
        start, stop = zero.slice_range(bucket, r, world)
        if start < slot.stop and slot.offset < stop:
            owners.add(r)
    return skipped, scales, owners


@pytest.mark.parametrize("stage", [2, 3])
def test_an_overflow_in_one_ranks_slice_skips_the_step_on_every_rank(run_ranks, stage):
    for skipped, scales, owners in run_ranks(_overflow_in_one_slice, stage):
        assert len(owners) == 1  # the non-finite gradient is in one rank's slice alone
        assert skipped == [0, 1, 0, 0]
        assert scales == [2.0**8, 2.0**7, 2.0**7, 2.0**7]


def _sharded_checkpoint_round_trip(rank, world, directory):
    """Stage 2, 16-mixed: 8 steps straight, with a sharded save after the first step past a skipped one whose scale
    has counted a finite step; then a fresh state loaded from it, trained to step 8."""
    precision = Precision("16-mixed", init_scale=2.0**20, growth_interval=3)
    step, state, update, plan, comm = _parts(rank, world, 2, adam(1e-2), precision, donate=False)
    saver, saved = ShardedSaver(comm, asynchronous=False, timeout_s=20), None
    for i in range(8):
        state, _ = step(state, rank_share(_batch(i), rank, world))
        lowered = state.loss_scale.scale.item() < 2.0**20
        if saved is None and lowered and state.loss_scale.growth_tracker.item() > 0:  # the same on every rank
            saver.save(directory, state, update, plan)
            saver.wait()
            saved = tuple(t.clone() for t in state.loss_scale)
    straight = zero.whole_params(state, plan, comm), tuple(state.loss_scale)
    step, fresh, update, plan, comm = _parts(rank, world, 2, adam(1e-2), precision, donate=False)
    loaded = load_sharded(checkpoint.resolve(directory), fresh, update, plan, comm)
    restored = tuple(t.clone() for t in loaded.loss_scale)
    for i in range(loaded.step, 8):
        loaded, _ = step(loaded, rank_share(_batch(i), rank, world))
    resumed = zero.whole_params(loaded, plan, comm), tuple(loaded.loss_scale)
    return saved, restored, straight, resumed


def test_a_sharded_checkpoint_keeps_the_loss_scale_and_resumes_bit_for_bit(run_ranks, tmp_path):
    for saved, restored, (params, scale), (params2, scale2) in run_ranks(_sharded_checkpoint_round_trip, tmp_path):
        assert saved is not None  # a scale that skipped steps lowered and a finite one counted
        assert [t.item() for t in restored] == [t.item() for t in saved]
        assert restored[1].dtype == torch.int32
        assert [t.item() for t in scale] == [t.item() for t in scale2]
        assert all(torch.equal(params[n], params2[n]) for n in params)


def test_16_mixed_is_accepted_at_every_zero_stage():
    for stage in (1, 2, 3):
        validate(compose("world=local2", "trainer.precision=16-mixed", f"trainer.zero_stage={stage}"))


@pytest.mark.timeout(900)  # three runs, one of two ranks stopped and resumed
def test_a_stage_3_16_mixed_run_resumes_from_sharded_checkpoints_like_one_process_uninterrupted(tmp_path):
    """The recipe's path: stage 3 builds each rank's slices on meta with the loss scale in the first state; 2 ranks
    stopped at step 3 and resumed from the sharded checkpoint end where one process at stage 0 ends."""
    from fdp.run.checkpoint.consolidate import consolidate
    from fdp.run.trainer import run

    common = [
        "model.hidden=32",
        "optim=adam",
        "trainer.precision=16-mixed",
        "trainer.progress=false",
        "data.global_batch_size=16",
        "trainer.bucket_cap_mb=0.01",
        "trainer.first_bucket_cap_mb=0.005",
        "trainer.eval_every=0",
        "trainer.eval_batches=1",
        "trainer.max_steps=6",
        "trainer.checkpoint_every=3",
        "trainer.checkpoint_format=sharded",
    ]
    run(compose(*common), tmp_path / "straight")
    sharded = [*common, "world=local2", "trainer.zero_stage=3"]
    run(compose(*sharded, "trainer.stop_at=3"), tmp_path / "resumed")
    assert consolidate(tmp_path / "resumed")["step"] == 3
    run(compose(*sharded, "trainer.resume=true"), tmp_path / "resumed")
    straight, resumed = consolidate(tmp_path / "straight"), consolidate(tmp_path / "resumed")
    assert straight["step"] == resumed["step"] == 6
    assert [t.item() for t in resumed["loss_scale"]] == [t.item() for t in straight["loss_scale"]] == [2.0**16, 6]
    assert all(torch.allclose(resumed["params"][n], p, atol=TOL, rtol=0) for n, p in straight["params"].items())
