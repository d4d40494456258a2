"""ZeRO stage 3 with several micro-batches per step: each micro-batch's buckets are reduce-scattered as they fill and
the slices accumulated, so a rank never holds the whole gradients; the result is the union batch's."""

import ctypes
import re

import torch

from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
from fdp.comm import Comm
from fdp.hooks import powersgd
from fdp.model.functional import functionalize
from fdp.optim import sgd
from fdp.plan import plan_buckets
from fdp.update import zero

MiB = 2**20
WIDTH, DEPTH = 512, 16  # 16 layers of 1 MiB: 16 MiB of fp32 params, a bucket per layer
ACCUM = 4


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _resident_follows_tensors() -> None:
    """From now on glibc gives blocks of 64 KiB and more pages of their own and returns them when freed (the
    threshold fixed, not raised as frees go): what is resident follows the tensors alive, not what the heap kept."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def _peak_growth(run) -> int:
    """How much ``run()`` grows this process's peak resident memory (Linux ``clear_refs`` and ``VmHWM``), in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status("VmRSS")
    run()
    return _status("VmHWM") - start


def _deep_mlp(rank: int, world: int, samples: int):
    """A deep narrow MLP, its loss, this rank's share of ``samples`` per step (3 steps) and a plan of 1 MiB buckets."""
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    model, params, buffers = functionalize(torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 3)))
    loss_fn = cross_entropy_loss(model)
    g = torch.Generator().manual_seed(1)
    share = samples // world
    batches = []
    for _ in range(3):
        x, y = torch.randn(samples, WIDTH, generator=g), torch.randint(0, 3, (samples,), generator=g)
        batches.append((x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]))
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=1.01, first_bucket_cap_mb=1)
    return model, loss_fn, params, buffers, batches, plan


def _stage_three_peaks(rank: int, world: int) -> dict:
    """How much the second stage-3 step (the first learnt the gathers) grows this rank's peak memory with 1 and with
    4 micro-batches, against the whole params; and the params after 3 steps of 4 micro-batches."""
    _resident_follows_tensors()
    out = {}
    for accum in (1, ACCUM):
        model, loss_fn, params, buffers, batches, plan = _deep_mlp(rank, world, 8 * world)
        comm, optimizer = Comm(), sgd(0.1)
        step = make_train_step(
            loss_fn, optimizer, plan, comm=comm, accum_steps=accum, donate=True, zero_stage=3, model=model
        )
        held = [zero.init_state(params, buffers, optimizer, plan, comm, stage=3)]

        def one_step(batch):
            held[0], _ = step(held[0], batch)

        one_step(batches[0])
        out[f"peak_{accum}"] = _peak_growth(lambda: one_step(batches[1]))
        one_step(batches[2])
    out["whole"] = sum(4 * b.numel for b in plan.buckets)
    out["bucket"] = max(4 * b.numel for b in plan.buckets)
    out["params"] = zero.whole_params(held[0], plan, comm)
    return out


def _union_batch_params() -> dict:
    """The same 3 steps in one process on the union batch (all ranks' samples, one micro-batch)."""
    model, loss_fn, params, buffers, batches, plan = _deep_mlp(0, 1, 16)
    step = make_train_step(loss_fn, sgd(0.1), plan)
    state = init_train_state(params, buffers, sgd(0.1), plan)
    for batch in batches:
        state, _ = step(state, batch)
    return state.params


def test_stage_three_accumulates_slices_not_whole_gradients_and_equals_the_union_batch(run_ranks):
    """Over 4 micro-batches a rank holds what one micro-batch holds (its buckets in flight) and its summed slices
    (half the params on 2 ranks), never the whole gradients (autograd's and the bucket buffers, and every bucket's
    params gathered, when the micro-batches before the last kept whole buckets); the params equal one process's on
    the union batch."""
    reference = _union_batch_params()
    for out in run_ranks(_stage_three_peaks, world_size=2):
        mib = {k: f"{v / MiB:.1f} MiB" for k, v in out.items() if k != "params"}
        # One micro-batch's peak (buckets in flight, gathered params, activations), plus this rank's summed slices.
        assert out[f"peak_{ACCUM}"] <= out["peak_1"] + out["whole"] / 2 + 2 * out["bucket"], mib
        diff = max((out["params"][n] - reference[n]).abs().max().item() for n in reference)
        assert diff <= 1e-6, diff


def _powersgd_accumulated(rank: int, world: int) -> dict:
    """PowerSGD (a hook with state: its error feedback and warm-up count are per step) at stage 3 with 2 micro-batches,
    and at stage 0: the params after 3 steps."""
    out = {}
    for stage in (0, 3):
        model, loss_fn, params, buffers, batches, plan = _deep_mlp(rank, world, 4 * world)
        comm, optimizer, hook = Comm(), sgd(0.1), powersgd(rank=2, start_iter=1)
        step = make_train_step(
            loss_fn, optimizer, plan, hook, comm, accum_steps=2, donate=True, zero_stage=stage, model=model
        )
        state = (
            zero.init_state(params, buffers, optimizer, plan, comm, hook, stage=stage)
            if stage
            else init_train_state(params, buffers, optimizer, plan, hook)
        )
        for batch in batches:
            state, _ = step(state, batch)
        out[stage] = zero.whole_params(state, plan, comm) if stage else state.params
    return out


def test_a_hook_with_state_reduces_once_per_step_at_stage_three_as_at_stage_zero(run_ranks):
    """A chain that keeps state per bucket (PowerSGD) sees one reduction per step, of the accumulated bucket, as at
    stage 0: reducing it per micro-batch would feed its error back and count its warm-up once per micro-batch."""
    for out in run_ranks(_powersgd_accumulated, world_size=2):
        diff = max((out[3][n] - out[0][n]).abs().max().item() for n in out[0])
        assert diff <= 1e-6, diff
