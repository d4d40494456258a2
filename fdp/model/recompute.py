"""Activation checkpointing under ``torch.func``: chosen modules keep only their inputs, and run again in backward.

A checkpointed module's forward runs without recording its graph; what backward needs
of it is made again, from its inputs, when backward reaches it. The activations inside
the module (attention scores, the MLP's wide hidden layer, dropout masks) are then alive
only while that one module's backward runs, instead of from the forward to the end of
backward: a transformer's step keeps one tensor per block instead of a dozen.

``torch.utils.checkpoint`` does not work inside ``torch.func``'s transforms (its
reentrant form is an ``autograd.Function`` without ``setup_context``; the other uses
saved-tensor hooks, which ``torch.func.vjp`` refuses). Here a module's call is one
``autograd.Function`` of the new style, which ``torch.func`` transforms: its inputs are
the module's own tensors (params and buffers, as the transform's wrappers hand them in)
and the tensors of its arguments; it saves only those, and its backward runs the module
again under ``torch.func.vjp``. The forward runs under ``vjp`` too (its pullback dropped at
once), so both pick the same kernels.

The recomputed forward is the forward, bit for bit: it draws the same random numbers
(the generators' states, CPU and CUDA, are taken before the forward and restored for
the recomputation, and a forward on per-sample streams, ``fdp.model.streams``, replays its
samples' streams from the same op number), runs under the same autocast, and reads the
module's buffers as they were (BatchNorm statistics are updated once, by the forward).
At ZeRO stage 3 the recomputation gathers the module's buckets again (``recomputing()``
tells ``fdp.update.zero.gather``), which is the gather backward makes anyway when params are
released after forward: checkpointing adds compute, not communication.

The modules a run checkpoints are chosen in ``fdp.model.remat``.

* ``checkpointed(loss_fn, modules)``: ``loss_fn`` whose calls checkpoint ``modules``.
* ``recomputing()``: whether a checkpointed module's forward is running again, in backward.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.func import vjp

from fdp._torch import swap_back, swap_into, tensor_slots, tree_flatten, tree_unflatten
from fdp.model import streams

__all__ = ["checkpointed", "recomputing"]

_recomputing = 0  # > 0 while a checkpointed module's forward runs again in backward


def recomputing() -> bool:
    """Whether a checkpointed module's forward is running again, in backward (its hooks fire a second time).

    >>> recomputing()
    False
    """
    return _recomputing > 0


def checkpointed(loss_fn: Callable, modules: Iterable[nn.Module]) -> Callable:
    """``loss_fn`` whose calls run each of ``modules`` checkpointed: its activations are recomputed in backward.

    The modules are changed only during the call (their ``forward`` is wrapped and put
    back after), so evaluation and any other use of the model run it as it is. Where no
    gradient is being recorded (``torch.no_grad``), a module runs as it is.

    >>> lin = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    >>> loss = checkpointed(lambda p, x: torch.func.functional_call(lin, p, (x,)).sum(), [lin[0]])
    >>> p, x = dict(lin.named_parameters()), torch.randn(2, 3)
    >>> g = torch.func.grad(loss)(p, x)
    >>> plain = torch.func.grad(lambda p, x: torch.func.functional_call(lin, p, (x,)).sum())(p, x)
    >>> torch.equal(g["0.weight"], plain["0.weight"])
    True
    """
    modules = list(modules)

    def run(*args, **kwargs):
        installed = []
        try:
            for m in modules:
                own = m.__dict__.get("forward")
                inner = own if own is not None else type(m).forward.__get__(m)
                m.forward = _recomputing_forward(m, inner)
                installed.append((m, own))
            return loss_fn(*args, **kwargs)
        finally:
            for m, own in installed:
                if own is None:
                    del m.forward
                else:
                    m.forward = own

    return run


def _recomputing_forward(module: nn.Module, forward: Callable) -> Callable:
    names = [n for named in (module.named_parameters, module.named_buffers) for n, _ in named(remove_duplicate=False)]
    slots = tensor_slots(module, names)
    buffer_names = [n for n, _ in module.named_buffers(remove_duplicate=False)]

    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled() or slots is None:
            return forward(*args, **kwargs)
        held = {name: owner[key] for name, (owner, key) in slots.items()}
        # Each distinct tensor enters once (ties inside the module), as the Function's input.
        order: dict[int, int] = {}
        own: list[torch.Tensor] = []
        for tensor in held.values():
            if id(tensor) not in order:
                order[id(tensor)] = len(own)
                own.append(tensor)
        where = {name: order[id(tensor)] for name, tensor in held.items()}
        # Buffers enter as copies (what backward runs on again); the forward updates the module's own in place.
        live = {where[name]: held[name] for name in buffer_names}
        for i, tensor in live.items():
            own[i] = tensor.detach().clone()
        leaves, spec = tree_flatten((args, kwargs))
        places = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        inputs = [*own, *(leaves[i] for i in places)]
        # What the transform differentiates (params, activations; not buffers, integer inputs).
        wanted = [i for i, t in enumerate(inputs) if t.requires_grad and t.is_floating_point() and i not in live]
        if not wanted:
            return forward(*args, **kwargs)
        call = _Call(forward, slots, where, live, len(own), leaves, places, spec, wanted)
        outputs = _Recompute.apply(call, *inputs)
        return call.rebuild(outputs)

    return checkpointed_forward


class _Call:
    """One call of a checkpointed module: how to run it on a list of tensors, and what it must replay."""

    def __init__(self, forward, slots, where, live, n_own, leaves, places, spec, wanted):
        self.wanted = wanted  # the inputs that get gradients
        self.forward, self.slots, self.where, self.live, self.buffers = forward, slots, where, live, set(live)
        self.n_own, self.leaves, self.places, self.spec = n_own, list(leaves), places, spec
        for i in places:
            self.leaves[i] = None  # the tensors come back as the Function's saved inputs
        self.devices = sorted(
            {
                t.device.index or 0
                for t in tree_flatten(leaves)[0]
                if isinstance(t, torch.Tensor) and t.device.type == "cuda"
            }
        )
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.stream = streams.position()
        device = "cuda" if self.devices else "cpu"
        self.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        self.out_spec = None
        self.out_places: list[int] = []
        self.out_leaves: list[Any] = []

    def run(self, tensors: tuple, live: bool = False) -> tuple:
        """The module's forward on ``tensors`` (its own, then its arguments'), its tensor outputs as a tuple.

        ``live``: on the module's own buffers (the forward), not the copies that entered.
        """
        own, given = list(tensors[: self.n_own]), tensors[self.n_own :]
        if live:
            for i, tensor in self.live.items():
                own[i] = tensor
        leaves = list(self.leaves)
        for i, tensor in zip(self.places, given):
            leaves[i] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        taken = swap_into(self.slots, {name: own[i] for name, i in self.where.items()})
        try:
            out = self.forward(*args, **kwargs)
        finally:
            swap_back(taken)
        out_leaves, self.out_spec = tree_flatten(out)
        self.out_places = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, torch.Tensor)]
        self.out_leaves = [None if i in self.out_places else leaf for i, leaf in enumerate(out_leaves)]
        return tuple(out_leaves[i] for i in self.out_places)

    def rebuild(self, outputs: tuple) -> Any:
        leaves = list(self.out_leaves)
        for i, tensor in zip(self.out_places, outputs):
            leaves[i] = tensor
        return tree_unflatten(leaves, self.out_spec)

    @contextlib.contextmanager
    def replayed(self):
        """The forward's random state, stream position and autocast, while the forward runs again."""
        global _recomputing
        device, enabled, dtype = self.autocast
        with (
            torch.random.fork_rng(devices=self.devices),
            streams.replaying(self.stream),
            torch.autocast(device, dtype=dtype, enabled=enabled),
        ):
            torch.set_rng_state(self.cpu_rng)
            for d, state in zip(self.devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, d)
            _recomputing += 1
            try:
                yield
            finally:
                _recomputing -= 1

    def traced(self, tensors: tuple, live: bool = False) -> tuple[tuple, Callable]:
        """The module's outputs on ``tensors`` and their pullback to the inputs that need gradients (``wanted``).

        The forward and its recomputation both run this way, under ``vjp``, so that they
        pick the same kernels: some (attention with dropout in bf16) take another path
        where no gradient is recorded, and would then give other numbers than the
        recomputation differentiates.
        """
        wanted = self.wanted

        def forward(*chosen):
            # Buffers run on copies, made inside the transform (which refuses to mutate a tensor from outside):
            # a forward that updates them in place (BatchNorm) did so once already.
            given = [t.clone() if i in self.buffers else t for i, t in enumerate(tensors)]
            for i, tensor in zip(wanted, chosen):
                given[i] = tensor
            return self.run(tuple(given), live)

        with torch.enable_grad():
            return vjp(forward, *[tensors[i] for i in wanted])

    def gradients(self, saved: tuple, grad_outputs: tuple) -> tuple:
        """The gradients of the saved inputs (``None`` for those that need none), the forward run again."""
        with self.replayed():
            _, pullback = self.traced(saved)
        grads = pullback(tuple(grad_outputs))
        out: list[Any] = [None] * len(saved)
        for i, grad in zip(self.wanted, grads):
            out[i] = grad
        return tuple(out)


class _Recompute(torch.autograd.Function):
    """A checkpointed module's call: saves its inputs only; backward runs the forward again under ``vjp``."""

    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple:
        out, _ = call.traced(tensors, live=True)  # the pullback is dropped: what it saved goes with it
        call.live = {}  # the module's buffers are not needed again
        return tuple(t.detach() for t in out)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Any) -> None:
        call, *tensors = inputs
        ctx.call = call
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor) -> tuple:
        return (None, *ctx.call.gradients(ctx.saved_tensors, grad_outputs))
