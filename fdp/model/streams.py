"""Each sample's own random stream: dropout masks that do not depend on the rank that computes the sample.

With one generator per rank, a sample's dropout mask depends on which rank and which
micro-batch it lands in: the same run on one process and on two trains other numbers,
and a world that loses a rank mid-run (``world.on_rank_loss=shrink``) could not go on
as the uninterrupted run would have. Here every random op of the forward whose first
dimension is the batch (dropout, attention dropout, ``rand_like``, ``bernoulli``, ...)
draws sample ``j``'s values from a counter-based stream keyed by the seed, the step, the
sample's index in the global batch and the op's number in the forward, as JAX splits a
key per sample: the values are the same whatever the world size, the micro-batch or the
device (integer arithmetic on the device, no generator state).

* ``SampleStreams(seed)``: made once per train step function; ``begin(step, first, sizes)``
  before each step names the micro-batches' first global indices, and ``wrap(loss_fn)``
  runs each forward under a dispatch mode that replaces those ops (backward runs
  without it). A model whose first forward draws nothing runs without the mode after
  it, so only models with randomness pay its host cost (a Python call per op of the
  forward).
* The train step enters the same draws as a function mode (``fdp.model.streams_functions``),
  a Python call per random function rather than per op: ``by_function`` in an eager step,
  which keeps the dispatch mode where its first forward draws out of a function mode's
  sight (a draw inside an ``autograd.Function`` under ``torch.func``: activation
  checkpointing's modules), and ``traced`` in a step compiled whole, which dynamo inlines.
* A forward run beside the step's (ZeRO stage 3's recording forward, ``fdp.update.zero.gather``)
  runs inside ``rehearsal()``: it draws the micro-batch's streams without taking its keys from
  the queue, so the step's own forward draws what it would have drawn without it.
* Random ops whose first dimension is not the batch (``randperm``, a noise tensor of a
  fixed shape), ops given an explicit ``generator`` and ops the mode does not know
  (``randint``, ``multinomial``, ``exponential_``) still draw from the step's generator
  (``TrainState.rng``, each rank's own): their values still depend on the rank.

>>> streams = SampleStreams(seed=0)
>>> keys = streams.keys(step=1, first=4, count=2)
>>> torch.equal(keys[1:], streams.keys(step=1, first=5, count=1))  # sample 5's key, whichever batch holds it
True
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable

import torch

from fdp._torch import TorchDispatchMode

__all__ = [
    "SampleStreams",
    "uniform",
    "RANDOM_OPS",
    "check_sample_streams",
    "wants_sample_streams",
    "compile_refusal",
    "position",
    "rehearsal",
    "replaying",
]

SETTINGS = ("auto", True, False)
# Where a compiled step on per-sample streams would run compiled code inside an eager forward, whose streams are
# the dispatch mode at first and for the draws a function mode cannot see (fdp.model.streams_functions.by_function),
# under which dynamo runs every function eagerly: the traced streams serve a step compiled whole only
# (tests/model/test_streams.py).
_EAGER_FORWARD = {
    "zero_stage=3": "ZeRO stage 3 compiles each block between eager gathers",
    "activation_checkpointing": "activation checkpointing replays a module's draws from the streams' position, and "
    "under torch.func its modules draw out of a function mode's sight",
}


def compile_refusal(zero_stage: int, checkpointing: bool) -> str | None:
    """Why ``trainer.compile`` cannot compile a step on per-sample streams, or ``None`` where it does.

    >>> compile_refusal(0, False) is None, compile_refusal(3, False).startswith("ZeRO stage 3 compiles each block")
    (True, True)
    """
    reason = _EAGER_FORWARD["zero_stage=3"] if zero_stage == 3 else None
    reason = _EAGER_FORWARD["activation_checkpointing"] if checkpointing else reason
    if reason is None:
        return None
    return (
        f"{reason}, and an eager forward's streams run under a dispatch mode at first and for draws out of a function "
        "mode's sight, where torch.compile runs the code uncompiled (traced streams serve a step compiled whole only)"
    )


_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # the multiplier of a 32-bit integer hash (< 2**27: products stay inside int64)
_SAMPLE = 0x9E3779B9  # odd steps that spread consecutive counters over the 32-bit range
_ELEMENT = 0x85EBCA6B
_OP = 0xC2B2AE35


def _mix(x: Any) -> Any:
    """A 32-bit integer hash of ``x`` (a Python int or an int64 tensor of values in [0, 2**32)).

    >>> _mix(0), _mix(1) != _mix(2)
    (0, True)
    """
    x = ((x ^ (x >> 16)) * _MUL) & _M32
    x = ((x ^ (x >> 16)) * _MUL) & _M32
    return x ^ (x >> 16)


def _bits(keys: torch.Tensor, count: int, stride: int = 1, start: int = 0) -> torch.Tensor:
    """``(len(keys), count)`` hashed 32-bit words.

    Row ``j`` is the stream of ``keys[j]`` at counters ``start + i * stride``.
    """
    counters = torch.arange(start, start + count * stride, stride, dtype=torch.int64, device=keys.device)
    x = (counters.mul_(_ELEMENT) + keys[:, None]).bitwise_and_(_M32)
    for _ in range(2):
        x = x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def _mantissa_bits(dtype: torch.dtype) -> int:
    """Bits of a uniform draw that ``dtype`` holds exactly below 1 (so a draw never rounds up to 1)."""
    return {torch.float64: 53, torch.float16: 11, torch.bfloat16: 8}.get(dtype, 24)


def uniform(keys: torch.Tensor, shape: tuple, dtype: torch.dtype = torch.float32, start: int = 0) -> torch.Tensor:
    """Values in [0, 1) of shape ``(len(keys), *shape)``: row ``j`` from the stream of ``keys[j]``.

    >>> u = uniform(torch.tensor([7, 8]), (3,))
    >>> u.shape, bool(((u >= 0) & (u < 1)).all()), torch.equal(u[1], uniform(torch.tensor([8]), (3,))[0])
    (torch.Size([2, 3]), True, True)
    """
    n = 1
    for size in shape:
        n *= size
    bits = _mantissa_bits(dtype)
    if bits > 32:  # two words per value
        words = _bits(keys, n, stride=2, start=2 * start)
        low = _bits(keys, n, stride=2, start=2 * start + 1)
        value = ((words >> 11) * 2**21 + (low >> 11)).to(torch.float64) * 2.0**-53
    else:
        value = (_bits(keys, n, start=start) >> (32 - bits)).to(torch.float32) * 2.0**-bits
    return value.to(dtype).view(len(keys), *shape)


def _below(keys: torch.Tensor, shape: tuple, dtype: torch.dtype, p: float) -> torch.Tensor:
    """``uniform(keys, shape, dtype) < p`` (a bool mask), compared in integers where ``dtype`` is float32.

    A float32 draw is ``k * 2**-24`` for the integer ``k = bits >> 8`` and ``p`` is rounded to float32 in the
    comparison, so ``draw < p`` is ``bits < 256 * ceil(p * 2**24)``: three fewer passes over the mask.

    >>> keys, p = torch.tensor([3, 4]), 0.9
    >>> torch.equal(_below(keys, (50,), torch.float32, p), uniform(keys, (50,)) < p)
    True
    """
    if _mantissa_bits(dtype) != 24:
        return uniform(keys, shape, dtype) < p
    n = 1
    for size in shape:
        n *= size
    return (_bits(keys, n) < _threshold(p)).view(len(keys), *shape)


@functools.lru_cache(maxsize=64)
def _threshold(p: float) -> int:
    """The 32-bit words ``k`` whose float32 draw is below ``p`` are those ``k < _threshold(p)``."""
    return math.ceil(torch.tensor(p, dtype=torch.float32).item() * 2**24) << 8


def _normal(keys: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values (Box-Muller over two uniform streams of each key)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    n = 1
    for size in shape:
        n *= size
    u1 = 1.0 - uniform(keys, (n,), work, start=0)  # (0, 1]: the log is finite
    u2 = uniform(keys, (n,), work, start=n)
    value = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * torch.pi * u2)
    return value.to(dtype).view(len(keys), *shape)


aten = torch.ops.aten
# The random ops replaced, and how each one's values are made from a uniform or normal draw.
RANDOM_OPS = {
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.bernoulli_.float,
    aten.bernoulli_.Tensor,
    aten.native_dropout.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.uniform_.default,
    aten.normal_.default,
    aten.rand.default,
    aten.randn.default,
}
# Random ops (by name, every overload) left to the generator; counted, so the ops after them keep their numbers.
_OTHER_RANDOM = {
    aten.randint,
    aten.randint_like,
    aten.randperm,
    aten.multinomial,
    aten.exponential_,
    aten.random_,
    aten.cauchy_,
    aten.log_normal_,
    aten.geometric_,
    aten.poisson,
}


# The same sets by the ids of their overloads (every one of ``_OTHER_RANDOM``'s): the mode looks up every op of the
# forward, and an id is hashed in C where an op is hashed by a Python ``__hash__``.
_REPLACED_IDS = frozenset(id(op) for op in RANDOM_OPS)
_COUNTED_IDS = (
    frozenset(id(getattr(packet, name)) for packet in _OTHER_RANDOM for name in packet.overloads()) - _REPLACED_IDS
)

_ACTIVE: list["_PerSample"] = []  # the forwards running on per-sample streams, innermost last


class _PerSample(TorchDispatchMode):
    """The forward of one micro-batch: batch-shaped random ops draw from each sample's stream."""

    def __init__(self, keys: torch.Tensor, drawn: int = 0):
        super().__init__()
        self.keys, self.batch, self.drawn = keys, len(keys), drawn

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.pop()
        return super().__exit__(*exc)

    def _op_keys(self, number: int, device: torch.device) -> torch.Tensor:
        """The keys of the forward's random op ``number`` (each sample's key, split by the op's number)."""
        keys = self.keys if self.keys.device == device else self.keys.to(device)
        return _mix(keys ^ _mix((number * _OP + 1) & _M32))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if id(func) not in _REPLACED_IDS:  # most ops: run as they are
            if id(func) in _COUNTED_IDS:
                self.drawn += 1
            return func(*args, **kwargs)
        number, self.drawn = self.drawn, self.drawn + 1
        shape = tuple(args[0]) if func in (aten.rand.default, aten.randn.default) else tuple(args[0].shape)
        chosen = kwargs.get("generator") is not None or any(isinstance(a, torch.Generator) for a in args)
        if chosen or not shape or shape[0] != self.batch:  # a generator of the caller's, or not per sample
            return func(*args, **kwargs)
        return _replace(func, args, kwargs, shape, self._op_keys(number, _device_of(func, args, kwargs)))


def _device_of(func, args, kwargs) -> torch.device:
    if func in (aten.rand.default, aten.randn.default):
        return torch.device(kwargs.get("device") or "cpu")
    return args[0].device


def _replace(func, args: tuple, kwargs: dict, shape: tuple, keys: torch.Tensor) -> torch.Tensor:
    """What ``func(*args, **kwargs)`` returns, its random values drawn per sample from ``keys``."""
    rest = shape[1:]
    if func in (aten.rand.default, aten.randn.default):
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        draw = uniform if func is aten.rand.default else _normal
        return draw(keys, rest, dtype).view(shape)
    self = args[0]
    if func in (aten.rand_like.default, aten.randn_like.default):
        dtype = kwargs.get("dtype") or self.dtype
        draw = uniform if func is aten.rand_like.default else _normal
        return draw(keys, rest, dtype).view(shape)
    work = torch.float64 if self.dtype == torch.float64 else torch.float32
    if func is aten.native_dropout.default:
        p, train = args[1], args[2] if len(args) > 2 else kwargs.get("train")
        if train is False:
            return func(*args, **kwargs)
        keep = 1.0 - p
        mask = _below(keys, rest, work, keep).view(shape)
        return self.mul(mask).mul_(1.0 / keep if keep > 0 else 0.0), mask
    if func is aten.uniform_.default:
        low, high = _arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0)
        return self.copy_(uniform(keys, rest, work).view(shape) * (high - low) + low)
    if func is aten.normal_.default:
        mean, std = _arg(args, kwargs, 1, "mean", 0.0), _arg(args, kwargs, 2, "std", 1.0)
        return self.copy_(_normal(keys, rest, work).view(shape) * std + mean)
    # bernoulli: probabilities from the input (bernoulli.default), a number or a tensor.
    if func is aten.bernoulli.default:
        p = self
    else:
        p = _arg(args, kwargs, 1, "p", 0.5)
    ones = uniform(keys, rest, work).view(shape) < p
    if func in (aten.bernoulli_.float, aten.bernoulli_.Tensor):
        return self.copy_(ones)
    return ones.to(self.dtype)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


class SampleStreams:
    """Per-sample random streams of one train step function (see the module docstring).

    >>> streams = SampleStreams(seed=3)
    >>> dropout = streams.wrap(lambda x: torch.nn.functional.dropout(x, 0.5, training=True))
    >>> streams.begin(step=1, first=0, sizes=[4])
    >>> whole = dropout(torch.ones(4, 6))
    >>> streams.begin(step=1, first=2, sizes=[2])  # samples 2 and 3 on another rank
    >>> torch.equal(dropout(torch.ones(2, 6)), whole[2:])
    True
    """

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.draws: bool | None = None  # whether the model's forward draws random numbers (None: not seen yet)
        # whether an eager forward's draws are all seen by a function mode (fdp.model.streams_functions.by_function)
        self.by_function: bool | None = None
        self._queue: list[torch.Tensor | None] = []  # each coming micro-batch's keys
        self.current: torch.Tensor | None = None  # the keys of the traced forward running now (streams_functions)

    def keys(self, step: int, first: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The keys of global samples ``first`` to ``first + count - 1`` at step ``step`` (int64, 32-bit values)."""
        base = _mix(_mix(_mix(self.seed & _M32) ^ ((self.seed >> 32) & _M32)) ^ (step & _M32))
        index = torch.arange(first, first + count, dtype=torch.int64, device=device)
        return _mix(index.mul_(_SAMPLE).add_(base).bitwise_and_(_M32))

    def begin(self, step: int, first: int, sizes: list[int], device: torch.device | str = "cpu") -> None:
        """The next forwards are step ``step``'s micro-batches of ``sizes`` samples, from global sample ``first`` on."""
        # The keys are made here, outside the transform that differentiates the forward.
        keys = self.keys(step, first, sum(sizes), device) if self.draws is not False else None
        self._queue = list(keys.split(sizes)) if keys is not None else [None] * len(sizes)

    def take(self) -> torch.Tensor | None:
        """The next micro-batch's keys (left queued in a ``rehearsal``), ``None`` where it draws nothing."""
        return (self._queue[0] if _REHEARSING else self._queue.pop(0)) if self._queue else None

    def wrap(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` whose calls (one per micro-batch, in ``begin``'s order) run on the samples' streams."""

        def on_sample_streams(*args, **kwargs):
            keys = self.take()
            if keys is None:
                return loss_fn(*args, **kwargs)
            mode = _PerSample(keys)
            with mode:
                out = loss_fn(*args, **kwargs)
            if self.draws is None:
                self.draws = mode.drawn > 0
            return out

        return on_sample_streams


_REHEARSING: list[bool] = []  # inside rehearsal(): forwards beside the step's own


@contextlib.contextmanager
def rehearsal():
    """Forwards run beside the step's own: they draw the next micro-batch's streams and leave its keys queued.

    >>> streams = SampleStreams(seed=2)
    >>> dropout = streams.wrap(lambda x: torch.nn.functional.dropout(x, 0.5, training=True))
    >>> streams.begin(step=1, first=0, sizes=[3])
    >>> with rehearsal():
    ...     rehearsed = dropout(torch.ones(3, 4))
    >>> torch.equal(dropout(torch.ones(3, 4)), rehearsed)
    True
    """
    _REHEARSING.append(True)
    try:
        yield
    finally:
        _REHEARSING.pop()


def position() -> tuple[torch.Tensor, int] | None:
    """Where the forward running now is in its samples' streams (their keys, the next op's number), or ``None``.

    Activation checkpointing (``fdp.model.recompute``) takes it before a module's forward and
    replays the module's random ops from it (``replaying``) when backward runs it again.

    >>> position() is None
    True
    """
    return (_ACTIVE[-1].keys, _ACTIVE[-1].drawn) if _ACTIVE else None


def replaying(at: tuple[torch.Tensor, int] | None) -> Any:
    """A context whose random ops draw from the streams at ``at`` (``position()``'s), as they did there.

    >>> streams = SampleStreams(seed=1)
    >>> dropout = streams.wrap(lambda x: (position(), torch.nn.functional.dropout(x, 0.5, training=True)))
    >>> streams.begin(step=1, first=0, sizes=[3])
    >>> at, mask = dropout(torch.ones(3, 5))
    >>> with replaying(at):
    ...     torch.equal(torch.nn.functional.dropout(torch.ones(3, 5), 0.5, training=True), mask)
    True
    """
    return contextlib.nullcontext() if at is None else _PerSample(*at)


def check_sample_streams(value: Any) -> bool | str:
    """``trainer.sample_streams``: ``auto``, ``True`` or ``False``; else a ``ValueError`` naming it.

    >>> check_sample_streams("yes")
    Traceback (most recent call last):
    ...
    ValueError: sample_streams='yes': expected auto, true or false
    """
    if value not in SETTINGS or isinstance(value, int) and not isinstance(value, bool):
        raise ValueError(f"sample_streams={value!r}: expected auto, true or false")
    return value


def wants_sample_streams(setting: bool | str, may_shrink: bool) -> bool:
    """Whether a run draws its forward's randomness per sample (``trainer.sample_streams``).

    ``auto`` draws per sample where the result must not depend on the world size while
    the run goes: a world that may shrink (``may_shrink``: ``fdp.run.rank_loss`` says). Elsewhere each
    rank's generator is used, since hashing each sample's masks costs more than the generator's
    draws, and the streams' mode a Python call per random function (per op under the dispatch
    mode): ``benchmarks/shrink_overhead.py``.

    >>> wants_sample_streams("auto", may_shrink=False), wants_sample_streams("auto", may_shrink=True)
    (False, True)
    >>> wants_sample_streams(True, may_shrink=False)
    True
    """
    return may_shrink if setting == "auto" else bool(setting)
