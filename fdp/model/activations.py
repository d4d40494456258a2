"""What a forward keeps for backward: the activations of a micro-batch, counted on a tiny batch and scaled.

A step's memory beyond its state is mostly the tensors autograd saves in forward for
backward. ``saved_activations`` runs the loss once under a saved-tensor hook and adds up
the distinct storages saved (the params themselves left out: they are counted as params),
on whatever device the params are (on ``meta`` it costs neither memory nor arithmetic).
With modules checkpointed (``fdp.model.recompute``) only their inputs are kept from forward to
backward, and backward holds one module's activations at a time while it recomputes them:
both come from the same plain forward, the saves inside each checkpointed module told
apart by module hooks. ``per_sample`` takes two tiny batches and scales linearly.

>>> lin = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> params = {n: p.detach().requires_grad_() for n, p in lin.named_parameters()}
>>> loss = lambda p, x: torch.func.functional_call(lin, p, (x,)).sum()
>>> saved_activations(loss, params, torch.ones(3, 4)).kept  # the input and the ReLU's output (the second layer's input)
144
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import torch
from torch import nn

from fdp._torch import tree_flatten
from fdp.data.batches import head

__all__ = ["Activations", "saved_activations", "traced_pair", "per_sample"]


class Activations(NamedTuple):
    """Bytes a forward keeps for backward: ``kept`` from forward to backward, ``largest`` the largest one
    saved tensor (backward holds its gradient and its input's at once), ``recomputed`` the most one
    checkpointed module holds again while backward recomputes it (0 without checkpointing)."""

    kept: int
    largest: int
    recomputed: int = 0

    def scaled(self, other: "Activations", samples: int, at: int = 1) -> "Activations":
        """Linear in the samples, from this count at ``at`` samples and ``other`` at ``at + 1``.

        >>> Activations(10, 4, 2).scaled(Activations(16, 6, 3), samples=5)
        Activations(kept=34, largest=12, recomputed=6)
        """
        return Activations(*(a + max(0, b - a) * (samples - at) for a, b in zip(self, other)))


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor reaches, ``(start, stop)``: a view keeps its whole storage alive, and views
    of one storage saved apart (attention's query, key and value cut from one projection) reach all of it.

    >>> qkv = torch.ones(2, 12)  # 96 bytes
    >>> [_span(t) for t in qkv.view(2, 3, 4).unbind(1)]  # interleaved: of 32 bytes each, together all 96
    [(0, 64), (16, 80), (32, 96)]
    """
    start = t.storage_offset()
    stop = start + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 if t.numel() else start
    return start * t.element_size(), stop * t.element_size()


def _reach(spans: dict[int, tuple[int, int]]) -> int:
    """The bytes saved views reach, summed over their storages (``_span`` of each, merged by storage)."""
    return sum(stop - start for start, stop in spans.values())


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """Attention on ``meta`` as a device runs it: the fused kernel, which saves its inputs, output and log-sum-exp
    for backward (on ``meta`` torch takes the unfused path, which saves the attention weights, a square per head:
    measured, 16 MiB more than the CPU's on a char transformer's 8 samples of 128 tokens). With a mask or grouped
    heads it is left as torch runs it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention and args[0].is_meta:
            names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            given = {**dict(zip(names, args[3:])), **kwargs}
            if given.get("attn_mask") is None and not given.get("enable_gqa"):
                query, key, value = args[:3]
                fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
                dropout, causal = given.get("dropout_p", 0.0), given.get("is_causal", False)
                return fused(query, key, value, dropout, causal, scale=given.get("scale"))[0]
        return func(*args, **kwargs)


def saved_activations(
    loss_fn: Callable[[dict, Any], Any],
    params: Mapping[str, torch.Tensor],
    batch: Any,
    checkpointed: Iterable[nn.Module] = (),
) -> Activations:
    """Run ``loss_fn(params, batch)`` once with gradients recorded and count what it saves for backward.

    ``params`` are leaves that require grad (any device, ``meta`` included). ``checkpointed``:
    modules whose saves are recomputed in backward (``fdp.model.recompute``): their inputs count as
    kept instead, and the most any one of them saved is ``recomputed``.
    """
    own = {_storage_key(p) for p in params.values()}
    # storage -> the bytes its saved views reach (start, stop), outside the checkpointed modules
    saved: dict[int, tuple[int, int]] = {}
    inputs: dict[int, int] = {}  # storage -> bytes of the checkpointed modules' inputs
    inside: list[dict[int, tuple[int, int]]] = []  # per checkpointed call: what it saved
    largest = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal largest
        key = _storage_key(t)
        if key not in own:
            largest = max(largest, t.numel() * t.element_size())  # its gradient: the size of the tensor
            where = inside[-1] if inside else saved
            # What its views reach together: a batch's first samples, or all of a projection cut in three.
            start, stop = _span(t)
            known = where.get(key, (start, stop))
            where[key] = (min(start, known[0]), max(stop, known[1]))
        return t.detach()  # not the tensor itself: an output saved by its own node would keep the graph alive

    def enter(module: nn.Module, args: tuple) -> None:
        for leaf in tree_flatten(args)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                key = _storage_key(leaf)
                inputs[key] = max(leaf.numel() * leaf.element_size(), inputs.get(key, 0))
        inside.append({})

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        calls.append(inside.pop())

    calls: list[dict[int, tuple[int, int]]] = []
    handles = [h for m in checkpointed for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    on_meta = any(p.is_meta for p in params.values())
    try:
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            _FusedAttention() if on_meta else contextlib.nullcontext(),
        ):
            out = loss_fn(dict(params), batch)
        del out
    finally:
        for h in handles:
            h.remove()
    kept = _reach(saved) + sum(n for k, n in inputs.items() if k not in saved and k not in own)
    return Activations(kept, largest, max((_reach(c) for c in calls), default=0))


def traced_pair(
    loss_fn: Callable[[dict, Any], Any], params: Mapping[str, torch.Tensor], batch: Any, checkpointed=()
) -> tuple[Activations, Activations]:
    """``saved_activations`` on the first one and on the first two samples of ``batch``: ``one.scaled(two, n)``
    gives any micro-batch ``n``."""
    modules = list(checkpointed)
    params = {n: p.detach().requires_grad_(p.is_floating_point()) for n, p in params.items()}
    return tuple(saved_activations(loss_fn, params, head(batch, n), modules) for n in (1, 2))


def per_sample(
    loss_fn: Callable[[dict, Any], Any],
    params: Mapping[str, torch.Tensor],
    batch: Any,
    samples: int,
    checkpointed: Iterable[nn.Module] = (),
) -> Activations:
    """``saved_activations`` on the first one and two samples of ``batch``, scaled linearly to ``samples``.

    >>> lin = torch.nn.Linear(4, 8)
    >>> params = {n: p.detach().requires_grad_() for n, p in lin.named_parameters()}
    >>> loss = lambda p, x: torch.func.functional_call(lin, p, (x,)).relu().sum()
    >>> per_sample(loss, params, torch.ones(2, 4), samples=10).kept  # 10 inputs of 4 and ReLU outputs of 8
    480
    """
    one, two = traced_pair(loss_fn, params, batch, checkpointed)
    return one.scaled(two, samples)
