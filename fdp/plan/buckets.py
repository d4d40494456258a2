"""Flat gradient buffers laid out by a :class:`~fdp.plan.BucketPlan`: one per bucket, reused.

``allocate`` makes the buffers once; every step ``pack`` copies the gradient tree into
them (in place) and, after the reduction, ``unpack`` hands the gradients back as views
into the buffers: zero copy, like DDP's ``gradient_as_bucket_view``. Those views alias
the buffers, so they change when the buffers are packed again.

>>> from fdp.plan import pack_into_buckets
>>> plan = pack_into_buckets([("b", (2,), "float32", "cpu"), ("w", (2, 3), "float32", "cpu")])
>>> flats = allocate(plan)
>>> flats = pack(plan, {"b": torch.ones(2), "w": torch.full((2, 3), 2.0)}, flats)
>>> flats[0].tolist()
[1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
>>> unpack(plan, flats)["w"].shape
torch.Size([2, 3])
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Mapping, Sequence, TypeVar

import torch

from fdp._torch import foreach, storage_alias
from fdp.plan import Bucket, BucketPlan

__all__ = [
    "allocate",
    "allocate_released",
    "pack",
    "unpack",
    "slot_views",
    "release",
    "regrow",
    "lay_out",
    "flat_buffers",
    "views_in",
    "crosses_flat",
]

# Up to this mean size per tensor, params laid out flat are worth their extra gradient pass on a CPU (crosses_flat).
FLAT_CPU_BYTES_PER_TENSOR = 32 * 2**10


def allocate(plan: BucketPlan, zeroed: bool = True) -> tuple[torch.Tensor, ...]:
    """Zero-filled flat buffers, one per bucket, with the bucket's dtype and device (``zeroed=False``: uninitialised).

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (2, 3), "float16", "cpu")])
    >>> [(f.shape, f.dtype) for f in allocate(plan)]
    [(torch.Size([6]), torch.float16)]
    """
    make = torch.zeros if zeroed else torch.empty
    return tuple(make(b.numel, dtype=b.torch_dtype, device=b.device) for b in plan.buckets)


_Views = TypeVar("_Views")


def allocate_released(
    plan: BucketPlan,
    views: Callable[[Bucket, torch.Tensor], _Views],
    numel: Callable[[Bucket], int] = lambda bucket: bucket.numel,
    dtype: torch.dtype | None = None,
) -> tuple[tuple[torch.Tensor, ...], list[_Views]]:
    """Released flat buffers, one per bucket (``numel(bucket)`` entries), and ``views(bucket, buffer)`` of each.

    Views need the memory to be made, so each buffer is made, viewed and released before the next: never
    two buckets' memory at once, where all of them together may be more than a rank holds (ZeRO stage 3's
    whole params and gradients). ``regrow`` gives a buffer its memory back; its views see it.

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (2, 3), "float32", "cpu")])
    >>> (flat,), (w,) = allocate_released(plan, lambda bucket, buffer: buffer.view(2, 3))
    >>> flat.untyped_storage().nbytes(), w.shape
    (0, torch.Size([2, 3]))
    """
    buffers, made = [], []
    for bucket in plan.buckets:
        buffer = torch.empty(numel(bucket), dtype=dtype or bucket.torch_dtype, device=bucket.device)
        made.append(views(bucket, buffer))
        release(buffer)
        buffers.append(buffer)
    return tuple(buffers), made


def release(buffer: torch.Tensor) -> None:
    """Free ``buffer``'s memory, keeping the tensor and every view of it (``regrow`` gives it back).

    A released buffer must not be read: its views point at no memory.

    >>> flat = torch.ones(4)
    >>> release(flat)
    >>> flat.untyped_storage().nbytes()
    0
    """
    buffer.untyped_storage().resize_(0)


def regrow(buffer: torch.Tensor, zero: bool = False) -> None:
    """Give a released buffer its memory back (its values are undefined until written, unless ``zero``).

    >>> flat = torch.ones(4)
    >>> release(flat); regrow(flat, zero=True)
    >>> flat.tolist()
    [0.0, 0.0, 0.0, 0.0]
    """
    storage = buffer.untyped_storage()
    needed = (buffer.storage_offset() + buffer.numel()) * buffer.element_size()
    if storage.nbytes() < needed:
        storage.resize_(needed)
        if zero:
            buffer.zero_()


def pack(
    plan: BucketPlan, grads: Mapping[str, torch.Tensor], buffers: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Copy every gradient into its slot of ``buffers`` (in place); return the buffers.

    Names of the plan absent from ``grads`` (parameters without a gradient) are
    zero-filled; a name in ``grads`` that the plan does not know, or a gradient of the
    wrong shape, raises. Values are cast to the bucket's dtype as ``Tensor.copy_`` does.

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("a", (2,), "float32", "cpu"), ("u", (1,), "float32", "cpu")])
    >>> flats = (torch.full((3,), 7.0),)
    >>> pack(plan, {"a": torch.tensor([1.0, 2.0])}, flats)[0].tolist()
    [1.0, 2.0, 0.0]
    """
    _check_buffers(plan, buffers)
    found = 0
    with torch.no_grad():
        for bucket, flat in zip(plan.buckets, buffers):
            names, _, shapes, _, _ = bucket._layout
            aliases = _aliases(bucket, flat)
            try:
                values = [grads[n] for n in names]
            except KeyError:
                found += _pack_partial(bucket, aliases, grads)
                continue
            if [v.shape for v in values] != shapes:
                _raise_shape_mismatch(names, shapes, values)
            # One fused copy for the whole bucket: per-tensor copy_ calls cost ~1 us of
            # Python each, which is most of the time for trees of many small tensors.
            foreach.copy_(aliases, values)
            found += len(names)
    if found != len(grads):
        known = set(plan.names)
        unknown = [n for n in grads if n not in known]
        raise KeyError(f"gradients for parameters the bucket plan does not have: {unknown[:10]}")
    return tuple(buffers)


def _pack_partial(bucket: Bucket, aliases: list[torch.Tensor], grads: Mapping[str, torch.Tensor]) -> int:
    names, _, shapes, _, _ = bucket._layout
    present = [i for i, n in enumerate(names) if n in grads]
    values = [grads[names[i]] for i in present]
    wanted = [shapes[i] for i in present]
    if [v.shape for v in values] != wanted:
        _raise_shape_mismatch([names[i] for i in present], wanted, values)
    if present:
        foreach.copy_([aliases[i] for i in present], values)
    taken = set(present)
    missing = [a for i, a in enumerate(aliases) if i not in taken]
    if missing:
        foreach.zero_(missing)
    return len(present)


def _raise_shape_mismatch(names: Sequence[str], shapes: Sequence[tuple[int, ...]], values: Sequence[torch.Tensor]):
    for name, shape, v in zip(names, shapes, values):
        if tuple(v.shape) != tuple(shape):
            raise ValueError(f"gradient {name!r} has shape {tuple(v.shape)}, the bucket plan expects {tuple(shape)}")


def unpack(plan: BucketPlan, buffers: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients as views into ``buffers``, in the parameters' shapes, in plan order.

    No data is copied: each value shares storage with its bucket buffer, so writing to the
    buffer shows in the view (and packing the next step overwrites it).

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (2, 2), "float32", "cpu")])
    >>> flats = (torch.arange(4.0),)
    >>> grads = unpack(plan, flats)
    >>> flats[0][3] = 9.0
    >>> grads["w"].tolist()
    [[0.0, 1.0], [2.0, 9.0]]
    """
    _check_buffers(plan, buffers)
    out: dict[str, torch.Tensor] = {}
    for bucket, flat in zip(plan.buckets, buffers):
        out.update(slot_views(bucket, flat))
    return out


def slot_views(bucket: Bucket, flat: torch.Tensor, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Views of one bucket's tensors in ``flat``, in their own shapes, in slot order.

    For hooks that work tensor by tensor (PowerSGD compresses each matrix on its own).
    ``dtype``: the dtype ``flat`` holds the bucket in, where not the plan's (ZeRO stage 3's
    bf16 gathers).

    >>> from fdp.plan import pack_into_buckets
    >>> bucket = pack_into_buckets([("b", (2,), "float32", "cpu"), ("w", (1, 2), "float32", "cpu")]).buckets[0]
    >>> {n: v.tolist() for n, v in slot_views(bucket, torch.arange(4.0)).items()}
    {'b': [0.0, 1.0], 'w': [[2.0, 3.0]]}
    """
    _check_buffer(bucket, flat, dtype)
    names, _, shapes, strides, offsets = bucket._layout
    base = flat.storage_offset()
    # One as_strided per tensor is one op; split() then view() would be two.
    return {n: flat.as_strided(s, st, base + o) for n, s, st, o in zip(names, shapes, strides, offsets)}


def lay_out(plan: BucketPlan, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` copied into one new flat buffer per bucket, as views in their own shapes.

    Same keys, same order. Params so laid out cross the ``torch.func`` transform as one
    tensor per bucket (``flat_buffers``), and their gradient comes out as one flat
    tensor per bucket; names the plan does not hold are kept as they are.

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("b", (2,), "float32", "cpu"), ("w", (1, 2), "float32", "cpu")])
    >>> params = lay_out(plan, {"w": torch.ones(1, 2), "b": torch.zeros(2)})
    >>> list(params), flat_buffers(plan, params)[0].tolist()
    (['w', 'b'], [0.0, 0.0, 1.0, 1.0])
    """
    views: dict[str, torch.Tensor] = {}
    for bucket in plan.buckets:
        views.update(slot_views(bucket, torch.empty(bucket.numel, dtype=bucket.torch_dtype, device=bucket.device)))
    names = [name for name in params if name in views]
    with torch.no_grad():
        foreach.copy_([views[n] for n in names], [params[n] for n in names])
    return {name: views.get(name, value) for name, value in params.items()}


def flat_buffers(
    plan: BucketPlan, params: Mapping[str, torch.Tensor], known_laid_out: bool = False
) -> tuple[torch.Tensor, ...] | None:
    """The flat tensors (one per bucket, ``bucket.numel`` long) that ``params`` are views of; ``None`` if they are not.

    Params are views of a bucket's buffer when each lies in one storage at its slot's
    offset, contiguous, in the bucket's dtype, as ``lay_out`` (or ``fdp.update.zero``) leaves
    them. The buffers returned share that storage (writing to them writes the params).
    ``known_laid_out=True`` skips the look at every tensor, for params already found laid out.

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (2,), "float32", "cpu")])
    >>> flat_buffers(plan, {"w": torch.ones(2)})[0].tolist(), flat_buffers(plan, {"w": torch.ones(4)[::2]})
    ([1.0, 1.0], None)
    """
    flats = []
    for bucket in plan.buckets:
        names, _, shapes, strides, offsets = bucket._layout
        first = params[names[0]]
        base = first.storage_offset() - offsets[0]
        storage = first.untyped_storage()
        if (
            base < 0
            or storage.nbytes() < (base + bucket.numel) * first.element_size()
            or first.dtype != bucket.torch_dtype
        ):
            return None
        start = storage.data_ptr()
        for name, shape, stride, offset in () if known_laid_out else zip(names, shapes, strides, offsets):
            p = params[name]
            if (
                p.untyped_storage().data_ptr() != start
                or p.storage_offset() != base + offset
                or p.shape != shape
                or p.stride() != stride
                or p.dtype != first.dtype
            ):
                return None
        flats.append(storage_alias(first, -offsets[0], (bucket.numel,), (1,)))
    return tuple(flats)


def crosses_flat(plan: BucketPlan) -> bool:
    """Whether a step should hand ``torch.func`` the params as one flat buffer per bucket (``lay_out``).

    Flat, the transform wraps, unwraps and differentiates one tensor per bucket instead
    of one per parameter (~8 us of host time each, measured on a 2-core CPU), at the
    cost of one more pass over the gradient: the backward of ``views_in``'s split
    concatenates each bucket's gradients before they are copied into the bucket. On a
    GPU that pass takes microseconds; on a CPU it pays only for small tensors, up to
    32 KiB on average. Measured here in CPU time per step (24-layer MLPs, batch 32): 2%
    faster flat at 8 KiB per tensor, the same at 33 KiB, 4% slower at 130 KiB and 24%
    slower at 4 MiB (the 25M MLP of ``vs_ddp.py``).

    >>> from fdp.plan import pack_into_buckets
    >>> crosses_flat(pack_into_buckets([("w", (64, 64), "float32", "cpu")]))  # 16 KiB
    True
    >>> crosses_flat(pack_into_buckets([("w", (1024, 1024), "float32", "cpu")]))
    False
    """
    if not plan.names:
        return False
    if any(torch.device(b.device).type != "cpu" for b in plan.buckets):
        return True
    return plan.nbytes / len(plan.names) <= FLAT_CPU_BYTES_PER_TENSOR


def views_in(bucket: Bucket, flat: torch.Tensor) -> list[torch.Tensor]:
    """The bucket's tensors as differentiable views of ``flat``, in slot order.

    One split, and a view per tensor that is not 1-D.

    Inside ``torch.func`` this costs two ops per matrix where passing each tensor in
    costs a wrapper per tensor; the gradient of ``flat`` comes out as one tensor.

    >>> from fdp.plan import pack_into_buckets
    >>> bucket = pack_into_buckets([("b", (2,), "float32", "cpu"), ("w", (1, 2), "float32", "cpu")]).buckets[0]
    >>> [v.shape for v in views_in(bucket, torch.arange(4.0))]
    [torch.Size([2]), torch.Size([1, 2])]
    """
    _, numels, shapes, _, _ = bucket._layout
    return [piece if len(shape) == 1 else piece.view(shape) for piece, shape in zip(flat.split(numels), shapes)]


def _check_buffers(plan: BucketPlan, buffers: Sequence[torch.Tensor]) -> None:
    if len(buffers) != len(plan.buckets):
        raise ValueError(f"{len(buffers)} buffers for a plan of {len(plan.buckets)} buckets")
    for bucket, flat in zip(plan.buckets, buffers):
        _check_buffer(bucket, flat)


def _check_buffer(bucket: Bucket, flat: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if flat.dim() != 1 or flat.numel() != bucket.numel or not flat.is_contiguous():
        raise ValueError(
            f"buffer of bucket {bucket.index} must be a contiguous 1-D tensor of {bucket.numel} elements, "
            f"got shape {tuple(flat.shape)} (contiguous={flat.is_contiguous()})"
        )
    expected = dtype or bucket.torch_dtype
    if flat.dtype != expected:
        raise ValueError(f"buffer of bucket {bucket.index} has dtype {flat.dtype}, expected {expected}")


# Per-buffer slot aliases for pack(), so that a step does not rebuild one view per tensor.
# They are made with set_() on the buffer's storage, not as views: a view keeps its base's
# Python object alive, so a cache of views would pin every buffer ever packed (measured:
# the weakref callback below never fires). Aliases only share the storage, so the buffer
# can die, its callback drops the entry and the memory is freed.
_ALIASES: dict[int, tuple[weakref.ref, int, Bucket, list[torch.Tensor]]] = {}


def _aliases(bucket: Bucket, flat: torch.Tensor) -> list[torch.Tensor]:
    key = id(flat)
    entry = _ALIASES.get(key)
    if entry is not None:
        ref, ptr, cached_bucket, aliases = entry
        if ref() is flat and ptr == flat.data_ptr():
            if cached_bucket is bucket:
                return aliases
            if cached_bucket == bucket:  # an equal plan rebuilt (e.g. from JSON): same layout
                _ALIASES[key] = (ref, ptr, bucket, aliases)
                return aliases
    _, _, shapes, strides, offsets = bucket._layout
    aliases = [storage_alias(flat, o, s, st) for s, st, o in zip(shapes, strides, offsets)]
    _ALIASES[key] = (weakref.ref(flat, functools.partial(_forget, key)), flat.data_ptr(), bucket, aliases)
    return aliases


def _forget(key: int, dead: weakref.ref) -> None:
    entry = _ALIASES.get(key) if _ALIASES is not None else None
    if entry is not None and entry[0] is dead:
        del _ALIASES[key]
