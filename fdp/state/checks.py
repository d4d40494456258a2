"""What a Python caller hands the train step, checked once, with errors naming the argument.

``make_train_step`` calls ``check_step_arguments`` when it is built and
``check_state_against_plan``, ``check_hook_states`` and ``check_same_replicas`` on the
first step's state. Each
error is one line naming the argument (``accum_steps``, ``state.params['fc.weight']``,
``state.hook_state[2]``) and what was expected; a config layer may translate the names
to its own keys. Everything here is a pure function of its arguments (and, for the
world, of the process environment).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fdp._torch import tree_flatten
from fdp.comm import Comm
from fdp.errors import check_int
from fdp.hooks.base import Hook, hook_name
from fdp.optim import GradientTransformation
from fdp.plan import BucketPlan
from fdp.procs.launch import refuse_world_of_one

__all__ = [
    "check_step_arguments",
    "check_accum_steps",
    "check_state_against_plan",
    "check_hook_states",
    "check_same_replicas",
    "check_world",
    "fingerprint",
]


def _is(kind: type, value: Any) -> bool:
    return isinstance(value, kind)


def check_world(comm: Comm | None) -> None:
    """Refuse a world of one in a process a launcher started as one of several but that never joined them.

    Once the process group exists, a world-of-one ``comm`` is deliberate (a local step
    between the syncs of an outer loop).

    >>> check_world(Comm())  # not launched: a world of one is what was asked for
    """
    if (comm or Comm()).world_size == 1:
        refuse_world_of_one(
            "comm",
            "join the others first (comm = fdp.init_distributed(WorldLayout('elastic' or 'torchrun', ...))) "
            "and pass that comm",
            RuntimeError,
        )


def check_accum_steps(accum_steps: Any) -> int:
    """``accum_steps``: micro-batches per step, an integer >= 1.

    >>> check_accum_steps(0)
    Traceback (most recent call last):
    ...
    ValueError: accum_steps=0: expected an integer >= 1
    """
    return check_int("accum_steps", accum_steps, low=1)


def check_step_arguments(
    loss_fn: Any,
    optimizer: Any,
    plan: Any,
    hook: Any,
    comm: Any,
) -> None:
    """The arguments of ``make_train_step``, before anything is built.

    >>> check_step_arguments(print, None, None, None, None)
    Traceback (most recent call last):
    ...
    TypeError: optimizer=None: expected an optimizer (GradientTransformation), e.g. fdp.sgd(0.1)
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r}: expected a function loss_fn(params, buffers, batch) -> (loss, aux)")
    if _is(Hook, optimizer):
        raise TypeError(
            "optimizer is a reduction hook (fdp.hooks.Hook): pass it as hook=, and an optimizer "
            "(fdp.sgd, fdp.adamw, or fdp.chain of them) as optimizer"
        )
    if not _is(GradientTransformation, optimizer):
        raise TypeError(f"optimizer={optimizer!r}: expected an optimizer (GradientTransformation), e.g. fdp.sgd(0.1)")
    if not _is(BucketPlan, plan):
        raise TypeError(f"plan={plan!r}: expected a BucketPlan (fdp.plan_buckets(...))")
    if _is(GradientTransformation, hook):
        raise TypeError(
            "hook is an optimizer (GradientTransformation): pass it as optimizer=; hooks come from "
            "fdp.hooks (allreduce(), powersgd(), fdp.hooks.chain(...))"
        )
    if hook is not None and not _is(Hook, hook):
        raise TypeError(f"hook={hook!r}: expected a Hook from fdp.hooks (or None for allreduce())")
    if comm is not None and not _is(Comm, comm):
        raise TypeError(f"comm={comm!r}: expected the Comm that fdp.init_distributed returns (or None)")
    check_world(comm)


_REMAKE = "make the state with init_train_state(params, buffers, optimizer, plan, hook) (or fdp.setup_state)"


def check_state_against_plan(state: Any, plan: BucketPlan) -> None:
    """``state.params`` must be what ``plan`` was made for: the same names, shapes, dtypes and devices.

    A dtype or device the plan does not expect would otherwise be cast silently when the
    gradients pass through the plan's buckets (bf16 params come back float32).

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (2,), "float32", "cpu")])
    >>> class State: params = {"w": torch.zeros(2, dtype=torch.bfloat16)}
    >>> check_state_against_plan(State, plan)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    TypeError: state.params['w'] is torch.bfloat16 but plan bucket 0 holds float32:
    plan with the params you train (plan_buckets(loss, params, batch)), or cast them to float32
    """
    params = getattr(state, "params", None)
    if not isinstance(params, dict):
        raise TypeError(f"state={type(state).__name__}: expected a TrainState ({_REMAKE})")
    planned = plan.names
    missing = [name for name in planned if name not in params]
    extra = [name for name in params if name not in set(planned)]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"in plan but not in state.params: {missing[:5]}")
        if extra:
            parts.append(f"in state.params but not in plan: {extra[:5]}")
        raise ValueError(
            f"state.params and plan name different parameters ({'; '.join(parts)}): "
            "make the plan from the params you train (plan_buckets(loss, params, batch))"
        )
    for bucket in plan.buckets:
        for slot in bucket.slots:
            p = params[slot.name]
            where = f"state.params[{slot.name!r}]"
            if tuple(p.shape) != slot.shape:
                raise ValueError(
                    f"{where} has shape {tuple(p.shape)} but plan bucket {bucket.index} expects {slot.shape}"
                )
            if p.dtype != bucket.torch_dtype:
                raise TypeError(
                    f"{where} is {p.dtype} but plan bucket {bucket.index} holds {bucket.dtype}: plan with the "
                    f"params you train (plan_buckets(loss, params, batch)), or cast them to {bucket.dtype}"
                )
            if str(p.device) != bucket.device:
                raise ValueError(
                    f"{where} is on {p.device} but plan bucket {bucket.index} is on {bucket.device}: "
                    "move the params before planning, or plan again"
                )


def _leaf_kind(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype)
    return type(leaf).__name__


def check_hook_states(hook_state: Any, hook: Hook, plan: BucketPlan) -> None:
    """``hook_state`` must hold one state per bucket of ``plan``, each shaped as ``hook.init`` makes it.

    >>> from fdp.hooks import powersgd
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (4, 4), "float32", "cpu")])
    >>> check_hook_states((), powersgd(), plan)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: state.hook_state holds 0 states but plan has 1 buckets (a state made without plan or hook?):
    make the state with init_train_state(params, buffers, optimizer, plan, hook) (or fdp.setup_state)
    """
    count = len(plan.buckets)
    if not isinstance(hook_state, tuple) or len(hook_state) != count:
        held = len(hook_state) if isinstance(hook_state, tuple) else type(hook_state).__name__
        raise ValueError(
            f"state.hook_state holds {held} states but plan has {count} buckets "
            f"(a state made without plan or hook?): {_REMAKE}"
        )
    for bucket, state in zip(plan.buckets, hook_state):
        # One bucket's fresh state at a time: at most one bucket's worth of memory.
        expected_leaves, expected_spec = tree_flatten(hook.init(bucket))
        leaves, spec = tree_flatten(state)
        same = spec == expected_spec and [_leaf_kind(x) for x in leaves] == [_leaf_kind(x) for x in expected_leaves]
        if not same:
            raise TypeError(
                f"state.hook_state[{bucket.index}] does not fit hook {hook_name(hook)} on bucket {bucket.index} "
                f"(made for another hook or plan?): {_REMAKE}, with the hook given to make_train_step"
            )


_CHUNK = 1 << 20
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor that changes with any bit of any element (and with the elements' order).

    The bits of each element, read as an integer, weighted by a position-dependent odd
    factor and summed with wrap-around: cheap (one pass), exact, and on the tensors' device.

    >>> a = {"w": torch.tensor([1.0, 2.0])}
    >>> bool((fingerprint(a) == fingerprint({"w": torch.tensor([1.0, 2.0])})).all())
    True
    >>> bool((fingerprint(a) == fingerprint({"w": torch.tensor([2.0, 1.0])})).all())
    False
    """
    out = []
    for t in tensors.values():
        bits = t.detach().contiguous().view(-1)
        bits = bits.view(_INT_OF_SIZE[bits.element_size()])
        total = torch.zeros((), dtype=torch.int64, device=bits.device)
        for start in range(0, bits.numel(), _CHUNK):  # in chunks: the int64 copies stay small
            part = bits[start : start + _CHUNK].to(torch.int64)
            weights = torch.arange(start, start + part.numel(), device=bits.device, dtype=torch.int64) * 2 + 1
            total += (part * weights).sum()
        out.append(total)
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)


def check_same_replicas(params: dict, buffers: dict, comm: Comm, fresh: bool) -> None:
    """Refuse ranks whose params (and, for a ``fresh`` state, buffers) differ: they would train apart silently.

    Every rank all-gathers one fingerprint per tensor (``fingerprint``) and compares it
    with rank 0's; the error names the first tensor that differs. A resumed state's
    buffers may differ by design (``sync_buffers="local"``), so only a fresh one's are compared.
    """
    if comm.world_size == 1:
        return
    tensors = {
        **{f"state.params[{n!r}]": p for n, p in params.items()},
        **({f"state.buffers[{n!r}]": b for n, b in buffers.items()} if fresh else {}),
    }
    if not tensors:
        return
    mine = fingerprint(tensors)
    if dist.get_backend(comm.group) == "gloo":
        mine = mine.cpu()  # ranks sharing a GPU talk over gloo, which gathers host tensors
    every = [torch.empty_like(mine) for _ in range(comm.world_size)]
    dist.all_gather(every, mine, group=comm.group)
    for rank, other in enumerate(every[1:], start=1):
        differs = (other != every[0]).nonzero()
        if len(differs):
            name = list(tensors)[int(differs[0])]
            dist.barrier(group=comm.group)  # every rank saw it: none tears its connections down under another
            raise ValueError(
                f"{name} differs between rank 0 and rank {rank}: the ranks start from different values and would "
                "train apart; make the state with fdp.setup_state(params, buffers, optimizer, plan, hook, comm), "
                "which gives every rank rank 0's params and buffers"
            )
