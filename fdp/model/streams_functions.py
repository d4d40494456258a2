"""Per-sample random streams as a function mode: only torch's random functions are intercepted.

The streams of ``fdp.model.streams`` replace random aten ops from a dispatch mode, which
costs a Python call per op of the forward and which dynamo runs eagerly. A function mode
sees torch's functions instead (``F.dropout``, ``F.scaled_dot_product_attention``,
``rand_like``, ``bernoulli_``, ...): each function the dispatch mode sees as random ops is
remade from the same keys and op number, so the masks are the dispatch mode's bit for bit.

* ``traced(streams, loss_fn)``, ``taking``: a step compiled whole. Dynamo inlines the mode
  (``_Traced``) and the masks are integer hashing inside the graph; the micro-batch's keys
  are graph inputs, taken outside it, so a new step's keys do not recompile. Functions that
  draw inside themselves (``dropout2d``, ``rrelu``, ...) are refused there.
* ``by_function(streams, loss_fn)``: an eager step (``_Eager``). Every other op runs as it
  is; dropout and attention dropout on the CPU are remade here, and every other random
  function (those that draw inside themselves included) runs under the dispatch mode for
  the length of its call, from the mode's op number. The first forward runs under the
  dispatch mode with the function mode watching (``_Watch``); where a draw came from no
  function the mode takes (one hidden from it: under ``torch.func`` an ``autograd.Function``,
  such as activation checkpointing's ``fdp.model.remat``, runs its forward out of a
  function mode's sight), the forwards keep the dispatch mode.

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

from fdp._torch import CUSTOM_FUNCTION_CALL
from fdp.model import streams
from fdp.model.streams import (
    _M32,
    _OP,
    _REHEARSING,
    SampleStreams,
    _arg,
    _below,
    _mix,
    _normal,
    _PerSample,
    uniform,
)

__all__ = ["traced", "taking", "by_function"]


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


class _Functions(TorchFunctionMode):
    """A forward on its samples' streams, seen as torch's functions: the op count and keys of ``_PerSample``."""

    def __init__(self, keys: torch.Tensor, drawn: int = 0):
        super().__init__()
        self.keys, self.batch, self.drawn = keys, len(keys), drawn

    def number(self, shape: tuple, device: torch.device) -> torch.Tensor | None:
        """The keys of the next random op, of ``shape``; ``None`` (counted) where it is not per sample."""
        number, self.drawn = self.drawn, self.drawn + 1
        if not shape or shape[0] != self.batch:
            return None
        keys = self.keys if self.keys.device == device else self.keys.to(device)
        return _mix(keys ^ _mix((number * _OP + 1) & _M32))

    def below(self, keys: torch.Tensor, shape: tuple, dtype: torch.dtype, p: float) -> torch.Tensor:
        """``uniform(keys, shape, dtype) < p``, the mask of a dropout (a bool tensor of ``(len(keys), *shape)``)."""
        return uniform(keys, shape, dtype) < p


class _Traced(_Functions):
    """``_PerSample`` for a forward ``torch.compile`` traces: a function mode, which dynamo inlines.

    It sees torch's functions rather than aten ops, so it remakes each function the dispatch mode
    sees as one random op (dropout, attention dropout, ``rand_like``, ``bernoulli_``, ...) with the
    same keys and op number: the masks are the eager ones, bit for bit, as integer hashing in the graph.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TRACED_OTHER:
            self.drawn += 1
        elif func in _TRACED_UNKNOWN or func is F.multi_head_attention_forward:
            _refuse_traced(func, args, kwargs)
        elif func in _TRACED_OPS:
            return _TRACED_OPS[func](self, func, args, kwargs)
        return func(*args, **kwargs)


def _draws_inside(func, args: tuple, kwargs: dict) -> bool:
    """Whether a call of a function that draws inside itself (``_TRACED_UNKNOWN``, attention's) draws."""
    training = _arg(args, kwargs, 2, "training", True) if func is not F.rrelu else _arg(args, kwargs, 3, "training", 0)
    if func is F.multi_head_attention_forward:
        training = _arg(args, kwargs, 12, "dropout_p", 0.0) > 0 and _arg(args, kwargs, 15, "training", True)
    return bool(training)


def _refuse_traced(func, args: tuple, kwargs: dict) -> None:
    if _draws_inside(func, args, kwargs):
        raise NotImplementedError(
            f"{func.__name__} in training draws inside itself, where a compiled forward's per-sample streams "
            "(fdp.model.streams) cannot reach: run it with trainer.compile=false"
        )


def _no_generator(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("generator") is None and not any(isinstance(a, torch.Generator) for a in args)


def _t_dropout(mode: _Functions, func, args: tuple, kwargs: dict):
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
    mask = mode.below(keys, tuple(x.shape[1:]), torch.float64 if x.dtype == torch.float64 else torch.float32, keep)
    mask = mask.view(x.shape)
    if func is torch.native_dropout:
        return x.mul(mask).mul_(1.0 / keep), mask
    noise = mask.to(x.dtype).div_(keep)
    return x.mul_(noise) if inplace else x * noise


def _t_attention(mode: _Functions, func, args: tuple, kwargs: dict):
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
    keep = mode.below(keys, shape[1:], work, 1.0 - p).view(shape)
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


# What an eager forward takes from torch's random functions: those of a compiled forward and those that draw
# inside themselves, the in-place and torch.* forms of dropout, nn.init's fills (Python functions that hide the
# fills inside them from a function mode), fractional max pooling (its random samples) and an autograd.Function's
# call under torch.func (its forward, activation checkpointing's modules among them, runs out of the mode's
# sight). A call of one of them that _Eager does not remake runs under the dispatch mode, so that every random
# op of the forward is numbered and drawn as the dispatch mode does.
_EAGER = frozenset(
    {*_TRACED_OPS, *_TRACED_OTHER, *_TRACED_UNKNOWN, F.multi_head_attention_forward, F.rrelu_}
    | {getattr(torch, name) for name in ("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout")}
    | {getattr(torch, name + "_") for name in ("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout")}
    | {torch.rrelu, torch.rrelu_, torch.normal, CUSTOM_FUNCTION_CALL}
    | {
        getattr(F, f"{way}fractional_max_pool{n}d{tail}")
        for n in (2, 3)
        for way, tail in (("_", ""), ("", "_with_indices"))
    }
    | {getattr(torch.nn.init, name) for name in ("uniform_", "normal_", "trunc_normal_", "orthogonal_", "sparse_")}
    | {getattr(torch.nn.init, f"{kind}_{law}_") for kind in ("kaiming", "xavier") for law in ("uniform", "normal")}
)
_PASS = "pass"  # a call that draws nothing: run as it is


def _eager_way(func, args: tuple, kwargs: dict, batch: int) -> Callable | str | None:
    """How ``_Eager`` runs a call of a function of ``_EAGER``: remade (the remake), as it is (``_PASS``), or, where
    it returns ``None``, under the dispatch mode.

    Dropout and attention dropout are remade where ATen's own path is the remake's, op for op: on the CPU (on a
    GPU dropout is one fused op) and, for attention, in float32 or float64 without a mask of the caller's (whose
    fully masked rows ATen's softmax sets to zero) or grouped heads.
    """
    if func is F.dropout:
        x, p, training = args[0], _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "training", True)
        if not training or p == 0 or p == 1 or x.numel() == 0:  # ATen's dropout draws nothing there
            return _PASS
        return _t_dropout if x.device.type == "cpu" and x.dim() and x.shape[0] == batch else None
    if func is F.scaled_dot_product_attention:
        q, k, v = args[:3]
        if _arg(args, kwargs, 4, "dropout_p", 0.0) == 0:
            return _PASS
        plain = _arg(args, kwargs, 3, "attn_mask", None) is None and not kwargs.get("enable_gqa")
        scale = _arg(args, kwargs, 6, "scale", None)
        plain = plain and (scale is None or scale > 0) and q.dim() == k.dim() == v.dim() == 4
        plain = plain and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
        return _t_attention if plain and q.shape[:2] == k.shape[:2] == v.shape[:2] and q.shape[0] == batch else None
    if func in _TRACED_UNKNOWN or func is F.multi_head_attention_forward:
        return None if _draws_inside(func, args, kwargs) else _PASS
    return None


class _Eager(_Functions):
    """``_PerSample`` for an eager forward, at a Python call per random function instead of one per op.

    Dropout and attention dropout are remade here (``_eager_way``); any other random function runs under
    ``_PerSample`` from this mode's op number for the length of its call. Its position is ``streams.position()``'s.
    """

    def __enter__(self):
        streams._ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        streams._ACTIVE.pop()
        return super().__exit__(*exc)

    def below(self, keys: torch.Tensor, shape: tuple, dtype: torch.dtype, p: float) -> torch.Tensor:
        return _below(keys, shape, dtype, p)  # compared in integers: fewer passes, the same mask

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _EAGER:
            return func(*args, **kwargs)
        way = _eager_way(func, args, kwargs, self.batch)
        if way is _PASS:
            return func(*args, **kwargs)
        if way is not None:
            return way(self, func, args, kwargs)
        dispatch = _PerSample(self.keys, self.drawn)
        with dispatch:
            out = func(*args, **kwargs)
        self.drawn = dispatch.drawn
        return out


class _Watch(TorchFunctionMode):
    """The first forward's function mode, under the dispatch mode: whether ``_Eager`` would draw what it draws.

    ``covered()``: every random op the dispatch mode numbered was in a call of a function of ``_EAGER``, and each
    call ``_Eager`` remakes numbered one op, as the remake does.
    """

    def __init__(self, dispatch: _PerSample):
        super().__init__()
        self.dispatch, self.seen, self.agrees = dispatch, 0, True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _EAGER:
            return func(*args, **kwargs)
        way = _eager_way(func, args, kwargs, self.dispatch.batch)
        before = self.dispatch.drawn
        out = func(*args, **kwargs)
        drawn = self.dispatch.drawn - before
        self.seen += drawn
        self.agrees = self.agrees and (way is None or drawn == (0 if way is _PASS else 1))
        return out

    def covered(self) -> bool:
        return self.agrees and self.seen == self.dispatch.drawn


def by_function(streams: SampleStreams, loss_fn: Callable) -> Callable:
    """``streams.wrap(loss_fn)``'s draws, bit for bit, at a Python call per random function instead of per op.

    The first forward runs under the dispatch mode, watched; the next ones under the function mode where it saw
    every draw (``streams.by_function``), else under the dispatch mode.

    >>> streams = SampleStreams(seed=3)
    >>> dropout = lambda x: F.dropout(x, 0.5, training=True)
    >>> streams.begin(step=1, first=0, sizes=[4, 4])
    >>> run = by_function(streams, dropout)
    >>> first, second = run(torch.ones(4, 6)), run(torch.ones(4, 6))  # watched, then by function
    >>> streams.begin(step=1, first=4, sizes=[4])
    >>> streams.by_function, torch.equal(streams.wrap(dropout)(torch.ones(4, 6)), second)
    (True, True)
    """

    def on_sample_streams(*args, **kwargs):
        keys = streams.take()
        if keys is None:
            return loss_fn(*args, **kwargs)
        if streams.by_function:
            with _Eager(keys):
                return loss_fn(*args, **kwargs)
        dispatch = _PerSample(keys)
        if streams.by_function is False or _REHEARSING:  # a forward beside the step's: not the one to watch
            with dispatch:
                return loss_fn(*args, **kwargs)
        watch = _Watch(dispatch)
        with dispatch, watch:
            out = loss_fn(*args, **kwargs)
        streams.draws, streams.by_function = dispatch.drawn > 0, watch.covered()
        return out

    return on_sample_streams


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
