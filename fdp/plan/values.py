"""The plan as a value: :class:`ParamSlot`, :class:`Bucket`, :class:`BucketPlan`.

Immutable, comparable, hashable and JSON-round-trippable; printing a plan gives a table.
Plans are made by :func:`fdp.plan.pack_into_buckets` (from an order) or
:func:`fdp.plan.plan_buckets` (from a model).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from fdp.errors import check_real

MiB = 2**20
_FORMAT = "fdp.BucketPlan"
_VERSION = 1

TensorSpec = tuple[str, tuple[int, ...], "torch.dtype | str", "torch.device | str"]


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
        # per bucket: fdp.plan.buckets packs every step and must not re-walk the slots in Python.
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

    >>> from fdp.plan import pack_into_buckets
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
        object.__setattr__(self, "bucket_cap_mb", check_cap("bucket_cap_mb", self.bucket_cap_mb))
        object.__setattr__(self, "first_bucket_cap_mb", check_cap("first_bucket_cap_mb", self.first_bucket_cap_mb))
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

        >>> from fdp.plan import pack_into_buckets
        >>> pack_into_buckets([("a", (1,), "float32", "cpu"), ("b", (1,), "float32", "cpu")]).names
        ('a', 'b')
        """
        return tuple(s.name for b in self.buckets for s in b.slots)

    @property
    def nbytes(self) -> int:
        """Total bytes of all bucket buffers.

        >>> from fdp.plan import pack_into_buckets
        >>> pack_into_buckets([("a", (3,), "float64", "cpu")]).nbytes
        24
        """
        return sum(b.nbytes for b in self.buckets)

    def slot(self, name: str) -> tuple[int, ParamSlot]:
        """``(bucket_index, ParamSlot)`` of parameter ``name``; ``KeyError`` if not planned.

        >>> from fdp.plan import pack_into_buckets
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

        >>> from fdp.plan import pack_into_buckets
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

        >>> from fdp.plan import pack_into_buckets
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

    def on_cpu(self) -> BucketPlan:
        """This plan with every bucket on the CPU: the layout ranks and checkpoints compare.

        Each rank's buckets live on its own GPU, and a checkpoint may be resumed on another
        device; neither changes which tensor sits where in which bucket.

        >>> from fdp.plan import pack_into_buckets
        >>> gpu = pack_into_buckets([("w", (2, 3), "float32", "cuda:1")])
        >>> gpu.on_cpu().buckets[0].device, gpu.on_cpu() == pack_into_buckets([("w", (2, 3), "float32", "cpu")])
        ('cpu', True)
        """
        layout = self.to_dict()
        return BucketPlan.from_dict({**layout, "buckets": [{**b, "device": "cpu"} for b in layout["buckets"]]})

    def fingerprint(self) -> str:
        """SHA-256 hex digest of the canonical JSON of the plan: same plan, same string, anywhere.

        Python's ``hash()`` is salted per process, so it cannot be compared across ranks;
        this can.

        >>> from fdp.plan import pack_into_buckets
        >>> a = pack_into_buckets([("w", (2, 3), "float32", "cpu")])
        >>> b = pack_into_buckets([("w", (3, 2), "float32", "cpu")])
        >>> a.fingerprint() == pack_into_buckets([("w", (2, 3), torch.float32, "cpu")]).fingerprint()
        True
        >>> a.fingerprint() == b.fingerprint()
        False
        """
        canonical = json.dumps(
            self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()

    # --------------------------------------------------------------- comparison

    def first_difference(self, other: BucketPlan) -> str | None:
        """A sentence naming the first thing that differs from ``other``; ``None`` if equal.

        Caps are compared first (they usually explain the rest), then parameters in plan
        order (positions are 0-based indices into :attr:`names`).

        >>> from fdp.plan import pack_into_buckets
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
        header = ("bucket", "dtype", "device", "params", "MiB", "tensors", "first param", "last param")
        rows = [
            (
                f"{b.index}{' (unused)' if b.unused else ''}",
                b.dtype,
                b.device,
                f"{sum(s.numel for s in b.slots):,}",
                _mib(b.nbytes),
                str(len(b.slots)),
                b.slots[0].name,
                b.slots[-1].name,
            )
            for b in self.buckets
        ]
        widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
        numeric = {3, 4, 5}

        def fmt(row: Sequence[str]) -> str:
            cells = (cell.rjust(w) if c in numeric else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths)))
            return " | ".join(cells).rstrip()

        # Gradients become ready from the last layer back: the plan packs them in that order.
        lines = [
            "buckets in backward order (bucket 0 holds the gradients that become ready first: the last layers)",
            fmt(header),
            "-+-".join("-" * w for w in widths),
        ]
        lines += [fmt(r) for r in rows]
        n_tensors = sum(len(b.slots) for b in self.buckets)
        n_params = sum(s.numel for b in self.buckets for s in b.slots)
        lines.append(
            f"total: {len(self.buckets)} buckets, {n_tensors} tensors, {n_params:,} params, "
            f"{self.nbytes / MiB:.3f} MiB "
            f"(caps: first {self.first_bucket_cap_mb:g} MiB, then {self.bucket_cap_mb:g} MiB)"
        )
        return "\n".join(lines)


def _mib(nbytes: int) -> str:
    # A tiny bucket printed as 0.000 MiB would look empty.
    return f"{nbytes / MiB:.3f}" if nbytes == 0 or nbytes >= MiB / 1000 else "<0.001"


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


def check_cap(name: str, value: float) -> float:
    """A bucket cap (``bucket_cap_mb``, ``first_bucket_cap_mb``): a finite size in MiB > 0.

    >>> check_cap("bucket_cap_mb", 0)
    Traceback (most recent call last):
    ...
    ValueError: bucket_cap_mb=0: expected a size in MiB > 0
    """
    return check_real(name, value, 0.0, low_open=True, what="a size in MiB > 0")
