"""Numeric precision of a run, and dynamic loss scaling as a value in the train state.

``trainer.precision`` takes Lightning's names:

* ``32-true``: float32 throughout (the default).
* ``bf16-mixed``: the forward (and so its backward) runs under ``torch.autocast`` to
  bfloat16 inside the ``torch.func`` transform; params stay float32 masters, so their
  gradients, the bucket buffers and the optimizer state are float32 (a hook such as
  ``bf16`` may still compress on the wire).
* ``16-mixed``: the same with float16, whose narrow range needs a loss scale: the loss
  is multiplied by ``LossScale.scale`` before differentiation, each bucket is unscaled
  once its reduction is done (at ZeRO stages 2 and 3, each rank's slice of it), and the
  step's one finiteness check (taken after the reduction, and agreed across ranks where
  each holds its slices) skips the update on every rank on overflow.
* ``bf16-true``: params, floating buffers and floating inputs in bfloat16, and with them
  gradients, buckets and optimizer state.

Under ``bf16-mixed`` two more things follow torch FSDP2's ``MixedPrecisionPolicy``:
ZeRO stage 3 all-gathers the params in bfloat16 (``gather_dtype``: each rank casts its
float32 master slice before the gather, so half the bytes and half the gathered buffers;
the forward reads bfloat16 params, which autocast's own casts leave as they are), and
``reduce_dtype`` (``float32``, the default, or ``bfloat16``) is the dtype the gradients are
averaged in, at every stage (``reducing``).

The scale follows ``torch.amp.GradScaler``'s defaults: 2**16 to start, halved on a step
with a non-finite gradient, doubled after 2000 finite steps in a row.

>>> p = Precision("16-mixed")
>>> p.autocast_dtype, p.loss_scaling
(torch.float16, True)
>>> scale = init_loss_scale()
>>> update_loss_scale(scale, finite=False, growth_interval=2000).scale.item()
32768.0
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, NamedTuple

import torch

from fdp._torch import tree_map
from fdp.errors import check_choice
from fdp.hooks import Hook, hook_name
from fdp.hooks.compress import reduced_in

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MATMUL_PRECISIONS = ("highest", "high", "medium")

INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


class LossScale(NamedTuple):
    """The dynamic loss scale: ``scale`` (float32, 0-d) and ``growth_tracker`` (int32, 0-d),
    the finite steps since the scale last changed. Both stay on the device: updating them
    needs no host synchronisation beyond the step's own finiteness check."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor


def init_loss_scale(init_scale: float = INIT_SCALE, device: torch.device | str = "cpu") -> LossScale:
    """The scale before step 1.

    >>> init_loss_scale(8.0)
    LossScale(scale=tensor(8.), growth_tracker=tensor(0, dtype=torch.int32))
    """
    return LossScale(
        torch.tensor(float(init_scale), dtype=torch.float32, device=device),
        torch.zeros((), dtype=torch.int32, device=device),
    )


def update_loss_scale(loss_scale: LossScale, finite: bool, growth_interval: int = GROWTH_INTERVAL) -> LossScale:
    """The scale for the next step, after a step whose reduced gradients were ``finite`` or not.

    The same rule as ``torch.amp.GradScaler.update``: back off on overflow; otherwise
    count, and grow once ``growth_interval`` finite steps have passed (unless growing
    would overflow float32).

    >>> s = init_loss_scale(4.0)
    >>> s = update_loss_scale(s, True, growth_interval=2)
    >>> s.scale.item(), s.growth_tracker.item()
    (4.0, 1)
    >>> s = update_loss_scale(s, True, growth_interval=2)
    >>> s.scale.item(), s.growth_tracker.item()
    (8.0, 0)
    """
    scale, tracker = loss_scale
    if not finite:
        return LossScale(scale * BACKOFF_FACTOR, torch.zeros_like(tracker))
    counted = tracker + 1
    grown = scale * GROWTH_FACTOR
    grow = (counted >= growth_interval) & torch.isfinite(grown)
    return LossScale(
        torch.where(grow, grown, scale), torch.where(counted >= growth_interval, 0, counted).to(tracker.dtype)
    )


def inverse_scale(loss_scale: LossScale) -> torch.Tensor:
    # GradScaler's reciprocal: taken in double, then rounded once to float32.
    return loss_scale.scale.double().reciprocal().float()


class Precision(NamedTuple):
    """One of ``PRECISIONS`` and the loss-scale settings of ``16-mixed``.

    ``wrap(loss_fn)`` is the loss the step differentiates; ``cast(tree)`` puts params,
    buffers or a batch in the run's storage dtype.

    >>> Precision("bf16-true").cast({"w": torch.ones(2), "i": torch.ones(2, dtype=torch.long)})["w"].dtype
    torch.bfloat16
    """

    name: str = "32-true"
    init_scale: float = INIT_SCALE
    growth_interval: int = GROWTH_INTERVAL
    reduce_dtype: str = "float32"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.name)

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bf16-true" else torch.float32

    @property
    def gather_dtype(self) -> torch.dtype | None:
        """The dtype ZeRO stage 3 gathers params in: bfloat16 under ``bf16-mixed``; ``None``: the params' own."""
        return torch.bfloat16 if self.name == "bf16-mixed" else None

    def reducing(self, hook: Hook) -> Hook:
        """``hook`` averaging in ``reduce_dtype`` (its state unchanged); ``ValueError`` if the pair is refused.

        >>> from fdp.hooks import allreduce, hook_name
        >>> hook_name(Precision("bf16-mixed", reduce_dtype="bfloat16").reducing(allreduce()))
        'reduced_in.allreduce'
        """
        if check_reduce_dtype(self.reduce_dtype, self.name, hook) == "float32":
            return hook
        return reduced_in(REDUCE_DTYPES[self.reduce_dtype], hook)

    @property
    def loss_scaling(self) -> bool:
        return self.name == "16-mixed"

    def cast(self, tree: Any) -> Any:
        """Floating tensors of ``tree`` in the storage dtype (``bf16-true``); else ``tree`` itself."""
        if self.param_dtype == torch.float32:
            return tree
        return tree_map(lambda t: t.to(self.param_dtype) if _floating(t) else t, tree)

    def init_loss_scale(self, device: torch.device | str = "cpu") -> LossScale | None:
        """The ``TrainState.loss_scale`` to start from: a ``LossScale`` for ``16-mixed``, else ``None``."""
        return init_loss_scale(self.init_scale, device) if self.loss_scaling else None

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """``torch.autocast`` for the mixed precisions; a no-op context otherwise."""
        dtype = self.autocast_dtype
        return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def wrap(self, loss_fn: Callable) -> Callable:
        """The loss the step differentiates, in this precision.

        Mixed: ``loss_fn`` runs under autocast and its loss comes back float32. With loss
        scaling the batch argument is ``(batch, scale)`` and the loss is multiplied by
        ``scale`` (the step passes ``TrainState.loss_scale.scale``: as data, so a compiled
        step does not recompile when it changes). ``bf16-true``: floating inputs are cast.

        >>> from fdp import functionalize, cross_entropy_loss
        >>> model, params, buffers = functionalize(torch.nn.Linear(3, 2))
        >>> loss_fn = Precision("16-mixed").wrap(cross_entropy_loss(model))
        >>> batch = (torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
        >>> plain, _ = cross_entropy_loss(model)(params, buffers, batch)
        >>> scaled, _ = loss_fn(params, buffers, (batch, torch.tensor(1024.0)))
        >>> bool(torch.allclose(scaled / 1024, plain, atol=1e-2))
        True
        """
        if self.name == "32-true":
            return loss_fn
        if self.name == "bf16-true":
            return lambda params, buffers, batch: loss_fn(params, buffers, self.cast(batch))
        scaling = self.loss_scaling

        def mixed(params, buffers, batch):
            if scaling:
                batch, scale = batch
            with self.autocast(_device_type(params)):
                loss, aux = loss_fn(params, buffers, batch)
            loss = loss.float()
            return (loss * scale if scaling else loss), aux

        return mixed


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _device_type(params: dict) -> str:
    first = next(iter(params.values()), None)
    return first.device.type if first is not None else "cpu"


def scaled_micro_batches(micro_batches: list, loss_scale: LossScale | None) -> list:
    """Each micro-batch paired with the scale, as ``Precision.wrap`` takes it under loss scaling."""
    if loss_scale is None:
        return micro_batches
    return [(batch, loss_scale.scale) for batch in micro_batches]


def unscale(buffer: torch.Tensor, loss_scale: LossScale | None, owned: bool) -> torch.Tensor:
    """A reduced bucket divided by the loss scale (in place where the step owns the buffer).

    >>> unscale(torch.tensor([4.0, float("inf")]), init_loss_scale(4.0), owned=False).tolist()
    [1.0, inf]
    """
    if loss_scale is None:
        return buffer
    inv = inverse_scale(loss_scale)
    return buffer.mul_(inv) if owned else buffer * inv


def unscaled_loss(loss: torch.Tensor, loss_scale: LossScale | None) -> torch.Tensor:
    """The loss as the model computed it, for logging (the scale is a power of two: exact)."""
    return loss if loss_scale is None else loss / loss_scale.scale


# -- settings --------------------------------------------------------------------------------
def check_reduce_dtype(reduce_dtype: str, precision: str = "bf16-mixed", hook: Hook | None = None) -> str:
    """``reduce_dtype``: ``float32`` (any precision) or ``bfloat16`` (``bf16-mixed`` averaging with ``allreduce``).

    With ``32-true`` a bfloat16 average is the ``bf16`` hook's job, and under ``16-mixed`` and
    ``bf16-true`` the gradients are already 16-bit. ``reduce_dtype`` is the dtype the gradient
    is averaged in (FSDP2's); a hook other than ``allreduce`` averages no gradient: PowerSGD
    sums low-rank factors of it and orthonormalises them, top-k gathers each rank's largest
    entries, the low-bit codes send integers of ``hooks.format``. What those send is the
    hook's own format, not a dtype of the average.

    >>> check_reduce_dtype("bfloat16", "32-true")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: reduce_dtype='bfloat16': expected float32 with precision=32-true (bfloat16 is for bf16-mixed; ...)
    >>> from fdp.hooks import topk
    >>> check_reduce_dtype("bfloat16", "bf16-mixed", topk())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: reduce_dtype='bfloat16': expected float32 with hooks 'topk', which average no gradient in a dtype: ...
    """
    check_choice("reduce_dtype", reduce_dtype, tuple(REDUCE_DTYPES))
    if reduce_dtype == "float32":
        return reduce_dtype
    if precision != "bf16-mixed":
        raise ValueError(
            f"reduce_dtype={reduce_dtype!r}: expected float32 with precision={precision} (bfloat16 is for "
            "bf16-mixed; hooks=bf16 averages float32 gradients in bfloat16)"
        )
    if hook is not None and hook_name(hook) != "allreduce":
        raise ValueError(
            f"reduce_dtype={reduce_dtype!r}: expected float32 with hooks {hook_name(hook)!r}, which average no "
            "gradient in a dtype: they send a payload of their own format (low-rank factors, selected entries, "
            "low-bit codes); bfloat16 averages with hooks=allreduce"
        )
    return reduce_dtype


def check_precision(precision: str, device: str = "cpu", reduce_dtype: str = "float32") -> Precision:
    """The ``Precision`` for ``precision``; ``ValueError`` naming it if unknown or unsupported on ``device``.

    >>> check_precision("bf16-mixed").autocast_dtype
    torch.bfloat16
    >>> check_precision("fp8")
    Traceback (most recent call last):
    ...
    ValueError: precision='fp8': expected 32-true, bf16-mixed, 16-mixed or bf16-true
    """
    check_choice("precision", precision, PRECISIONS)
    value = Precision(precision, reduce_dtype=check_reduce_dtype(reduce_dtype, precision))
    dtype = value.autocast_dtype
    if dtype is not None and not autocast_supported(device, dtype):
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"precision={precision!r}: this torch cannot autocast to {name} on {device}; expected 32-true or bf16-mixed"
        )
    return value


def autocast_supported(device: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device, dtype)`` really casts (torch warns and disables it where not)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.autocast(device, dtype=dtype):
                return torch.is_autocast_enabled(device)
    except (RuntimeError, UserWarning, TypeError):
        return False


def check_matmul_precision(matmul_precision: str) -> str:
    """One of ``highest`` (float32 matmuls), ``high`` (TF32 or bf16x3), ``medium`` (bf16).

    >>> check_matmul_precision("high")
    'high'
    """
    return check_choice("matmul_precision", matmul_precision, MATMUL_PRECISIONS)


def set_matmul_precision(matmul_precision: str) -> None:
    """Set ``torch.set_float32_matmul_precision`` for this process (a process-wide setting)."""
    torch.set_float32_matmul_precision(check_matmul_precision(matmul_precision))


# -- bf16 on a CPU ---------------------------------------------------------------------------
_NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 (AVX512-BF16, AMX) and Arm (FEAT_BF16)


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 instructions (``/proc/cpuinfo``'s flags; ``False`` where it cannot tell).

    >>> cpu_has_native_bf16("flags : fpu sse avx2"), cpu_has_native_bf16("flags : avx512f avx512_bf16")
    (False, True)
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    words = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            words.update(value.split())
    return bool(words & _NATIVE_BF16_FLAGS)


def slow_precision_note(
    precision: str, accelerator: str, gpus: int | None = None, native: bool | None = None
) -> str | None:
    """A start-up warning for bf16 on the CPU, where it is much slower than float32 (``None``: nothing to say).

    ``accelerator`` is ``world.accelerator``; with ``auto`` the run is on the CPU when no
    GPU is visible (``gpus``, counted here when not given).

    >>> slow_precision_note("32-true", "cpu") is None, slow_precision_note("bf16-mixed", "gpu") is None
    (True, True)
    >>> slow_precision_note("bf16-true", "cpu", native=False)[:60]
    'fdp: trainer.precision=bf16-true on a CPU without native bf1'
    """
    if "bf16" not in precision or accelerator == "gpu":
        return None
    if accelerator == "auto":
        visible = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if gpus is None else gpus
        if visible > 0:
            return None
    native = cpu_has_native_bf16() if native is None else native
    if not native:
        return (
            f"fdp: trainer.precision={precision} on a CPU without native bf16 (no AVX512-BF16, AMX or Arm BF16): "
            "every bf16 op is emulated and a step is many times slower than 32-true (charlm: ~18x); "
            "use trainer.precision=32-true here"
        )
    return (
        f"fdp: trainer.precision={precision} on the CPU: even with native bf16 matmuls a step is slower than 32-true "
        "(charlm on AVX512-BF16: 4.7x bf16-mixed, 12x bf16-true; the ops around the matmuls are not bf16-fast); "
        "bf16 pays on GPUs"
    )
