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
    return init, dict(model.named_parameters()), params, {"norms": torch_norms, "torch_lrs": torch_lrs, "fdp_lrs": fdp_lrs}


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
            opt, lambda s: _reference_lr(s, peak, warmup, decay, end)),
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
    "clip_adamw_schedule": lambda: fo.chain(fo.clip_by_global_norm(0.1), fo.adamw(fo.warmup_cosine_schedule(1e-2, 2, 10))),
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
    assert torch.allclose(new["a"], torch.tensor([0.9, 1.9])) and torch.allclose(new["b"], torch.tensor([0.8], dtype=torch.float64))


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
    from fdp.config import compose
    from fdp.optim import build_optimizer
    from fdp.validate import validate

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
    cfg = compose("optim=adamw", "trainer.max_steps=20", "optim.warmup_steps=5")  # steps of one's own win over the ratio
    opt = build_optimizer(dict(cfg.optim), 20)
    assert opt.init(params) is not None
    with pytest.raises(ValueError, match=r"^optim\.warmup_ratio=1\.5: expected a fraction of trainer\.max_steps in \[0, 1\)$"):
        build_optimizer({**cfg.optim, "warmup_ratio": 1.5}, 20)
