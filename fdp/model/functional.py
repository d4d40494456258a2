"""Any ``nn.Module`` as pure functions of explicit parameter and buffer trees.

Params and buffers are flat dicts keyed by the names of ``named_parameters()`` /
``named_buffers()``. Tied parameters appear once (under their first name), frozen
parameters (``requires_grad=False``) are kept as constants of the model and never enter
the gradient tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call, vjp

from fdp._torch import (
    release_storage,
    storage_alias,
    swap_back,
    swap_into,
    tensor_slots,
    tree_flatten,
    tree_map,
    tree_unflatten,
)

Params = dict[str, torch.Tensor]
Buffers = dict[str, torch.Tensor]


@dataclass(frozen=True)
class FunctionalModel:
    """A module and its constants; ``apply`` is the pure forward.

    ``ties`` pairs each further name of a tied tensor with the name it is kept under.
    It, the list of submodules and where each parameter and buffer is held are found
    once here: searching the module for them on every call cost ~1 ms of host time per
    step on a 100-tensor transformer, and resolving the names again on every call as
    ``functional_call`` does, ~0.2 ms more.
    """

    module: nn.Module
    frozen: Params
    ties: tuple[tuple[str, str], ...] = field(init=False, repr=False)
    _submodules: tuple[nn.Module, ...] = field(init=False, repr=False, compare=False)
    _slots: dict | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "ties", _ties(self.module))
        object.__setattr__(self, "_submodules", tuple(self.module.modules()))
        names = [
            n
            for named in (self.module.named_parameters, self.module.named_buffers)
            for n, _ in named(remove_duplicate=False)
        ]
        object.__setattr__(self, "_slots", tensor_slots(self.module, names))

    def apply(
        self, params: Params, buffers: Buffers, *inputs: Any, training: bool = True, **named_inputs: Any
    ) -> tuple[Any, Buffers]:
        """Run the forward on ``params``/``buffers``; return ``(outputs, new_buffers)``.

        ``inputs`` go to the module's ``forward`` by position and ``named_inputs`` by name
        (``model.apply(params, buffers, input_ids=ids, attention_mask=mask)``).
        ``training=False`` runs the module in eval mode (BatchNorm uses its running
        statistics, dropout is off).

        Buffers a module updates in place (BatchNorm running statistics) are updated on
        fresh copies that come back as ``new_buffers``; the caller's tensors are untouched.

        >>> model, params, buffers = functionalize(nn.BatchNorm1d(3))
        >>> out, new_buffers = model.apply(params, buffers, torch.randn(4, 3))
        >>> bool((new_buffers["running_mean"] != buffers["running_mean"]).any())
        True
        >>> model, params, buffers = functionalize(nn.Bilinear(2, 3, 1))
        >>> model.apply(params, buffers, input1=torch.ones(4, 2), input2=torch.ones(4, 3))[0].shape
        torch.Size([4, 1])
        """
        new_buffers = {name: b.clone() for name, b in buffers.items()}
        if any(m.training != training for m in self._submodules):
            self.module.train(training)
        tensors = {**params, **new_buffers, **self.frozen}
        for alias, name in self.ties:
            if name in tensors:
                tensors[alias] = tensors[name]
        return self._call(tensors, inputs, named_inputs), new_buffers

    def _call(self, tensors: dict[str, torch.Tensor], inputs: tuple, named_inputs: dict) -> Any:
        # The module's own tensors are swapped for ``tensors`` and back, as functional_call
        # does, through the places found once; a name it does not know takes torch's path.
        slots = self._slots
        if slots is None or not tensors.keys() <= slots.keys():
            return functional_call(self.module, tensors, inputs, named_inputs or None, tie_weights=False, strict=False)
        taken = swap_into(slots, tensors)
        try:
            return self.module(*inputs, **named_inputs)
        finally:
            swap_back(taken)


def grad_and_value(fn: Callable) -> Callable:
    """``torch.func.grad_and_value(fn, has_aux=True)``, computed through ``torch.func.vjp``.

    ``run(primal, *rest) -> (grads, (value, aux))`` differentiates ``fn(primal, *rest)
    -> (value, aux)`` with respect to ``primal`` (a tensor or a tree of them) alone; the
    other arguments enter as they are. The numbers are ``grad_and_value``'s, bit for
    bit. The host time is not: ``grad_and_value`` runs the backward inside its
    transform, where every backward op passes through the transform's wrappers and
    records a graph of its own (``create_graph=True``, for transforms stacked on top).
    The function ``vjp`` returns runs the backward once the transform is left, on plain
    tensors and without that graph: on a 100-tensor transformer of tiny widths (so the
    time is the host's) a step's gradient took ~0.8 ms less, about what the backward
    costs in eager PyTorch.

    >>> w = torch.tensor([1.0, 2.0])
    >>> grads, (value, aux) = grad_and_value(lambda w, x: ((w * x).sum(), x.max()))(w, torch.tensor([3.0, 4.0]))
    >>> grads.tolist(), value.item(), aux.item()
    ([3.0, 4.0], 11.0, 4.0)
    """

    def run(primal: Any, *rest: Any) -> tuple[Any, tuple[torch.Tensor, Any]]:
        value, backward, aux = vjp(lambda p: fn(p, *rest), primal, has_aux=True)
        with torch.no_grad():
            (grads,) = backward(torch.ones_like(value), retain_graph=False)
        return grads, (value, aux)

    return run


def autograd_grad_and_value(fn: Callable) -> Callable:
    """``grad_and_value``'s ``run(primal, *rest) -> (grads, (value, aux))`` by plain autograd, outside ``torch.func``.

    The primal's tensors enter as fresh leaves on their storage, each with a version
    counter of its own (ZeRO stage 3 releases a param's memory after the forward and
    gathers the same values into it again for backward, writes autograd would otherwise
    take for a change), and ``fn`` runs on them with autograd recording; a tensor no path reaches gets a zero
    gradient, as under ``torch.func``. Code compiled by ``torch.compile`` runs inside it:
    an eager ``torch.func`` transform refuses a compiled call, which is how ZeRO stage 3
    compiles the model's blocks between its gathers (``fdp.step.compiled.compiled_regions``).

    >>> w = torch.tensor([1.0, 2.0])
    >>> run = autograd_grad_and_value(lambda w, x: ((w * x).sum(), x.max()))
    >>> grads, (value, aux) = run(w, torch.tensor([3.0, 4.0]))
    >>> grads.tolist(), value.item(), aux.item(), w.requires_grad
    ([3.0, 4.0], 11.0, 4.0, False)
    """

    def run(primal: Any, *rest: Any) -> tuple[Any, tuple[torch.Tensor, Any]]:
        leaves, spec = tree_flatten(primal)
        leaves = [storage_alias(t, 0, tuple(t.shape), t.stride()).requires_grad_() for t in leaves]
        with torch.enable_grad():
            value, aux = fn(tree_unflatten(leaves, spec), *rest)
        grads = torch.autograd.grad(value, leaves, allow_unused=True, materialize_grads=True)
        detached = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux)
        return tree_unflatten(list(grads), spec), (value.detach(), detached)

    return run


def functionalize(module: nn.Module, keep_module_weights: bool = True) -> tuple[FunctionalModel, Params, Buffers]:
    """Split ``module`` into a ``FunctionalModel``, its trainable params and its buffers.

    The returned tensors are detached copies: training them never touches ``module``.
    ``apply`` always runs on the params it is given, so a caller that owns ``module``
    and uses it only through the ``FunctionalModel`` can pass
    ``keep_module_weights=False``: the module's own trainable tensors are then emptied
    (its ``Parameter`` objects stay, so weight ties still resolve), which saves a copy of
    the model's weights.

    >>> model, params, buffers = functionalize(nn.Linear(2, 3))
    >>> sorted(params)
    ['bias', 'weight']
    >>> model, params, _ = functionalize(nn.Linear(2, 3), keep_module_weights=False)
    >>> model.module.weight.numel(), params["weight"].shape
    (0, torch.Size([3, 2]))
    """
    params, frozen = {}, {}
    for name, p in module.named_parameters():  # remove_duplicate=True: tied weights once
        (params if p.requires_grad else frozen)[name] = p.detach().clone()
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    if not keep_module_weights:
        for p in module.parameters():
            if p.requires_grad:
                release_storage(p)
    return FunctionalModel(module, frozen), params, buffers


def _ties(module: nn.Module) -> tuple[tuple[str, str], ...]:
    # (alias, first name) for every tensor the module reaches under more than one name.
    ties = []
    for named in (module.named_parameters, module.named_buffers):
        first: dict[int, str] = {}
        for name, tensor in named(remove_duplicate=False):
            kept = first.setdefault(id(tensor), name)
            if kept != name:
                ties.append((name, kept))
    return tuple(ties)
