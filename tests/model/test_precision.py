"""Mixed precision and loss scaling against torch.autocast + GradScaler + torch.optim; compiled steps.

Tolerances: the references run the same casts in the same order, so what remains is the
optimizers' own rounding (fdp's Adam and torch's differ by float32 rounding, as in
tests/optim/test_optim.py) carried through a few steps: 1e-5 on params of size ~0.1. Each
test also checks that the precision did something (params differ from float32
training by far more than the tolerance), so a silently ignored setting fails.
"""

import logging

import pytest
import torch
from _saved import saved
from torch import nn

from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
from fdp.comm import Comm
from fdp.data import global_batch, load_digits, rank_share
from fdp.errors import ConfigError
from fdp.model.builtin import MLP
from fdp.model.functional import functionalize
from fdp.model.precision import LossScale, Precision, check_precision, init_loss_scale, update_loss_scale
from fdp.optim import adam, sgd
from fdp.plan import plan_buckets
from fdp.run import checkpoint
from fdp.run.checkpoint.atomic import atomic_save
from fdp.run.checkpoint.whole import rank_payload, restore, state_payload
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate

TOL = 1e-5
DATA = load_digits()


def _batch(step, size=32):
    return global_batch(DATA, step, size, seed=0)


def _fdp(module, optimizer, precision, batch, **kwargs):
    model, params, buffers = functionalize(module)
    params, buffers = precision.cast(params), precision.cast(buffers)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, precision.cast(batch), bucket_cap_mb=0.02, first_bucket_cap_mb=0.005
    )
    step = make_train_step(loss_fn, optimizer, plan, precision=precision, **kwargs)
    return step, init_train_state(params, buffers, optimizer, plan, kwargs.get("hook"), precision=precision)


def _max_diff(params, module):
    return max((params[n].float() - p.detach().float()).abs().max().item() for n, p in module.named_parameters())


def _eager(module, steps, dtype=None, scaler=None, lr=1e-2):
    """Plain torch: autocast (``dtype``), GradScaler (``scaler``), Adam; the scale before each step and skips."""
    opt = torch.optim.Adam(module.parameters(), lr=lr, foreach=False)
    scales, skips = [], 0
    for i in range(steps):
        x, y = _batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = nn.functional.cross_entropy(module(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
            continue
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skips += scaler.get_scale() < scales[-1]  # GradScaler backs off exactly on the steps it skips
    return scales, skips


def _copy(module_a, module_b):
    module_b.load_state_dict(module_a.state_dict())
    return module_b


def test_bf16_mixed_matches_eager_autocast_and_adam():
    torch.manual_seed(0)
    module = MLP(64, 64, 2, 10)
    reference, fp32 = _copy(module, MLP(64, 64, 2, 10)), _copy(module, MLP(64, 64, 2, 10))
    _eager(reference, 6, torch.bfloat16)
    _eager(fp32, 6)
    step, state = _fdp(module, adam(1e-2), Precision("bf16-mixed"), _batch(0))
    for i in range(6):
        state, metrics = step(state, _batch(i))
    assert all(p.dtype == torch.float32 for p in state.params.values())  # float32 masters
    assert all(m.dtype == torch.float32 for m in state.opt_state.mu.values())
    assert _max_diff(state.params, reference) <= TOL
    assert _max_diff(state.params, fp32) > 100 * TOL  # bf16 really ran
    assert metrics["loss"].dtype == torch.float32


def test_bf16_true_trains_bf16_params_like_torch():
    torch.manual_seed(0)
    module = MLP(64, 64, 2, 10)
    reference = _copy(module, MLP(64, 64, 2, 10)).to(torch.bfloat16)
    step, state = _fdp(module, sgd(0.1, momentum=0.9), Precision("bf16-true"), _batch(0), donate=True)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for i in range(4):
        x, y = _batch(i)
        state, _ = step(state, (x, y))
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x.bfloat16()), y).backward()
        opt.step()
    assert all(p.dtype == torch.bfloat16 for p in state.params.values())
    assert all(m.dtype == torch.bfloat16 for m in state.opt_state.momentum.values())
    # fdp adds -lr * grad as a rounded update, torch fuses it into one add: a bf16 ulp or two apart.
    assert _max_diff(state.params, reference) <= 2.0**-8


def test_16_mixed_matches_grad_scaler_with_overflow_skips_and_growth():
    """A scale of 2**40 overflows float16 gradients: the first steps skip and halve it, as GradScaler does."""
    torch.manual_seed(0)
    module = MLP(64, 64, 2, 10)
    reference = _copy(module, MLP(64, 64, 2, 10))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=3)
    ref_scales, ref_skips = _eager(reference, 30, torch.float16, scaler)
    precision = Precision("16-mixed", init_scale=2.0**40, growth_interval=3)
    step, state = _fdp(module, adam(1e-2), precision, _batch(0))
    scales, skips = [], 0
    for i in range(30):
        scales.append(state.loss_scale.scale.item())
        state, metrics = step(state, _batch(i))
        skips += metrics["skipped"]
    assert scales == ref_scales
    assert skips == ref_skips and skips >= 10  # 2**40 halves to below ~2**28 before gradients fit
    assert any(b == 2 * a for a, b in zip(scales, scales[1:]))  # and it grew after 3 finite steps
    assert state.step == 30 and state.opt_state.count == 30 - skips
    assert _max_diff(state.params, reference) <= TOL


def test_16_mixed_keeps_the_batchnorm_statistics_of_skipped_steps_as_grad_scaler_does():
    """GradScaler skips the optimizer step, not the forward: BatchNorm's running statistics count every batch."""
    from fdp.model.builtin import ConvNet

    torch.manual_seed(0)
    module = ConvNet(width=4)
    reference = _copy(module, ConvNet(width=4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=3)
    _, ref_skips = _eager(reference, 10, torch.float16, scaler)
    step, state = _fdp(module, adam(1e-2), Precision("16-mixed", init_scale=2.0**40, growth_interval=3), _batch(0))
    skips = 0
    for i in range(10):
        state, metrics = step(state, _batch(i))
        skips += metrics["skipped"]
    assert skips == ref_skips >= 3
    assert all(state.buffers[n].item() == 10 for n in state.buffers if n.endswith("num_batches_tracked"))
    for name, buffer in reference.named_buffers():
        assert torch.allclose(state.buffers[name].float(), buffer.float(), rtol=0, atol=TOL), name
    assert _max_diff(state.params, reference) <= TOL


def test_skipped_step_leaves_params_optimizer_and_hooks_untouched():
    from fdp.hooks import chain, fp16_compress, fp16_decompress, powersgd

    torch.manual_seed(0)
    hook = chain(fp16_compress(), powersgd(rank=1, start_iter=0), fp16_decompress())
    precision = Precision("16-mixed", init_scale=2.0**60)
    step, state = _fdp(MLP(64, 64, 2, 10), adam(1e-2), precision, _batch(0), hook=hook)

    def leaves(tree):
        return [t.clone() for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]

    before = leaves((state.params, state.opt_state, state.hook_state))
    new, metrics = step(state, _batch(0))
    assert metrics["skipped"] == 1 and new.step == 1
    after = leaves((new.params, new.opt_state, new.hook_state))
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    assert new.loss_scale.scale.item() == 2.0**59 and new.loss_scale.growth_tracker.item() == 0


def test_compiled_step_equals_eager_and_compiles_once():
    """16-mixed with an overflowing scale: the scale changes every step, yet nothing recompiles."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    # The shapes of each rank's step in the two-rank test above: the second compile hits inductor's cache.
    module = MLP(64, 64, 2, 10)
    twin = _copy(module, MLP(64, 64, 2, 10))
    precision = Precision("16-mixed", init_scale=2.0**30, growth_interval=2)
    eager_step, eager = _fdp(twin, adam(1e-2), precision, _batch(0, 16))
    step, state = _fdp(module, adam(1e-2), precision, _batch(0, 16), compile=True)
    records, logger = [], logging.getLogger("fdp")
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for i in range(6):
            state, metrics = step(state, _batch(i, 16))
            eager, eager_metrics = eager_step(eager, _batch(i, 16))
            assert metrics["skipped"] == eager_metrics["skipped"]
            if i == 0:
                graphs = counters["stats"]["unique_graphs"]
    finally:
        logger.removeHandler(handler)
    assert graphs >= 1 and counters["stats"]["unique_graphs"] == graphs  # no recompilation after step 1
    assert sum(1 for r in records if "compiled the gradient computation" in r.message) == 1
    assert state.loss_scale.scale.item() == eager.loss_scale.scale.item() < 2.0**30
    for name in state.params:
        torch.testing.assert_close(state.params[name], eager.params[name], rtol=1e-4, atol=1e-5)


def _ddp_16_mixed(rank, world, schedule, compile):
    torch.manual_seed(0)
    module = MLP(64, 64, 2, 10)
    ddp = nn.parallel.DistributedDataParallel(_copy(module, MLP(64, 64, 2, 10)), bucket_cap_mb=0.02)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**36, growth_interval=2)
    precision = Precision("16-mixed", init_scale=2.0**36, growth_interval=2)
    example = rank_share(_batch(0), rank, world)
    step, state = _fdp(
        module, sgd(0.1, momentum=0.9), precision, example, comm=Comm(), schedule=schedule, compile=compile
    )
    skips, ref_skips, scales, ref_scales = [], [], [], []
    for i in range(12):
        x, y = rank_share(_batch(i), rank, world)
        state, metrics = step(state, (x, y))
        skips.append(metrics["skipped"])
        scales.append(state.loss_scale.scale.item())
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ddp(x), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        ref_scales.append(scaler.get_scale())
        ref_skips.append(int(ref_scales[-1] < before))  # GradScaler backs off exactly on the steps it skips
    return skips, ref_skips, scales, ref_scales, _max_diff(state.params, ddp.module)


@pytest.mark.parametrize("schedule,compile", [("overlap", False), ("after", True)])
def test_two_ranks_16_mixed_match_ddp_with_autocast_and_grad_scaler(run_ranks, schedule, compile):
    """Both ranks skip the same steps (decided after the reduction) and end where DDP + GradScaler ends."""
    results = run_ranks(_ddp_16_mixed, schedule, compile)
    for skips, ref_skips, scales, ref_scales, diff in results:
        assert skips == ref_skips and sum(skips) >= 3
        assert scales == ref_scales
        assert diff <= TOL
    assert results[0][0] == results[1][0]


def test_loss_scale_round_trips_through_a_weights_only_checkpoint(tmp_path):
    precision = Precision("16-mixed")
    step, state = _fdp(MLP(64, 16, 1, 10), sgd(0.1), precision, _batch(0))
    state, _ = step(state, _batch(0))
    state = state._replace(loss_scale=LossScale(torch.tensor(512.0), torch.tensor(7, dtype=torch.int32)))
    path = atomic_save(state_payload(state, [rank_payload(state)]), tmp_path / "c.pt")
    restored = restore(checkpoint.load(path), state, rank=0)
    assert isinstance(restored.loss_scale, LossScale)
    assert restored.loss_scale.scale.item() == 512.0 and restored.loss_scale.growth_tracker.item() == 7
    assert restored.loss_scale.growth_tracker.dtype == torch.int32


def test_16_mixed_run_resumes_bit_exact(tmp_path):
    from fdp.run.trainer import run

    common = [
        "trainer.precision=16-mixed",
        "optim=adamw",
        "optim.warmup_steps=2",
        "model.hidden=32",
        "trainer.checkpoint_every=5",
        "trainer.eval_every=0",
        "trainer.progress=false",
        "trainer.max_steps=10",
    ]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run(compose(*common), straight)
    run(compose(*common, "trainer.stop_at=5"), stopped)
    run(compose(*common, "trainer.resume=true"), stopped)
    a = saved(straight)
    b = saved(stopped)
    assert a["step"] == b["step"] == 10
    assert [t.item() for t in a["loss_scale"]] == [t.item() for t in b["loss_scale"]] == [2.0**16, 10]
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    for x, y in zip(a["opt_state"], b["opt_state"]):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_update_loss_scale_follows_grad_scaler_rules():
    scale = init_loss_scale(2.0**127)
    grown = update_loss_scale(scale, True, growth_interval=1)
    assert grown.scale.item() == 2.0**127 and grown.growth_tracker.item() == 0  # growing would overflow float32
    halved = update_loss_scale(grown, False)
    assert halved.scale.item() == 2.0**126


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.precision=fp8", "trainer.precision='fp8': expected 32-true, bf16-mixed, 16-mixed or bf16-true"),
        ("trainer.matmul_precision=low", "trainer.matmul_precision='low': expected highest, high or medium"),
    ],
)
def test_bad_precision_settings_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as error:
        validate(compose(override))
    assert str(error.value) == message


def test_16_mixed_where_the_device_cannot_autocast_is_refused():
    with pytest.raises(ValueError) as error:
        check_precision("16-mixed", device="meta")
    assert (
        str(error.value)
        == "precision='16-mixed': this torch cannot autocast to float16 on meta; expected 32-true or bf16-mixed"
    )


def test_compile_without_a_compiler_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError) as error:
        validate(compose("trainer.compile=true"))
    assert str(error.value).startswith("trainer.compile=True: torch.compile needs a C++ compiler")
    assert "\n" not in str(error.value)
