"""Per-sample random streams in a forward that torch.compile traces (trainer.compile with sample streams).

The streams of ``fdp.model.streams`` enter a forward as a dispatch mode, and dynamo runs
whatever is called under a dispatch mode eagerly. A traced forward enters them as a
function mode instead (``_Traced``), which dynamo inlines: it sees torch's functions
rather than aten ops, so it remakes each function the dispatch mode sees as one random op
(dropout, attention dropout, ``rand_like``, ``bernoulli_``, ...) from the same keys and op
number. The masks are the eager ones bit for bit, made by integer hashing inside the graph;
the micro-batch's keys are graph inputs, taken outside it (``taking``), so a new step's
keys do not recompile.

>>> streams = SampleStreams(seed=3)
>>> dropout = lambda x: F.dropout(x, 0.5, training=True)
>>> streams.begin(step=1, first=0, sizes=[4])
>>> eager = streams.wrap(dropout)(torch.ones(4, 6))
>>> streams.begin(step=1, first=0, sizes=[4])
>>> torch.equal(taking(streams, traced(streams, dropout))(torch.ones(4, 6)), eager)
True
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from fdp.model.streams import _M32, _OP, SampleStreams, _arg, _mix, _normal, uniform

__all__ = ["traced", "taking"]


F = torch.nn.functional
# The functions (as torch calls them, above aten) whose draws a compiled forward takes per sample, each one
# random op of the dispatch mode's count, made with the same keys and op number, so a compiled step draws
# the masks an eager one does (_Traced). Those that draw from the generator are counted only.
_TRACED_OTHER = {
    torch.randint,
    torch.randint_like,
    torch.randperm,
    torch.multinomial,
    torch.Tensor.multinomial,
    torch.Tensor.exponential_,
    torch.Tensor.random_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.geometric_,
    torch.poisson,
    F.gumbel_softmax,
}
# Functions whose random ops run inside them, out of a function mode's sight, and that _Traced does not remake.
_TRACED_UNKNOWN = {F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, F.rrelu}


class _Traced(TorchFunctionMode):
    """``_PerSample`` for a forward ``torch.compile`` traces: a function mode, which dynamo inlines.

    It sees torch's functions rather than aten ops, so it remakes each function the dispatch mode
    sees as one random op (dropout, attention dropout, ``rand_like``, ``bernoulli_``, ...) with the
    same keys and op number: the masks are the eager ones, bit for bit, as integer hashing in the graph.
    """

    def __init__(self, keys: torch.Tensor):
        super().__init__()
        self.keys, self.batch, self.drawn = keys, len(keys), 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TRACED_OTHER:
            self.drawn += 1
        elif func in _TRACED_UNKNOWN or func is F.multi_head_attention_forward:
            _refuse_traced(func, args, kwargs)
        elif func in _TRACED_OPS:
            return _TRACED_OPS[func](self, func, args, kwargs)
        return func(*args, **kwargs)

    def number(self, shape: tuple, device: torch.device) -> torch.Tensor | None:
        """The keys of the next random op, of ``shape``; ``None`` (counted) where it is not per sample."""
        number, self.drawn = self.drawn, self.drawn + 1
        if not shape or shape[0] != self.batch:
            return None
        keys = self.keys if self.keys.device == device else self.keys.to(device)
        return _mix(keys ^ _mix((number * _OP + 1) & _M32))


def _refuse_traced(func, args: tuple, kwargs: dict) -> None:
    training = _arg(args, kwargs, 2, "training", True) if func is not F.rrelu else _arg(args, kwargs, 3, "training", 0)
    if func is F.multi_head_attention_forward:
        training = _arg(args, kwargs, 12, "dropout_p", 0.0) > 0 and _arg(args, kwargs, 15, "training", True)
    if training:
        raise NotImplementedError(
            f"{func.__name__} in training draws inside itself, where a compiled forward's per-sample streams "
            "(fdp.model.streams) cannot reach: run it with trainer.compile=false"
        )


def _no_generator(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("generator") is None and not any(isinstance(a, torch.Generator) for a in args)


def _t_dropout(mode: _Traced, func, args: tuple, kwargs: dict):
    x, p = args[0], _arg(args, kwargs, 1, "p", 0.5)
    training, inplace = _arg(args, kwargs, 2, "training", True), _arg(args, kwargs, 3, "inplace", False)
    if func is torch.native_dropout:
        training = _arg(args, kwargs, 2, "train", True)
        if training is False:
            return func(*args, **kwargs)
    elif not training or p == 0 or p == 1 or x.numel() == 0:  # ATen's dropout draws nothing there
        return func(*args, **kwargs)
    keys = mode.number(tuple(x.shape), x.device)
    if keys is None:
        return func(*args, **kwargs)
    keep = 1.0 - p
    mask = uniform(keys, tuple(x.shape[1:]), torch.float64 if x.dtype == torch.float64 else torch.float32)
    mask = mask.view(x.shape) < keep
    if func is torch.native_dropout:
        return x.mul(mask).mul_(1.0 / keep), mask
    noise = mask.to(x.dtype).div_(keep)
    return x.mul_(noise) if inplace else x * noise


def _t_attention(mode: _Traced, func, args: tuple, kwargs: dict):
    q, k, v = args[:3]
    mask, p = _arg(args, kwargs, 3, "attn_mask", None), _arg(args, kwargs, 4, "dropout_p", 0.0)
    causal, scale = _arg(args, kwargs, 5, "is_causal", False), _arg(args, kwargs, 6, "scale", None)
    if p == 0 or kwargs.get("enable_gqa"):
        return func(*args, **kwargs)
    shape = (*q.shape[:-1], k.shape[-2])
    keys = mode.number(shape, q.device)
    if keys is None:
        return func(*args, **kwargs)
    # The math of torch's own attention with dropout (the path it takes on the CPU).
    root = (scale if scale is not None else 1.0 / q.shape[-1] ** 0.5) ** 0.5
    scores = (q * root) @ (k.transpose(-2, -1) * root)
    if causal:
        mask = torch.ones(shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores if mask is None else scores + mask, dim=-1)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    keep = uniform(keys, shape[1:], work).view(shape) < 1.0 - p
    return (weights * keep.to(q.dtype).div_(1.0 - p)) @ v


def _t_like(mode: _Traced, func, args: tuple, kwargs: dict):
    x = args[0]
    keys = mode.number(tuple(x.shape), kwargs.get("device") or x.device) if _no_generator(args, kwargs) else None
    if keys is None:
        return func(*args, **kwargs)
    draw = uniform if func is torch.rand_like else _normal
    out = draw(keys, tuple(x.shape[1:]), kwargs.get("dtype") or x.dtype).view(x.shape)
    return out.requires_grad_() if kwargs.get("requires_grad") else out


def _t_fresh(mode: _Traced, func, args: tuple, kwargs: dict):
    shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args or kwargs.get("size")
    shape = tuple(shape)
    device = torch.device(kwargs.get("device") or "cpu")
    keys = mode.number(shape, device) if _no_generator(args, kwargs) else None
    if keys is None:
        return func(*args, **kwargs)
    draw = uniform if func is torch.rand else _normal
    out = draw(keys, shape[1:], kwargs.get("dtype") or torch.get_default_dtype()).view(shape)
    return out.requires_grad_() if kwargs.get("requires_grad") else out


def _t_fill(mode: _Traced, func, args: tuple, kwargs: dict):
    x = args[0]
    keys = mode.number(tuple(x.shape), x.device) if _no_generator(args, kwargs) else None
    if keys is None:
        return func(*args, **kwargs)
    work, rest = torch.float64 if x.dtype == torch.float64 else torch.float32, tuple(x.shape[1:])
    if func is torch.Tensor.uniform_:
        low, high = _arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0)
        return x.copy_(uniform(keys, rest, work).view(x.shape) * (high - low) + low)
    if func is torch.Tensor.normal_:
        mean, std = _arg(args, kwargs, 1, "mean", 0.0), _arg(args, kwargs, 2, "std", 1.0)
        return x.copy_(_normal(keys, rest, work).view(x.shape) * std + mean)
    p = x if func is torch.bernoulli and len(args) < 2 and "p" not in kwargs else _arg(args, kwargs, 1, "p", 0.5)
    ones = uniform(keys, rest, work).view(x.shape) < p
    return x.copy_(ones) if func is torch.Tensor.bernoulli_ else ones.to(x.dtype)


_TRACED_OPS = {
    F.dropout: _t_dropout,
    torch.native_dropout: _t_dropout,
    F.scaled_dot_product_attention: _t_attention,
    torch.rand_like: _t_like,
    torch.randn_like: _t_like,
    torch.rand: _t_fresh,
    torch.randn: _t_fresh,
    torch.Tensor.uniform_: _t_fill,
    torch.Tensor.normal_: _t_fill,
    torch.Tensor.bernoulli_: _t_fill,
    torch.bernoulli: _t_fill,
    torch.Tensor.bernoulli: _t_fill,
}


def traced(streams: SampleStreams, loss_fn: Callable) -> Callable:
    """``loss_fn`` on the samples' streams, traceable: it reads the keys ``taking`` set for its micro-batch."""

    def on_traced_streams(*args, **kwargs):
        keys = streams.current
        if keys is None:
            return loss_fn(*args, **kwargs)
        with _Traced(keys):
            return loss_fn(*args, **kwargs)

    return on_traced_streams


def taking(streams: SampleStreams, grad_fn: Callable) -> Callable:
    """``grad_fn`` (which runs a ``traced`` forward) taking its micro-batch's keys from the queue before each call."""

    def with_keys(*args, **kwargs):
        streams.current = streams.take()
        try:
            return grad_fn(*args, **kwargs)
        finally:
            streams.current = None

    return with_keys
