"""The state before a donated step, kept for a world that goes back to it (``fdp.state.kept``, ``fdp.procs.shrink``).

A donated step (``donate=True``) writes over its input; a survivor one step ahead, or one whose step failed part
way (a bucket stepped in place before a later bucket's collective failed), goes back to the state the step began
with. Here one process steps an MLP of several buckets under Adam; a hook fails on the last bucket to stand for a
collective that failed when a peer was lost.
"""

from __future__ import annotations

import pytest
import torch

from fdp import adam, functionalize, init_train_state, make_train_step, plan_buckets
from fdp._torch import tree_flatten, tree_map
from fdp.hooks.base import stateless
from fdp.model.losses import cross_entropy_loss, planner_loss
from fdp.state.kept import KeptState


def _tensors(state):
    return [leaf for leaf in tree_flatten(state)[0] if isinstance(leaf, torch.Tensor)]


def _same(a, b) -> bool:
    return len(_tensors(a)) == len(_tensors(b)) and all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b)))


def _storages(params):
    return {t.untyped_storage().data_ptr() for t in params.values()}


def _clone(state):
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 3))
    model, params, buffers = functionalize(net)
    loss_fn = cross_entropy_loss(model)
    batches = [(torch.randn(6, 8), torch.randint(0, 3, (6,))) for _ in range(3)]
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=0.01, first_bucket_cap_mb=0.01
    )
    assert len(plan.buckets) >= 2, "the test needs a bucket stepped before the last one's failure"
    optimizer = adam(1e-2)
    first = init_train_state(params, buffers, optimizer, plan)
    step = make_train_step(loss_fn, optimizer, plan, donate=True)
    state = step(_clone(first), batches[0])[0]  # a state whose Adam moments are not zero
    return loss_fn, optimizer, plan, batches, state


def _failing_on_last_bucket(plan, failing):
    last = len(plan.buckets) - 1

    def apply(grads, comm):
        summed = yield comm.allreduce(grads.buffer)
        if failing and grads.spec.index == last:
            raise RuntimeError("the peer's socket closed")  # what a collective with a lost rank raises
        return grads._replace(buffer=summed)

    return stateless(apply)


def test_a_donated_step_that_failed_part_way_goes_back_to_the_state_it_began_with(setup):
    loss_fn, optimizer, plan, batches, state = setup
    failing = []
    # Each bucket stepped in place as its reduction is done, before the last one's fails, as on many ranks.
    hook = _failing_on_last_bucket(plan, failing)
    step = make_train_step(loss_fn, optimizer, plan, hook, donate=True)
    donated = step(_clone(state), batches[0])[0]  # laid out as the step function keeps its params: written in place
    began, kept = _clone(donated), KeptState(copies=True)
    kept.keep(donated)
    failing.append(True)
    with pytest.raises(RuntimeError, match="socket closed"):
        step(donated, batches[1])
    assert not _same(donated, began), "the failed step wrote over no bucket: nothing here to go back from"
    back = kept.take()
    assert back.step == began.step and _same(back, began)
    # Laid out as the state was (the params of a bucket views of one flat buffer): what the step function expects.
    assert len(_storages(back.params)) == len(_storages(donated.params)) < len(back.params)
    # Stepped on from there, it is the step that never failed, bit for bit.
    again = make_train_step(loss_fn, optimizer, plan, donate=True)(back, batches[1])[0]
    uninterrupted = make_train_step(loss_fn, optimizer, plan, donate=True)(_clone(began), batches[1])[0]
    assert _same(again, uninterrupted)


def test_a_rank_one_step_ahead_and_one_behind_go_on_from_the_same_state(setup):
    loss_fn, optimizer, plan, batches, state = setup
    step = make_train_step(loss_fn, optimizer, plan, donate=True)
    behind, ahead, kept = _clone(state), _clone(state), KeptState(copies=True)
    for batch in batches[1:]:  # a second keep refreshes the same buffers in place
        kept.keep(ahead)
        ahead = step(ahead, batch)[0]
    behind = step(behind, batches[1])[0]
    back = kept.take()
    assert (back.step, ahead.step) == (behind.step, behind.step + 1)
    assert _same(back, behind)
    assert kept.step is None  # handed over: the next keep makes buffers of its own
