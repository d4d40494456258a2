"""An asynchronous save's staging copy (fdp.run.checkpoint.staging): planned at the first save, then one copy a leaf."""

from __future__ import annotations

import torch

from fdp import adam, cross_entropy_loss, functionalize, plan_buckets, planner_loss
from fdp._torch import chunk_of, mark_chunk
from fdp.comm import Comm
from fdp.model.builtin import MLP
from fdp.run.checkpoint.staging import Staging
from fdp.step.train_step import make_train_step
from fdp.update import zero


def _states(stage: int = 0):
    """An update, and two states of one layout a step apart (the second's tensors new: the step donates nothing)."""
    torch.manual_seed(0)
    model, params, buffers = functionalize(MLP(6, 8, 1, 3))
    batch = (torch.randn(4, 6), torch.randint(0, 3, (4,)))
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch, bucket_cap_mb=0.0002)
    update = zero.update_for(stage, adam(1e-2), plan, Comm(), model=model)
    first = update.first_state(params, buffers, None, Comm())
    step = make_train_step(loss_fn, adam(1e-2), plan, comm=Comm(), donate=False, zero_stage=stage, model=model)
    second, _ = step(first, batch)
    return update, first, second


class _Pieces:
    """The update's pieces of a state's trees, counting the times they are worked out."""

    def __init__(self, update, copied: bool = False):
        self.update, self.copied, self.calls = update, copied, 0

    def __call__(self, trees):
        self.calls += 1
        tensors, plain = self.update.checkpoint_pieces(trees[0], Comm())
        if self.copied:  # no view of the state: as a conversion would hand them
            tensors = {k: mark_chunk(t.clone(), *chunk_of(t)) if chunk_of(t) else t.clone() for k, t in tensors.items()}
        return tensors, [plain]

    def of(self, state):
        return self.update.checkpoint_pieces({"params": state.params, "opt_state": state.opt_state}, Comm())


def _trees(state):
    return [{"params": state.params, "opt_state": state.opt_state}]


def _same(staged: dict, expected: dict) -> bool:
    return staged.keys() == expected.keys() and all(
        torch.equal(staged[k], expected[k]) and chunk_of(staged[k]) == chunk_of(expected[k]) for k in expected
    )


def test_a_later_save_of_the_same_layout_copies_into_the_first_saves_buffers_without_working_out_the_pieces():
    update, first, second = _states(stage=1)
    pieces, staging = _Pieces(update), Staging()
    staged, (plain,) = staging.stage(_trees(first), pieces, key=(update,))
    expected, expected_plain = pieces.of(first)
    assert _same(staged, expected) and plain == expected_plain
    buffers = {k: t.untyped_storage().data_ptr() for k, t in staged.items()}
    staged, (plain,) = staging.stage(_trees(second), pieces, key=(update,))
    expected, expected_plain = pieces.of(second)
    assert _same(staged, expected) and plain == expected_plain  # the second state's values and step count
    assert pieces.calls == 1  # worked out once
    assert {k: t.untyped_storage().data_ptr() for k, t in staged.items()} == buffers  # the same buffers
    # each a storage of its own: DCP writes a view of a larger one only after copying it again
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in staged.values())
    assert not any(
        t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
        for t in staged.values()
        for s in [*second.params.values()]
    )  # copies, not views of the state


def test_pieces_that_are_no_views_of_the_state_are_worked_out_and_copied_at_every_save():
    update, first, second = _states()
    pieces, staging = _Pieces(update, copied=True), Staging()
    for state in (first, second):
        staged, _ = staging.stage(_trees(state), pieces, key=(update,))
        assert _same(staged, pieces.of(state)[0])
    assert pieces.calls == 2


def test_another_key_or_layout_is_planned_anew():
    update, first, _ = _states()
    other, _, _ = _states()
    pieces, staging = _Pieces(update), Staging()
    staging.stage(_trees(first), pieces, key=(update,))
    staging.stage(_trees(first), pieces, key=(other,))  # another update: its pieces may differ
    assert pieces.calls == 2
    grown = first._replace(params={**first.params, "extra": torch.zeros(2)})
    staging.stage(_trees(grown), pieces, key=(other,))
    assert pieces.calls == 3
