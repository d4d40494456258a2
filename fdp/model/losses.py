"""Training losses from config: a function ``(outputs, targets) -> scalar``, and what evaluation reports.

``loss=cross_entropy`` (the default) and ``loss=mse`` name the functions below;
``loss=causal_lm`` and ``loss=masked_lm`` name ``TokenCrossEntropy`` for language models
with padded data; ``loss=custom loss._target_=my_pkg.losses.f`` names the user's own, and
further keys (``+loss.label_smoothing=0.1``) are bound as its keyword arguments (a class,
such as ``torch.nn.CrossEntropyLoss``, is built with them). The built-in losses read the
scores out of what the model returns (``logits_of``: a tensor, a Hugging Face
``ModelOutput``, a dict or dataclass with ``logits``, or a tuple that starts with them).
The train step gets ``loss_fn(params, buffers, batch)`` from ``make_loss_fn``;
``evaluate`` reports the mean loss and, where outputs are class scores for integer
targets, the accuracy.

>>> criterion = build_loss({"name": "mse", "_target_": "fdp.model.losses.mse"})
>>> criterion(torch.ones(2, 3), torch.zeros(2, 3))
tensor(1.)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fdp._torch import tree_map
from fdp.comm import Comm
from fdp.data.batches import model_inputs
from fdp.errors import ConfigError
from fdp.model.functional import Buffers, FunctionalModel, Params
from fdp.model.precision import Precision
from fdp.targets import label, locate

__all__ = [
    "TokenCrossEntropy",
    "TokenWeightedLoss",
    "UnreadableOutput",
    "Weighted",
    "batch_metrics",
    "build_loss",
    "cross_entropy",
    "cross_entropy_loss",
    "eval_metrics",
    "logits_of",
    "make_loss_fn",
    "scores_accuracy",
    "mse",
    "planner_loss",
    "weigh_micro_batches",
]

Criterion = Callable[[Any, Tensor], Tensor]
IGNORE_INDEX = -100  # torch's and Hugging Face's mark of a target that no loss counts (padding)


class UnreadableOutput(TypeError):
    """A model output that holds no scores fdp can find; the message names its type and the way out."""


def logits_of(outputs: Any) -> Tensor:
    """The scores in what a model returned: a tensor itself, the ``logits`` of a Hugging Face
    ``ModelOutput``, a dict or a dataclass, or the first element of a tuple.

    >>> logits_of(torch.zeros(2, 3)).shape
    torch.Size([2, 3])
    >>> logits_of({"logits": torch.zeros(2, 3), "hidden_states": None}).shape
    torch.Size([2, 3])
    >>> logits_of((torch.zeros(2, 3), torch.ones(1))).shape
    torch.Size([2, 3])
    >>> logits_of({"last_hidden_state": torch.zeros(2, 3)})  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
        ...
    fdp.model.losses.UnreadableOutput: the model returns a dict with no logits (entries: last_hidden_state);
    the built-in losses read a tensor of scores, a ModelOutput, dict or dataclass with logits,
    or a tuple whose first element is the logits:
    set loss._target_ to a function (outputs, targets) -> scalar that reads this output
    """
    if isinstance(outputs, Tensor):
        return outputs
    found, what = None, f"a {type(outputs).__name__}"
    if isinstance(outputs, Mapping):  # ModelOutput is a dict too
        found = outputs.get("logits")
        what += f" with no logits (entries: {', '.join(map(str, outputs)) or 'none'})"
    elif dataclasses.is_dataclass(outputs) and not isinstance(outputs, type):
        found = getattr(outputs, "logits", None)
        what += " with no logits field"
    elif isinstance(outputs, (tuple, list)) and outputs:
        found = outputs[0]
        what += f" whose first element is a {type(found).__name__}"
    if isinstance(found, Tensor):
        return found
    raise UnreadableOutput(
        f"the model returns {what}; the built-in losses read a tensor of scores, a ModelOutput, dict or dataclass "
        "with logits, or a tuple whose first element is the logits: set loss._target_ to a function "
        "(outputs, targets) -> scalar that reads this output"
    )


def cross_entropy(
    outputs: Any, targets: Tensor, label_smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Mean cross-entropy of class scores ``(..., classes)`` against integer targets ``(...)``.

    Sequences (a language model's ``(B, T, vocab)``) are scored per token; targets equal
    to ``ignore_index`` are left out of the mean (of this batch: ``TokenCrossEntropy``
    averages over the whole global batch).

    >>> cross_entropy(torch.zeros(4, 2), torch.tensor([0, 1, 0, 1]))
    tensor(0.6931)
    """
    logits = logits_of(outputs)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        label_smoothing=label_smoothing,
        ignore_index=ignore_index,
    )


def mse(outputs: Any, targets: Tensor) -> Tensor:
    """Mean squared error; outputs and targets must have the same shape (no silent broadcasting).

    >>> mse(torch.zeros(3, 1), torch.zeros(3))
    Traceback (most recent call last):
        ...
    ValueError: mse: outputs of shape (3, 1) and targets of shape (3,) differ; expected the same shape
    """
    outputs = logits_of(outputs)
    if outputs.shape != targets.shape:
        raise ValueError(
            f"mse: outputs of shape {tuple(outputs.shape)} and targets of shape {tuple(targets.shape)} differ; "
            "expected the same shape"
        )
    return F.mse_loss(outputs, targets.to(outputs.dtype))


class TokenCrossEntropy:
    """Cross-entropy averaged over every counted target of the step's global batch.

    The loss of ``loss=causal_lm`` and ``loss=masked_lm``.

    Targets equal to ``ignore_index`` (-100: what Hugging Face's collators put at padding)
    are not counted. With padding, batches differ in how many targets count: the train
    step (``weigh_micro_batches``) counts them over every micro-batch of every rank, so
    the gradient is that of the mean over all counted tokens, whatever the world size or
    ``accum_steps``. ``shift=1`` scores position ``t``'s logits against the target at
    ``t + 1``: a causal LM whose labels are its input ids (Hugging Face's convention).

    >>> loss = TokenCrossEntropy(shift=1)
    >>> labels = torch.tensor([[3, 1, 2, -100]])
    >>> int(loss.counted(labels)), tuple(loss.align(torch.zeros(1, 4, 5), labels)[1].shape)
    (2, (1, 3))
    >>> loss(torch.zeros(1, 4, 5), labels)
    tensor(1.6094)
    """

    def __init__(self, shift: int = 0, ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0):
        if shift < 0:
            raise ValueError(f"shift={shift}: expected an integer >= 0 (1 for a causal LM whose labels are its inputs)")
        self.shift, self.ignore_index, self.label_smoothing = shift, ignore_index, label_smoothing

    def __repr__(self) -> str:
        return (
            f"TokenCrossEntropy(shift={self.shift}, ignore_index={self.ignore_index}, "
            f"label_smoothing={self.label_smoothing})"
        )

    def align(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Scores and the targets they are scored against (``shift`` positions apart along dim 1)."""
        if not self.shift:
            return logits, targets
        if targets.dim() < 2:
            raise ValueError(
                f"shift={self.shift}: targets of shape {tuple(targets.shape)} have no sequence dimension; "
                "expected (batch, length)"
            )
        return logits[:, : -self.shift], targets[:, self.shift :]

    def counted(self, targets: Tensor) -> Tensor:
        """How many targets the loss averages over (an int64 scalar)."""
        targets = targets[:, self.shift :] if self.shift else targets
        return (targets != self.ignore_index).sum()

    def summed(self, outputs: Any, targets: Tensor) -> Tensor:
        """The sum of the counted targets' losses."""
        logits, targets = self.align(logits_of(outputs), targets)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction="sum",
        )

    def __call__(self, outputs: Any, targets: Tensor) -> Tensor:
        return self.summed(outputs, targets) / self.counted(targets).clamp_min(1)


def build_loss(node: Mapping) -> Criterion:
    """The function a ``loss`` config node names, its extra keys bound as keyword arguments (a class: built with them).

    >>> build_loss({"name": "custom", "_target_": "torch.nn.functional.l1_loss", "reduction": "sum"}).keywords
    {'reduction': 'sum'}
    >>> build_loss({"name": "custom", "_target_": "torch.nn.CrossEntropyLoss", "label_smoothing": 0.1})
    CrossEntropyLoss()
    >>> build_loss({"name": "custom", "_target_": "torch.nn.functional.l1_loss", "smoothing": 0.1})
    Traceback (most recent call last):
        ...
    fdp.errors.ConfigError: loss._target_='torch.nn.functional.l1_loss': got an unexpected keyword argument 'smoothing'
    """
    settings = {str(k): v for k, v in node.items() if k != "name"}
    if "_target_" not in settings:
        raise ConfigError("loss._target_: missing; expected a dotted path to a function (outputs, targets) -> scalar")
    fn = locate("loss._target_", settings.pop("_target_"))
    if inspect.isclass(fn):  # a loss object, such as torch.nn.CrossEntropyLoss: its settings are the constructor's
        try:
            return fn(**settings)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{label('loss', node)}: {str(error).strip().splitlines()[0]}") from None
    try:
        inspect.signature(fn).bind(None, None, **settings)
    except TypeError as error:
        raise ConfigError(f"{label('loss', node)}: {error}") from None
    except ValueError:  # no signature to check against (a builtin): the first batch will tell
        pass
    return functools.partial(fn, **settings) if settings else fn


class Weighted(NamedTuple):
    """A micro-batch and what its loss is averaged over: ``total`` counted targets in ``units`` micro-batches."""

    batch: Any
    total: Tensor  # int64 scalar: the counted targets of the step's global batch (every micro-batch of every rank)
    units: int  # micro-batches the step's gradient is the mean over (ranks x accumulation steps)


def weigh_micro_batches(loss_fn: Callable, micro_batches: list, comm: Comm) -> list:
    """``micro_batches`` as the step hands them to ``loss_fn``.

    Each is a ``Weighted`` one where ``loss_fn`` counts targets.

    A loss averaged over counted targets (``TokenCrossEntropy``) must divide by the count
    of the whole global batch, not of each micro-batch: with padding the counts differ,
    and a mean of means would depend on the world size. The counts are summed over this
    rank's micro-batches and all-reduced (one scalar), on the device, without stopping
    the host. Other losses get their micro-batches as they are.

    >>> from fdp.model.functional import functionalize
    >>> model, params, buffers = functionalize(torch.nn.Embedding(5, 5))
    >>> loss_fn = make_loss_fn(model, TokenCrossEntropy())
    >>> batches = [
    ...     (torch.tensor([[1, 2]]), torch.tensor([[1, -100]])),
    ...     (torch.tensor([[3, 4]]), torch.tensor([[3, 4]])),
    ... ]
    >>> [(int(w.total), w.units) for w in weigh_micro_batches(loss_fn, batches, Comm())]
    [(3, 2), (3, 2)]
    """
    if not isinstance(loss_fn, TokenWeightedLoss):
        return micro_batches
    total = torch.stack([loss_fn.counted(batch) for batch in micro_batches]).sum()
    if comm.world_size > 1:
        total = comm.allreduce(total).wait()
    units = comm.world_size * len(micro_batches)
    return [Weighted(batch, total, units) for batch in micro_batches]


def make_loss_fn(model: FunctionalModel, criterion: Criterion) -> Callable:
    """``loss_fn(params, buffers, batch) -> (loss, (new_buffers, metrics))`` for the train step.

    The batch is split by ``fdp.data.model_inputs``: a dict's entries but ``labels`` go to
    the model by name, ``labels`` to ``criterion``. A criterion that counts its targets
    (``counted``, ``summed``: ``TokenCrossEntropy``) gives a ``TokenWeightedLoss``, to
    which the step hands ``Weighted`` micro-batches (``weigh_micro_batches``).

    >>> from fdp.model.functional import functionalize
    >>> model, params, buffers = functionalize(torch.nn.Linear(3, 2))
    >>> loss, (new_buffers, _) = make_loss_fn(model, mse)(params, buffers, (torch.zeros(4, 3), torch.zeros(4, 2)))
    >>> loss.shape
    torch.Size([])
    """
    if _counts_targets(criterion):
        return TokenWeightedLoss(model, criterion)

    def loss_fn(params: Params, buffers: Buffers, batch):
        args, kwargs, targets = model_inputs(batch)
        outputs, new_buffers = model.apply(params, buffers, *args, **kwargs)
        return criterion(outputs, targets), (new_buffers, {})

    return loss_fn


def _counts_targets(criterion: Criterion) -> bool:
    """Whether ``criterion`` is a mean over the targets it counts (``counted`` and ``summed``)."""
    return callable(getattr(criterion, "counted", None)) and callable(getattr(criterion, "summed", None))


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed as itself, like a function
class TokenWeightedLoss:
    """The ``loss_fn`` of a criterion that counts its targets: a ``Weighted`` micro-batch's
    loss is its summed loss over the global batch's count, so the step's mean is over
    every counted target, however the batch is split; a plain batch gets the criterion's mean.
    """

    model: FunctionalModel
    criterion: Criterion

    def __call__(self, params: Params, buffers: Buffers, batch):
        weighted = isinstance(batch, Weighted)
        args, kwargs, targets = model_inputs(batch.batch if weighted else batch)
        outputs, new_buffers = self.model.apply(params, buffers, *args, **kwargs)
        if not weighted:
            return self.criterion(outputs, targets), (new_buffers, {})
        summed = self.criterion.summed(outputs, targets)
        # units / total in float64: exactly 1 / (count per micro-batch) when the counts are all equal.
        return summed * (batch.units / batch.total.clamp_min(1).double()).to(summed.dtype), (new_buffers, {})

    def counted(self, batch) -> Tensor:
        """The targets of ``batch`` its mean runs over (int64 scalar)."""
        return self.criterion.counted(model_inputs(batch)[2])


def cross_entropy_loss(model: FunctionalModel) -> Callable:
    """``loss_fn(params, buffers, batch) -> (loss, (new_buffers, metrics))`` for classifiers and LMs.

    Logits of any shape ``(..., classes)`` are scored against targets of shape ``(...)``.

    >>> from fdp.model.functional import functionalize
    >>> model, params, buffers = functionalize(torch.nn.Linear(3, 2))
    >>> batch = (torch.zeros(4, 3), torch.tensor([0, 1, 0, 1]))
    >>> loss, (new_buffers, metrics) = cross_entropy_loss(model)(params, buffers, batch)
    >>> loss.shape, metrics
    (torch.Size([]), {})
    """
    return make_loss_fn(model, cross_entropy)


def planner_loss(loss_fn: Callable, buffers: Buffers) -> Callable:
    """Adapt a train loss to the planner's ``loss(params, batch)`` signature (``fdp.plan_buckets``)."""
    return lambda params, batch: loss_fn(params, buffers, batch)[0]


def _scores_and_targets(criterion: Criterion, outputs: Any, targets: Tensor) -> tuple[Tensor, Tensor] | None:
    """Class scores ``(..., classes)`` and integer targets ``(...)`` scored against them, where accuracy applies."""
    try:
        scores = logits_of(outputs)
    except UnreadableOutput:
        return None
    align = getattr(criterion, "align", None)
    if align is not None:
        scores, targets = align(scores, targets)
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        return None
    if scores.dim() != targets.dim() + 1 or scores.shape[:-1] != targets.shape:
        return None
    return scores, targets


def scores_accuracy(criterion: Criterion, outputs: Any, targets: Any) -> bool:
    """Whether accuracy applies to ``outputs`` against ``targets`` (class scores for integer targets), as
    ``batch_metrics`` scores it; shapes and dtypes decide, so outputs on ``meta`` tell too.

    >>> scores_accuracy(cross_entropy, torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64))
    True
    >>> scores_accuracy(mse, torch.zeros(2, 1), torch.ones(2, 1))
    False
    """
    if not isinstance(targets, Tensor):
        return False
    try:
        return _scores_and_targets(criterion, outputs, targets) is not None
    except ValueError:  # a loss whose alignment refuses these (it said so on the first batch)
        return False


def batch_metrics(criterion: Criterion, outputs: Any, targets: Tensor) -> tuple[float, int, int, int]:
    """``(loss * weight, weight, correct, scored)`` of one evaluation batch.

    The weight is the number of target elements (those counted, for ``TokenCrossEntropy``),
    so batch means of any size combine into the mean over the whole split. ``correct`` /
    ``scored`` count argmax hits where accuracy applies (class scores ``(..., classes)``
    for integer targets ``(...)``; negative targets, padding, are not scored), else 0 / 0.

    >>> batch_metrics(cross_entropy, torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0]))[2:]
    (1, 2)
    >>> batch_metrics(mse, torch.zeros(2, 1), torch.ones(2, 1))
    (2.0, 2, 0, 0)
    """
    if _counts_targets(criterion):
        weight = int(criterion.counted(targets))
        loss = criterion.summed(outputs, targets).item()
    else:
        weight = targets.numel()
        loss = criterion(outputs, targets).item() * weight
    scored = _scores_and_targets(criterion, outputs, targets)
    if scored is None:
        return loss, weight, 0, 0
    scores, targets = scored
    valid = (targets >= 0) & (targets != getattr(criterion, "ignore_index", IGNORE_INDEX))
    hits = (scores.argmax(-1) == targets) & valid
    return loss, weight, int(hits.sum().item()), int(valid.sum().item())


def eval_metrics(
    model: FunctionalModel,
    criterion: Criterion,
    params: Params,
    buffers: Buffers,
    batch: Any,
    precision: Precision = Precision(),
    wrap: Callable[[Callable], Callable] | None = None,
) -> tuple[float, int, int, int]:
    """``batch_metrics`` of the model in eval mode on one batch (in ``precision``, scored in float32);
    ``wrap(model.apply)`` runs the model where given (ZeRO stage 3 gathers its params around it).

    >>> from fdp.model.functional import functionalize
    >>> model, params, buffers = functionalize(torch.nn.Linear(3, 2))
    >>> batch = (torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64))
    >>> eval_metrics(model, cross_entropy, params, buffers, batch)[1::2]
    (4, 4)
    """
    args, kwargs, targets = model_inputs(batch)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    with precision.autocast(device.type):
        apply = wrap(model.apply) if wrap is not None else model.apply
        outputs, _ = apply(params, buffers, *precision.cast(args), training=False, **precision.cast(kwargs))
    outputs = tree_map(lambda t: t.float() if isinstance(t, Tensor) and t.is_floating_point() else t, outputs)
    return batch_metrics(criterion, outputs, targets)
