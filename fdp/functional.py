"""Any ``nn.Module`` as pure functions of explicit parameter and buffer trees.

Params and buffers are flat dicts keyed by the names of ``named_parameters()`` /
``named_buffers()``. Tied parameters appear once (under their first name), frozen
parameters (``requires_grad=False``) are kept as constants of the model and never enter
the gradient tree.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from torch.func import functional_call

from fdp._torch import release_storage

Params = dict[str, torch.Tensor]
Buffers = dict[str, torch.Tensor]


class FunctionalModel(NamedTuple):
    """A module and its constants; ``apply`` is the pure forward."""

    module: nn.Module
    frozen: Params

    def apply(self, params: Params, buffers: Buffers, *inputs: Any, training: bool = True) -> tuple[Any, Buffers]:
        """Run the forward on ``params``/``buffers``; return ``(outputs, new_buffers)``.

        ``training=False`` runs the module in eval mode (BatchNorm uses its running
        statistics, dropout is off).

        Buffers a module updates in place (BatchNorm running statistics) are updated on
        fresh copies that come back as ``new_buffers``; the caller's tensors are untouched.

        >>> model, params, buffers = functionalize(nn.BatchNorm1d(3))
        >>> out, new_buffers = model.apply(params, buffers, torch.randn(4, 3))
        >>> bool((new_buffers["running_mean"] != buffers["running_mean"]).any())
        True
        """
        new_buffers = {name: b.clone() for name, b in buffers.items()}
        self.module.train(training)
        outputs = functional_call(self.module, (params, new_buffers, self.frozen), inputs, tie_weights=True, strict=False)
        return outputs, new_buffers


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
