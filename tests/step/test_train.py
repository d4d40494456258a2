"""The pure train step on one process: purity, accumulation, and the step against eager torch."""

import pytest
import torch
from torch import nn

from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
from fdp.data import global_batch, load_digits
from fdp.model.builtin import MLP, ConvNet
from fdp.model.functional import functionalize
from fdp.optim import adam, sgd
from fdp.plan import plan_buckets


def _setup(module, optimizer, batch, accum_steps=1, schedule="after", cap_mb=0.01):
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb)
    step = make_train_step(loss_fn, optimizer, plan, accum_steps=accum_steps, schedule=schedule)
    return step, init_train_state(params, buffers, optimizer, plan)


def _digits_batch(step=0, size=32):
    data = load_digits(flatten=False)
    return global_batch(data, step, size, seed=0)


def _clone_tree(tree):
    return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def _assert_trees_equal(a, b):
    la, sa = torch.utils._pytree.tree_flatten(a)
    lb, sb = torch.utils._pytree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("schedule", ["after", "overlap"])
def test_train_step_is_pure(schedule):
    torch.manual_seed(0)
    batch = _digits_batch()
    step, state = _setup(ConvNet(), adam(1e-2), batch, schedule=schedule)
    snapshot = _clone_tree(state)
    first, _ = step(state, batch)
    _assert_trees_equal(state, snapshot)  # the input state is unchanged
    second, _ = step(state, batch)
    _assert_trees_equal(first, second)  # and the step is a function of it
    assert first.step == 1
    assert any(not torch.equal(first.params[n], state.params[n]) for n in state.params)


def test_step_matches_eager_torch_sgd():
    torch.manual_seed(0)
    module = MLP(64, 32, 2, 10)
    reference = MLP(64, 32, 2, 10)
    reference.load_state_dict(module.state_dict())
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    step, state = _setup(module, sgd(0.1, momentum=0.9), _digits_batch())
    for i in range(20):
        x, y = _digits_batch(i)
        state, metrics = step(state, (x.flatten(1), y))
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x.flatten(1)), y).backward()
        opt.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=0, atol=1e-6)
    assert metrics["bytes_sent"] == 0  # a world of one sends nothing


@pytest.mark.parametrize("schedule", ["after", "overlap"])
def test_accumulation_equals_one_larger_batch(schedule):
    torch.manual_seed(0)
    module = MLP(64, 32, 2, 10)
    batch = _digits_batch(size=32)
    big_step, big = _setup(module, sgd(0.1, momentum=0.9), batch)
    acc_step, acc = _setup(module, sgd(0.1, momentum=0.9), batch, accum_steps=4, schedule=schedule)
    for i in range(5):
        b = _digits_batch(i, 32)
        big, _ = big_step(big, b)
        acc, _ = acc_step(acc, b)
    for name in big.params:
        torch.testing.assert_close(acc.params[name], big.params[name], rtol=0, atol=1e-6)


def test_batchnorm_buffers_advance_through_the_state():
    torch.manual_seed(0)
    batch = _digits_batch()
    step, state = _setup(ConvNet(), sgd(0.05), batch)
    new, _ = step(state, batch)
    tracked = [n for n in new.buffers if n.endswith("num_batches_tracked")]
    assert tracked and all(int(new.buffers[n]) == 1 for n in tracked)
    assert all(int(state.buffers[n]) == 0 for n in tracked)


def test_nonfinite_gradient_raises_with_step_and_parameter():
    torch.manual_seed(0)
    module = MLP(64, 16, 1, 10)
    batch = _digits_batch()
    step, state = _setup(module, sgd(0.1), batch)
    bad_params = dict(state.params)
    name = next(iter(bad_params))
    bad_params[name] = bad_params[name].clone()
    bad_params[name][0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"step 1 .*parameter"):
        step(state._replace(params=bad_params), batch)


def test_nonfinite_skip_keeps_params_and_counts():
    torch.manual_seed(0)
    module = MLP(64, 16, 1, 10)
    batch = _digits_batch()
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    step = make_train_step(loss_fn, sgd(0.1), plan, nonfinite="skip")
    state = init_train_state(params, buffers, sgd(0.1), plan)
    x, y = batch
    x = x.clone()
    x[0, 0, 0, 0] = float("inf")
    new, metrics = step(state, (x, y))
    assert metrics["skipped"] == 1 and new.step == 1
    _assert_trees_equal(new.params, state.params)


def _tied_lm():
    from fdp.model.builtin import CharTransformer

    return CharTransformer(vocab_size=16, block_size=8, d_model=8, n_layer=2, n_head=2)  # a tied head


@pytest.mark.parametrize(
    "make,batch",
    [
        (ConvNet, lambda: _digits_batch(0, 16)),  # BatchNorm buffers through the step
        (_tied_lm, lambda: (torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8)))),
    ],
)
@pytest.mark.parametrize("schedule", ["after", "overlap"])
def test_params_laid_out_flat_step_as_separate_tensors_do_bit_for_bit(make, batch, schedule):
    """The state's params are one flat buffer per bucket; the step crosses torch.func with those."""
    from fdp.plan.buckets import flat_buffers
    from fdp.step.reduce import GradReducer

    torch.manual_seed(0)
    module, example = make(), batch()
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, example, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005
    )
    assert len(plan.buckets) > 2
    calls = []
    flat_loss = GradReducer._flat_loss

    def counted(self, *args):
        calls.append(1)
        return flat_loss(self, *args)

    ends = []
    for flat in (True, False):
        opt = adam(1e-2)
        state = init_train_state(params, buffers, opt, plan)
        assert flat_buffers(plan, state.params) is not None
        if not flat:  # the same values as separate tensors
            state = state._replace(params={k: v.clone() for k, v in state.params.items()})
        laid_out = GradReducer.laid_out
        GradReducer._flat_loss = counted
        if not flat:
            GradReducer.laid_out = lambda self, p: p
        try:
            step = make_train_step(loss_fn, opt, plan, accum_steps=2, schedule=schedule, donate=True)
            calls.clear()
            for i in range(3):
                state, metrics = step(state, example)
        finally:
            GradReducer._flat_loss, GradReducer.laid_out = flat_loss, laid_out
        assert len(calls) == (6 if flat else 0)  # 3 steps x 2 micro-batches
        ends.append((state, metrics["loss"]))
    (a, loss_a), (b, loss_b) = ends
    _assert_trees_equal(a.params, b.params)
    _assert_trees_equal(a.buffers, b.buffers)
    _assert_trees_equal(a.opt_state, b.opt_state)
    assert torch.equal(loss_a, loss_b)


def test_a_donated_state_not_laid_out_is_laid_out_once_then_stepped_in_place():
    torch.manual_seed(0)
    from fdp.plan.buckets import flat_buffers

    module, batch = MLP(8, 8, 2, 3), (torch.randn(4, 8), torch.randint(0, 3, (4,)))
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    state = init_train_state(params, buffers, sgd(0.1), plan)
    state = state._replace(params={k: v.clone() for k, v in state.params.items()})  # as a checkpoint restores them
    step = make_train_step(loss_fn, sgd(0.1), plan, donate=True)
    state, _ = step(state, batch)
    assert flat_buffers(plan, state.params) is not None
    first = dict(state.params)
    state, _ = step(state, batch)
    assert all(state.params[n] is t for n, t in first.items())  # in place from then on
