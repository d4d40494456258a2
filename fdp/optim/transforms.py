"""``GradientTransformation`` pairs over flat dicts of tensors, and their combinators: clipping, ``chain``, and a
step applied pure or in place (the optimizers themselves: ``fdp.optim.optimizers``)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import torch

from fdp._torch import HAS_FUSED_OPTIMIZERS, foreach
from fdp.optim.schedules import _check

Params = dict[str, torch.Tensor]
Grads = dict[str, torch.Tensor]
Updates = dict[str, torch.Tensor]
State = Any


SumAcross = Callable[[torch.Tensor], torch.Tensor]


class GradientTransformation(NamedTuple):
    """``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``.

    ``update`` and ``update_inplace`` also take ``sum_across=``: given (by ZeRO, whose
    ranks each hold a shard of the gradients), it sums a tensor over the ranks that hold
    the other shards, so a transform that looks at all gradients at once
    (``clip_by_global_norm``) completes what it computed over its shard. Transforms that
    work elementwise ignore it; ``chain`` passes it to every member.

    ``update_inplace(grads, state, params) -> state``, where present, is the same step for
    donated inputs: it writes the new params into ``params`` and the new state's tensors
    into ``state``'s (``grads`` may be overwritten too) and returns the new state. Use it
    through ``apply_gradients(..., donate=True)``, which falls back to ``update`` where
    the fused kernels do not apply.

    ``elementwise`` says each parameter's step depends only on its own gradient, state
    and value (SGD, Adam; not global-norm clipping). ``update_inplace`` of such a
    transform also takes the gradients of a subset of the params and steps only those,
    so a train step can update each bucket's params as soon as its reduction is done;
    every call for one step gets the same ``state`` and returns the same new state.

    ``by_name`` says a step depends on the parameters' names (a ``decay_mask`` that exempts
    some from weight decay). ZeRO steps flat slices of buckets keyed ``bucket<i>`` instead:
    ``with_decay_mask(to_slices)``, where present, is the same transform with each of its
    rules ``decay_mask`` replaced by ``to_slices(decay_mask)``, a rule on the slices that
    answers with ``DecayRuns`` where a slice is partly decayed (``fdp.update.zero.decay``);
    a ``by_name`` transform without it cannot step slices.
    """

    init: Callable[[Params], State]
    update: Callable[[Grads, State, Params], tuple[Updates, State]]
    update_inplace: Callable[[Grads, State, Params], State] | None = None
    elementwise: bool = False
    by_name: bool = False
    with_decay_mask: Callable[[Callable[["DecayMask"], "DecayMask"]], "GradientTransformation"] | None = None


# Which params weight decay applies to, by name and value (``fdp.optim.decay_rule`` makes one from config). For
# a flat tensor (a ZeRO slice) a rule may answer with runs instead: ``DecayRuns``, the ``(start, stop)`` element
# ranges of the flat tensor that decay, in order and apart; every other element does not.
DecayRuns = tuple[tuple[int, int], ...]
DecayMask = Callable[[str, torch.Tensor], "bool | DecayRuns"]


class ClipState(NamedTuple):
    """Empty: clipping keeps no state, but a chained state still has one member per transform."""


# ---------------------------------------------------------------------- combinators etc.


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by ``min(1, max_norm / (global_norm + 1e-6))``, as ``clip_grad_norm_``.

    The scale stays a tensor (no ``.item()``), so clipping never synchronizes with a GPU.
    Given ``sum_across`` (the grads are one shard of them all), the norm is taken over
    every shard.

    >>> clip = clip_by_global_norm(1.0)
    >>> grads = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
    >>> updates, _ = clip.update(grads, clip.init(grads), None)
    >>> torch.cat(list(updates.values()))  # norm 5 -> 1
    tensor([0.6000, 0.8000])
    >>> updates, _ = clip.update({"a": torch.tensor([3.0, 4.0])}, (), None, sum_across=lambda t: t * 2)
    >>> updates["a"]  # as if a second rank held a shard just like this one: global norm sqrt(50)
    tensor([0.4243, 0.5657])
    """
    _check(max_norm > 0, "max_norm", "> 0", max_norm)

    def init(params: Params) -> ClipState:
        return ClipState()

    def update(
        grads: Grads, state: ClipState, params: Params | None = None, sum_across=None
    ) -> tuple[Updates, ClipState]:
        keys, g = aligned(grads, None)
        if not g:
            return {}, state
        device = g[0].device
        norms = foreach.norm(g, 2)
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2)
        if sum_across is not None:  # a shard of the gradients: the norm is over all shards
            total = sum_across(total.square()).sqrt()
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # Grouped by device because a foreach op takes one scale tensor for all its inputs.
        out: dict[str, torch.Tensor] = {}
        for dev in dict.fromkeys(t.device for t in g):
            idx = [i for i, t in enumerate(g) if t.device == dev]
            scaled = foreach.mul([g[i] for i in idx], scale.to(dev))
            out.update(zip((keys[i] for i in idx), scaled))
        return {k: out[k] for k in keys}, state

    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order, each to the previous one's updates; state is a tuple.

    >>> from fdp.optim import sgd
    >>> opt = chain(clip_by_global_norm(1.0), sgd(0.5))
    >>> params = {"w": torch.tensor([0.0, 0.0])}
    >>> updates, state = opt.update({"w": torch.tensor([6.0, 8.0])}, opt.init(params), params)
    >>> updates["w"]
    tensor([-0.3000, -0.4000])
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            what = "a reduction hook (fdp.hooks.Hook)" if hasattr(t, "apply") else f"a {type(t).__name__}"
            raise TypeError(
                f"fdp.chain: argument {i} is {what}, not an optimizer (GradientTransformation): "
                "fdp.chain (fdp.optim.chain) composes optimizers, fdp.hooks.chain composes reduction hooks"
            )

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(grads: Grads, state: tuple, params: Params | None = None, sum_across=None) -> tuple[Updates, tuple]:
        if len(state) != len(transforms):
            raise ValueError(f"state has {len(state)} members, chain has {len(transforms)} transforms")
        new_states = []
        for transform, member in zip(transforms, state):
            grads, member = _update(transform, grads, member, params, sum_across)
            new_states.append(member)
        return grads, tuple(new_states)

    last = transforms[-1].update_inplace if transforms else None

    def update_inplace(grads: Grads, state: tuple, params: Params, sum_across=None) -> tuple:
        # Every member but the last makes new updates as usual; the last one, an
        # optimizer, applies them to the donated params in place.
        new_states = []
        for transform, member in zip(transforms[:-1], state[:-1]):
            grads, member = _update(transform, grads, member, params, sum_across)
            new_states.append(member)
        return (*new_states, last(grads, state[-1], params))

    elementwise = all(t.elementwise for t in transforms)
    by_name = any(t.by_name for t in transforms)
    named = [t for t in transforms if t.by_name]

    def with_decay_mask(to_slices: Callable[[DecayMask], DecayMask]) -> GradientTransformation:
        return chain(*(t.with_decay_mask(to_slices) if t.by_name else t for t in transforms))

    remaskable = bool(named) and all(t.with_decay_mask is not None for t in named)
    return GradientTransformation(
        init, update, update_inplace if last else None, elementwise, by_name, with_decay_mask if remaskable else None
    )


def apply_gradients(
    optimizer: GradientTransformation,
    grads: Grads,
    state: State,
    params: Params,
    donate: bool = False,
    sum_across: SumAcross | None = None,
) -> tuple[Params, State]:
    """One optimizer step: ``(new_params, new_state)``.

    With ``donate=False`` nothing passed in is modified (``update`` then
    ``apply_updates``). With ``donate=True`` the caller gives up ``grads``, ``params`` and
    ``state``: when ``optimizer`` has an in-place form and the tensors suit torch's fused
    kernels (floating point, on CPU or CUDA), the new params and state are written into
    the old tensors, which come back in new containers; otherwise the pure path runs.

    >>> from fdp.optim import sgd
    >>> opt = sgd(0.5, momentum=0.9)
    >>> params = {"w": torch.tensor([1.0])}
    >>> new_params, state = apply_gradients(opt, {"w": torch.tensor([2.0])}, opt.init(params), params, donate=True)
    >>> new_params["w"], new_params["w"] is params["w"]
    (tensor([0.]), True)
    """
    if donate and grads.keys() == params.keys() and supports_inplace(optimizer, params, grads):
        if sum_across is None:
            return dict(params), optimizer.update_inplace(grads, state, params)
        return dict(params), optimizer.update_inplace(grads, state, params, sum_across=sum_across)
    updates, state = _update(optimizer, grads, state, params, sum_across)
    return apply_updates(params, updates), state


def _update(transform: GradientTransformation, grads: Grads, state: State, params: Params | None, sum_across):
    # A transform written for whole gradients (three arguments) is called as such.
    if sum_across is None:
        return transform.update(grads, state, params)
    return transform.update(grads, state, params, sum_across=sum_across)


def takes_sum_across(optimizer: GradientTransformation) -> bool:
    """Whether ``optimizer.update`` accepts ``sum_across=`` (needed to step a shard of the gradients).

    >>> from fdp.optim import adam
    >>> takes_sum_across(chain(clip_by_global_norm(1.0), adam(1e-3)))
    True
    >>> takes_sum_across(GradientTransformation(lambda p: (), lambda g, s, p: (g, s)))
    False
    """
    try:
        parameters = inspect.signature(optimizer.update).parameters
    except (TypeError, ValueError):
        return False
    return "sum_across" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# torch 2.13's CPU fused SGD moves bfloat16/float16 params the wrong way in its vectorised
# loop (64 elements at 0.1, gradient 0.0129, lr 0.1, momentum 0.9: 0.1 -> 0.10010, where
# the unfused step gives 0.09863); low-precision params on CPU take the pure path.
_FUSED_CPU_DTYPES = (torch.float32, torch.float64)


def supports_inplace(optimizer: GradientTransformation, params: Params, grads: Grads | None = None) -> bool:
    """Whether ``apply_gradients(optimizer, grads, state, params, donate=True)`` works in place.

    It does when ``optimizer`` has an in-place form and the tensors suit torch's fused
    kernels: dense, one floating dtype, all on one CPU or CUDA device (what
    ``torch.optim`` checks before it allows ``fused=True``).

    >>> from fdp.optim import sgd
    >>> supports_inplace(sgd(0.1), {"w": torch.zeros(2)})
    True
    >>> supports_inplace(sgd(0.1), {"w": torch.zeros(2, dtype=torch.int64)})
    False
    """
    if optimizer.update_inplace is None or not HAS_FUSED_OPTIMIZERS:
        return False
    tensors = [*params.values(), *(grads or {}).values()]
    if not tensors:
        return False
    device, dtype = tensors[0].device, tensors[0].dtype
    dtypes = _FUSED_CPU_DTYPES if device.type == "cpu" else _FUSED_DTYPES
    return (
        device.type in _FUSED_DEVICES
        and dtype in dtypes
        and all(t.device == device and t.dtype == dtype and t.layout == torch.strided for t in tensors)
    )


def apply_updates(params: Params, updates: Updates) -> Params:
    """Return a new dict ``{k: params[k] + updates[k]}``; ``params`` is left untouched.

    >>> apply_updates({"w": torch.tensor([1.0])}, {"w": torch.tensor([-0.25])})
    {'w': tensor([0.7500])}
    """
    if params.keys() != updates.keys():
        raise ValueError(f"params and updates have different keys: {sorted(params.keys() ^ updates.keys())}")
    keys = list(params)
    return dict(zip(keys, foreach.add(list(params.values()), [updates[k] for k in keys])))


def current_lr(opt_state: State) -> float | None:
    """The learning rate of the last update (before any update: of the first), for logging.

    Searches a (possibly nested, chained) state and returns the ``lr`` field of the first
    NamedTuple that has one; ``None`` if no member has one.

    >>> from fdp.optim import adamw, warmup_cosine_schedule
    >>> opt = chain(clip_by_global_norm(1.0), adamw(warmup_cosine_schedule(1.0, 4, 8)))
    >>> params = {"w": torch.zeros(2)}
    >>> state = opt.init(params)
    >>> for _ in range(3):
    ...     _, state = opt.update({"w": torch.ones(2)}, state, params)
    >>> current_lr(state)  # the third update ran at step 2 of the warm-up
    0.5
    """
    if isinstance(opt_state, tuple) and "lr" in getattr(opt_state, "_fields", ()):  # SGDState, AdamState, yours
        return opt_state.lr
    if isinstance(opt_state, (tuple, list)):
        for member in opt_state:
            lr = current_lr(member)
            if lr is not None:
                return lr
    return None


# ------------------------------------------------------------------------------ helpers


def aligned(grads: Grads, state_dict: dict | None) -> tuple[list[str], list[torch.Tensor]]:
    """Keys and values of ``grads``, in the key order of ``state_dict`` when there is one.

    Following the state's order (set by ``init``) keeps the state's pytree structure fixed,
    so a checkpoint's flat leaves always line up with the template they are rebuilt on.
    """
    if state_dict is None:
        return list(grads), list(grads.values())
    if grads.keys() != state_dict.keys():
        raise ValueError(
            f"grads and optimizer state have different keys: {sorted(grads.keys() ^ state_dict.keys())[:5]}"
        )
    keys = list(state_dict)
    return keys, [grads[k] for k in keys]
