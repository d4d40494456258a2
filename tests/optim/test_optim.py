"""fdp.optim against torch.optim on real training runs, plus purity, schedules, errors, state I/O."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils import _pytree as pytree

from fdp import optim as fo

torch.set_num_threads(1)

STEPS = 20
TOL = 1e-6


def _mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).to(dtype)


def _batch(step: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)  # a different batch each step
    x = torch.randn(16, 6, generator=gen, dtype=dtype)
    return x, torch.randn(16, 3, generator=gen, dtype=dtype) + x[:, :3]


def _fdp_grads(module, params, step, dtype=torch.float32):
    x, y = _batch(step, dtype)
    leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
    loss = nn.functional.mse_loss(functional_call(module, leaves, (x,)), y)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def _run_pair(make_torch, fdp_opt, steps=STEPS, clip=None, scheduler=None, dtype=torch.float32, donate=False):
    """Train the same MLP with torch.optim and with fdp.optim; return both final params and logs.

    ``donate=True`` steps fdp through ``apply_gradients(..., donate=True)`` (in place).
    """
    model = _mlp(dtype)
    init = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = make_torch(model.parameters())
    sched = scheduler(opt) if scheduler else None
    torch_norms, torch_lrs = [], []
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(step, dtype)
        nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            torch_norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        torch_lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched:
            sched.step()

    params = {k: v.clone() for k, v in init.items()}
    state = fdp_opt.init(params)
    fdp_lrs = []
    for step in range(steps):
        grads = _fdp_grads(model, params, step, dtype)
        if donate:
            params, state = fo.apply_gradients(fdp_opt, grads, state, params, donate=True)
        else:
            updates, state = fdp_opt.update(grads, state, params)
            params = fo.apply_updates(params, updates)
        fdp_lrs.append(fo.current_lr(state))
    return (
        init,
        dict(model.named_parameters()),
        params,
        {"norms": torch_norms, "torch_lrs": torch_lrs, "fdp_lrs": fdp_lrs},
    )


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].detach() - b[k]).abs().max()) for k in a)


CASES = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), lambda: fo.sgd(0.1)),
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), lambda: fo.sgd(0.05, momentum=0.9)),
    "sgd_nesterov": (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
        lambda: fo.sgd(0.05, momentum=0.9, nesterov=True),
    ),
    "sgd_wd_dampening": (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.05),
        lambda: fo.sgd(0.05, momentum=0.8, dampening=0.3, weight_decay=0.05),
    ),
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2), lambda: fo.adam(1e-2)),
    "adam_wd": (
        lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05),
        lambda: fo.adam(1e-2, b1=0.8, b2=0.99, eps=1e-7, weight_decay=0.05),
    ),
    "adamw": (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.85, 0.995), weight_decay=0.1),
        lambda: fo.adamw(1e-2, b1=0.85, b2=0.995, weight_decay=0.1),
    ),
}


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_optim(name, donate):
    make_torch, make_fdp = CASES[name]
    init, torch_params, fdp_params, _ = _run_pair(make_torch, make_fdp(), donate=donate)
    assert _max_diff(torch_params, fdp_params) <= TOL
    assert _max_diff(torch_params, init) > 1e-3  # the run really trained


CLIP = 1.0  # grad norms of this run range over ~0.7..1.6: some steps clip, some do not


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", ["sgd_momentum", "adamw"])
def test_clip_by_global_norm_chained_matches_clip_grad_norm_(name, donate):
    make_torch, make_fdp = CASES[name]
    fdp_opt = fo.chain(fo.clip_by_global_norm(CLIP), make_fdp())
    init, torch_params, fdp_params, log = _run_pair(make_torch, fdp_opt, clip=CLIP, donate=donate)
    assert any(n > CLIP for n in log["norms"]) and any(n < CLIP for n in log["norms"])  # both regimes hit
    assert _max_diff(torch_params, fdp_params) <= TOL
    assert _max_diff(torch_params, init) > 1e-3


def test_clip_by_global_norm_values():
    # A small norm makes clip_grad_norm_'s 1e-6 in the denominator visible (a 2e-4 relative effect).
    clip = fo.clip_by_global_norm(1e-3)
    grads = {"a": torch.tensor([3e-3, 0.0]), "b": torch.tensor([[4e-3]])}
    out, _ = clip.update(grads, clip.init(grads), None)
    scale = 1e-3 / (5e-3 + 1e-6)
    torch.testing.assert_close(out["a"], torch.tensor([3e-3 * scale, 0.0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(out["b"], torch.tensor([[4e-3 * scale]]), rtol=1e-6, atol=0)
    small = {"a": torch.tensor([3e-4]), "b": torch.tensor([[4e-4]])}
    out, _ = clip.update(small, clip.init(small), None)  # norm 5e-4 < 1e-3: unchanged (scale clamped at 1)
    assert all(torch.equal(out[k], small[k]) for k in small)


def _reference_lr(step, peak, warmup, decay, end):
    """Independent closed form of the warm-up + cosine schedule, as a LambdaLR factor of ``peak``."""
    if step < warmup:
        return step / warmup
    t = min(step, decay) - warmup
    return (end + (peak - end) * (1 + math.cos(math.pi * t / (decay - warmup))) / 2) / peak


def test_adamw_with_warmup_cosine_matches_lambda_lr():
    peak, warmup, decay, end, steps = 2e-2, 5, 20, 1e-3, 25  # runs past decay_steps into the flat tail
    init, torch_params, fdp_params, log = _run_pair(
        lambda ps: torch.optim.AdamW(ps, lr=peak, weight_decay=0.05),
        fo.adamw(fo.warmup_cosine_schedule(peak, warmup, decay, end), weight_decay=0.05),
        steps=steps,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: _reference_lr(s, peak, warmup, decay, end)
        ),
    )
    assert _max_diff(torch_params, fdp_params) <= TOL
    assert _max_diff(torch_params, init) > 1e-3
    assert log["fdp_lrs"] == pytest.approx(log["torch_lrs"], rel=1e-12, abs=1e-15)
    assert log["torch_lrs"][0] == 0.0 and log["torch_lrs"][warmup] == pytest.approx(peak)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_float_dtypes(dtype):
    make_torch, make_fdp = CASES["adam_wd"]
    steps = STEPS if dtype == torch.float64 else 1  # bf16 rounding drifts; one step checks the math
    _, torch_params, fdp_params, _ = _run_pair(make_torch, make_fdp(), steps=steps, dtype=dtype)
    assert all(p.dtype == dtype for p in fdp_params.values())
    assert _max_diff(torch_params, fdp_params) <= (1e-12 if dtype == torch.float64 else 1e-2)


# ---------------------------------------------------------------------------------- purity

PURE = {
    "sgd_nesterov_wd": lambda: fo.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "sgd_dampening": lambda: fo.sgd(0.1, momentum=0.9, dampening=0.5),
    "adam_wd": lambda: fo.adam(1e-2, weight_decay=0.1),
    "adamw": lambda: fo.adamw(1e-2),
    "clip_sgd": lambda: fo.chain(fo.clip_by_global_norm(0.1), fo.sgd(0.1, momentum=0.9)),
    "clip_adamw_schedule": lambda: fo.chain(
        fo.clip_by_global_norm(0.1), fo.adamw(fo.warmup_cosine_schedule(1e-2, 2, 10))
    ),
}


def _snapshot(tree):
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _bit_equal(a, b) -> bool:
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    return spec_a == spec_b and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else type(x) is type(y) and x == y
        for x, y in zip(leaves_a, leaves_b)
    )


@pytest.mark.parametrize("warm_steps", [0, 2])  # first step (buffers seeded) and later steps
@pytest.mark.parametrize("name", list(PURE))
def test_update_is_pure(name, warm_steps):
    opt, model = PURE[name](), _mlp()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    state = opt.init(params)
    for step in range(warm_steps):
        updates, state = opt.update(_fdp_grads(model, params, step), state, params)
        params = fo.apply_updates(params, updates)
    grads = _fdp_grads(model, params, warm_steps)
    before = _snapshot((grads, state, params))
    first = opt.update(grads, state, params)
    second = opt.update(grads, state, params)
    assert _bit_equal((grads, state, params), before)
    assert _bit_equal(first, second)
    assert not _bit_equal(first[1], state)  # the state did advance


@pytest.mark.parametrize("name", list(PURE))
def test_donated_step_works_in_place(name):
    opt, model = PURE[name](), _mlp()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    state = opt.init(params)
    for step in range(3):
        grads = _fdp_grads(model, params, step)
        tensors_in = {id(t) for t in pytree.tree_leaves((params, state)) if isinstance(t, torch.Tensor)}
        expected = opt.update(grads, state, params)
        expected = fo.apply_updates(params, expected[0]), expected[1]
        params, state = fo.apply_gradients(opt, grads, state, params, donate=True)
        tensors_out = {id(t) for t in pytree.tree_leaves((params, state)) if isinstance(t, torch.Tensor)}
        assert tensors_out == tensors_in  # the same tensors, updated: no new params or state
        assert _max_diff(params, expected[0]) <= 1e-6
        assert state.__class__ is expected[1].__class__ and fo.current_lr(state) == fo.current_lr(expected[1])


def test_donate_falls_back_where_fused_kernels_do_not_apply():
    opt = fo.sgd(0.1, momentum=0.9)
    params = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([1.0], dtype=torch.float64)}  # mixed dtypes
    grads = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([2.0], dtype=torch.float64)}
    new, _ = fo.apply_gradients(opt, grads, opt.init(params), params, donate=True)
    assert new["a"] is not params["a"] and torch.equal(params["a"], torch.tensor([1.0, 2.0]))  # pure path
    assert torch.allclose(new["a"], torch.tensor([0.9, 1.9])) and torch.allclose(
        new["b"], torch.tensor([0.8], dtype=torch.float64)
    )


def test_state_does_not_alias_grads():
    opt = fo.sgd(0.1, momentum=0.9)
    grads = {"w": torch.tensor([1.0, 2.0])}
    _, state = opt.update(grads, opt.init(grads), grads)
    grads["w"].mul_(100)  # a caller reusing its grad buffer must not corrupt the optimizer
    assert torch.equal(state.momentum["w"], torch.tensor([1.0, 2.0]))


def test_apply_updates_is_out_of_place():
    params = {"w": torch.tensor([1.0, 2.0])}
    new = fo.apply_updates(params, {"w": torch.tensor([0.5, -0.5])})
    assert torch.equal(new["w"], torch.tensor([1.5, 1.5])) and torch.equal(params["w"], torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="different keys"):
        fo.apply_updates(params, {"v": torch.zeros(2)})


@pytest.mark.parametrize("name", ["sgd_nesterov_wd", "clip_adamw_schedule"])
def test_state_keeps_init_key_order(name):
    """Grads in another key order (e.g. bucket order) must not reorder the state's pytree."""
    opt, model = PURE[name](), _mlp()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    state = opt.init(params)
    init_spec = pytree.tree_flatten(state)[1]
    grads = _fdp_grads(model, params, 0)
    shuffled = dict(reversed(grads.items()))
    updates, new_state = opt.update(shuffled, state, params)
    assert pytree.tree_flatten(new_state)[1] == init_spec
    assert _bit_equal((updates, new_state), opt.update(grads, state, params))  # same values, same order
    with pytest.raises(ValueError, match="different keys"):
        opt.update({k: v for k, v in grads.items() if k != "0.bias"}, state, params)


# ------------------------------------------------------------------------------- schedules


def test_warmup_cosine_schedule_key_points():
    peak, warmup, decay, end = 2.0, 10, 30, 0.5
    lr = fo.warmup_cosine_schedule(peak, warmup, decay, end)
    assert lr(0) == 0.0
    assert lr(5) == pytest.approx(1.0)  # half-way through the warm-up
    assert lr(warmup) == pytest.approx(peak)
    assert lr(15) == pytest.approx(end + (peak - end) * (1 + math.cos(math.pi / 4)) / 2)
    assert lr(20) == pytest.approx((peak + end) / 2)  # cosine mid-point
    assert lr(decay) == pytest.approx(end)
    assert lr(10_000) == end
    assert fo.warmup_cosine_schedule(1.0, 4, 8, init_value=0.2)(0) == pytest.approx(0.2)
    no_warmup = fo.warmup_cosine_schedule(1.0, 0, 10)
    assert no_warmup(0) == pytest.approx(1.0) and no_warmup(10) == 0.0


def test_constant_schedule_and_current_lr():
    assert fo.constant_schedule(0.3)(12345) == 0.3
    params = {"w": torch.zeros(3)}
    sched = fo.warmup_cosine_schedule(1.0, 4, 12)
    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.sgd(sched, momentum=0.5))
    state = opt.init(params)
    assert fo.current_lr(state) == sched(0)
    for step in range(6):
        _, state = opt.update({"w": torch.ones(3)}, state, params)
        assert fo.current_lr(state) == sched(step)
    assert fo.current_lr(fo.clip_by_global_norm(1.0).init(params)) is None


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "factory, kwargs, name",
    [
        (fo.sgd, dict(lr=-0.1), "lr"),
        (fo.sgd, dict(lr=0.1, momentum=-0.5), "momentum"),
        (fo.sgd, dict(lr=0.1, dampening=1.5), "dampening"),
        (fo.sgd, dict(lr=0.1, nesterov=True), "momentum"),
        (fo.sgd, dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "dampening"),
        (fo.sgd, dict(lr=0.1, weight_decay=-1e-4), "weight_decay"),
        (fo.adam, dict(lr=-1e-3), "lr"),
        (fo.adam, dict(lr=1e-3, b1=1.0), "b1"),
        (fo.adam, dict(lr=1e-3, b1=-0.1), "b1"),
        (fo.adam, dict(lr=1e-3, b2=1.0), "b2"),
        (fo.adam, dict(lr=1e-3, eps=0.0), "eps"),
        (fo.adam, dict(lr=1e-3, weight_decay=-0.1), "weight_decay"),
        (fo.adamw, dict(lr=-1e-3), "lr"),
        (fo.adamw, dict(lr=1e-3, b2=1.5), "b2"),
        (fo.adamw, dict(lr=1e-3, eps=-1e-8), "eps"),
        (fo.adamw, dict(lr=1e-3, weight_decay=-0.01), "weight_decay"),
        (fo.clip_by_global_norm, dict(max_norm=0.0), "max_norm"),
        (fo.clip_by_global_norm, dict(max_norm=-1.0), "max_norm"),
        (fo.constant_schedule, dict(value=-1.0), "value"),
        (fo.warmup_cosine_schedule, dict(peak_value=-1.0, warmup_steps=1, decay_steps=2), "peak_value"),
        (fo.warmup_cosine_schedule, dict(peak_value=1.0, warmup_steps=-1, decay_steps=2), "warmup_steps"),
        (fo.warmup_cosine_schedule, dict(peak_value=1.0, warmup_steps=5, decay_steps=4), "decay_steps"),
        (fo.warmup_cosine_schedule, dict(peak_value=1.0, warmup_steps=1, decay_steps=2, end_value=-0.1), "end_value"),
    ],
)
def test_invalid_arguments_raise(factory, kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}=.*: expected "):
        factory(**kwargs)


def test_weight_decay_needs_params():
    opt = fo.adamw(1e-3)
    grads = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"^params=None: expected the params"):
        opt.update(grads, opt.init(grads), None)


# -------------------------------------------------------------------------------- state I/O


@pytest.mark.parametrize("name", ["sgd_dampening", "clip_adamw_schedule"])
def test_state_round_trips_through_torch_save(name, tmp_path):
    opt, model = PURE[name](), _mlp()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    state = opt.init(params)
    for step in range(3):
        updates, state = opt.update(_fdp_grads(model, params, step), state, params)
        params = fo.apply_updates(params, updates)
    leaves, spec = pytree.tree_flatten(state)
    torch.save(leaves, tmp_path / "state.pt")
    restored = pytree.tree_unflatten(torch.load(tmp_path / "state.pt", weights_only=True), spec)
    assert _bit_equal(restored, state)
    grads = _fdp_grads(model, params, 3)  # and training continues identically from the restored state
    assert _bit_equal(opt.update(grads, restored, params), opt.update(grads, state, params))


def test_the_adamw_preset_warms_up_over_a_tenth_of_any_run():
    """optim=adamw once warmed up over a fixed 30 steps, refusing every shorter run (a 20-step smoke test)."""
    from fdp.optim import build_optimizer
    from fdp.run.config.compose import compose
    from fdp.run.config.validate import validate

    params = {"w": torch.zeros(3)}
    for max_steps, warmup in ((20, 2), (300, 30)):
        cfg = compose("optim=adamw", f"trainer.max_steps={max_steps}")
        validate(cfg)
        opt = build_optimizer(dict(cfg.optim), max_steps)
        state, rates = opt.init(params), []
        for _ in range(warmup + 2):  # after the update of step k, the state holds the rate of step k
            _, state = opt.update({"w": torch.ones(3)}, state, params)
            rates.append(fo.current_lr(state))
        assert max(rates) == pytest.approx(cfg.optim.lr) and rates.index(max(rates)) == warmup, rates
    cfg = compose(
        "optim=adamw", "trainer.max_steps=20", "optim.warmup_steps=5"
    )  # steps of one's own win over the ratio
    opt = build_optimizer(dict(cfg.optim), 20)
    assert opt.init(params) is not None
    with pytest.raises(
        ValueError, match=r"^optim\.warmup_ratio=1\.5: expected a fraction of trainer\.max_steps in \[0, 1\)$"
    ):
        build_optimizer({**cfg.optim, "warmup_ratio": 1.5}, 20)


# ------------------------------------------------------------------- schedules from config


def _rates(schedule, steps):
    return [schedule(t) for t in range(steps)]


def _torch_rates(make_scheduler, steps, lr=1.0):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler, rates = make_scheduler(opt), []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates


def test_schedules_without_warmup_match_torch_lr_schedulers():
    steps, peak, end = 40, 0.5, 0.05
    # Up to the run's end: torch's cosine goes up again past T_max, where fdp's stays at its end value.
    assert _rates(fo.warmup_cosine_schedule(peak, 0, 30, end), 31) == pytest.approx(
        _torch_rates(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=30, eta_min=end), 31, peak), rel=1e-9
    )
    assert _rates(fo.warmup_cosine_schedule(peak, 0, 30, end), steps)[30:] == [end] * 10
    # Past total_iters the linear ones stay at their end value, as torch's do.
    assert _rates(fo.warmup_linear_schedule(peak, 0, 30, end), steps) == pytest.approx(
        _torch_rates(lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, end / peak, total_iters=30), steps, peak),
        rel=1e-9,
    )
    # wsd: ConstantLR's factor 1 for the stable part, then LinearLR's decay (SequentialLR starts it at step 24).
    assert _rates(fo.wsd_schedule(peak, 0, 30, decay_fraction=0.2, end_value=end), steps) == pytest.approx(
        _torch_rates(
            lambda o: torch.optim.lr_scheduler.SequentialLR(
                o,
                [
                    torch.optim.lr_scheduler.ConstantLR(o, factor=1.0, total_iters=24),
                    torch.optim.lr_scheduler.LinearLR(o, 1.0, end / peak, total_iters=6),
                ],
                milestones=[24],
            ),
            steps,
            peak,
        ),
        rel=1e-9,
    )


def test_schedules_with_warmup_take_their_closed_form_values():
    peak, warmup, steps, end = 2.0, 4, 24, 0.2
    ramp = [peak * t / warmup for t in range(warmup)]  # 0 at the first update, as Hugging Face's schedulers
    assert _rates(fo.warmup_constant_schedule(peak, warmup), 30) == pytest.approx(ramp + [peak] * 26)
    linear = _rates(fo.warmup_linear_schedule(peak, warmup, steps, end), 30)
    assert linear == pytest.approx(
        ramp + [end + (peak - end) * (steps - t) / (steps - warmup) for t in range(4, 24)] + [end] * 6
    )
    # Hugging Face's get_linear_schedule_with_warmup, as a LambdaLR factor: max(0, (N - t) / (N - W)) after W.
    hf = _torch_rates(
        lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, lambda t: t / warmup if t < warmup else max(0.0, (steps - t) / (steps - warmup))
        ),
        30,
        peak,
    )
    assert _rates(fo.warmup_linear_schedule(peak, warmup, steps), 30) == pytest.approx(hf, rel=1e-12, abs=1e-15)
    wsd = _rates(fo.wsd_schedule(peak, warmup, steps, decay_fraction=0.25, end_value=end), 30)
    assert wsd == pytest.approx(
        ramp + [peak] * 14 + [end + (peak - end) * (24 - t) / 6 for t in range(18, 24)] + [end] * 6
    )
    assert fo.wsd_schedule(1.0, 10, 12, decay_fraction=0.5)(10) == 1.0  # the decay never starts inside the warm-up


@pytest.mark.parametrize("name", ["constant", "warmup_constant", "warmup_linear", "warmup_cosine", "wsd"])
def test_every_schedule_is_built_from_config_and_logged(name):
    opt = fo.build_optimizer(
        {
            "name": "sgd",
            "lr": 0.1,
            "momentum": 0.0,
            "lr_schedule": name,
            "warmup_steps": 2,
            "end_lr": 0.01,
            "decay_fraction": 0.5,
        },
        max_steps=10,
    )
    params, rates = {"w": torch.zeros(2)}, []
    state = opt.init(params)
    for _ in range(10):
        updates, state = opt.update({"w": torch.ones(2)}, state, params)
        rates.append(-float(updates["w"][0]))  # SGD without momentum: the update is -lr * grad
        assert fo.current_lr(state) == pytest.approx(rates[-1])
    expected = {
        "constant": [0.1] * 10,
        "warmup_constant": [0.0, 0.05] + [0.1] * 8,
        "warmup_linear": [0.0, 0.05] + [0.01 + 0.09 * (10 - t) / 8 for t in range(2, 10)],
        "warmup_cosine": [0.0, 0.05] + [0.01 + 0.09 * (1 + math.cos(math.pi * (t - 2) / 8)) / 2 for t in range(2, 10)],
        "wsd": [0.0, 0.05, 0.1, 0.1, 0.1] + [0.01 + 0.09 * (10 - t) / 5 for t in range(5, 10)],
    }[name]
    assert rates == pytest.approx(expected)


# --------------------------------------------------------------------------- decay_filter


class _TinyLM(nn.Module):
    """An embedding, a norm and two linear layers: every kind ``decay_filter=weights`` tells apart."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.norm = nn.Embedding(11, 8), nn.LayerNorm(8)
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 11)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(self.norm(self.embed(x)))))


def _lm_grads(module, params, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randint(0, 11, (16,), generator=g), torch.randint(0, 11, (16,), generator=g)
    leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
    loss = nn.functional.cross_entropy(functional_call(module, leaves, (x,)), y)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


DECAY_CASES = {  # torch.optim with two param groups against the config's optimizer and decay_filter
    "adamw_weights": (
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.5),
        {"name": "adamw", "lr": 1e-2, "weight_decay": 0.5, "decay_filter": "weights"},
        {"fc.weight", "head.weight"},
    ),
    "adamw_patterns": (
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.5),
        {"name": "adamw", "lr": 1e-2, "weight_decay": 0.5, "decay_filter": ["*.bias", "norm.*"]},
        {"fc.weight", "head.weight", "embed.weight"},
    ),
    "adam_l2_weights": (
        lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.5),
        {"name": "adam", "lr": 1e-2, "weight_decay": 0.5, "decay_filter": "weights"},
        {"fc.weight", "head.weight"},
    ),
    "sgd_weights": (
        lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.5),
        {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.5, "decay_filter": "weights"},
        {"fc.weight", "head.weight"},
    ),
}


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", list(DECAY_CASES))
def test_decay_filter_equals_torch_param_groups_without_decay(name, donate):
    make_torch, spec, decayed = DECAY_CASES[name]
    module = _TinyLM()
    assert fo.embedding_names(module) == {"embed.weight"}
    init = {k: p.detach().clone() for k, p in module.named_parameters()}
    groups = [
        {"params": [p for k, p in module.named_parameters() if k in decayed]},
        {"params": [p for k, p in module.named_parameters() if k not in decayed], "weight_decay": 0.0},
    ]
    reference = make_torch(groups)
    opt, params = fo.build_optimizer(spec, max_steps=10, embeddings=fo.embedding_names(module)), dict(init)
    state = opt.init(params)
    for step in range(10):
        grads = _lm_grads(module, params, step)
        if donate:
            params, state = fo.apply_gradients(opt, grads, state, params, donate=True)
        else:
            updates, state = opt.update(grads, state, params)
            params = fo.apply_updates(params, updates)
    for step in range(10):
        reference.zero_grad()
        x_y = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, 11, (16,), generator=x_y), torch.randint(0, 11, (16,), generator=x_y)
        nn.functional.cross_entropy(module(x), y).backward()
        reference.step()
    assert _max_diff(dict(module.named_parameters()), params) <= TOL
    # The filter mattered: decaying every param ends elsewhere.
    everything = fo.build_optimizer({**spec, "decay_filter": "all"}, max_steps=10)
    p_all = dict(init)
    s_all = everything.init(p_all)
    for step in range(10):
        updates, s_all = everything.update(_lm_grads(module, p_all, step), s_all, p_all)
        p_all = fo.apply_updates(p_all, updates)
    assert _max_diff(p_all, params) > 1e-4


def test_decay_filter_refusals_name_the_setting():
    for value, message in (
        ("nobias", r"^optim\.decay_filter='nobias': expected all or weights, or a list"),
        ([], r"^optim\.decay_filter=\[\]: expected all or weights, or a non-empty list"),
    ):
        with pytest.raises(ValueError, match=message):
            fo.build_optimizer({"name": "adamw", "decay_filter": value}, max_steps=10)


# ------------------------------------------------------------------------- optim=custom


@pytest.fixture
def my_project(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))


def test_a_custom_optimizer_gets_the_schedule_and_the_decay_rule_of_the_shared_settings(my_project):
    spec = {
        "name": "custom",
        "_target_": "my_project.optim.lion",
        "b1": 0.5,
        "weight_decay": 1.0,
        "lr": 0.1,
        "lr_schedule": "warmup_linear",
        "warmup_steps": 1,
        "decay_filter": ["*.bias"],
        "clip_norm": 1.0,
    }
    opt = fo.build_optimizer(spec, max_steps=3)
    params = {"fc.weight": torch.ones(2), "fc.bias": torch.ones(2)}
    state = opt.init(params)
    steps = []
    for _ in range(3):
        updates, state = opt.update({k: torch.full((2,), 30.0) for k in params}, state, params)
        steps.append({k: float(u[0]) for k, u in updates.items()})
    # Rates 0, 0.1, 0.05 (warm-up, then linear to 0 at step 3); Lion steps -lr * sign(...); the weight also decays.
    assert steps == [
        pytest.approx({"fc.weight": 0.0, "fc.bias": 0.0}),
        pytest.approx({"fc.weight": -0.1 - 0.1, "fc.bias": -0.1}),
        pytest.approx({"fc.weight": -0.05 - 0.05, "fc.bias": -0.05}),
    ]
    assert fo.current_lr(state) == pytest.approx(0.05)  # a state of one's own with an lr field is logged too


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"_target_": "my_project.optim.nothing"},
            r"^optim\._target_='my_project\.optim\.nothing': module "
            r"my_project\.optim has no attribute 'nothing'$",
        ),
        (
            {"_target_": "my_project.hooks.clip_then_allreduce"},
            r"^optim\._target_='my_project\.hooks\.clip_then_allreduce': returned a reduction hook "
            r"\(fdp\.hooks\.Hook\); expected a GradientTransformation",
        ),
        (
            {"_target_": "torch.optim.AdamW"},
            r"^optim\._target_='torch\.optim\.AdamW': a torch\.optim optimizer, which steps",
        ),
        (
            {"_target_": "my_project.optim.lion", "b1": 1.5},
            r"^optim\._target_='my_project\.optim\.lion': b1=1\.5: expected",
        ),
        (
            {"_target_": "my_project.optim.lion", "b3": 0.5},
            r"^optim\._target_=.*: lion\(\) got an unexpected keyword argument",
        ),
        (
            {"_target_": "fdp.optim.clip_by_global_norm", "max_norm": 1.0, "decay_filter": "weights"},
            r"^optim\.decay_filter: fdp\.optim\.clip_by_global_norm takes no decay_mask argument",
        ),
        ({}, r"^optim\._target_: missing; optim=custom needs the dotted path to a factory returning a "),
    ],
)
def test_a_custom_optimizer_that_is_not_importable_or_no_optimizer_is_refused_in_one_line(my_project, spec, message):
    with pytest.raises(ValueError, match=message) as error:
        fo.build_optimizer({"name": "custom", **spec}, max_steps=10)
    assert "\n" not in str(error.value)


def test_a_decay_rule_by_name_of_an_optimizer_that_cannot_step_slices_is_refused_at_zero_stages(my_project):
    """fdp's optimizers step ZeRO's slices by their runs of decayed elements (tests/update/test_zero_decay.py); an
    optimizer of one's own with a rule by name and no ``with_decay_mask`` cannot, and is refused in one line."""
    from fdp.errors import ConfigError
    from fdp.run.config.compose import compose
    from fdp.run.config.validate import validate

    validate(compose("world=local2", "optim=adamw", "optim.decay_filter=weights", "trainer.zero_stage=1"))
    lion = ["optim=custom", "optim._target_=my_project.optim.lion", "optim.decay_filter=weights"]
    validate(compose("world=local2", *lion))
    with pytest.raises(
        ConfigError,
        match=r"^trainer\.zero_stage=2: the optimizer exempts params from weight decay by name, and has no "
        r"with_decay_mask to step ZeRO's flat slices",
    ):
        validate(compose("world=local2", *lion, "trainer.zero_stage=2"))


def test_resuming_another_length_is_refused_for_every_schedule_that_spans_the_run():
    def run(steps, schedule):
        return {"trainer": {"max_steps": steps}, "optim": {"lr_schedule": schedule}}

    for schedule in ("warmup_linear", "warmup_cosine", "wsd"):
        with pytest.raises(ValueError, match=rf"optim\.lr_schedule={schedule}\) spans trainer\.max_steps=100"):
            fo.check_resumed_schedule(run(100, schedule), run(200, schedule))
    for schedule in ("constant", "warmup_constant"):
        fo.check_resumed_schedule(run(100, schedule), run(200, schedule))


def test_a_run_built_from_config_exempts_the_model_s_embeddings_tied_head_included():
    """``optim.decay_filter=weights`` through ``fdp.run.build``: the charlm's token and position embeddings (the head is
    tied to the first) and its norms and biases take no weight decay, its linear weights do."""
    from fdp.comm import Comm
    from fdp.run.build import build_run
    from fdp.run.config.compose import compose

    cfg = compose(
        "model=charlm",
        "data=stdlib_text",
        "model.d_model=16",
        "model.n_layer=1",
        "model.n_head=2",
        "data.block_size=8",
        "data.max_chars=4000",
        "optim=adamw",
        "optim.lr_schedule=constant",
        "optim.decay_filter=weights",
        "optim.weight_decay=0.5",
    )
    parts = build_run(cfg, Comm())
    params = parts.state.params
    zeros = {k: torch.zeros_like(p) for k, p in params.items()}  # AdamW's step is then the decay alone
    updates, _ = parts.optimizer.update(zeros, parts.optimizer.init(params), params)
    decayed = {k for k, u in updates.items() if u.abs().max() > 0}
    assert {"tok_emb.weight", "pos_emb.weight"} <= params.keys() - decayed and "head.weight" not in params
    assert decayed and all(params[k].ndim == 2 for k in decayed)
    assert {k for k, p in params.items() if p.ndim == 2} - decayed == {"tok_emb.weight", "pos_emb.weight"}
