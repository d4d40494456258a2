"""PowerSGD: low-rank gradient compression with error feedback (Vogels et al., NeurIPS 2019).

Two hooks, with the numerics of PyTorch's DDP hooks of the same names:

* ``powersgd()`` (``powerSGD_hook``): every tensor of the bucket, viewed as an n x m
  matrix (its first dimension by the rest), is approximated by P Qᵀ with P n x r and
  Q m x r. Tensors where that does not save enough (``(n + m) r * min_compression_rate
  >= n m``; all 1-D tensors among them) are averaged exactly instead.
* ``batched_powersgd()`` (``batched_powerSGD_hook``): the whole flat bucket, zero-padded
  to a square, is one matrix. Cheaper, and much less accurate unless ``rank=1``.

One step of compression, on every rank, for each matrix M (the local gradient plus the
error left over from the last step)::

    P = M Q          allreduce(P)    P = orthonormalise(P)
    Q = Mᵀ P         allreduce(Q)    Q = Q / world
    M ≈ P Qᵀ         error = M - P Qᵀ

Since the summed P is orthonormalised, P Qᵀ = P Pᵀ mean(M): every rank gets the same
approximation of the average gradient. With warm start, Q is kept and reused (after
re-orthonormalising) the next step, so the approximation refines over steps like power
iteration; otherwise it is drawn afresh each step.

Everything that decides the numbers is in the per-bucket state, so a step is a pure
function of (state, gradient) and a resumed run continues bit for bit:

* ``iteration``: steps this bucket has been through (plain averaging while
  ``iteration < start_iter``, compression from then on);
* ``error``: this rank's residual (``None`` without error feedback);
* ``q``: the Q of the last step (``None`` without warm start); P is recomputed from
  scratch each step, so it is not state;
* ``rng``: the state of the generator that seeds each random Q (a numpy
  ``RandomState``, as in PyTorch, packed into an int64 tensor);
* ``draws``: how many random Qs were drawn. With warm start Q is drawn when ``draws``
  is 0 (the first compressed step) and reused after, whatever ``start_iter`` a resumed
  run is given.

All tensors are allocated by ``init`` in the bucket's dtype, so the state has the same
structure from the first step to the last (checkpoints flatten it). When the hook runs
on a 16-bit buffer (after ``fp16_compress()``) the arithmetic is 16-bit, like
``fp16_compress_wrapper(powerSGD_hook)``, and the state holds those 16-bit values exactly.

Random Q: like PyTorch, each time Q must be drawn a seed is taken as ``randint(10**9)``
from ``numpy.random.RandomState(seed)`` and Q is filled with ``torch.randn`` from a
generator seeded with it, one tensor at a time (or one shape group at a time when
batching). Ranks agree without communicating. Each bucket has its own stream: bucket 0
uses ``RandomState(seed)`` (so a one-bucket plan reproduces PyTorch's draws exactly),
bucket i > 0 uses ``RandomState([seed, i])``.

At ZeRO stages 2 and 3, where each rank keeps only its slice of a reduced bucket, both
hooks run as at stage 0 and the rank keeps its slice of the approximation
(``fdp.hooks.for_slices``): P and Q are all-reduced whole, and every rank needs the
whole approximation for its error anyway. The same bytes go over the wire; in memory, the
approximation is made whole, one bucket per chain in flight, until its slice is copied
out, and the state stays whole: each rank keeps its error feedback for the whole bucket
(as large as the bucket, in its dtype) and Q, so the hook state does not shrink with the
stage as the optimizer state does.

Deliberate differences from PyTorch:

* an all-zero column met while orthonormalising (a layer whose gradient is exactly zero,
  e.g. an ``unused`` bucket) stays zero instead of turning into NaN when
  ``orthogonalization_epsilon == 0`` (PyTorch means to do this, but its
  ``ZeroDivisionError`` handler never runs: tensor division by zero does not raise);
* ``start_iter`` may be 0 or 1 (see ``powersgd``);
* the rank of ``batched_powersgd`` is capped by the side of the square matrix;
* PyTorch's ``batched_powerSGD_hook`` fails in torch 2.13 once compression starts (it
  hands a 2-D Q to an orthogonaliser that asserts 3-D input); ours runs, with the
  numerics that hook has when its Q is orthonormalised as a batch of one.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from fdp.comm import Comm
from fdp.errors import check_bool, check_int, check_real
from fdp.hooks.allreduce import allreduce
from fdp.hooks.base import GradBucket, Hook, expect_floating
from fdp.plan import Bucket

__all__ = ["PowerSGDState", "powersgd", "batched_powersgd", "DEFAULT_START_ITER"]

# Plain averaging for the first 10 steps of each bucket, then compression. See powersgd().
DEFAULT_START_ITER = 10

_SEED_BOUND = 1_000_000_000  # each Q seed is randint(_SEED_BOUND), as in PyTorch
_MT_WORDS = 624  # Mersenne Twister state words
_ALLREDUCE = allreduce()


class PowerSGDState(NamedTuple):
    """One bucket's PowerSGD state (see the module docstring)."""

    iteration: int
    error: torch.Tensor | None
    q: torch.Tensor | None
    rng: torch.Tensor
    draws: int  # random Qs drawn so far (with warm start: 0 until compression starts, then 1)


# ----------------------------------------------------------------------------- settings


# ----------------------------------------------------------------------------- random Q


def _rng_init(seed: int, index: int) -> torch.Tensor:
    stream = np.random.RandomState(seed if index == 0 else [seed, index])
    return _rng_pack(stream)


def _rng_pack(stream: np.random.RandomState) -> torch.Tensor:
    _, words, pos, _, _ = stream.get_state()
    return torch.from_numpy(np.append(words.astype(np.int64), np.int64(pos)))


def _rng_draw(packed: torch.Tensor) -> tuple[int, np.random.RandomState]:
    """The next Q seed of a packed stream, and the stream after the draw (the input is untouched).

    The caller packs the advanced stream (``_rng_pack``) only after its first collective:
    under the overlap schedule the code before it runs inside torch.func's grad
    transform, where a new tensor comes out wrapped and must not be kept in the state.
    """
    # tolist, not numpy(): inside the transform even plain tensors refuse numpy().
    words = np.asarray(packed.tolist(), dtype=np.int64)
    stream = np.random.RandomState(0)
    stream.set_state(("MT19937", words[:_MT_WORDS].astype(np.uint32), int(words[_MT_WORDS])))
    value = int(stream.randint(_SEED_BOUND))
    return value, stream


def _random_matrices(seed: int, shapes, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    # Drawn on the CPU whatever the device, so that every device gets the same numbers.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype).to(device) for shape in shapes]


# ----------------------------------------------------------------------------- maths


def _orthonormalise(mats: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Orthonormal columns for each matrix of a (batch, n, k) stack, k <= n; a new tensor.

    Gram-Schmidt for k <= 2 and for 16-bit dtypes (QR has no half kernels), else QR.
    """
    k = mats.shape[2]
    if k > 2 and mats.dtype not in (torch.float16, torch.bfloat16):
        # LAPACK hands Q back column-major; the matmuls that follow round differently on
        # a transposed operand, so give them the row-major layout PyTorch's hook uses.
        return torch.linalg.qr(mats).Q.contiguous()
    done = mats
    for i in range(k):
        col = done[:, :, i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        if epsilon == 0:
            # A zero column stays zero (0/0 would poison the whole bucket with NaN).
            col = torch.where(norm == 0, torch.zeros_like(col), col / norm)
        else:
            col = col / (norm + epsilon)
        parts = [done[:, :, :i], col]
        if i + 1 < k:
            rest = done[:, :, i + 1 :]
            parts.append(rest - torch.sum(col * rest, dim=1, keepdim=True) * col)
        done = col if k == 1 else torch.cat(parts, dim=2)
    return done


class _Unit(NamedTuple):
    """Matrices compressed together: ``len(slots)`` of shape n x m, approximated at rank r."""

    slots: tuple[int, ...]  # positions in bucket.slots
    n: int
    m: int
    r: int


class _Layout(NamedTuple):
    plain: tuple[int, ...]  # slots averaged exactly, in slot order
    units: tuple[_Unit, ...]  # in P/Q memory order
    place: tuple[tuple[str, int, int], ...]  # per slot: ("plain", start, numel) or ("unit", unit, batch index)


@functools.lru_cache(maxsize=256)
def _layout(bucket: Bucket, rank: int, min_compression_rate: float, batch: bool) -> _Layout:
    plain: list[int] = []
    groups: dict[tuple[int, int], list[int]] = {}  # first-appearance order of shapes, as PyTorch groups them
    ranks: dict[tuple[int, int], int] = {}
    for i, slot in enumerate(bucket.slots):
        if len(slot.shape) == 0:
            plain.append(i)
            continue
        n = slot.shape[0]
        m = slot.numel // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            groups.setdefault((n, m), []).append(i)
            ranks[(n, m)] = r
        else:
            plain.append(i)
    units: list[_Unit] = []
    for (n, m), members in groups.items():
        if batch:
            units.append(_Unit(tuple(members), n, m, ranks[(n, m)]))
        else:
            units.extend(_Unit((i,), n, m, ranks[(n, m)]) for i in members)
    place: list[tuple[str, int, int]] = [("", 0, 0)] * len(bucket.slots)
    start = 0
    for i in plain:
        numel = bucket.slots[i].numel
        place[i] = ("plain", start, numel)
        start += numel
    for u, unit in enumerate(units):
        for b, i in enumerate(unit.slots):
            place[i] = ("unit", u, b)
    return _Layout(tuple(plain), tuple(units), tuple(place))


def _split(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    sizes = [math.prod(s) for s in shapes]
    return [part.view(shape) for part, shape in zip(torch.split(flat, sizes), shapes)]


def _flat_cat(tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not tensors:
        return like.new_empty(0)
    return torch.cat([t.reshape(-1) for t in tensors])


def _average(grads: GradBucket, comm: Comm):
    # Before compression starts: DDP's allreduce_hook (divide, then sum).
    return (yield from _ALLREDUCE.apply((), grads, comm))[0]


# ----------------------------------------------------------------------------- hooks


def powersgd(
    rank: int = 1,
    start_iter: int = DEFAULT_START_ITER,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
    seed: int = 0,
    batch_same_shape: bool = False,
) -> Hook:
    """PowerSGD, tensor by tensor, as DDP's ``powerSGD_hook`` computes it.

    Settings (PyTorch's ``PowerSGDState`` names in brackets):

    * ``rank`` (``matrix_approximation_rank``): r of the P Qᵀ approximation.
    * ``start_iter`` (``start_powerSGD_iter``): steps of plain averaging before compression.
      The default is 10, not PyTorch's 1000: at 1000 the runs fdp is made for (tens to a
      few thousand steps) would compress late or never, and a compression setting that
      never takes effect teaches nothing. PyTorch's own advice is about 10% of the run;
      Vogels et al. compress from the first step (error feedback and warm start repair
      the early error). Ten steps of exact averaging skip the first, largest and fastest
      changing gradients, where a rank-r approximation with a random Q is worst.
      PyTorch also demands ``start_powerSGD_iter > 1`` with error feedback or warm start,
      because DDP rebuilds its buckets after step 1 and memorised tensors would no
      longer fit. fdp's bucket plan is fixed before step 1 and this state is sized by
      ``init`` from it, so any ``start_iter >= 0`` is valid (0 compresses from the first step).
    * ``min_compression_rate``: compress a tensor only if n m exceeds
      ``(n + m) r * min_compression_rate``; the others are averaged exactly (>= 1).
    * ``error_feedback`` (``use_error_feedback``): add last step's residual first.
    * ``warm_start``: reuse last step's Q instead of drawing a new one.
    * ``orthogonalization_epsilon``: added to each column norm (0 keeps zero columns zero).
    * ``seed`` (``random_seed``): seed of the random Q stream, shared by all ranks.
    * ``batch_same_shape`` (``batch_tensors_with_same_shape``): compress same-shaped
      matrices as one batch (one ``bmm`` per shape group instead of one per tensor).
      Off by default, as in PyTorch, because it does not give the same numbers: CPU
      ``bmm`` of a stack differs in the last bits from ``bmm`` of each matrix for rank 1,
      and a stacked Q is drawn as one ``randn`` call (torch's random stream is not the
      same split into pieces). Each setting matches PyTorch with the same setting.

    Per step and bucket, at most three collectives, in this order: the exactly averaged
    tensors, P, Q (one allreduce each, left out when empty).

    >>> hook = powersgd(rank=2, start_iter=10)
    """
    rank = check_int("rank", rank, 1)
    start_iter = check_int("start_iter", start_iter, 0)
    min_compression_rate = check_real("min_compression_rate", min_compression_rate, 1.0)
    error_feedback = check_bool("error_feedback", error_feedback)
    warm_start = check_bool("warm_start", warm_start)
    epsilon = check_real("orthogonalization_epsilon", orthogonalization_epsilon, 0.0)
    seed = check_int("seed", seed, 0, 2**32 - 1)
    batch = check_bool("batch_same_shape", batch_same_shape)

    def init(bucket: Bucket) -> PowerSGDState:
        dtype, device = bucket.torch_dtype, torch.device(bucket.device)
        error = torch.zeros(bucket.numel, dtype=dtype, device=device) if error_feedback else None
        q = None
        if warm_start:
            units = _layout(bucket, rank, min_compression_rate, batch).units
            q_numel = sum(len(u.slots) * u.m * u.r for u in units)
            q = torch.zeros(q_numel, dtype=dtype, device=device)
        return PowerSGDState(0, error, q, _rng_init(seed, bucket.index), 0)

    def apply(state: PowerSGDState, grads: GradBucket, comm: Comm):
        expect_floating(grads, "powersgd")
        if state.iteration < start_iter:
            grads = yield from _average(grads, comm)
            return grads, state._replace(iteration=state.iteration + 1)

        world = comm.world_size
        buf = grads.buffer
        dtype = buf.dtype
        layout = _layout(grads.spec, rank, min_compression_rate, batch)
        slots = grads.spec.slots
        x = buf + state.error.to(dtype) if error_feedback else buf

        def piece(i: int) -> torch.Tensor:
            slot = slots[i]
            return x[slot.offset : slot.stop]

        # The matrices, one (batch, n, m) stack per unit.
        ms = []
        for unit in layout.units:
            if len(unit.slots) == 1:
                ms.append(piece(unit.slots[0]).view(1, unit.n, unit.m))
            else:
                ms.append(torch.stack([piece(i).view(unit.n, unit.m) for i in unit.slots]))
        q_shapes = [(len(u.slots), u.m, u.r) for u in layout.units]

        stream = None
        if not warm_start or state.draws == 0:
            q_seed, stream = _rng_draw(state.rng)
            qs = _random_matrices(q_seed, q_shapes, dtype, buf.device)
        else:
            qs = _split(state.q.to(dtype), q_shapes)
        qs = [_orthonormalise(q, epsilon) for q in qs]
        ps = [torch.bmm(m, q) for m, q in zip(ms, qs)]

        # Launch the exact part and P together; they are awaited in that order.
        plain = _flat_cat([piece(i) for i in layout.plain], x)
        plain_pending = comm.allreduce(plain) if plain.numel() else None
        p_pending = comm.allreduce(_flat_cat(ps, x)) if ps else None
        plain_mean = (yield plain_pending) / world if plain_pending is not None else plain

        approx: list[torch.Tensor] = []
        q_mean = x.new_empty(0)
        if p_pending is not None:
            p_sum = yield p_pending
            # No division: the orthonormalisation removes the scale anyway.
            ps = [_orthonormalise(p, epsilon) for p in _split(p_sum, [tuple(p.shape) for p in ps])]
            qs = [torch.bmm(m.transpose(1, 2), p) for m, p in zip(ms, ps)]
            q_sum = yield comm.allreduce(_flat_cat(qs, x))
            q_mean = q_sum / world
            qs = _split(q_mean, q_shapes)
            approx = [torch.bmm(p, q.transpose(1, 2)) for p, q in zip(ps, qs)]

        parts = []
        for kind, a, b in layout.place:
            parts.append(plain_mean[a : a + b] if kind == "plain" else approx[a][b].reshape(-1))
        out = torch.cat(parts)

        error = (x - out).to(state.error.dtype) if error_feedback else None
        q = q_mean.to(state.q.dtype) if warm_start else None
        rng, draws = (state.rng, state.draws) if stream is None else (_rng_pack(stream), state.draws + 1)
        return grads._replace(buffer=out), PowerSGDState(state.iteration + 1, error, q, rng, draws)

    return Hook(init, apply)


def batched_powersgd(
    rank: int = 1,
    start_iter: int = DEFAULT_START_ITER,
    error_feedback: bool = True,
    warm_start: bool = True,
    seed: int = 0,
    orthogonalization_epsilon: float = 0.0,
) -> Hook:
    """PowerSGD on the whole bucket as one square matrix, as DDP's ``batched_powerSGD_hook``.

    The flat bucket of length L is zero-padded to s² with s = ceil(sqrt(L)) and viewed as
    an s x s matrix; the error (with error feedback) covers the padding too. Two
    collectives per step (P, Q). Settings as in :func:`powersgd` (there is no
    ``min_compression_rate``: everything is compressed); ``rank`` is capped at s.

    >>> hook = batched_powersgd(rank=1, start_iter=10)
    """
    rank = check_int("rank", rank, 1)
    start_iter = check_int("start_iter", start_iter, 0)
    error_feedback = check_bool("error_feedback", error_feedback)
    warm_start = check_bool("warm_start", warm_start)
    seed = check_int("seed", seed, 0, 2**32 - 1)
    epsilon = check_real("orthogonalization_epsilon", orthogonalization_epsilon, 0.0)

    def sizes(numel: int) -> tuple[int, int]:
        side = math.isqrt(numel)
        side += side * side < numel
        return side, min(rank, side)

    def init(bucket: Bucket) -> PowerSGDState:
        dtype, device = bucket.torch_dtype, torch.device(bucket.device)
        side, r = sizes(bucket.numel)
        error = torch.zeros(side * side, dtype=dtype, device=device) if error_feedback else None
        q = torch.zeros(side * r, dtype=dtype, device=device) if warm_start else None
        return PowerSGDState(0, error, q, _rng_init(seed, bucket.index), 0)

    def apply(state: PowerSGDState, grads: GradBucket, comm: Comm):
        expect_floating(grads, "batched_powersgd")
        if state.iteration < start_iter:
            grads = yield from _average(grads, comm)
            return grads, state._replace(iteration=state.iteration + 1)

        world = comm.world_size
        buf = grads.buffer
        dtype, numel = buf.dtype, buf.numel()
        side, r = sizes(numel)
        x = torch.cat([buf, buf.new_zeros(side * side - numel)])
        if error_feedback:
            x = x + state.error.to(dtype)
        matrix = x.view(side, side)

        stream = None
        if not warm_start or state.draws == 0:
            q_seed, stream = _rng_draw(state.rng)
            (q,) = _random_matrices(q_seed, [(side, r)], dtype, buf.device)
        else:
            q = state.q.to(dtype).view(side, r)
        q = _orthonormalise(q.unsqueeze(0), epsilon)[0]

        p_sum = yield comm.allreduce(torch.matmul(matrix, q))
        p = _orthonormalise(p_sum.unsqueeze(0), epsilon)[0]
        q_sum = yield comm.allreduce(torch.matmul(matrix.t(), p))
        q_mean = q_sum / world
        approx = torch.matmul(p, q_mean.t()).reshape(-1)

        error = (x - approx).to(state.error.dtype) if error_feedback else None
        q_new = q_mean.reshape(-1).to(state.q.dtype) if warm_start else None
        out = approx[:numel].clone()
        rng, draws = (state.rng, state.draws) if stream is None else (_rng_pack(stream), state.draws + 1)
        return grads._replace(buffer=out), PowerSGDState(state.iteration + 1, error, q_new, rng, draws)

    return Hook(init, apply)
