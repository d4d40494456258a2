"""Tracing the order in which backward makes gradients ready, and planning from it."""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal, Mapping

import torch

from fdp._torch import tree_map
from fdp.plan.packing import pack_into_buckets
from fdp.plan.values import BucketPlan, TensorSpec, check_cap

Trace = Literal["auto", "meta", "real"]


# Below this mean tensor size a real backward on a tiny batch beats the meta device's
# Python decompositions (measured in benchmarks/plan_and_pack.py).
_META_MIN_MEAN_NUMEL = 2**16


def gradient_ready_order(
    loss_fn: Callable[[dict[str, torch.Tensor], Any], Any],
    params: Mapping[str, torch.Tensor],
    example_batch: Any,
    *,
    trace: Trace = "auto",
) -> list[str]:
    """Names of ``params`` in the order backward makes their gradients ready.

    Runs the backward of ``loss_fn(params, batch)`` once under ``torch.func.vjp``, with a
    tensor hook on every parameter; ``loss_fn`` may return a scalar loss or ``(loss, aux)``.
    Parameters whose hook never fires get no gradient and are left out of the list. The
    order does not depend on the batch's size: a sample or two traces as well as a
    whole batch, at a fraction of its memory.

    ``trace`` picks the tensors the backward runs on:

    * ``"meta"``: copies of ``params`` and ``example_batch`` on the meta device: no memory,
      no arithmetic; fails for models that mix in real tensors (e.g. buffers captured by
      ``loss_fn``) or read values (data-dependent control flow);
    * ``"real"``: the given tensors and (tiny) example batch;
    * ``"auto"`` (default): ``"meta"`` (then ``"real"`` if the meta run raises) for trees
      of large tensors, ``"real"`` for trees of many small ones, whichever is faster.

    ``loss_fn`` should not keep tensors from the trace: a module that caches, say, rotary
    tables built from its input would keep meta tensors after a meta trace.

    Many meta kernels are Python decompositions (~0.1-0.5 ms per op against a few us for a
    tiny real op), so for models of many small tensors ``"real"`` on a tiny batch is
    several times faster, while for large dense layers ``"meta"`` is; see
    ``benchmarks/results/plan_and_pack.md``.

    >>> import torch.nn.functional as F
    >>> params = {"w1": torch.randn(8, 4), "w2": torch.randn(2, 8)}
    >>> loss = lambda p, x: F.linear(F.linear(x, p["w1"]).relu(), p["w2"]).sum()
    >>> gradient_ready_order(loss, params, torch.randn(3, 4))
    ['w2', 'w1']
    """
    if not params:
        raise ValueError("no parameters to trace: the parameter tree is empty")
    if trace not in ("auto", "meta", "real"):
        raise ValueError(f"trace={trace!r}: expected 'auto', 'meta' or 'real'")
    if trace == "auto" and sum(t.numel() for t in params.values()) < _META_MIN_MEAN_NUMEL * len(params):
        trace = "real"
    if trace == "real":
        return _traced_order(loss_fn, dict(params), example_batch)
    try:
        meta_params = {name: _to_meta(t) for name, t in params.items()}
        return _traced_order(loss_fn, meta_params, tree_map(_to_meta, example_batch))
    except Exception as meta_error:
        if trace == "meta":
            raise
        try:
            return _traced_order(loss_fn, dict(params), example_batch)
        except Exception as real_error:
            real_error.add_note(f"fdp: tracing on the meta device failed first with: {meta_error!r}")
            raise


def _traced_order(loss_fn: Callable, params: dict[str, torch.Tensor], batch: Any) -> list[str]:
    # A dict keeps insertion order: re-inserting on a repeated firing records the last one,
    # i.e. when the gradient is complete.
    ready: dict[str, None] = {}

    def traced(p: dict[str, torch.Tensor], b: Any) -> torch.Tensor:
        for name, t in p.items():
            t.register_hook(functools.partial(_mark_ready, ready, name))
        out = loss_fn(p, b)
        return out[0] if isinstance(out, (tuple, list)) else out

    # vjp's backward runs once the transform is left, freeing each activation as it goes;
    # torch.func.grad would keep the whole forward alive to the end of its backward (it
    # records a graph of the backward too): on a GPU that held a step's activations twice.
    loss, backward = torch.func.vjp(lambda p: traced(p, batch), params)
    with torch.no_grad():
        backward(torch.ones_like(loss), retain_graph=False)
    return list(ready)


def _mark_ready(ready: dict[str, None], name: str, grad: torch.Tensor) -> None:
    ready.pop(name, None)
    ready[name] = None


def _to_meta(x: Any) -> Any:
    return x.detach().to("meta") if isinstance(x, torch.Tensor) else x


def plan_buckets(
    loss_fn: Callable[[dict[str, torch.Tensor], Any], Any],
    params: Mapping[str, torch.Tensor],
    example_batch: Any,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    allow_unused: bool = False,
    *,
    trace: Trace = "auto",
    device: torch.device | None = None,
) -> BucketPlan:
    """Trace the gradient-ready order of ``params`` and pack it into a :class:`BucketPlan`.

    ``loss_fn(params, batch)`` returns a scalar loss or ``(loss, aux)``. Parameters that
    receive no gradient raise ``ValueError`` naming them, unless ``allow_unused``, which
    puts them in final buckets marked ``unused`` (reduced as zeros). Dtypes, devices and
    shapes are taken from ``params`` itself, whatever device the trace ran on. ``trace``
    is as in :func:`gradient_ready_order`; packing is :func:`pack_into_buckets`. ``device``: where the buckets
    live, for ``params`` that stand in on ``meta`` for tensors not made yet (``fdp.model.deferred``).

    >>> from fdp.model.functional import functionalize
    >>> model, params, buffers = functionalize(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    >>> loss_fn = lambda p, x: model.apply(p, buffers, x)[0].sum()
    >>> plan = plan_buckets(loss_fn, params, torch.randn(3, 4))
    >>> plan.names
    ('1.bias', '1.weight', '0.bias', '0.weight')
    """
    bucket_cap_mb = check_cap("bucket_cap_mb", bucket_cap_mb)
    first_bucket_cap_mb = check_cap("first_bucket_cap_mb", first_bucket_cap_mb)
    if not params:
        raise ValueError("no parameters to plan: the parameter tree is empty")
    order = gradient_ready_order(loss_fn, params, example_batch, trace=trace)
    fired = set(order)
    missing = [name for name in params if name not in fired]
    if missing and not allow_unused:
        raise ValueError(f"parameters receive no gradient: {missing}; set allow_unused=true to reduce them as zeros")

    def spec(name: str) -> TensorSpec:
        t = params[name]
        return (name, tuple(t.shape), t.dtype, t.device if device is None else device)

    return pack_into_buckets(
        [spec(n) for n in order], bucket_cap_mb, first_bucket_cap_mb, unused=[spec(n) for n in missing]
    )
