"""Static gradient-bucket plans, decided before step 1 and kept as plain values.

PyTorch DDP picks its buckets at run time: a first guess in reverse ``parameters()``
order, rebuilt after the first iteration from the order it observed. fdp instead traces
one backward before training, records the order in which each gradient becomes ready, and
packs that order into buckets once. The result, a :class:`BucketPlan`, is an immutable
value: print it, save it as JSON, and compare its :meth:`~BucketPlan.fingerprint` across
ranks before the first all-reduce.

>>> plan = pack_into_buckets([("fc2.bias", (10,), "float32", "cpu"),
...                           ("fc2.weight", (10, 64), "float32", "cpu"),
...                           ("fc1.weight", (64, 32), "float32", "cpu")],
...                          bucket_cap_mb=0.01, first_bucket_cap_mb=0.001)
>>> [b.names for b in plan.buckets]
[('fc2.bias',), ('fc2.weight',), ('fc1.weight',)]
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "ParamSlot",
    "Bucket",
    "BucketPlan",
    "gradient_ready_order",
    "plan_buckets",
    "pack_into_buckets",
]

MiB = 2**20
_FORMAT = "fdp.BucketPlan"
_VERSION = 1

TensorSpec = tuple[str, tuple[int, ...], "torch.dtype | str", "torch.device | str"]
Trace = Literal["auto", "meta", "real"]


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place inside its bucket's flat buffer (offset/numel in elements).

    >>> s = ParamSlot("fc.weight", (10, 64), offset=10, numel=640)
    >>> s.stop
    650
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    def __post_init__(self) -> None:
        # Normalise so that a slot read back from JSON (lists) equals the original (tuples).
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if math.prod(self.shape) != self.numel:
            raise ValueError(f"slot {self.name!r}: numel {self.numel} does not match shape {self.shape}")
        if self.offset < 0:
            raise ValueError(f"slot {self.name!r}: negative offset {self.offset}")

    @property
    def stop(self) -> int:
        """End (exclusive) of the slot in the bucket's flat buffer.

        >>> ParamSlot("b", (3,), offset=2, numel=3).stop
        5
        """
        return self.offset + self.numel


@dataclass(frozen=True)
class Bucket:
    """A run of gradients of one dtype and device, reduced as one flat buffer.

    ``unused=True`` marks the final bucket(s) of parameters that receive no gradient
    (``allow_unused``): the runtime reduces them as zeros.

    >>> b = Bucket(0, "float32", "cpu", (ParamSlot("w", (2, 3), 0, 6), ParamSlot("b", (2,), 6, 2)), 8)
    >>> b.names, b.nbytes, b.torch_dtype
    (('w', 'b'), 32, torch.float32)
    """

    index: int
    dtype: str
    device: str
    slots: tuple[ParamSlot, ...]
    numel: int
    unused: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        object.__setattr__(self, "device", _device_name(self.device))
        object.__setattr__(self, "slots", tuple(self.slots))
        if not self.slots:
            raise ValueError(f"bucket {self.index} is empty")
        offset = 0
        for s in self.slots:
            # Contiguous, gap-free slots are what lets pack() fill a bucket with one cat.
            if s.offset != offset:
                raise ValueError(f"bucket {self.index}: slot {s.name!r} at offset {s.offset}, expected {offset}")
            offset = s.stop
        if offset != self.numel:
            raise ValueError(f"bucket {self.index}: numel {self.numel} but slots hold {offset} elements")

    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names in the bucket, in gradient-ready order.

        >>> Bucket(0, "float32", "cpu", (ParamSlot("w", (1,), 0, 1),), 1).names
        ('w',)
        """
        return tuple(s.name for s in self.slots)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The bucket's dtype as a ``torch.dtype``.

        >>> Bucket(0, "bfloat16", "cpu", (ParamSlot("w", (1,), 0, 1),), 1).torch_dtype
        torch.bfloat16
        """
        return getattr(torch, self.dtype)

    @functools.cached_property
    def _layout(self) -> tuple[list[str], list[int], list[tuple[int, ...]], list[tuple[int, ...]], list[int]]:
        # Names, numels, shapes, contiguous strides and offsets as plain lists, computed once
        # per bucket: fdp.buckets packs every step and must not re-walk the slots in Python.
        # (cached_property writes the instance __dict__ directly, so it works on a frozen
        # dataclass and takes no part in eq/hash.)
        names = [s.name for s in self.slots]
        numels = [s.numel for s in self.slots]
        shapes = [s.shape for s in self.slots]
        strides = [_contiguous_strides(s.shape) for s in self.slots]
        offsets = [s.offset for s in self.slots]
        return names, numels, shapes, strides, offsets

    @property
    def nbytes(self) -> int:
        """Size of the bucket's flat buffer in bytes.

        >>> Bucket(0, "float16", "cpu", (ParamSlot("w", (4,), 0, 4),), 4).nbytes
        8
        """
        return self.numel * self.torch_dtype.itemsize


@dataclass(frozen=True)
class BucketPlan:
    """Which gradient goes into which bucket, at which offset: a plain, comparable value.

    ``bucket_cap_mb``/``first_bucket_cap_mb`` are the caps the plan was packed with (MiB,
    2**20 bytes). Buckets are numbered in the order they become fully ready in backward.

    >>> plan = pack_into_buckets([("b", (4,), "float32", "cpu"), ("w", (4, 4), "float32", "cpu")])
    >>> len(plan), plan.names, plan.nbytes
    (1, ('b', 'w'), 80)
    >>> plan.slot("w")
    (0, ParamSlot(name='w', shape=(4, 4), offset=4, numel=16))
    >>> plan == BucketPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    True
    """

    buckets: tuple[Bucket, ...]
    bucket_cap_mb: float
    first_bucket_cap_mb: float
    _where: dict[str, tuple[int, int]] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", tuple(self.buckets))
        # 25 and 25.0 must give the same JSON, or equal plans would get different fingerprints.
        object.__setattr__(self, "bucket_cap_mb", _check_cap("bucket_cap_mb", self.bucket_cap_mb))
        object.__setattr__(self, "first_bucket_cap_mb", _check_cap("first_bucket_cap_mb", self.first_bucket_cap_mb))
        if not self.buckets:
            raise ValueError("a BucketPlan needs at least one bucket")
        where: dict[str, tuple[int, int]] = {}
        seen_unused = False
        for i, b in enumerate(self.buckets):
            if b.index != i:
                raise ValueError(f"bucket at position {i} has index {b.index}")
            if seen_unused and not b.unused:
                raise ValueError(f"bucket {i} receives gradients but follows an unused bucket")
            seen_unused |= b.unused
            for j, s in enumerate(b.slots):
                if s.name in where:
                    raise ValueError(f"parameter {s.name!r} appears in buckets {where[s.name][0]} and {i}")
                where[s.name] = (i, j)
        object.__setattr__(self, "_where", where)

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def names(self) -> tuple[str, ...]:
        """All parameter names, bucket by bucket, slot by slot.

        >>> pack_into_buckets([("a", (1,), "float32", "cpu"), ("b", (1,), "float32", "cpu")]).names
        ('a', 'b')
        """
        return tuple(s.name for b in self.buckets for s in b.slots)

    @property
    def nbytes(self) -> int:
        """Total bytes of all bucket buffers.

        >>> pack_into_buckets([("a", (3,), "float64", "cpu")]).nbytes
        24
        """
        return sum(b.nbytes for b in self.buckets)

    def slot(self, name: str) -> tuple[int, ParamSlot]:
        """``(bucket_index, ParamSlot)`` of parameter ``name``; ``KeyError`` if not planned.

        >>> pack_into_buckets([("a", (3,), "float32", "cpu")]).slot("a")
        (0, ParamSlot(name='a', shape=(3,), offset=0, numel=3))
        """
        try:
            i, j = self._where[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not in the bucket plan") from None
        return i, self.buckets[i].slots[j]

    # --------------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; :meth:`from_dict` inverts it exactly.

        >>> d = pack_into_buckets([("a", (2, 3), "float32", "cpu")]).to_dict()
        >>> d["buckets"][0]["slots"]
        [{'name': 'a', 'shape': [2, 3], 'offset': 0, 'numel': 6}]
        """
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "bucket_cap_mb": self.bucket_cap_mb,
            "first_bucket_cap_mb": self.first_bucket_cap_mb,
            "buckets": [
                {
                    "index": b.index,
                    "dtype": b.dtype,
                    "device": b.device,
                    "numel": b.numel,
                    "unused": b.unused,
                    "slots": [
                        {"name": s.name, "shape": list(s.shape), "offset": s.offset, "numel": s.numel} for s in b.slots
                    ],
                }
                for b in self.buckets
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BucketPlan:
        """Rebuild a plan from :meth:`to_dict` output (e.g. after ``json.load``), validating it.

        >>> plan = pack_into_buckets([("a", (2, 3), "float32", "cpu")])
        >>> BucketPlan.from_dict(plan.to_dict()) == plan
        True
        """
        if d.get("format") != _FORMAT or d.get("version") != _VERSION:
            raise ValueError(
                f"not a {_FORMAT} version {_VERSION} dict (format={d.get('format')!r}, version={d.get('version')!r})"
            )
        buckets = tuple(
            Bucket(
                index=int(b["index"]),
                dtype=b["dtype"],
                device=b["device"],
                numel=int(b["numel"]),
                unused=bool(b["unused"]),
                slots=tuple(
                    ParamSlot(str(s["name"]), tuple(s["shape"]), int(s["offset"]), int(s["numel"])) for s in b["slots"]
                ),
            )
            for b in d["buckets"]
        )
        return cls(buckets, d["bucket_cap_mb"], d["first_bucket_cap_mb"])

    def fingerprint(self) -> str:
        """SHA-256 hex digest of the canonical JSON of the plan: same plan, same string, anywhere.

        Python's ``hash()`` is salted per process, so it cannot be compared across ranks;
        this can.

        >>> a = pack_into_buckets([("w", (2, 3), "float32", "cpu")])
        >>> b = pack_into_buckets([("w", (3, 2), "float32", "cpu")])
        >>> a.fingerprint() == pack_into_buckets([("w", (2, 3), torch.float32, "cpu")]).fingerprint()
        True
        >>> a.fingerprint() == b.fingerprint()
        False
        """
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()

    # --------------------------------------------------------------- comparison

    def first_difference(self, other: BucketPlan) -> str | None:
        """A sentence naming the first thing that differs from ``other``; ``None`` if equal.

        Caps are compared first (they usually explain the rest), then parameters in plan
        order (positions are 0-based indices into :attr:`names`).

        >>> a = pack_into_buckets([("b", (10,), "float32", "cpu"), ("fc.weight", (10, 64), "float32", "cpu")])
        >>> b = pack_into_buckets([("b", (10,), "float32", "cpu"), ("fc.weight", (10, 32), "float32", "cpu")])
        >>> a.first_difference(b)
        "parameter 1: 'fc.weight' shape (10, 64) vs (10, 32)"
        >>> a.first_difference(a) is None
        True
        """
        if self == other:
            return None
        for cap in ("first_bucket_cap_mb", "bucket_cap_mb"):
            mine, theirs = getattr(self, cap), getattr(other, cap)
            if mine != theirs:
                return f"{cap} {mine} vs {theirs}"
        rows_a, rows_b = self._rows(), other._rows()
        for i, (a, b) in enumerate(zip(rows_a, rows_b)):
            if a == b:
                continue
            name_a, name_b = a[0], b[0]
            if name_a != name_b:
                return f"parameter {i}: {name_a!r} vs {name_b!r}"
            head = f"parameter {i}: {name_a!r}"
            for label, x, y in zip(("shape", "dtype", "device", "unused", "bucket", "offset"), a[1:], b[1:]):
                if x != y:
                    if label == "unused":
                        return f"{head} {'unused' if x else 'used'} vs {'unused' if y else 'used'}"
                    return f"{head} {label} {x} vs {y}"
        if len(rows_a) != len(rows_b):
            n = min(len(rows_a), len(rows_b))
            extra = (rows_a if len(rows_a) > n else rows_b)[n][0]
            side = "only this plan" if len(rows_a) > n else "only the other plan"
            return f"{len(rows_a)} parameters vs {len(rows_b)}; parameter {n}: {extra!r} is in {side}"
        # Same parameters in the same places: the buckets themselves must differ in layout.
        return f"plans differ (fingerprints {self.fingerprint()[:12]} vs {other.fingerprint()[:12]})"

    def _rows(self) -> list[tuple[Any, ...]]:
        return [
            (s.name, s.shape, b.dtype, b.device, b.unused, b.index, s.offset) for b in self.buckets for s in b.slots
        ]

    # --------------------------------------------------------------- display

    def __str__(self) -> str:
        header = ("bucket", "dtype", "device", "MiB", "tensors", "first param", "last param")
        rows = [
            (
                f"{b.index}{' (unused)' if b.unused else ''}",
                b.dtype,
                b.device,
                _mib(b.nbytes),
                str(len(b.slots)),
                b.slots[0].name,
                b.slots[-1].name,
            )
            for b in self.buckets
        ]
        widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
        numeric = {3, 4}

        def fmt(row: Sequence[str]) -> str:
            cells = (cell.rjust(w) if c in numeric else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths)))
            return " | ".join(cells).rstrip()

        lines = [fmt(header), "-+-".join("-" * w for w in widths)]
        lines += [fmt(r) for r in rows]
        n_tensors = sum(len(b.slots) for b in self.buckets)
        lines.append(
            f"total: {len(self.buckets)} buckets, {n_tensors} tensors, {self.nbytes / MiB:.3f} MiB "
            f"(caps: first {self.first_bucket_cap_mb:g} MiB, then {self.bucket_cap_mb:g} MiB)"
        )
        return "\n".join(lines)


def _mib(nbytes: int) -> str:
    # A tiny bucket printed as 0.000 MiB would look empty.
    return f"{nbytes / MiB:.3f}" if nbytes == 0 or nbytes >= MiB / 1000 else "<0.001"


# ----------------------------------------------------------------------------- packing


def pack_into_buckets(
    order: Sequence[TensorSpec],
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    unused: Sequence[TensorSpec] = (),
) -> BucketPlan:
    """Pack ``(name, shape, dtype, device)`` specs, in gradient-ready order, into buckets.

    Rules (the pure step of :func:`plan_buckets`, usable without a model):

    * tensors are grouped by ``(dtype, device)``, with one open bucket per group;
    * before adding a tensor that would push the open bucket over its cap, that bucket is
      closed; the first bucket of each group is capped at ``first_bucket_cap_mb`` (so the
      first all-reduce starts early), later ones at ``bucket_cap_mb``;
    * a tensor is never split: one larger than the cap gets a bucket of its own;
    * buckets are numbered by the gradient-ready position of their last tensor, i.e. in
      the order they become fully ready in backward;
    * ``unused`` specs (parameters that get no gradient) go into final buckets marked
      ``unused=True``, grouped the same way and capped at ``bucket_cap_mb``.

    >>> f32 = lambda name, n: (name, (n,), "float32", "cpu")
    >>> plan = pack_into_buckets([f32("a", 2), f32("b", 2), f32("c", 3)],
    ...                          bucket_cap_mb=12 / MiB, first_bucket_cap_mb=16 / MiB)
    >>> [b.names for b in plan.buckets]
    [('a', 'b'), ('c',)]
    """
    bucket_cap_mb = _check_cap("bucket_cap_mb", bucket_cap_mb)
    first_bucket_cap_mb = _check_cap("first_bucket_cap_mb", first_bucket_cap_mb)
    used = [_spec(s) for s in order]
    idle = [_spec(s) for s in unused]
    if not used and not idle:
        raise ValueError("no parameters to plan: the parameter tree is empty")
    seen: set[str] = set()
    for name, *_ in used + idle:
        if name in seen:
            raise ValueError(f"parameter {name!r} appears more than once")
        seen.add(name)
    groups = _greedy(used, first_bucket_cap_mb * MiB, bucket_cap_mb * MiB, unused=False)
    groups += _greedy(idle, bucket_cap_mb * MiB, bucket_cap_mb * MiB, unused=True)
    # Sorting by (unused, position of the last tensor) numbers buckets in the order they
    # become fully ready; unused buckets are never "ready", so they come last.
    buckets = []
    for index, (_, dtype, device, specs, is_unused) in enumerate(sorted(groups, key=lambda g: (g[4], g[0]))):
        slots, offset = [], 0
        for name, shape, _, _ in specs:
            numel = math.prod(shape)
            slots.append(ParamSlot(name, shape, offset, numel))
            offset += numel
        buckets.append(Bucket(index, dtype, device, tuple(slots), offset, is_unused))
    return BucketPlan(tuple(buckets), bucket_cap_mb, first_bucket_cap_mb)


def _greedy(
    specs: list[tuple[str, tuple[int, ...], str, str]], first_cap: float, cap: float, unused: bool
) -> list[tuple[int, str, str, list, bool]]:
    open_: dict[tuple[str, str], list] = {}  # (dtype, device) -> [specs, nbytes, cap, last position]
    closed: list[tuple[int, str, str, list, bool]] = []
    for pos, spec in enumerate(specs):
        _, shape, dtype, device = spec
        nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
        key = (dtype, device)
        cur = open_.get(key)
        if cur is None:
            cur = open_[key] = [[], 0, first_cap, pos]
        elif cur[0] and cur[1] + nbytes > cur[2]:
            # Close before overflowing; an empty bucket still takes an oversized tensor,
            # since tensors are never split.
            closed.append((cur[3], dtype, device, cur[0], unused))
            cur = open_[key] = [[], 0, cap, pos]
        cur[0].append(spec)
        cur[1] += nbytes
        cur[3] = pos
    closed += [(c[3], dtype, device, c[0], unused) for (dtype, device), c in open_.items()]
    return closed


def _spec(spec: TensorSpec) -> tuple[str, tuple[int, ...], str, str]:
    name, shape, dtype, device = spec
    if not isinstance(name, str):
        raise TypeError(f"parameter names must be str, got {name!r}")
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"parameter {name!r}: negative dimension in shape {shape}")
    return name, shape, _dtype_name(dtype), _device_name(device)


def _dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        dtype = resolved
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype or its name, got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def _device_name(device: torch.device | str) -> str:
    return str(torch.device(device))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _check_cap(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r}: expected > 0 (and finite)")
    return float(value)


# ----------------------------------------------------------------------------- tracing


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

    Runs ``torch.func.grad`` of ``loss_fn(params, batch)`` once, with a tensor hook on
    every parameter; ``loss_fn`` may return a scalar loss or ``(loss, aux)``. Parameters
    whose hook never fires get no gradient and are left out of the list.

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
        return _traced_order(loss_fn, meta_params, pytree.tree_map(_to_meta, example_batch))
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

    torch.func.grad(traced)(params, batch)
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
) -> BucketPlan:
    """Trace the gradient-ready order of ``params`` and pack it into a :class:`BucketPlan`.

    ``loss_fn(params, batch)`` returns a scalar loss or ``(loss, aux)``. Parameters that
    receive no gradient raise ``ValueError`` naming them, unless ``allow_unused``, which
    puts them in final buckets marked ``unused`` (reduced as zeros). Dtypes, devices and
    shapes are taken from ``params`` itself, whatever device the trace ran on. ``trace``
    is as in :func:`gradient_ready_order`; packing is :func:`pack_into_buckets`.

    >>> from fdp.functional import functionalize
    >>> model, params, buffers = functionalize(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    >>> loss_fn = lambda p, x: model.apply(p, buffers, x)[0].sum()
    >>> plan = plan_buckets(loss_fn, params, torch.randn(3, 4))
    >>> plan.names
    ('1.bias', '1.weight', '0.bias', '0.weight')
    """
    bucket_cap_mb = _check_cap("bucket_cap_mb", bucket_cap_mb)
    first_bucket_cap_mb = _check_cap("first_bucket_cap_mb", first_bucket_cap_mb)
    if not params:
        raise ValueError("no parameters to plan: the parameter tree is empty")
    order = gradient_ready_order(loss_fn, params, example_batch, trace=trace)
    fired = set(order)
    missing = [name for name in params if name not in fired]
    if missing and not allow_unused:
        raise ValueError(
            f"parameters receive no gradient: {missing}; set allow_unused=true to reduce them as zeros"
        )

    def spec(name: str) -> TensorSpec:
        t = params[name]
        return (name, tuple(t.shape), t.dtype, t.device)

    return pack_into_buckets(
        [spec(n) for n in order], bucket_cap_mb, first_bucket_cap_mb, unused=[spec(n) for n in missing]
    )
