"""Low-precision gathers and reductions (FSDP2's ``MixedPrecisionPolicy``): under ``bf16-mixed`` ZeRO stage 3
gathers params in bf16, and ``reduce_dtype`` is the dtype gradients are averaged in. Compared with torch's
FSDP2 on two gloo ranks, and with the ``bf16`` hook they share their reduction with."""

import pytest
import torch
from _configs import quiet as _cfg

from fdp import init_train_state, make_train_step, planner_loss
from fdp.comm import Comm
from fdp.errors import ConfigError
from fdp.hooks import bf16, powersgd
from fdp.model.functional import functionalize
from fdp.model.losses import make_loss_fn
from fdp.model.precision import Precision, check_reduce_dtype
from fdp.optim import adam
from fdp.plan import plan_buckets
from fdp.run.config import register_configs
from fdp.run.config.validate import validate
from fdp.update import zero

register_configs()

SIZES = (13, 24, 24, 5)  # odd sizes: slices start inside parameters and the last one runs into padding
STEPS = 4
LR = 1e-3
CAP_MB = 300 * 4 / 2**20  # several buckets


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    a, b, c, d = SIZES
    # LayerNorm runs outside autocast's casts on the CPU: its weights are read as gathered, so float32
    # gathers would part from FSDP2 there (the Linears' weights autocast rounds to bf16 either way).
    return torch.nn.Sequential(
        torch.nn.Linear(a, b),
        torch.nn.LayerNorm(b),
        torch.nn.ReLU(),
        torch.nn.Linear(b, c),
        torch.nn.ReLU(),
        torch.nn.Linear(c, d),
    )


def _criterion(outputs, targets):
    # The loss in float32 on both sides: fdp's autocast runs cross-entropy in float32 on the CPU, and FSDP2
    # (no autocast) is handed float32 logits the same way.
    return torch.nn.functional.cross_entropy(outputs.float(), targets)


def _batches(rank, world):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(8 * world, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (8 * world,), generator=g)
        out.append((x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]))
    return out


def _fdp(rank, world, stage, precision, hook=None, gather_dtype="precision"):
    """fdp's params after ``STEPS`` Adam steps, and the bytes the last step sent."""
    model, params, buffers = functionalize(_module())
    loss_fn = make_loss_fn(model, _criterion)
    batches = _batches(rank, world)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB
    )
    comm = Comm()
    # gather_dtype=None: stage 3 as before bf16 gathers (float32 params under autocast), for contrast.
    update = (
        None
        if gather_dtype == "precision"
        else zero.update_for(stage, adam(LR), plan, comm, model=model, gather_dtype=gather_dtype)
    )
    step = make_train_step(
        loss_fn, adam(LR), plan, hook, comm, zero_stage=stage, model=model, precision=precision, update=update
    )
    if stage:
        state = zero.init_state(params, buffers, adam(LR), plan, comm, hook, stage=stage)
    else:
        state = init_train_state(params, buffers, adam(LR), plan, hook)
    for batch in batches:
        state, metrics = step(state, batch)
    # float32 bytes a step sends: each bucket's slice all-gathered twice (forward, and again for backward),
    # and on gloo each bucket all-reduced whole (as stage 0 does, its slice kept).
    gathers = 2 * 4 * sum(zero.layout.slice_numel(b, world) for b in plan.buckets)
    reductions = 4 * sum(b.numel for b in plan.buckets)
    return zero.whole_params(state, plan, comm), (metrics["bytes_sent"], gathers, reductions)


def _fsdp2(rank, world, reduce_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    module = _module()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)
    for x, y in _batches(rank, world):
        _criterion(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.full_tensor() for name, p in module.named_parameters()}


def _against_fsdp2(rank, world):
    out = {}
    for reduce_dtype in ("float32", "bfloat16"):
        theirs = _fsdp2(rank, world, getattr(torch, reduce_dtype))
        ours, _ = _fdp(rank, world, 3, Precision("bf16-mixed", reduce_dtype=reduce_dtype))
        assert sorted(ours) == sorted(theirs)
        assert all(p.dtype == torch.float32 for p in ours.values())  # the masters stay float32
        out[reduce_dtype] = max((ours[n] - theirs[n]).abs().max().item() for n in theirs)
    old, _ = _fdp(rank, world, 3, Precision("bf16-mixed"), gather_dtype=None)
    out["float32_gathers"] = max((old[n] - theirs[n]).abs().max().item() for n in theirs)
    # How far bf16-mixed's params move from 32-true's over the same steps: what the 1e-5 above tells apart.
    full, sent = _fdp(rank, world, 3, Precision())
    out["32-true"] = max((full[n] - theirs[n]).abs().max().item() for n in theirs)
    # Bytes per step: halved for the gathers with float32 reductions, halved throughout with bf16 ones.
    _, (sent_f32_reduce, _, _) = _fdp(rank, world, 3, Precision("bf16-mixed"))
    _, (sent_bf16_reduce, _, _) = _fdp(rank, world, 3, Precision("bf16-mixed", reduce_dtype="bfloat16"))
    # Stage 0: reduce_dtype=bfloat16 averages exactly as the bf16 hook does, with allreduce's state.
    reduced, _ = _fdp(rank, world, 0, Precision("bf16-mixed", reduce_dtype="bfloat16"))
    hooked, _ = _fdp(rank, world, 0, Precision("bf16-mixed"), hook=bf16())
    out["stage0_vs_bf16_hook"] = max((reduced[n] - hooked[n]).abs().max().item() for n in hooked)
    return out, (*sent, sent_f32_reduce, sent_bf16_reduce)


def test_bf16_gathers_equal_fsdp2_mixed_precision_and_halve_the_bytes(run_ranks):
    """Stage 3 under bf16-mixed, reducing in float32 or bfloat16, against FSDP2 with the same policy (one spawn
    for every comparison: the ranks' start-up is most of the time)."""
    for out, (sent_32, gathers, reductions, sent_f32_reduce, sent_bf16_reduce) in run_ranks(_against_fsdp2):
        assert out["float32"] <= 1e-5 and out["bfloat16"] <= 1e-5, out
        assert out["32-true"] > 1e-4, out  # the comparison sees bf16's rounding at all
        assert out["float32_gathers"] > 1e-4, out  # and where params are read in bf16
        assert out["stage0_vs_bf16_hook"] == 0.0, out
        scalars = sent_32 - gathers - reductions  # a step's few scalar collectives, in no bucket's dtype
        assert 0 <= scalars <= 64, (sent_32, gathers, reductions)
        assert sent_f32_reduce == gathers // 2 + reductions + scalars
        assert sent_bf16_reduce == gathers // 2 + reductions // 2 + scalars


def test_reduce_dtype_refusals_are_one_line():
    with pytest.raises(ValueError, match=r"^reduce_dtype='float16': expected float32 or bfloat16$"):
        check_reduce_dtype("float16")
    with pytest.raises(ConfigError, match=r"^trainer.reduce_dtype='bfloat16': expected float32 with precision=32-true"):
        validate(_cfg("trainer.reduce_dtype=bfloat16"))
    with pytest.raises(ConfigError, match=r"^trainer.reduce_dtype='bfloat16': expected float32 with hooks 'powersgd'"):
        validate(_cfg("trainer.reduce_dtype=bfloat16", "trainer.precision=bf16-mixed", "hooks=powersgd"))
    validate(_cfg("trainer.reduce_dtype=bfloat16", "trainer.precision=bf16-mixed", "trainer.zero_stage=3"))
    with pytest.raises(ValueError, match=r"^reduce_dtype='bfloat16': expected float32 with hooks 'powersgd'"):
        Precision("bf16-mixed", reduce_dtype="bfloat16").reducing(powersgd())
