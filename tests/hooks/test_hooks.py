"""Reduction hooks: purity, parity with DDP's comm hooks, error feedback, top-k, PowerSGD at scale, registry.

Two multi-process jobs do all the 2-rank work (each spawn costs seconds on this machine):
``_against_ddp`` trains the same model with DDP and with fdp for every hook DDP has, and
``_on_two_ranks`` runs the other 2-rank checks. Each job runs once, through ``run_ranks``,
the first time a test needs it; the tests then read their part of its result.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils import _pytree as pytree

from fdp.comm import Comm
from fdp.hooks import (
    HOOKS,
    GradBucket,
    Hook,
    Int8State,
    PowerSGDState,
    TopKState,
    allreduce,
    batched_powersgd,
    bf16,
    build_hook,
    chain,
    for_slices,
    fp16,
    fp16_compress,
    fp16_decompress,
    int8,
    int8_compress,
    int8_decompress,
    int8_sum,
    lowbit,
    noop,
    powersgd,
    run_hook,
    stateless,
    topk,
)
from fdp.hooks.lowbit import decode, encode
from fdp.plan import pack_into_buckets
from fdp.plan.buckets import unpack
from fdp.step.chains import Reduction

torch.set_num_threads(1)

DDP_STEPS = 20
MANY_BUCKET_STEPS = 200
EF_STEPS = 200


# ----------------------------------------------------------------------------- helpers


def _plan(shapes, cap_mb=100.0, dtype="float32"):
    return pack_into_buckets(
        [(n, s, dtype, "cpu") for n, s in shapes], bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb
    )


def _reduce(hook, plan, flats, states, comm):
    """One step of the runtime: start every bucket in plan order, then finish them all."""
    reduction = Reduction(hook, comm, states, plan)
    for flat in flats:
        reduction.start(flat)
    reduced = dict(reduction.finished())
    return tuple(reduced[i].buffer for i in range(len(plan.buckets))), reduction.hook_states


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_clone(x) for x in tree))
    if isinstance(tree, tuple):
        return tuple(_clone(x) for x in tree)
    return tree


def _same(a, b) -> bool:
    """Equal to the bit: same structure, dtypes, shapes and bytes (so -0.0 != 0.0, NaN == NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, tuple):
        return (
            isinstance(b, tuple) and type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
        )
    return type(a) is type(b) and a == b


# A bucket with compressible matrices (two of one shape), a 3-D tensor compressible only at
# low rank, a bias and a 0-d scalar.
PURITY_SHAPES = [("a", (16, 12)), ("b", (16,)), ("c", (16, 12)), ("d", (6, 4, 5)), ("s", ())]

HOOK_CASES = {
    "allreduce": lambda: allreduce(),
    "fp16": lambda: fp16(),
    "bf16": lambda: bf16(),
    "noop": lambda: noop(),
    "topk": lambda: topk(ratio=0.1),
    "topk_no_error_feedback": lambda: topk(ratio=0.1, error_feedback=False),
    "powersgd": lambda: powersgd(rank=2, start_iter=1),
    "powersgd_qr_cold_batched": lambda: powersgd(
        rank=3, start_iter=1, warm_start=False, batch_same_shape=True, orthogonalization_epsilon=1e-8
    ),
    "batched_powersgd": lambda: batched_powersgd(rank=2, start_iter=1),
    "fp16_powersgd": lambda: chain(fp16_compress(), powersgd(rank=1, start_iter=1), fp16_decompress()),
    "int8": lambda: int8(),
    "int8_no_error_feedback": lambda: int8(error_feedback=False),
    "lowbit_fp4": lambda: lowbit("fp4", block=16),
    "lowbit_int4": lambda: lowbit("int4", block=16),
    "lowbit_fp8_no_error_feedback": lambda: lowbit("fp8", block=32, error_feedback=False),
    "lowbit_int8": lambda: lowbit("int8"),
}


def _purity_problems(hook, bucket, comm, seed, steps=4) -> list[str]:
    """Run ``hook`` twice on the same (input, state) each step; report any impurity.

    A third run hands the chain a copy of the input as an owned buffer, which it may
    overwrite: the output must not change.
    """
    problems = []
    state = hook.init(bucket)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        grads = GradBucket(bucket.index, torch.randn(bucket.numel, generator=gen), bucket)
        buffer_before, state_before = grads.buffer.clone(), _clone(state)
        out1, state1 = run_hook(hook, state, grads, comm)
        if not _same(grads.buffer, buffer_before):
            problems.append(f"step {step}: the input buffer was modified")
        if not _same(state, state_before):
            problems.append(f"step {step}: the input state was modified")
        out2, state2 = run_hook(hook, state, grads, comm)
        if not _same(out1.buffer, out2.buffer):
            problems.append(f"step {step}: same input and state gave different outputs")
        if not _same(state1, state2):
            problems.append(f"step {step}: same input and state gave different new states")
        if out1.buffer.dtype != bucket.torch_dtype or out1.buffer.shape != (bucket.numel,):
            problems.append(f"step {step}: output {out1.buffer.dtype} {tuple(out1.buffer.shape)}")
        # Handed over as scratch (as the runtime does), the chain may work in place: same result.
        owned, _ = run_hook(hook, state, grads._replace(buffer=grads.buffer.clone(), owned=True), comm)
        if not _same(owned.buffer, out1.buffer):
            problems.append(f"step {step}: an owned buffer gave a different output")
        state = state1
    return problems


# ----------------------------------------------------------------------------- 2-rank jobs

_JOBS: dict[str, list] = {}


def _job(run_ranks, fn):
    if fn.__name__ not in _JOBS:
        _JOBS[fn.__name__] = run_ranks(fn)
    return _JOBS[fn.__name__]


def _mlp():
    torch.manual_seed(0)
    # Two (32, 32) weights, so that batching same-shaped tensors has something to batch.
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8)
    )


def _batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(12, 16, generator=gen), torch.randint(0, 8, (12,), generator=gen)


def _ddp_cases():
    """case -> (DDP hook, its state, fdp hook, one bucket like DDP's?). Built inside the worker."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    def bf16_under_another_name(process_group, bucket):
        # DDP refuses bf16_compress_hook by its name unless NCCL is there; gloo sums bf16 fine.
        return dh.bf16_compress_hook(process_group, bucket)

    def psgd(**kw):
        return ps.PowerSGDState(None, **kw)

    return {
        "allreduce": (dh.allreduce_hook, None, allreduce(), False),
        "fp16": (dh.fp16_compress_hook, None, fp16(), False),
        "bf16": (bf16_under_another_name, None, bf16(), False),
        "powersgd_rank2": (
            ps.powerSGD_hook,
            psgd(matrix_approximation_rank=2, start_powerSGD_iter=3, random_seed=7),
            powersgd(rank=2, start_iter=3, seed=7),
            True,
        ),
        "powersgd_rank3_qr_cold": (
            ps.powerSGD_hook,
            psgd(matrix_approximation_rank=3, start_powerSGD_iter=2, random_seed=3, warm_start=False),
            powersgd(rank=3, start_iter=2, seed=3, warm_start=False),
            True,
        ),
        "powersgd_batch_same_shape": (
            ps.powerSGD_hook,
            psgd(matrix_approximation_rank=2, start_powerSGD_iter=3, random_seed=7, batch_tensors_with_same_shape=True),
            powersgd(rank=2, start_iter=3, seed=7, batch_same_shape=True),
            True,
        ),
        "fp16_powersgd": (
            dh.fp16_compress_wrapper(ps.powerSGD_hook),
            psgd(matrix_approximation_rank=1, start_powerSGD_iter=2),
            chain(fp16_compress(), powersgd(rank=1, start_iter=2, seed=0), fp16_decompress()),
            True,
        ),
        "batched_powersgd": (
            ps.batched_powerSGD_hook,
            psgd(matrix_approximation_rank=1, start_powerSGD_iter=3, random_seed=7),
            batched_powersgd(rank=1, start_iter=3, seed=7),
            True,
        ),
    }


def _run_ddp(rank, ddp_hook, hook_state, lr):
    """DDP with one bucket and ``ddp_hook``; params after every step, and the bucket's parameter order."""
    module = _mlp()
    names = {id(p): n for n, p in module.named_parameters()}
    order = []

    def recording(state, bucket):
        order.append(tuple(names[id(p)] for p in bucket.parameters()))
        return ddp_hook(state, bucket)

    ddp = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=100)  # one bucket
    ddp.register_comm_hook(hook_state, recording)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    history = []
    for step in range(DDP_STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        history.append({n: p.detach().clone() for n, p in module.named_parameters()})
    return history, order


def _run_fdp(rank, hook, order, cap_mb, lr):
    """The same training with fdp: torch.func gradients, packed, reduced through ``Reduction``."""
    module = _mlp()
    params = {n: p.detach().clone() for n, p in module.named_parameters()}

    def loss(p, x, y):
        return F.cross_entropy(torch.func.functional_call(module, p, (x,)), y)

    grad_fn = torch.func.grad(loss)
    plan = _plan([(n, tuple(params[n].shape)) for n in order], cap_mb=cap_mb)
    states = tuple(hook.init(b) for b in plan.buckets)
    comm = Comm()
    history = []
    for step in range(DDP_STEPS):
        grads = grad_fn(params, *_batch(rank, step))
        flats = tuple(torch.cat([grads[n].reshape(-1) for n in b.names]) for b in plan.buckets)
        flats, states = _reduce(hook, plan, flats, states, comm)
        reduced = unpack(plan, flats)
        params = {n: p.add(reduced[n], alpha=-lr) for n, p in params.items()}  # torch.optim.SGD's arithmetic
        history.append(params)
    return history, len(plan)


def _against_ddp(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    # torch 2.13's batched_powerSGD_hook hands its 2-D Q to an orthogonaliser that asserts
    # 3-D input and fails once compression starts; the shim passes it as a batch of one.
    original = ps._orthogonalize
    ps._orthogonalize = lambda m, epsilon=0: original(m.unsqueeze(0) if m.dim() == 2 else m, epsilon)
    lr = 0.1
    results = {}
    reference = None
    for case, (ddp_hook, hook_state, hook, one_bucket) in _ddp_cases().items():
        start = getattr(hook_state, "start_powerSGD_iter", 0)
        ddp_history, order = _run_ddp(rank, ddp_hook, hook_state, lr)
        if one_bucket:
            # PowerSGD's random Qs are assigned in bucket order: use the order DDP compressed with.
            layout = order[start]
            assert all(o == layout for o in order[start:]), "DDP's bucket changed after compression started"
            cap = 100.0
        else:
            layout = tuple(reversed([n for n, _ in _mlp().named_parameters()]))
            cap = 0.004  # several buckets in flight; elementwise averages do not depend on bucketing
        fdp_history, buckets = _run_fdp(rank, hook, layout, cap, lr)
        diff = max((fdp[n] - ddp[n]).abs().max().item() for fdp, ddp in zip(fdp_history, ddp_history) for n in ddp)
        final = fdp_history[-1]
        if case == "allreduce":
            reference = final
        away = max((final[n] - reference[n]).abs().max().item() for n in final)
        results[case] = {"diff": diff, "buckets": buckets, "from_allreduce": away}
    return results


def _on_two_ranks(rank, world):
    comm = Comm()
    out = {}

    # Purity of every hook with a real 2-rank Comm.
    bucket = _plan(PURITY_SHAPES).buckets[0]
    out["purity"] = {name: _purity_problems(make(), bucket, comm, seed=10 + rank) for name, make in HOOK_CASES.items()}

    # noop: no collective, the local gradient back unchanged.
    comm.take_counters()
    local = torch.randn(bucket.numel)
    result, _ = run_hook(noop(), (), GradBucket(0, local, bucket), comm)
    out["noop"] = (_same(result.buffer, local), comm.take_counters())

    # top-k with ratio 1 against allreduce, several buckets through the runtime.
    plan = _plan([("w1", (16, 12)), ("b1", (16,)), ("w2", (7, 5)), ("w3", (40,))], cap_mb=0.0008)
    gen = torch.Generator().manual_seed(rank)
    dense, sparse = allreduce(), topk(ratio=1.0)
    dense_states, sparse_states = (
        tuple(dense.init(b) for b in plan.buckets),
        tuple(sparse.init(b) for b in plan.buckets),
    )
    same = []
    for _ in range(5):
        flats = tuple(torch.randn(b.numel, generator=gen) for b in plan.buckets)
        want, dense_states = _reduce(dense, plan, flats, dense_states, comm)
        got, sparse_states = _reduce(sparse, plan, flats, sparse_states, comm)
        same.append(all(torch.equal(a, b) for a, b in zip(want, got)))
        same.append(all(torch.count_nonzero(s.error).item() == 0 for s in sparse_states))
    out["topk_ratio_1"] = (len(plan), same)

    # Error feedback: the applied updates add up to the mean gradient less the mean final error.
    bucket = _plan([("w", (32, 16)), ("b", (32,)), ("v", (16, 24))]).buckets[0]
    G = torch.randn(bucket.numel, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(100 + rank)
    out["error_feedback"] = {}
    for name, hook in (("powersgd", powersgd(rank=1, start_iter=0)), ("topk", topk(ratio=0.05))):
        state = hook.init(bucket)
        sum_grads = torch.zeros(bucket.numel, dtype=torch.float64)
        sum_applied = torch.zeros_like(sum_grads)
        for _ in range(EF_STEPS // 2):
            g = G + 0.3 * torch.randn(bucket.numel, generator=gen)
            result, state = run_hook(hook, state, GradBucket(0, g, bucket), comm)
            sum_grads += g.double()
            sum_applied += result.buffer.double()
        out["error_feedback"][name] = (sum_grads, sum_applied, state.error.double())

    # PowerSGD over 8 buckets of mixed shapes, 200 steps: a digest of every step's output.
    plan = _plan(MANY_BUCKET_SHAPES, cap_mb=0.003)
    hook = powersgd(rank=2, start_iter=5)
    states = tuple(hook.init(b) for b in plan.buckets)
    gen = torch.Generator().manual_seed(1 + rank)
    digests, sent, finite = [], [], True
    comm.take_counters()
    for _ in range(MANY_BUCKET_STEPS):
        flats = tuple(torch.randn(b.numel, generator=gen) for b in plan.buckets)
        flats, states = _reduce(hook, plan, flats, states, comm)
        digests.append(hashlib.sha256(b"".join(f.numpy().tobytes() for f in flats)).hexdigest())
        finite = finite and all(bool(torch.isfinite(f).all()) for f in flats)
        sent.append(comm.take_counters())
    out["many_buckets"] = {
        "buckets": len(plan),
        "nbytes": plan.nbytes,
        "digests": digests,
        "sent": sent,
        "finite": finite,
        "iterations": [s.iteration for s in states],
    }

    # int8 through the runtime, several buckets in flight: outputs, final errors and bytes of every step.
    plan = _plan(INT8_SHAPES, cap_mb=0.0003)
    hook = int8()
    states = tuple(hook.init(b) for b in plan.buckets)
    outputs, sent = [], []
    comm.take_counters()
    for flats in _int8_gradients(plan)[rank]:
        flats, states = _reduce(hook, plan, flats, states, comm)
        outputs.append(flats)
        sent.append(comm.take_counters())
    out["int8"] = {"outputs": outputs, "errors": [s[0].error for s in states], "sent": sent}

    # Low-bit codes: each rank's own rounding (by the independent grid reference), and the chain's mean.
    bucket = _plan([("w", (30, 10)), ("b", (7,))]).buckets[0]
    g = torch.randn(bucket.numel, generator=torch.Generator().manual_seed(7 + rank)) * (1 + 9 * rank)
    out["lowbit"] = {}
    for format in LOWBIT_FORMATS:
        comm.take_counters()
        result, _ = run_hook(
            lowbit(format, block=16), lowbit(format, block=16).init(bucket), GradBucket(0, g, bucket), comm
        )
        out["lowbit"][format] = (_nearest_code(g, format, 16), result.buffer, comm.take_counters())
    return out


LOWBIT_FORMATS = ("int8", "fp8", "int4", "fp4")
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _nearest_code(x, format, block):
    """The reference rounding: per block of ``block`` entries, scale = max |x| / top, each entry
    to the nearest representable value of the format (fp8 by torch's own e4m3 cast)."""
    pad = -x.numel() % block
    rows = torch.cat([x.double(), x.new_zeros(pad, dtype=torch.float64)]).view(-1, block)
    top = {"int8": 127, "fp8": 448, "int4": 7, "fp4": 6}[format]
    scale = (rows.abs().amax(1, keepdim=True) / top).float().double()
    y = rows / scale
    if format == "fp8":
        values = y.float().to(torch.float8_e4m3fn).double()
    elif format == "fp4":
        grid = torch.tensor([-v for v in _E2M1[:0:-1]] + _E2M1, dtype=torch.float64)
        values = grid[(y.unsqueeze(-1) - grid).abs().argmin(-1)]
    else:
        values = torch.round(y)
    return (values * scale).view(-1)[: x.numel()].float()


INT8_SHAPES = [("w1", (16, 12)), ("b1", (16,)), ("w2", (7, 5)), ("zero", (100,)), ("w3", (40,))]
INT8_STEPS = 4


def _int8_gradients(plan, world=2):
    """Per rank, per step, per bucket: gradients of very different sizes (and one all-zero bucket)."""
    streams = []
    for rank in range(world):
        gen = torch.Generator().manual_seed(50 + rank)
        steps = []
        for step in range(INT8_STEPS):
            flats = []
            for b in plan.buckets:
                g = torch.randn(b.numel, generator=gen) * 10.0 ** (b.index - rank)
                flats.append(torch.zeros(b.numel) if b.names == ("zero",) else g)
            steps.append(tuple(flats))
        streams.append(steps)
    return streams


MANY_BUCKET_SHAPES = [
    ("emb", (50, 8)),
    ("conv1", (8, 3, 3, 3)),
    ("conv1.b", (8,)),
    ("conv2", (16, 8, 3, 3)),
    ("conv2.b", (16,)),
    ("fc1", (32, 144)),
    ("fc1.b", (32,)),
    ("fc2", (32, 32)),
    ("fc3", (32, 32)),
    ("ln", (32,)),
    ("scale", ()),
    ("head", (10, 32)),
    ("head.b", (10,)),
]


# ----------------------------------------------------------------------------- against DDP

DDP_CASES = [
    "allreduce",
    "fp16",
    "bf16",
    "powersgd_rank2",
    "powersgd_rank3_qr_cold",
    "powersgd_batch_same_shape",
    "fp16_powersgd",
    "batched_powersgd",
]


@pytest.mark.parametrize("case", DDP_CASES)
def test_training_matches_ddp_comm_hook_to_the_bit(run_ranks, case):
    """20 SGD steps of an MLP on 2 gloo ranks: fdp's params equal DDP's exactly, every step.

    The tolerance is zero for every hook, fp16 and PowerSGD included, because both sides
    do the same arithmetic on the same numbers: torch.func gradients equal eager ones
    here, fp16/bf16 cast and then divide in 16 bits as DDP does, and PowerSGD draws its
    Qs from PowerSGDState's stream (numpy RandomState(seed) -> torch seed -> randn per
    tensor), keeps DDP's bucket order, and lays Q out row-major as DDP does (a column-major
    QR output changes the matmul rounding). fp16/bf16 are checked against DDP's fp16/bf16
    hooks, not against fp32 (from which they differ by ~1e-3 relative, the 16-bit rounding).
    """
    results = _job(run_ranks, _against_ddp)
    for rank, result in enumerate(results):
        r = result[case]
        assert r["diff"] == 0.0, f"rank {rank}: {case} drifts from DDP by {r['diff']:.3g}"
        if case in ("allreduce", "fp16", "bf16"):
            assert r["buckets"] > 1  # the elementwise hooks ran with several buckets in flight
        else:
            assert r["buckets"] == 1  # one bucket, as DDP's
        if case != "allreduce":
            # Not vacuous: the compressed runs end measurably away from exact averaging.
            assert r["from_allreduce"] > 1e-6, f"{case} gave the allreduce result"
    assert results[0][case]["diff"] == results[1][case]["diff"]


# ----------------------------------------------------------------------------- purity


@pytest.mark.parametrize("name", list(HOOK_CASES))
def test_hook_is_pure_on_a_world_of_one(name):
    bucket = _plan(PURITY_SHAPES).buckets[0]
    assert _purity_problems(HOOK_CASES[name](), bucket, Comm(), seed=3) == []


@pytest.mark.parametrize("name", list(HOOK_CASES))
def test_hook_is_pure_on_two_ranks(run_ranks, name):
    for rank, result in enumerate(_job(run_ranks, _on_two_ranks)):
        assert result["purity"][name] == [], f"rank {rank}"


def test_noop_returns_the_local_gradient_without_communicating(run_ranks):
    for result in _job(run_ranks, _on_two_ranks):
        unchanged, (sent, collectives) = result["noop"]
        assert unchanged and sent == 0 and collectives == 0


# ----------------------------------------------------------------------------- top-k


def test_topk_with_ratio_one_equals_allreduce_exactly(run_ranks):
    for result in _job(run_ranks, _on_two_ranks):
        buckets, same = result["topk_ratio_1"]
        assert buckets > 1
        assert all(same)


def test_topk_sends_k_entries_and_keeps_the_rest_as_error():
    bucket = _plan([("w", (10, 10))]).buckets[0]
    g = torch.arange(100, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(50)  # distinct magnitudes
    out, state = run_hook(topk(ratio=0.05), topk(ratio=0.05).init(bucket), GradBucket(0, g, bucket), Comm())
    largest = torch.arange(95, 100)
    expected = torch.zeros(100)
    expected[largest] = g[largest]
    assert torch.equal(out.buffer, expected)
    assert torch.equal(state.error, g - expected)
    out_k, _ = run_hook(topk(k=5, error_feedback=False), TopKState(None), GradBucket(0, g, bucket), Comm())
    assert torch.equal(out_k.buffer, expected)


# ----------------------------------------------------------------------------- error feedback


def _error_feedback_run(hook, error_feedback):
    bucket = _plan([("w", (32, 16)), ("b", (32,)), ("v", (16, 24))]).buckets[0]
    G = torch.randn(bucket.numel, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    state = hook.init(bucket)
    sum_grads = torch.zeros(bucket.numel, dtype=torch.float64)
    sum_applied = torch.zeros_like(sum_grads)
    gaps = {}
    for t in range(1, EF_STEPS + 1):
        g = G + 0.3 * torch.randn(bucket.numel, generator=gen)
        out, state = run_hook(hook, state, GradBucket(0, g, bucket), Comm())
        sum_grads += g.double()
        sum_applied += out.buffer.double()
        if t in (EF_STEPS // 4, EF_STEPS):
            gaps[t] = ((sum_grads - sum_applied).norm() / G.norm()).item()
    return gaps, sum_grads - sum_applied, state


@pytest.mark.parametrize(
    "make",
    [lambda ef: powersgd(rank=1, start_iter=0, error_feedback=ef), lambda ef: topk(ratio=0.05, error_feedback=ef)],
    ids=["powersgd", "topk"],
)
def test_error_feedback_keeps_the_sum_of_updates_on_the_sum_of_gradients(make):
    """A gradient stream with a fixed full-rank part: compression without error feedback
    loses the same directions every step (the gap grows linearly); with it, the gap stays
    bounded and is exactly the error still held back."""
    gaps, gap, state = _error_feedback_run(make(True), True)
    quarter, end = EF_STEPS // 4, EF_STEPS
    assert gaps[end] < 1.25 * gaps[quarter] and gaps[end] < 20  # bounded, in units of |G|
    error = state.error if hasattr(state, "error") else state[0].error  # a chain's first hook holds it
    torch.testing.assert_close(gap, error.double(), rtol=0, atol=1e-3)
    lossy, _, _ = _error_feedback_run(make(False), False)
    assert lossy[end] > 3.5 * lossy[quarter]  # grows ~linearly without error feedback
    assert lossy[end] > 10 * gaps[end]


def test_error_feedback_on_two_ranks_accounts_for_every_rank(run_ranks):
    """On 2 ranks the updates add up to the mean of the ranks' gradient sums, less the mean of their final errors."""
    results = _job(run_ranks, _on_two_ranks)
    for name in ("powersgd", "topk"):
        (g0, a0, e0), (g1, a1, e1) = (r["error_feedback"][name] for r in results)
        assert torch.equal(a0, a1)  # every rank applied the same updates
        torch.testing.assert_close(a0, (g0 + g1) / 2 - (e0 + e1) / 2, rtol=0, atol=1e-3)
        assert (g0 - g1).abs().max() > 1  # the ranks' gradients differ


# ----------------------------------------------------------------------------- PowerSGD


def test_powersgd_eight_buckets_two_hundred_steps_agree_on_both_ranks(run_ranks):
    r0, r1 = (r["many_buckets"] for r in _job(run_ranks, _on_two_ranks))
    assert r0["buckets"] == 8
    assert r0["finite"] and r1["finite"]
    assert r0["digests"] == r1["digests"]  # identical reduced gradients at every one of the 200 steps
    assert len(set(r0["digests"])) == MANY_BUCKET_STEPS
    assert r0["iterations"] == [MANY_BUCKET_STEPS] * 8
    # Before start_iter every byte is sent; after it, much less (compression is on).
    assert r0["sent"][0][0] == r0["nbytes"]
    assert r0["sent"][-1][0] < r0["nbytes"] / 2
    assert r0["sent"] == r1["sent"]


def test_powersgd_matches_an_independent_rank_r_power_step():
    """World of one, no error feedback, Q from the state: one step is P = orth(M Q), out = P Pᵀ M."""
    bucket = _plan([("w", (20, 12)), ("b", (20,))], dtype="float64").buckets[0]
    hook = powersgd(rank=2, start_iter=0, error_feedback=False)
    g = torch.randn(bucket.numel, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    q = torch.randn(12 * 2, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    state = hook.init(bucket)._replace(iteration=1, q=q, draws=1)  # past the random draw: warm Q from the state
    out, new_state = run_hook(hook, state, GradBucket(0, g, bucket), Comm())
    M = g[:240].view(20, 12)
    Q, _ = torch.linalg.qr(state.q.view(12, 2))
    P, _ = torch.linalg.qr(M @ Q)
    torch.testing.assert_close(out.buffer[:240].view(20, 12), P @ P.T @ M, rtol=1e-10, atol=1e-12)
    assert torch.equal(out.buffer[240:], g[240:])  # 1-D tensor: exact average (of one rank)
    torch.testing.assert_close(new_state.q.view(12, 2).abs(), (M.T @ P).abs(), rtol=1e-10, atol=1e-12)


def test_powersgd_start_iter_averages_exactly_then_compresses():
    bucket = _plan([("w", (32, 32))]).buckets[0]
    hook = powersgd(rank=1, start_iter=2)
    state = hook.init(bucket)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        g = torch.randn(bucket.numel, generator=gen)
        out, state = run_hook(hook, state, GradBucket(0, g, bucket), Comm())
        assert state.iteration == step + 1
        if step < 2:
            assert torch.equal(out.buffer, g) and not state.error.any()
        else:
            assert torch.linalg.matrix_rank(out.buffer.view(32, 32)).item() == 1
    assert state.draws == 1  # warm start: one random Q, at the first compressed step
    # A run resumed with a later start_iter than it was begun with still draws its first Q.
    late = powersgd(rank=1, start_iter=1)
    out, state = run_hook(
        late, powersgd(rank=1, start_iter=100).init(bucket)._replace(iteration=50), GradBucket(0, g, bucket), Comm()
    )
    assert state.draws == 1 and torch.linalg.matrix_rank(out.buffer.view(32, 32)).item() == 1


def test_powersgd_zero_gradient_stays_zero_instead_of_nan():
    bucket = _plan([("w", (16, 16)), ("b", (16,))]).buckets[0]
    for hook in (powersgd(rank=1, start_iter=0), powersgd(rank=2, start_iter=0), batched_powersgd(start_iter=0)):
        out, state = run_hook(hook, hook.init(bucket), GradBucket(0, torch.zeros(bucket.numel), bucket), Comm())
        assert torch.equal(out.buffer, torch.zeros(bucket.numel))


@pytest.mark.parametrize(
    "make",
    [
        lambda: powersgd(rank=2, start_iter=1, warm_start=False),
        lambda: batched_powersgd(start_iter=1),
        lambda: chain(fp16_compress(), powersgd(rank=2, start_iter=1), fp16_decompress()),
        lambda: topk(ratio=0.1),
        lambda: int8(),
        lambda: lowbit("fp4", block=32),
    ],
    ids=["powersgd_cold", "batched_powersgd", "fp16_powersgd", "topk", "int8", "lowbit_fp4"],
)
def test_state_saved_and_loaded_resumes_bit_identically(tmp_path, make):
    """The state flattens to leaves a weights_only checkpoint holds, with the structure ``init`` gives,
    and carries everything random: 3 steps, save, load, 3 more equals 6 steps straight."""
    hook = make()
    plan = _plan(MANY_BUCKET_SHAPES, cap_mb=0.003)
    initial = tuple(hook.init(b) for b in plan.buckets)
    gen = torch.Generator().manual_seed(0)
    stream = [tuple(torch.randn(b.numel, generator=gen) for b in plan.buckets) for _ in range(6)]
    straight, states = [], initial
    for flats in stream:
        out, states = _reduce(hook, plan, flats, states, Comm())
        straight.append(out)
    states = initial
    for flats in stream[:3]:
        _, states = _reduce(hook, plan, flats, states, Comm())
    torch.save(pytree.tree_flatten(states)[0], tmp_path / "state.pt")
    leaves = torch.load(tmp_path / "state.pt", weights_only=True)
    states = pytree.tree_unflatten(leaves, pytree.tree_flatten(initial)[1])
    for flats, expected in zip(stream[3:], straight[3:]):
        out, states = _reduce(hook, plan, flats, states, Comm())
        assert all(_same(a, b) for a, b in zip(out, expected))


@pytest.mark.parametrize(
    "make",
    [
        lambda: powersgd(rank=1, start_iter=0, warm_start=False),
        lambda: batched_powersgd(start_iter=0, warm_start=False),
    ],
    ids=["powersgd", "batched"],
)
def test_state_holds_no_functorch_wrapper_when_the_chain_starts_inside_backward(make):
    """The overlap schedule starts a bucket's chain from a tensor hook inside torch.func.grad,
    where every new tensor is wrapped for the transform; the chain is resumed after the
    transform has ended. Nothing made before the first collective may end up in the state."""
    from torch._C._functorch import is_functorch_wrapped_tensor

    hook = make()
    bucket = _plan([("w", (16, 12)), ("b", (16,))]).buckets[0]
    state = hook.init(bucket)
    grads = GradBucket(0, torch.randn(bucket.numel, generator=torch.Generator().manual_seed(0)), bucket)
    started = {}

    def loss(w):
        def on_grad(_):
            run = hook.apply(state, grads, Comm())
            started["run"], started["pending"] = run, next(run)

        w.register_hook(on_grad)
        return (w * 2).sum()

    torch.func.grad(loss)(torch.ones(3))
    run, pending = started["run"], started["pending"]
    try:
        while True:
            pending = run.send(pending.wait())
    except StopIteration as done:
        out, new_state = done.value
    leaves = [leaf for leaf in pytree.tree_leaves(new_state) if isinstance(leaf, torch.Tensor)]
    assert leaves and not any(is_functorch_wrapped_tensor(leaf) for leaf in leaves)
    expected, expected_state = run_hook(hook, state, grads, Comm())
    assert _same(out.buffer, expected.buffer) and _same(new_state, expected_state)


def test_powersgd_state_is_fixed_in_structure_and_seeded_per_bucket():
    plan = _plan(MANY_BUCKET_SHAPES, cap_mb=0.003)
    hook = powersgd(rank=2, start_iter=0)
    states = tuple(hook.init(b) for b in plan.buckets)
    gen = torch.Generator().manual_seed(0)
    flats = tuple(torch.randn(b.numel, generator=gen) for b in plan.buckets)
    _, after = _reduce(hook, plan, flats, states, Comm())
    for before, new in zip(states, after):
        assert isinstance(new, PowerSGDState)
        assert all((x is None) == (y is None) for x, y in zip(before, new))
        assert new.error.shape == before.error.shape and new.q.shape == before.q.shape
        assert not torch.equal(new.rng, before.rng)  # the first compressed step drew a seed
    assert len({tuple(s.rng.tolist()) for s in states}) == len(states)  # one stream per bucket


# ----------------------------------------------------------------------------- registry


@pytest.mark.parametrize(
    "spec,needles",
    [
        ({"name": "nope"}, ["hooks.name='nope'", "allreduce", "powersgd", "topk", "noop"]),
        ({"rank": 2}, ["hooks.name", "missing"]),
        ({"name": "powersgd", "foo": 1}, ["hooks.foo", "powersgd", "start_iter", "min_compression_rate"]),
        ({"name": "fp16", "rank": 1}, ["hooks.rank", "accepted settings: none"]),
        ({"name": "powersgd", "rank": 0}, ["hooks.rank=0", "integer >= 1"]),
        ({"name": "powersgd", "rank": 1.5}, ["hooks.rank=1.5"]),
        ({"name": "powersgd", "start_iter": -1}, ["hooks.start_iter=-1"]),
        ({"name": "powersgd", "min_compression_rate": 0.5}, ["hooks.min_compression_rate=0.5"]),
        ({"name": "powersgd", "orthogonalization_epsilon": -1e-8}, ["hooks.orthogonalization_epsilon"]),
        ({"name": "powersgd", "seed": -1}, ["hooks.seed=-1"]),
        ({"name": "powersgd", "warm_start": "yes"}, ["hooks.warm_start='yes'"]),
        ({"name": "batched_powersgd", "rank": 0}, ["hooks.rank=0"]),
        ({"name": "batched_powersgd", "min_compression_rate": 2}, ["hooks.min_compression_rate", "batched_powersgd"]),
        ({"name": "topk", "ratio": 0}, ["hooks.ratio=0"]),
        ({"name": "topk", "ratio": 1.5}, ["hooks.ratio=1.5"]),
        ({"name": "topk", "k": 0}, ["hooks.k=0"]),
        ({"chain": [{"name": "fp16_compress"}, {"name": "powersgd", "rank": 0}]}, ["hooks.chain[1].rank=0"]),
        ({"chain": [{"name": "fp16_compresss"}]}, ["hooks.chain[0].name='fp16_compresss'", "fp16_compress"]),
        ({"name": "chain", "chain": [{"name": "topk", "bar": 1}]}, ["hooks.chain[0].bar", "ratio"]),
        ({"name": "chain", "stages": [{"name": "topk"}]}, ["hooks.stages: not a setting of a chain", "chain, name"]),
        ({"chain": []}, ["hooks.chain"]),
        ({"chain": [{"name": "noop"}], "rank": 1}, ["hooks.rank"]),
        (3, ["hooks=3"]),
    ],
)
def test_registry_names_the_bad_setting(spec, needles):
    with pytest.raises(ValueError) as error:
        build_hook(spec)
    for needle in needles:
        assert needle in str(error.value)


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_registry_builds_every_hook_by_name(name):
    bucket = _plan(PURITY_SHAPES).buckets[0]
    hook = build_hook({"name": name})
    g = torch.randn(bucket.numel)
    out, _ = run_hook(hook, hook.init(bucket), GradBucket(0, g, bucket), Comm())
    assert out.buffer.shape == g.shape


YAML_CHAIN = """
chain:
  - name: fp16_compress
  - name: powersgd
    rank: 4
    start_iter: 1
    batch_same_shape: true
  - name: fp16_decompress
"""

YAML_NAMED_CHAIN = """
name: chain
chain:
  - fp16_compress
  - {name: powersgd, rank: 4, start_iter: 1, batch_same_shape: true}
  - {name: fp16_decompress}
"""


@pytest.mark.parametrize("text", [YAML_CHAIN, YAML_NAMED_CHAIN], ids=["chain", "name_chain"])
def test_registry_yaml_chain_builds_and_runs_like_the_hand_built_chain(text):
    spec = OmegaConf.to_container(OmegaConf.create(text))
    built = build_hook(spec)
    by_hand = chain(fp16_compress(), powersgd(rank=4, start_iter=1, batch_same_shape=True), fp16_decompress())
    plan = _plan([("w1", (16, 12)), ("w2", (16, 12)), ("b", (16,)), ("w3", (24, 40))], cap_mb=0.001)
    assert len(plan) > 1
    states_a = tuple(built.init(b) for b in plan.buckets)
    states_b = tuple(by_hand.init(b) for b in plan.buckets)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        flats = tuple(torch.randn(b.numel, generator=gen) for b in plan.buckets)
        out_a, states_a = _reduce(built, plan, flats, states_a, Comm())
        out_b, states_b = _reduce(by_hand, plan, flats, states_b, Comm())
        assert all(_same(a, b) for a, b in zip(out_a, out_b))
        assert all(o.dtype == torch.float32 for o in out_a)
    assert _same(states_a, states_b)
    assert states_a[0][1].iteration == 3


# ----------------------------------------------------------------------------- int8 and side data


def _int8_reference(streams):
    """The int8 chain on every rank at once, in plain torch: one scale per bucket and step from the
    largest |gradient + error| over all ranks, rounding to -127..127, an exact integer sum, error kept."""
    world, steps, buckets = len(streams), len(streams[0]), len(streams[0][0])
    errors = [[torch.zeros_like(g) for g in streams[r][0]] for r in range(world)]
    outputs = []
    for step in range(steps):
        reduced = []
        for b in range(buckets):
            xs = [streams[r][step][b] + errors[r][b] for r in range(world)]
            top = torch.stack([x.abs().max() for x in xs]).max()
            scale = top / 127 if top > 0 else torch.tensor(1.0)
            levels = [torch.round(x / scale).clamp(-127, 127) for x in xs]
            for r in range(world):
                errors[r][b] = xs[r] - levels[r] * scale
            total = torch.stack([q.to(torch.int32) for q in levels]).sum(0, dtype=torch.int32)
            reduced.append(total.to(torch.float32) * (scale / world))
        outputs.append(reduced)
    return outputs, errors


def test_int8_on_two_ranks_equals_a_plain_torch_reference(run_ranks):
    """Outputs (every step, every bucket) and each rank's error equal the reference to the bit; a
    bucket costs 4 bytes for the shared scale plus one byte per element."""
    results = _job(run_ranks, _on_two_ranks)
    plan = _plan(INT8_SHAPES, cap_mb=0.0003)
    assert len(plan) > 2
    streams = _int8_gradients(plan)
    want, errors = _int8_reference(streams)
    exact = [[(streams[0][t][b] + streams[1][t][b]) / 2 for b in range(len(plan))] for t in range(INT8_STEPS)]
    for rank, result in enumerate(results):
        got = result["int8"]
        for t in range(INT8_STEPS):
            assert all(_same(a, b) for a, b in zip(got["outputs"][t], want[t])), f"rank {rank} step {t}"
        assert all(_same(a, b) for a, b in zip(got["errors"], errors[rank]))
        assert all(sent == (sum(4 + b.numel for b in plan.buckets), 2 * len(plan)) for sent in got["sent"])
    # Not vacuous: at step 1 (no error yet) rounding moved the mean, by at most half a step of the scale.
    first = results[0]["int8"]["outputs"][0]
    for b, (got, mean) in enumerate(zip(first, exact[0])):
        half_step = max(streams[0][0][b].abs().max(), streams[1][0][b].abs().max()).item() / 127 / 2
        assert (got - mean).abs().max().item() <= half_step * (1 + 1e-5)
    assert max((got - mean).abs().max().item() for got, mean in zip(first, exact[0])) > 0
    zero = [i for i, b in enumerate(plan.buckets) if b.names == ("zero",)][0]
    assert all(torch.count_nonzero(results[0]["int8"]["outputs"][t][zero]) == 0 for t in range(INT8_STEPS))


def test_int8_scale_travels_in_side_data_and_error_in_the_state():
    bucket = _plan([("w", (8, 4))]).buckets[0]
    g = torch.linspace(-1.0, 3.0, bucket.numel)
    grads = GradBucket(0, g, bucket, side={"other": "kept"})
    compressed, state = run_hook(int8_compress(), int8_compress().init(bucket), grads, Comm())
    assert compressed.buffer.dtype == torch.int8 and compressed.buffer.abs().max() == 127
    assert set(compressed.side) == {"other", "int8_scale"} and dict(grads.side) == {"other": "kept"}
    scale = compressed.side["int8_scale"]
    assert scale == g.abs().max() / 127
    assert isinstance(state, Int8State) and torch.equal(state.error, g - compressed.buffer.float() * scale)
    summed, _ = run_hook(int8_sum(), (), compressed, Comm())
    out, _ = run_hook(int8_decompress(), (), summed, Comm())
    assert dict(out.side) == {"other": "kept"} and out.buffer.dtype == torch.float32
    torch.testing.assert_close(out.buffer + state.error, g, rtol=0, atol=1e-6)  # nothing is lost: it waits in the error
    with pytest.raises(TypeError, match=r"int8_decompress.*int8_compress\(\) earlier"):
        run_hook(int8_decompress(), (), GradBucket(0, g, bucket), Comm())
    with pytest.raises(TypeError, match="int8_sum got bucket 0 as torch.float32"):
        run_hook(int8_sum(), (), GradBucket(0, g, bucket), Comm())


# ----------------------------------------------------------------------------- hooks that misbehave


def _run_one(hook, g=None):
    bucket = _plan([("w", (4, 3))]).buckets[0]
    return run_hook(hook, hook.init(bucket), GradBucket(0, torch.ones(12) if g is None else g, bucket), Comm())


@pytest.mark.parametrize("name", ["allreduce", "powersgd", "batched_powersgd", "topk"])
def test_an_integer_bucket_reaching_a_builtin_collective_hook_names_it(name):
    hook = chain(int8_compress(), build_hook({"name": name}), int8_decompress())
    with pytest.raises(TypeError, match=rf"hook {name} got bucket 0 as torch.int8.*floating-point"):
        _run_one(hook)


def _returns_the_bucket_alone(state, grads, comm):
    return grads


def _forgets_to_yield(grads, comm):
    return grads._replace(buffer=comm.allreduce(grads.buffer))


def _uses_a_pending(grads, comm):
    return grads._replace(buffer=comm.allreduce(grads.buffer).div_(2))


def _yields_a_tensor(grads, comm):
    summed = yield grads.buffer
    return grads._replace(buffer=summed)


@pytest.mark.parametrize(
    "hook,needles",
    [
        (
            Hook(lambda b: (), _returns_the_bucket_alone),
            ["chain[1] (_returns_the_bucket_alone)", "GradBucket alone", "(grads, state)"],
        ),
        (stateless(_forgets_to_yield), ["chain[1] (_forgets_to_yield)", "Pending", "yield it"]),
        (stateless(_uses_a_pending), ["'Pending' object has no attribute 'div_'", "yield"]),
        (stateless(_yields_a_tensor), ["chain[1] (_yields_a_tensor) yielded a Tensor", "Pending"]),
        (stateless(lambda grads, comm: (grads, ())), ["returns the GradBucket alone"]),
    ],
    ids=["returns_bucket_alone", "forgets_yield", "uses_pending", "yields_tensor", "stateless_returns_pair"],
)
def test_a_misbehaving_hook_in_a_chain_is_named_in_one_line(hook, needles):
    with pytest.raises((TypeError, AttributeError)) as error:
        _run_one(chain(allreduce(), hook))
    message = str(error.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_a_bare_hook_that_returns_the_bucket_alone_is_named_by_the_train_step():
    from fdp import (
        cross_entropy_loss,
        functionalize,
        init_train_state,
        make_train_step,
        plan_buckets,
        planner_loss,
        sgd,
    )

    model, params, buffers = functionalize(nn.Linear(4, 3))
    loss_fn = cross_entropy_loss(model)
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    hook = Hook(lambda bucket: (), _returns_the_bucket_alone)
    step = make_train_step(loss_fn, sgd(0.1), plan, hook)
    with pytest.raises(TypeError, match=r"hook _returns_the_bucket_alone returned the GradBucket alone"):
        step(init_train_state(params, buffers, sgd(0.1), plan, hook), batch)


def test_optimizer_and_hook_chains_refuse_each_others_members():
    import fdp

    with pytest.raises(TypeError, match=r"fdp.hooks.chain: argument 1 is an optimizer.*fdp.chain \(fdp.optim.chain\)"):
        chain(allreduce(), fdp.sgd(0.1))
    with pytest.raises(TypeError, match=r"fdp.chain: argument 0 is a reduction hook.*fdp.hooks.chain"):
        fdp.chain(fp16_compress(), fdp.sgd(0.1))
    with pytest.raises(TypeError, match=r"argument 0 is the function 'allreduce'.*allreduce\(\)"):
        chain(allreduce)


# -- hooks=custom: a user's own factory ---------------------------------------------------------------------------
def _unshardable_clip(max_norm: float = 1.0):
    """A user's hook that does not declare ``shardable``: it makes the whole bucket, of which ZeRO keeps a slice."""
    return chain(
        stateless(lambda grads, comm: grads._replace(buffer=grads.buffer.clamp(-max_norm, max_norm))), allreduce()
    )


@pytest.fixture
def my_project(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))


def test_a_custom_hook_is_built_from_its_target_with_its_settings(my_project):
    hook = build_hook({"name": "custom", "_target_": "my_project.hooks.clip_then_allreduce", "max_norm": 1.0})
    bucket = _plan([("w", (2,))]).buckets[0]
    out, state = run_hook(hook, hook.init(bucket), GradBucket(0, torch.tensor([6.0, 8.0]), bucket), Comm())
    torch.testing.assert_close(out.buffer, torch.tensor([0.6, 0.8]))
    assert hook.shardable and [int(t) for t in state[0]] == [1, 1]  # one step seen, clipped
    # In a YAML chain too.
    assert build_hook({"chain": [{"name": "custom", "_target_": "my_project.hooks.clip_then_allreduce"}]}).shardable


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"_target_": "my_project.nothing.make"},
            r"^hooks\._target_='my_project\.nothing\.make': module my_project has no "
            r"attribute 'nothing'$",
        ),
        (
            {"_target_": "my_project.optim.lion"},
            r"^hooks\._target_='my_project\.optim\.lion': returned an optimizer "
            r"\(GradientTransformation\); expected an fdp\.hooks\.Hook",
        ),
        (
            {"_target_": "fdp.hooks.fp16_compress", "max_norm": 1.0},
            r"^hooks\._target_='fdp\.hooks\.fp16_compress': "
            r"fp16_compress\(\) got an unexpected keyword argument",
        ),
        (
            {"_target_": "my_project.hooks.clip_then_allreduce", "max_norm": -1},
            r"^hooks\._target_=.*: max_norm=-1: expected",
        ),
        (
            {"_target_": "test_hooks.stateless"},
            r"^hooks\._target_='test_hooks\.stateless': stateless\(\) missing 1 required",
        ),
        ({"_target_": "torch.nn.Identity"}, r"^hooks\._target_='torch\.nn\.Identity': returned a Identity; expected"),
        (
            {"_target_": "???"},
            r"^hooks\._target_: missing; hooks=custom needs the dotted path to a factory returning a Hook",
        ),
    ],
)
def test_a_custom_hook_that_does_not_import_or_returns_no_hook_is_refused_in_one_line(my_project, spec, message):
    with pytest.raises(ValueError, match=message) as error:
        build_hook({"name": "custom", **spec})
    assert "\n" not in str(error.value)


def test_a_custom_hook_is_accepted_at_every_zero_stage_whether_or_not_it_declares_shardable(my_project):
    from fdp.run.config.compose import compose
    from fdp.run.config.validate import validate

    base = ["world=local2", "hooks=custom"]
    for target in ("my_project.hooks.clip_then_allreduce", "test_hooks._unshardable_clip"):
        for stage in (1, 2, 3):
            validate(compose(*base, f"hooks._target_={target}", f"trainer.zero_stage={stage}"))


def test_a_hook_that_makes_the_whole_bucket_keeps_the_slice_a_scattering_comm_keeps():
    """for_slices: over a comm that keeps part of each bucket, an unshardable hook runs over the whole comm and
    hands back its part, zero-padded; a shardable one is left as it is."""

    class _KeepsThird(Comm):  # a one-rank comm that keeps elements [2, 4) of a 3-element bucket, as rank 1 of 2
        def kept_range(self, numel):
            return 2, 4

    bucket = _plan([("w", (3,))]).buckets[0]
    hook = for_slices(_unshardable_clip(2.0))
    out, _ = run_hook(hook, hook.init(bucket), GradBucket(0, torch.tensor([1.0, -5.0, 3.0]), bucket), _KeepsThird())
    assert out.buffer.tolist() == [2.0, 0.0]  # clipped to 2, then the slice, padded
    shardable = topk()
    assert for_slices(shardable) is shardable


# ----------------------------------------------------------------------------- low-bit codes


@pytest.mark.parametrize("format", LOWBIT_FORMATS)
def test_lowbit_rounds_to_the_nearest_code_within_its_bound(format):
    """Blocks of very different magnitudes each get their own scale: every entry rounds to the
    reference's nearest code, off by at most half a step of its block's grid."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 64, generator=gen) * torch.logspace(-6, 3, 8).unsqueeze(1)).view(-1)[:500]
    codes, scales = encode(x, format, 64)
    got = decode(codes, scales, format, 64, x.numel())
    torch.testing.assert_close(got, _nearest_code(x, format, 64), rtol=0, atol=0)
    step = {"int8": 0.5, "int4": 0.5, "fp4": 1.0}  # half the widest gap of the grid, in units of the scale
    block_scale = scales.repeat_interleave(64)[: x.numel()]
    if format == "fp8":
        bound = torch.maximum(x.abs() / 16, block_scale * 2.0**-10)
    else:
        bound = block_scale * step[format]
    assert bool(((x - got).abs() <= bound * (1 + 1e-6)).all())
    # On the wire: the codes (4 or 8 bits each) and one fp32 scale per block.
    assert codes.numel() == {"int8": 512, "fp8": 512, "int4": 256, "fp4": 256}[format] and scales.numel() == 8


def test_lowbit_on_two_ranks_sums_every_ranks_codes_in_fp32(run_ranks):
    """Both ranks get the mean of the ranks' rounded values (each with its own scales), and send
    the codes plus scales: for fp4, a seventh of float32's bytes."""
    results = _job(run_ranks, _on_two_ranks)
    for format in LOWBIT_FORMATS:
        (rounded0, mean0, sent0), (rounded1, mean1, sent1) = (r["lowbit"][format] for r in results)
        assert torch.equal(mean0, mean1)
        torch.testing.assert_close(mean0, (rounded0 + rounded1) / 2, rtol=1e-6, atol=0)
        codes = {"int8": 320, "fp8": 320, "int4": 160, "fp4": 160}[format]
        assert sent0 == sent1 == (codes + 4 * 20, 1)  # 307 entries: 20 blocks of 16, one allgather


@pytest.mark.parametrize("format", ["fp4", "int4"])
def test_lowbit_error_feedback_keeps_the_sum_sent_on_the_sum_of_gradients(format):
    """With error feedback the gap between what was sent and what was given stays bounded and is
    exactly the error held back (fp32, in the state); without it the rounding bias piles up."""
    gaps, gap, state = _error_feedback_run(lowbit(format, block=64), True)
    quarter, end = EF_STEPS // 4, EF_STEPS
    assert gaps[end] < 1.25 * gaps[quarter]
    assert state[0].error.dtype == torch.float32
    torch.testing.assert_close(gap, state[0].error.double(), rtol=0, atol=1e-4)
    lossy, _, _ = _error_feedback_run(lowbit(format, block=64, error_feedback=False), False)
    assert lossy[end] > 1.5 * lossy[quarter] and lossy[end] > 10 * gaps[end]
