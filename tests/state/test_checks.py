"""What a Python caller hands the train step: one-line errors naming the argument, before any harm."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import fdp
from fdp.hooks import allreduce, powersgd, topk
from fdp.state.checks import check_world


def _setup(module=None, dtype=torch.float32):
    torch.manual_seed(0)
    module = module or nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model, params, buffers = fdp.functionalize(module.to(dtype))
    loss_fn = fdp.cross_entropy_loss(model)
    batch = (torch.randn(8, 6, dtype=dtype), torch.randint(0, 3, (8,)))
    plan = fdp.plan_buckets(fdp.planner_loss(loss_fn, buffers), params, batch, bucket_cap_mb=0.0001)
    return loss_fn, params, buffers, batch, plan


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_params_of_another_dtype_than_the_plan_are_refused_at_the_first_step():
    loss_fn, params, buffers, batch, plan = _setup()
    step = fdp.make_train_step(loss_fn, fdp.sgd(0.1), plan)
    state = fdp.init_train_state({n: p.bfloat16() for n, p in params.items()}, buffers, fdp.sgd(0.1), plan)
    with pytest.raises(TypeError) as error:
        step(state, batch)
    message = _one_line(error)
    assert "state.params['" in message and "torch.bfloat16" in message and "float32" in message


def test_params_the_plan_does_not_know_or_of_another_shape_are_refused():
    loss_fn, params, buffers, batch, plan = _setup()
    step = fdp.make_train_step(loss_fn, fdp.sgd(0.1), plan)
    renamed = {("x." + n if n == "0.bias" else n): p for n, p in params.items()}
    with pytest.raises(ValueError) as error:
        step(fdp.init_train_state(renamed, buffers, fdp.sgd(0.1), plan), batch)
    assert "in plan but not in state.params: ['0.bias']" in _one_line(error)
    assert "in state.params but not in plan: ['x.0.bias']" in str(error.value)
    reshaped = {**params, "2.bias": torch.zeros(4)}
    with pytest.raises(
        ValueError, match=r"state.params\['2.bias'\] has shape \(4,\) but plan bucket \d+ expects \(3,\)"
    ):
        step(fdp.init_train_state(reshaped, buffers, fdp.sgd(0.1), plan), batch)


def test_a_state_made_without_a_plan_is_refused_by_name():
    loss_fn, params, buffers, batch, plan = _setup()
    step = fdp.make_train_step(loss_fn, fdp.sgd(0.1), plan)
    with pytest.raises(ValueError) as error:
        step(fdp.init_train_state(params, buffers, fdp.sgd(0.1)), batch)
    message = _one_line(error)
    assert f"state.hook_state holds 0 states but plan has {len(plan)} buckets" in message
    assert "init_train_state(params, buffers, optimizer, plan, hook)" in message


def test_hook_states_of_another_hook_are_refused_naming_bucket_and_hook():
    loss_fn, params, buffers, batch, plan = _setup()
    step = fdp.make_train_step(loss_fn, fdp.sgd(0.1), plan, powersgd(rank=1, start_iter=0))
    state = fdp.init_train_state(params, buffers, fdp.sgd(0.1), plan)  # allreduce's states
    with pytest.raises(TypeError) as error:
        step(state, batch)
    assert "state.hook_state[0] does not fit hook powersgd on bucket 0" in _one_line(error)
    # The same hook with another setting that changes the state's shape: refused too.
    step = fdp.make_train_step(loss_fn, fdp.sgd(0.1), plan, topk(ratio=0.5, error_feedback=True))
    state = fdp.init_train_state(params, buffers, fdp.sgd(0.1), plan, topk(ratio=0.5, error_feedback=False))
    with pytest.raises(TypeError, match=r"state.hook_state\[0\] does not fit hook topk"):
        step(state, batch)


@pytest.mark.parametrize(
    "kwargs,error,needles",
    [
        ({"accum_steps": 0}, ValueError, ["accum_steps=0", "integer >= 1"]),
        ({"accum_steps": 2.0}, ValueError, ["accum_steps=2.0"]),
        ({"schedule": "later"}, ValueError, ["schedule='later'", "after", "overlap"]),
        ({"nonfinite": "ignore"}, ValueError, ["nonfinite='ignore'", "raise", "skip"]),
        ({"sync_buffers": "mean"}, ValueError, ["sync_buffers='mean'", "broadcast", "average", "local"]),
        ({"comm": "gloo"}, TypeError, ["comm='gloo'", "init_distributed"]),
    ],
)
def test_step_arguments_are_named_as_python_arguments(kwargs, error, needles):
    loss_fn, params, buffers, batch, plan = _setup()
    with pytest.raises(error) as raised:
        fdp.make_train_step(loss_fn, fdp.sgd(0.1), plan, **kwargs)
    message = _one_line(raised)
    assert "trainer." not in message
    for needle in needles:
        assert needle in message


def test_a_batch_that_does_not_split_into_accum_steps_names_accum_steps():
    loss_fn, params, buffers, batch, plan = _setup()
    step = fdp.make_train_step(loss_fn, fdp.sgd(0.1), plan, accum_steps=3)
    with pytest.raises(ValueError, match=r"^accum_steps=3: expected a divisor of the per-rank batch of 8 samples$"):
        step(fdp.init_train_state(params, buffers, fdp.sgd(0.1), plan), batch)


def test_optimizer_and_hook_in_each_others_place_are_named():
    loss_fn, params, buffers, batch, plan = _setup()
    with pytest.raises(TypeError, match=r"^optimizer is a reduction hook.*pass it as hook="):
        fdp.make_train_step(loss_fn, allreduce(), plan, fdp.sgd(0.1))
    with pytest.raises(TypeError, match=r"^hook is an optimizer.*pass it as optimizer="):
        fdp.make_train_step(loss_fn, fdp.sgd(0.1), plan, fdp.sgd(0.1))
    with pytest.raises(TypeError, match=r"^plan=None: expected a BucketPlan"):
        fdp.make_train_step(loss_fn, fdp.sgd(0.1), None)


def test_a_launched_process_without_its_world_is_refused(monkeypatch):
    loss_fn, params, buffers, batch, plan = _setup()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        RuntimeError, match=r"^comm is a world of one, but this process was started as one of WORLD_SIZE=2"
    ):
        fdp.make_train_step(loss_fn, fdp.sgd(0.1), plan)
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_world(None)  # torchrun with one process: a world of one is right


# -- ranks that start from different values ------------------------------------------------------
def _two_ranks_built_apart(rank, world):
    """Each rank builds its model from its own seed, as ranks do that never share params; the
    state from fdp.setup_state trains, the one from init_train_state on each rank is refused."""
    torch.manual_seed(100 + rank)
    model, params, buffers = fdp.functionalize(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)))
    loss_fn = fdp.cross_entropy_loss(model)
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    plan = fdp.plan_buckets(fdp.planner_loss(loss_fn, buffers), params, batch)
    comm = fdp.Comm()
    step = fdp.make_train_step(loss_fn, fdp.sgd(0.1), plan, comm=comm)
    trained, _ = step(fdp.setup_state(params, buffers, fdp.sgd(0.1), plan, comm=comm), batch)
    apart = fdp.make_train_step(loss_fn, fdp.sgd(0.1), plan, comm=comm)  # its own first step, and checks
    try:
        apart(fdp.init_train_state(params, buffers, fdp.sgd(0.1), plan), batch)
    except ValueError as error:
        return {name: p.clone() for name, p in trained.params.items()}, str(error)
    return None, "trained apart"


def test_ranks_that_start_from_different_params_are_refused_at_the_first_step(run_ranks):
    """DDP broadcasts rank 0's params when it is built; a state from init_train_state on each
    rank has no such step, so the first step compares the ranks' fingerprints and names the
    first tensor that differs (in the state's order), on every rank."""
    (params0, error0), (params1, error1) = run_ranks(_two_ranks_built_apart, timeout_s=30.0)
    assert error0 == error1
    assert re.fullmatch(
        r"state\.params\['0\.weight'\] differs between rank 0 and rank 1: the ranks start from different values "
        r"and would train apart; make the state with fdp\.setup_state\(params, buffers, optimizer, plan, hook, comm\), "
        r"which gives every rank rank 0's params and buffers",
        error0,
    ), error0
    assert all(torch.equal(params0[name], params1[name]) for name in params0)  # setup_state: rank 0's everywhere


def test_a_fingerprint_sees_one_bit_and_the_order_of_elements():
    from fdp.state.checks import fingerprint

    x = torch.randn(3000)
    flipped = x.clone()
    flipped.view(torch.int32)[2999] ^= 1  # the last bit of the last element
    tensors = {"a": x, "b": torch.arange(6, dtype=torch.bfloat16), "c": torch.zeros(0)}
    base = fingerprint(tensors)
    assert base.shape == (3,) and base.dtype == torch.int64
    assert (fingerprint({**tensors, "a": flipped}) != base).tolist() == [True, False, False]
    assert (fingerprint({**tensors, "b": torch.arange(6, dtype=torch.bfloat16).flip(0)}) != base).tolist() == [
        False,
        True,
        False,
    ]
