"""The pure train step on one process: purity, accumulation, and the step against eager torch."""
import pytest
import torch
from torch import nn

from fdp.data import global_batch, load_digits
from fdp.functional import functionalize
from fdp.models import ConvNet, MLP
from fdp.optim import adam, sgd
from fdp.plan import plan_buckets
from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss


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
