"""The first-batch check: a model, data and loss that do not fit are refused before step 1, in one line.

``check_first_batch`` runs the model and the loss once on the first micro-batch (no
gradients, the RNG left as it was) and names what does not fit: a forward or a loss
that raises (whatever the exception), an output the loss cannot read, a loss that is not
a scalar, class scores that do not cover the labels or the data's declared classes, or
token targets that the loss aligns differently from the data (``check_alignment``): a loss
that shifts (``loss=causal_lm``) on targets already shifted (``data=stdlib_text``) would
learn the token two ahead, and a loss that does not shift on labels equal to the input
ids would learn to copy its input, both silently.

>>> from fdp.model.functional import functionalize
>>> from fdp.model.losses import cross_entropy
>>> model, params, buffers = functionalize(torch.nn.Linear(3, 1000))
>>> batch = (torch.zeros(4, 3), torch.tensor([0, 1, 2, 9]))
>>> names = Names(classes_setting="+model.num_classes")
>>> check_first_batch(model, cross_entropy, params, buffers, batch, names, 10)  # doctest: +NORMALIZE_WHITESPACE
Traceback (most recent call last):
    ...
fdp.errors.ConfigError: model does not fit data with loss: the model outputs 1000 class scores but data has 10 classes;
expected +model.num_classes=10
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fdp.data.batches import describe, model_inputs
from fdp.errors import ConfigError
from fdp.model.functional import Buffers, FunctionalModel, Params
from fdp.model.losses import IGNORE_INDEX, Criterion, TokenCrossEntropy, UnreadableOutput, cross_entropy, logits_of

__all__ = ["Names", "check_alignment", "check_first_batch", "untransformable"]


class Names(NamedTuple):
    """How messages name the model, the data, the loss, and the setting that sets the model's classes."""

    model: str = "model"
    data: str = "data"
    loss: str = "loss"
    classes_setting: str = "+model.num_classes"


def _reason(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    usual = isinstance(error, (RuntimeError, ValueError, TypeError, IndexError))
    return text if usual and text else f"{type(error).__name__}: {text}" if text else type(error).__name__


def check_first_batch(
    model: FunctionalModel,
    criterion: Criterion,
    params: Params,
    buffers: Buffers,
    batch: Any,
    names: Names = Names(),
    declared_classes: int | None = None,
    targets_shifted: bool | None = None,
) -> Any:
    """Run ``model`` and ``criterion`` on ``batch``; a ``ConfigError`` of one line if they do not fit it.

    ``declared_classes`` is what the data says its classes are, ``targets_shifted`` whether
    it says its targets are the next tokens already (``None``: it does not say). Returns the
    model's outputs (what the run's evaluations will score: ``fdp.model.losses.scores_accuracy``).
    """
    fits = f"{names.model} does not fit {names.data} with {names.loss}"
    try:
        args, kwargs, targets = model_inputs(batch)
    except ValueError as error:
        raise ConfigError(f"{names.data}: {error}") from None
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            with warnings.catch_warnings():  # a probe without gradients: what the forward warns, the step warns again
                warnings.simplefilter("ignore")
                outputs, _ = model.apply(params, buffers, *args, **kwargs)
        except Exception as error:  # anything the user's forward raises: one line, not a traceback
            raise ConfigError(f"{fits}: {_reason(error)} (first batch: {describe(batch)})") from None
        _check_classes(criterion, outputs, targets, names, declared_classes)
        try:
            loss = criterion(outputs, targets)
        except UnreadableOutput as error:
            raise ConfigError(f"{names.loss}: {error}") from None
        except Exception as error:
            if not isinstance(outputs, Tensor):  # a structured output (a ModelOutput) that the loss does not read
                try:
                    logits_of(outputs)
                    way_out = (
                        "a loss that reads it (outputs.logits), or a built-in one (loss=cross_entropy reads the logits)"
                    )
                except UnreadableOutput:
                    way_out = (
                        "a loss that reads it (loss._target_=my_pkg.losses.f, a function (outputs, targets) -> scalar)"
                    )
                raise ConfigError(
                    f"{names.loss} cannot read what the model returns, a {type(outputs).__name__}: "
                    f"{_reason(error)}; expected {way_out}"
                ) from None
            raise ConfigError(f"{fits}: {_reason(error)} (first batch: {describe(batch)})") from None
    if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        got = f"shape {tuple(loss.shape)} {loss.dtype}" if isinstance(loss, Tensor) else type(loss).__name__
        raise ConfigError(f"{names.loss}: returned {got}; expected a floating-point scalar")
    # Last: a model and loss that run may still disagree with the data on which token each position predicts.
    check_alignment(criterion, _token_ids(args, kwargs), targets, names, targets_shifted)
    return outputs


def _scores_classes(criterion: Criterion) -> bool:
    """Whether ``criterion`` takes class scores ``(..., C)`` for labels in ``0 .. C-1`` (a cross-entropy)."""
    fn = criterion.func if isinstance(criterion, functools.partial) else criterion
    return fn in (cross_entropy, F.cross_entropy, F.nll_loss) or isinstance(
        fn, (TokenCrossEntropy, nn.CrossEntropyLoss, nn.NLLLoss)
    )


def _check_classes(criterion: Criterion, outputs: Any, targets: Any, names: Names, declared: int | None) -> None:
    """Class scores ``(..., C)`` for integer targets: every label below C, and C the data's classes where it says.

    Only for the cross-entropies: a loss of one's own may read integer targets otherwise
    (embeddings against class ids), and says itself what does not fit.
    """
    if not _scores_classes(criterion):
        return
    try:
        scores = logits_of(outputs)
    except UnreadableOutput:
        return
    if not isinstance(targets, Tensor):
        return
    align = getattr(criterion, "align", None)
    if align is not None:
        try:
            scores, targets = align(scores, targets)
        except ValueError:
            return  # the loss itself will say
    integer = not (targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool)
    if not integer or scores.dim() != targets.dim() + 1 or scores.shape[:-1] != targets.shape:
        return
    classes = scores.shape[-1]
    labels = targets[(targets >= 0) & (targets != getattr(criterion, "ignore_index", IGNORE_INDEX))]
    largest = int(labels.max()) if labels.numel() else -1
    needed = max(largest + 1, declared or 0)
    if largest >= classes:
        raise ConfigError(
            f"{names.model} does not fit {names.data} with {names.loss}: "
            f"the first batch has label {largest} but the model outputs {classes} class scores; "
            f"expected {names.classes_setting}={needed}"
        )
    if declared is not None and classes != declared:
        raise ConfigError(
            f"{names.model} does not fit {names.data} with {names.loss}: the model outputs {classes} class scores but "
            f"{names.data} has {declared} classes; expected {names.classes_setting}={declared}"
        )


# -- how the loss and the data align targets with positions --------------------------------
def _shift_of(criterion: Criterion) -> int:
    """How many positions ahead ``criterion`` scores each position (``TokenCrossEntropy.shift``; 0 otherwise)."""
    fn = criterion.func if isinstance(criterion, functools.partial) else criterion
    shift = getattr(fn, "shift", 0)
    return shift if isinstance(shift, int) else 0


def _token_ids(args: tuple, kwargs: dict) -> Tensor | None:
    """The model's token ids: ``input_ids`` by name, else its first input."""
    first = kwargs.get("input_ids", args[0] if args else next(iter(kwargs.values()), None))
    return first if isinstance(first, Tensor) else None


def _same_tokens(a: Tensor, b: Tensor, counted: Tensor) -> bool:
    """``a`` equals ``b`` at every counted position (and at least one is counted)."""
    return bool(counted.any()) and bool((a == b)[counted].all())


def check_alignment(
    criterion: Criterion, inputs: Tensor | None, targets: Any, names: Names = Names(), shifted: bool | None = None
) -> None:
    """Refuse a loss and data that disagree on which token each position predicts, in one line.

    ``shifted`` is what the data says (targets are its inputs shifted by one already);
    where it does not say (``None``), the batch tells: token-id inputs ``(B, T)`` and integer
    targets of that shape that equal the inputs one position on, or the inputs themselves.

    >>> ids = torch.tensor([[5, 1, 4, 2, 3]])
    >>> names = Names(data="data=text", loss="loss=causal_lm")
    >>> check_alignment(TokenCrossEntropy(shift=1), ids[:, :-1], ids[:, 1:], names)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
        ...
    fdp.errors.ConfigError: loss=causal_lm scores position t against the target at t + 1,
    but data=text's targets are already the next tokens (its inputs shifted by one):
    the model would learn the token 2 ahead; expected loss=cross_entropy, or data whose targets are its input ids
    """
    shift = _shift_of(criterion)
    tokens = (
        isinstance(inputs, Tensor)
        and isinstance(targets, Tensor)
        and inputs.dim() == 2
        and inputs.shape == targets.shape
        and inputs.shape[1] > 1
        and not inputs.is_floating_point()
        and not targets.is_floating_point()
    )
    counted = (targets != getattr(criterion, "ignore_index", IGNORE_INDEX)) & (targets >= 0) if tokens else None
    if shift and shifted is not True and tokens:
        # Inputs that repeat one token are their own shift: only a batch that tells the two apart says so.
        shifted = shifted or (
            _same_tokens(targets[:, :-1], inputs[:, 1:], counted[:, :-1]) and not _same_tokens(targets, inputs, counted)
        )
    if shift and shifted:
        raise ConfigError(
            f"{names.loss} scores position t against the target at t + {shift}, but {names.data}'s targets are already "
            f"the next tokens (its inputs shifted by one): the model would learn the token {shift + 1} ahead; "
            "expected loss=cross_entropy, or data whose targets are its input ids"
        )
    copies = tokens and shifted is not True and _same_tokens(targets, inputs, counted)
    if not shift and copies and _scores_classes(criterion):
        raise ConfigError(
            f"{names.data}'s targets are its input ids, but {names.loss} scores each position against its own token: "
            "the model would learn to copy its input; expected loss=causal_lm (position t against the token at t + 1)"
        )


# -- what torch.func's gradients cannot run ----------------------------------------------------
# torch.func raises these (RuntimeError) when a forward uses what its transforms do not support.
_SAVED_TENSOR_HOOKS = "don't yet support saved tensor hooks"
_OLD_STYLE_FUNCTION = "must override the setup_context staticmethod"


def _raised_under(error: BaseException, suffix: str) -> bool:
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(suffix):
            return True
        tb = tb.tb_next
    return False


def untransformable(error: BaseException, model: str = "model") -> ConfigError | None:
    """The one-line refusal for a forward that torch.func's gradients cannot run (``None``: not such an error).

    fdp takes gradients with ``torch.func.grad``: ``torch.utils.checkpoint`` inside a model
    (either form), saved-tensor hooks and ``autograd.Function``s without ``setup_context``
    fail there with a long traceback; this names what to use instead.

    >>> error = RuntimeError("torch.func.{grad, vjp} don't yet support saved tensor hooks.")
    >>> print(untransformable(error, "model=mlp"))  # doctest: +NORMALIZE_WHITESPACE
    model=mlp: its forward uses saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, save_on_cpu),
    which fdp's torch.func gradients do not run; expected a forward without them
    """
    text = str(error)
    if not isinstance(error, RuntimeError) or not (_SAVED_TENSOR_HOOKS in text or _OLD_STYLE_FUNCTION in text):
        return None
    if _raised_under(error, "torch/utils/checkpoint.py"):
        return ConfigError(
            f"{model}: its forward calls torch.utils.checkpoint, which fdp's torch.func gradients "
            "do not run; expected a forward without it, and trainer.activation_checkpointing=blocks to recompute "
            "activations instead"
        )
    if _SAVED_TENSOR_HOOKS in text:
        return ConfigError(
            f"{model}: its forward uses saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, "
            "save_on_cpu), which fdp's torch.func gradients do not run; expected a forward without them"
        )
    return ConfigError(
        f"{model}: its forward calls a torch.autograd.Function without setup_context, which fdp's "
        "torch.func gradients do not run; expected one that overrides setup_context "
        "(https://pytorch.org/docs/stable/notes/extending.func.html)"
    )
