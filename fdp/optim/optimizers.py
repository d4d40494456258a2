"""The optimizers: SGD (momentum, Nesterov, weight decay) and Adam / AdamW, each a ``GradientTransformation``
with a pure ``update`` and, for donated inputs, an ``update_inplace`` on torch's fused kernels."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from fdp._torch import foreach, fused_adam_, fused_adamw_, fused_sgd_
from fdp.optim.schedules import Schedule, _as_schedule, _check
from fdp.optim.transforms import DecayMask, DecayRuns, GradientTransformation, Grads, Params, Updates, aligned

__all__ = ["SGDState", "AdamState", "sgd", "adam", "adamw"]


class SGDState(NamedTuple):
    """``count`` updates done; ``lr`` of the last one; momentum buffers."""

    count: int
    lr: float
    momentum: dict[str, torch.Tensor] | None  # None when momentum == 0


class AdamState(NamedTuple):
    """``count`` updates done; ``lr`` of the last one; first and second moment estimates."""

    count: int
    lr: float
    mu: dict[str, torch.Tensor]
    nu: dict[str, torch.Tensor]


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    decay_mask: DecayMask | None = None,
) -> GradientTransformation:
    """SGD with ``torch.optim.SGD`` semantics (L2 weight decay added to the gradient).

    As in torch, the first step seeds the momentum buffer with the gradient itself
    (dampening is not applied to it). ``decay_mask(name, param)`` says which params
    weight decay applies to (``None``: all), as two ``torch.optim`` param groups would.

    >>> opt = sgd(0.1, momentum=0.9)
    >>> params = {"w": torch.tensor([1.0])}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": torch.tensor([2.0])}, state, params)
    >>> updates["w"], state.count
    (tensor([-0.2000]), 1)
    """
    schedule = _as_schedule(lr)
    _check(momentum >= 0, "momentum", ">= 0", momentum)
    _check(0 <= dampening <= 1, "dampening", "in [0, 1]", dampening)
    _check(weight_decay >= 0, "weight_decay", ">= 0", weight_decay)
    if nesterov:
        _check(momentum > 0, "momentum", "> 0 with nesterov=True", momentum)
        _check(dampening == 0, "dampening", "== 0 with nesterov=True", dampening)

    def init(params: Params) -> SGDState:
        buffers = {k: torch.zeros_like(p) for k, p in params.items()} if momentum else None
        return SGDState(count=0, lr=schedule(0), momentum=buffers)

    def update(
        grads: Grads, state: SGDState, params: Params | None = None, sum_across=None
    ) -> tuple[Updates, SGDState]:
        keys, d = aligned(grads, state.momentum)
        if weight_decay:
            d = _with_l2(d, keys, _params_for(keys, params, "weight_decay"), weight_decay, decays)
        buffers = None
        if momentum:
            if state.count == 0:
                # Cloned so the state never aliases the caller's grads.
                buf = [t.clone() for t in d]
            else:
                buf = foreach.mul([state.momentum[k] for k in keys], momentum)
                foreach.add_(buf, d, alpha=1.0 - dampening)
            d = foreach.add(d, buf, alpha=momentum) if nesterov else buf
            buffers = dict(zip(keys, buf))
        lr_now = schedule(state.count)
        updates = dict(zip(keys, foreach.mul(d, -lr_now)))
        return updates, SGDState(count=state.count + 1, lr=lr_now, momentum=buffers)

    def update_inplace(grads: Grads, state: SGDState, params: Params, sum_across=None) -> SGDState:
        keys, g = _subset(grads, params)
        lr_now = schedule(state.count)
        rows = [(params[k], g[i], *((state.momentum[k],) if momentum else ())) for i, k in enumerate(keys)]
        for group, decay in _groups(keys, rows, weight_decay, decays):  # torch.optim's param groups
            columns = [list(column) for column in zip(*group)]
            fused_sgd_(
                columns[0],
                columns[1],
                columns[2] if momentum else [],
                weight_decay=decay,
                momentum=momentum,
                lr=lr_now,
                dampening=dampening,
                nesterov=nesterov,
                maximize=False,
                is_first_step=state.count == 0,
            )
        return SGDState(count=state.count + 1, lr=lr_now, momentum=state.momentum)

    decays = _decays(decay_mask)

    def with_decay_mask(to_slices):
        return sgd(lr, momentum, dampening, nesterov, weight_decay, to_slices(decay_mask))

    return _transformation(init, update, update_inplace, decay_mask, with_decay_mask)


def adam(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decay_mask: DecayMask | None = None,
) -> GradientTransformation:
    """Adam with ``torch.optim.Adam`` semantics (L2 weight decay added to the gradient).

    ``decay_mask(name, param)`` says which params weight decay applies to (``None``: all).

    >>> opt = adam(0.1)
    >>> params = {"w": torch.tensor([1.0, -1.0])}
    >>> updates, state = opt.update({"w": torch.tensor([3.0, -0.5])}, opt.init(params), params)
    >>> updates["w"]  # the first Adam step is -lr * sign(grad)
    tensor([-0.1000,  0.1000])
    """
    return _adam(lr, b1, b2, eps, weight_decay, decay_mask, decoupled=False)


def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    decay_mask: DecayMask | None = None,
) -> GradientTransformation:
    """AdamW with ``torch.optim.AdamW`` semantics: params shrink by ``lr * weight_decay`` each step.

    ``decay_mask(name, param)`` says which params shrink (``None``: all), as a ``torch.optim``
    param group with ``weight_decay=0`` for the others would.

    >>> opt = adamw(0.1, weight_decay=0.5)
    >>> params = {"w": torch.tensor([2.0])}
    >>> updates, state = opt.update({"w": torch.tensor([0.0])}, opt.init(params), params)
    >>> updates["w"]  # zero gradient: only the decay, -0.1 * 0.5 * 2.0
    tensor([-0.1000])
    """
    return _adam(lr, b1, b2, eps, weight_decay, decay_mask, decoupled=True)


def _adam(
    lr: float | Schedule,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    decay_mask: DecayMask | None,
    decoupled: bool,
):
    schedule = _as_schedule(lr)
    _check(0 <= b1 < 1, "b1", "in [0, 1)", b1)
    _check(0 <= b2 < 1, "b2", "in [0, 1)", b2)
    _check(eps > 0, "eps", "> 0", eps)
    _check(weight_decay >= 0, "weight_decay", ">= 0", weight_decay)

    def init(params: Params) -> AdamState:
        mu = {k: torch.zeros_like(p) for k, p in params.items()}
        nu = {k: torch.zeros_like(p) for k, p in params.items()}
        return AdamState(count=0, lr=schedule(0), mu=mu, nu=nu)

    def update(
        grads: Grads, state: AdamState, params: Params | None = None, sum_across=None
    ) -> tuple[Updates, AdamState]:
        keys, g = aligned(grads, state.mu)
        p = _params_for(keys, params, "weight_decay") if weight_decay else None
        if weight_decay and not decoupled:
            g = _with_l2(g, keys, p, weight_decay, decays)
        # Same op sequence as torch.optim's, so the float32 results agree to the last bits.
        # In-place ops only ever touch tensors allocated here: fewer allocations, still pure.
        mu = foreach.lerp([state.mu[k] for k in keys], g, 1.0 - b1)
        nu = foreach.mul([state.nu[k] for k in keys], b2)
        foreach.addcmul_(nu, g, g, value=1.0 - b2)
        lr_now, count = schedule(state.count), state.count + 1
        denom = foreach.sqrt(nu)
        foreach.div_(denom, (1.0 - b2**count) ** 0.5)
        foreach.add_(denom, eps)
        updates = foreach.mul(mu, -lr_now / (1.0 - b1**count))
        foreach.div_(updates, denom)
        if weight_decay and decoupled:
            shrunk = [part for i, k in enumerate(keys) for part in _split(decays(k, p[i]), (updates[i], p[i]))[0]]
            if shrunk:
                foreach.add_([u for u, _ in shrunk], [q for _, q in shrunk], alpha=-lr_now * weight_decay)
        new_state = AdamState(count=count, lr=lr_now, mu=dict(zip(keys, mu)), nu=dict(zip(keys, nu)))
        return dict(zip(keys, updates)), new_state

    def update_inplace(grads: Grads, state: AdamState, params: Params, sum_across=None) -> AdamState:
        keys, g = _subset(grads, params)
        lr_now, count = schedule(state.count), state.count + 1
        # The kernel reads the step count (for the bias corrections) from a tensor per param.
        new_state = AdamState(count=count, lr=lr_now, mu=state.mu, nu=state.nu)
        if not keys:
            return new_state
        # Filled on the device: a tensor made from a Python number is a host copy, which waits for the GPU.
        step = torch.full((), float(count), device=g[0].device)
        fused = fused_adamw_ if decoupled else fused_adam_
        rows = [(params[k], g[i], state.mu[k], state.nu[k]) for i, k in enumerate(keys)]
        for group, decay in _groups(keys, rows, weight_decay, decays):  # torch.optim's param groups
            columns = [list(column) for column in zip(*group)]
            fused(
                *columns,
                [],
                [step] * len(group),
                lr=lr_now,
                beta1=b1,
                beta2=b2,
                weight_decay=decay,
                eps=eps,
                amsgrad=False,
                maximize=False,
            )
        return new_state

    decays = _decays(decay_mask)

    def with_decay_mask(to_slices):
        return _adam(lr, b1, b2, eps, weight_decay, to_slices(decay_mask), decoupled)

    return _transformation(init, update, update_inplace, decay_mask, with_decay_mask)


# ------------------------------------------------------------------------------ helpers


def _subset(grads: Grads, params: Params) -> tuple[list[str], list[torch.Tensor]]:
    """Keys and values of ``grads``, which may name any subset of ``params``."""
    unknown = grads.keys() - params.keys()
    if unknown:
        raise ValueError(f"grads for parameters the optimizer does not have: {sorted(unknown)[:5]}")
    return list(grads), list(grads.values())


def _transformation(init, update, update_inplace, decay_mask, with_decay_mask) -> GradientTransformation:
    """An elementwise optimizer; with a ``decay_mask``, one that steps ZeRO's slices by the rule made for them."""
    named = decay_mask is not None
    return GradientTransformation(
        init,
        update,
        update_inplace,
        elementwise=True,
        by_name=named,
        with_decay_mask=with_decay_mask if named else None,
    )


def _decays(decay_mask: DecayMask | None) -> DecayMask:
    """``decay_mask`` with its answer kept per name (asked once per param, not every step); all when ``None``.

    An answer is ``True``, ``False`` or, for a flat slice, its ``DecayRuns``.
    """
    if decay_mask is None:
        return lambda name, param: True
    answers: dict[str, bool | DecayRuns] = {}

    def decays(name: str, param: torch.Tensor) -> bool | DecayRuns:
        if name not in answers:
            answer = decay_mask(name, param)
            answers[name] = tuple(answer) if isinstance(answer, (tuple, list)) else bool(answer)
        return answers[name]

    return decays


def _split(answer: bool | DecayRuns, tensors: tuple[torch.Tensor, ...]) -> tuple[list[tuple], list[tuple]]:
    """``tensors`` (a param and what lines up with it: its gradient, update or state) split by a rule's ``answer``
    into the parts that decay and the parts that do not: the tensors themselves, or views of the runs.

    >>> decayed, exempt = _split(((1, 3),), (torch.arange(5.0),))
    >>> [t.tolist() for (t,) in decayed], [t.tolist() for (t,) in exempt]
    ([[1.0, 2.0]], [[0.0], [3.0, 4.0]])
    """
    if isinstance(answer, bool):
        return ([tensors], []) if answer else ([], [tensors])
    sizes, decaying = _segments(answer, tensors[0].numel())
    pieces = [(t if t.dim() == 1 else t.view(-1)).split(sizes) for t in tensors]  # one call a tensor, any runs
    decayed, exempt = [], []
    for i, decays in enumerate(decaying):
        (decayed if decays else exempt).append(tuple(piece[i] for piece in pieces))
    return decayed, exempt


@functools.lru_cache(maxsize=1024)
def _segments(runs: DecayRuns, numel: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """The lengths of a flat tensor's consecutive segments under ``runs``, and whether each decays."""
    sizes, decaying, at = [], [], 0
    for start, stop in runs:
        if start > at:
            sizes.append(start - at)
            decaying.append(False)
        sizes.append(stop - start)
        decaying.append(True)
        at = stop
    if at < numel:
        sizes.append(numel - at)
        decaying.append(False)
    return tuple(sizes), tuple(decaying)


def _with_l2(
    grads: list[torch.Tensor], keys: list[str], params: list[torch.Tensor], weight_decay: float, decays: DecayMask
) -> list[torch.Tensor]:
    """``grads`` with ``weight_decay * param`` added where ``decays`` says the param decays (new tensors there)."""
    out, whole, parts = list(grads), [], []
    for i, k in enumerate(keys):
        answer = decays(k, params[i])
        if answer is True:
            whole.append(i)
        elif answer:  # runs of a slice: a copy of its gradient, decayed in place where the runs are
            out[i] = grads[i].clone()
            parts += _split(answer, (out[i], params[i]))[0]
    if whole:
        added = foreach.add([grads[i] for i in whole], [params[i] for i in whole], alpha=weight_decay)
        for i, tensor in zip(whole, added):
            out[i] = tensor
    if parts:
        foreach.add_([g for g, _ in parts], [p for _, p in parts], alpha=weight_decay)
    return out


def _groups(keys: list[str], rows: list[tuple], weight_decay: float, decays: DecayMask) -> list[tuple[list, float]]:
    """The rows (each param with its gradient and state, ``rows[i][0]`` the param of ``keys[i]``) split as
    ``torch.optim`` param groups would be: ``(rows, weight_decay)`` pairs, the decayed ones and the others
    (``weight_decay`` 0), a slice's runs as views, leaving out an empty group."""
    decayed, exempt = [], []
    for k, row in zip(keys, rows):
        yes, no = _split(decays(k, row[0]) if weight_decay else True, row)
        decayed += yes
        exempt += no
    return [(group, decay) for group, decay in ((decayed, weight_decay), (exempt, 0.0)) if group]


def _params_for(keys: list[str], params: Params | None, why: str) -> list[torch.Tensor]:
    if params is None:
        raise ValueError(f"params=None: expected the params, which update needs when {why} != 0")
    return [params[k] for k in keys]
