"""The train state: everything that changes during training, in one value.

A train step (``fdp.step.train_step``) maps one ``TrainState`` to the next; checkpoints
(``fdp.run.checkpoint``) save and restore it whole; ZeRO (``fdp.update.zero``) shards parts of it
over the ranks. This module holds the value and what is measured of it, and nothing
that steps it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fdp._torch import tree_flatten
from fdp.hooks import Hook, allreduce, init_hook_states
from fdp.model.functional import Buffers, Params
from fdp.model.precision import LossScale, Precision
from fdp.optim import GradientTransformation
from fdp.plan import BucketPlan
from fdp.plan.buckets import crosses_flat, lay_out
from fdp.procs.devices import device_of, seeded_cuda_rng
from fdp.state.checks import check_state_against_plan

__all__ = ["TrainState", "init_train_state", "state_nbytes"]


class TrainState(NamedTuple):
    """Everything that changes during training, in one value.

    ``params`` are the trained tensors by name (under ZeRO stage 3, this rank's flat
    slice of each bucket, by bucket: see ``fdp.update.zero``); ``hook_state`` holds one state
    per bucket for the reduction's hook chain; ``rng`` is the CPU generator state that
    dropout and other random ops draw from, ``cuda_rng`` that of the params' GPU (empty
    when they are not on one); ``loss_scale`` the dynamic ``LossScale`` of ``16-mixed``
    precision (``None`` otherwise); ``outer`` the outer loop's state when training syncs
    only every few steps (``fdp.step.outer``); ``mirror``, under ZeRO stage 1 in a world that may
    shrink (``fdp.procs.shrink``), the optimizer state of the next rank's slices (rank ``r`` keeps
    rank ``r + 1``'s, mod the world size), so that a lost rank's slices survive it (empty
    otherwise; never saved: a checkpoint holds the whole state).
    """

    step: int
    params: Params
    buffers: Buffers
    opt_state: Any
    hook_state: Any
    rng: torch.Tensor
    cuda_rng: torch.Tensor = torch.empty(0, dtype=torch.uint8)
    loss_scale: LossScale | None = None
    outer: Any = ()
    mirror: Any = ()


def init_train_state(
    params: Params,
    buffers: Buffers,
    optimizer: GradientTransformation,
    plan: BucketPlan | None = None,
    hook: Hook | None = None,
    seed: int = 0,
    precision: Precision | None = None,
) -> TrainState:
    """The state before step 1 (pass ``plan``, and ``hook`` unless it is ``allreduce()``, for a
    state that ``make_train_step`` can step; ``fdp.setup_state`` does this across ranks).

    With ``plan``, where the step hands ``torch.func`` one flat buffer per bucket
    (``fdp.plan.buckets.crosses_flat``), the state's params are copies laid out that way.

    >>> from fdp import functionalize, sgd
    >>> model, params, buffers = functionalize(torch.nn.Linear(2, 2))
    >>> init_train_state(params, buffers, sgd(0.1)).step
    0
    """
    hook_state = init_hook_states(hook or allreduce(), plan) if plan is not None else ()
    if plan is not None:
        params = _laid_out(plan, params)
    rng = torch.Generator().manual_seed(seed).get_state()
    cuda_rng = seeded_cuda_rng(seed, device_of(params))
    loss_scale = precision.init_loss_scale(device_of(params)) if precision is not None else None
    return TrainState(0, params, buffers, optimizer.init(params), hook_state, rng, cuda_rng, loss_scale)


def _laid_out(plan: BucketPlan, params: Params) -> Params:
    # One flat buffer per bucket where the step hands those to torch.func; params the plan
    # was not made for are left as they are, for the first step to name what is wrong.
    try:
        check_state_against_plan(TrainState(0, params, {}, None, None, None), plan)
    except (TypeError, ValueError):
        return params
    return lay_out(plan, params) if crosses_flat(plan) else params


def state_nbytes(state: Any, grad_buffers: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of params, optimizer state and gradient buffers held, each storage counted once.

    A storage's size is read as it is now: a buffer released between steps (ZeRO stage 2)
    counts nothing.

    >>> from fdp import sgd
    >>> params = {"w": torch.ones(4)}
    >>> state_nbytes(init_train_state(params, {}, sgd(0.1, momentum=0.9)))  # params, momentum
    32
    """
    seen: dict[int, int] = {}
    tensors = [*state.params.values(), *tree_flatten(state.opt_state)[0], *tree_flatten(state.mirror)[0], *grad_buffers]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())
