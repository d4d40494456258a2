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


def functionalize(module: nn.Module) -> tuple[FunctionalModel, Params, Buffers]:
    """Split ``module`` into a ``FunctionalModel``, its trainable params and its buffers.

    The returned tensors are detached copies: training them never touches ``module``.

    >>> model, params, buffers = functionalize(nn.Linear(2, 3))
    >>> sorted(params)
    ['bias', 'weight']
    """
    params, frozen = {}, {}
    for name, p in module.named_parameters():  # remove_duplicate=True: tied weights once
        (params if p.requires_grad else frozen)[name] = p.detach().clone()
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    return FunctionalModel(module, frozen), params, buffers
