"""Training losses from config: a function ``(outputs, targets) -> scalar``, and what evaluation reports.

``loss=cross_entropy`` (the default) and ``loss=mse`` name the functions below;
``loss=custom loss._target_=my_pkg.losses.f`` names the user's own, and further keys
(``+loss.label_smoothing=0.1``) are bound as its keyword arguments. The train step gets
``loss_fn(params, buffers, batch)`` from ``make_loss_fn``; ``evaluate`` reports the mean
loss and, where outputs are class scores for integer targets, the accuracy.

>>> criterion = build_loss({"name": "mse", "_target_": "fdp.losses.mse"})
>>> criterion(torch.ones(2, 3), torch.zeros(2, 3))
tensor(1.)
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fdp.errors import ConfigError
from fdp.functional import Buffers, FunctionalModel, Params
from fdp.targets import label, locate

__all__ = ["batch_metrics", "build_loss", "cross_entropy", "cross_entropy_loss", "make_loss_fn", "mse", "planner_loss"]

Criterion = Callable[[Any, Tensor], Tensor]


def cross_entropy(outputs: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean cross-entropy of class scores ``(..., classes)`` against integer targets ``(...)``.

    Sequences (a language model's ``(B, T, vocab)``) are scored per token.

    >>> cross_entropy(torch.zeros(4, 2), torch.tensor([0, 1, 0, 1]))
    tensor(0.6931)
    """
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1), label_smoothing=label_smoothing)


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    """Mean squared error; outputs and targets must have the same shape (no silent broadcasting).

    >>> mse(torch.zeros(3, 1), torch.zeros(3))
    Traceback (most recent call last):
        ...
    ValueError: mse: outputs of shape (3, 1) and targets of shape (3,) differ; expected the same shape
    """
    if outputs.shape != targets.shape:
        raise ValueError(
            f"mse: outputs of shape {tuple(outputs.shape)} and targets of shape {tuple(targets.shape)} differ; "
            "expected the same shape"
        )
    return F.mse_loss(outputs, targets.to(outputs.dtype))


def build_loss(node: Mapping) -> Criterion:
    """The function a ``loss`` config node names, its extra keys bound as keyword arguments.

    >>> build_loss({"name": "custom", "_target_": "torch.nn.functional.l1_loss", "reduction": "sum"}).keywords
    {'reduction': 'sum'}
    >>> build_loss({"name": "custom", "_target_": "torch.nn.functional.l1_loss", "smoothing": 0.1})
    Traceback (most recent call last):
        ...
    fdp.errors.ConfigError: loss._target_='torch.nn.functional.l1_loss': got an unexpected keyword argument 'smoothing'
    """
    settings = {str(k): v for k, v in node.items() if k != "name"}
    if "_target_" not in settings:
        raise ConfigError("loss._target_: missing; expected a dotted path to a function (outputs, targets) -> scalar")
    fn = locate("loss._target_", settings.pop("_target_"))
    try:
        inspect.signature(fn).bind(None, None, **settings)
    except TypeError as error:
        raise ConfigError(f"{label('loss', node)}: {error}") from None
    except ValueError:  # no signature to check against (a builtin): the first batch will tell
        pass
    return functools.partial(fn, **settings) if settings else fn


def make_loss_fn(model: FunctionalModel, criterion: Criterion) -> Callable:
    """``loss_fn(params, buffers, batch) -> (loss, (new_buffers, metrics))`` for the train step.

    >>> from fdp.functional import functionalize
    >>> model, params, buffers = functionalize(torch.nn.Linear(3, 2))
    >>> loss, (new_buffers, _) = make_loss_fn(model, mse)(params, buffers, (torch.zeros(4, 3), torch.zeros(4, 2)))
    >>> loss.shape
    torch.Size([])
    """

    def loss_fn(params: Params, buffers: Buffers, batch):
        inputs, targets = batch
        outputs, new_buffers = model.apply(params, buffers, inputs)
        return criterion(outputs, targets), (new_buffers, {})

    return loss_fn


def cross_entropy_loss(model: FunctionalModel) -> Callable:
    """``loss_fn(params, buffers, batch) -> (loss, (new_buffers, metrics))`` for classifiers and LMs.

    Logits of any shape ``(..., classes)`` are scored against targets of shape ``(...)``.

    >>> from fdp.functional import functionalize
    >>> model, params, buffers = functionalize(torch.nn.Linear(3, 2))
    >>> loss, (new_buffers, metrics) = cross_entropy_loss(model)(params, buffers, (torch.zeros(4, 3), torch.tensor([0, 1, 0, 1])))
    >>> loss.shape, metrics
    (torch.Size([]), {})
    """
    return make_loss_fn(model, cross_entropy)


def planner_loss(loss_fn: Callable, buffers: Buffers) -> Callable:
    """Adapt a train loss to the planner's ``loss(params, batch)`` signature (``fdp.plan_buckets``)."""
    return lambda params, batch: loss_fn(params, buffers, batch)[0]


def batch_metrics(criterion: Criterion, outputs: Any, targets: Tensor) -> tuple[float, int, int, int]:
    """``(loss * weight, weight, correct, scored)`` of one evaluation batch.

    The weight is the number of target elements, so batch means of any size combine
    into the mean over the whole split. ``correct`` / ``scored`` count argmax hits where
    accuracy applies (outputs ``(..., classes)`` for integer targets ``(...)``), else 0 / 0.

    >>> batch_metrics(cross_entropy, torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0]))[2:]
    (1, 2)
    >>> batch_metrics(mse, torch.zeros(2, 1), torch.ones(2, 1))
    (2.0, 2, 0, 0)
    """
    weight = targets.numel()
    loss = criterion(outputs, targets).item() * weight
    classes = (
        isinstance(outputs, Tensor)
        and not targets.is_floating_point()
        and not targets.is_complex()
        and outputs.dim() == targets.dim() + 1
        and outputs.shape[:-1] == targets.shape
    )
    if not classes:
        return loss, weight, 0, 0
    return loss, weight, int((outputs.argmax(-1) == targets).sum().item()), weight
