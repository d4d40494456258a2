"""One consistent state on every rank (``setup_state``) and buffers across ranks (``sync_buffers``), against DDP.

All 2-rank work runs in one job (``_on_two_ranks``), started once by the first test that needs it.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fdp
from fdp.comm import Comm
from fdp.state.replicas import rank_seed

torch.set_num_threads(1)

STEPS = 4
LR = 0.1


def _bn_module(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _batch(rank: int, step: int):
    # The ranks' inputs have different means and spreads, so their BatchNorm statistics differ.
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 6, generator=gen) * (1 + 2 * rank) + 3 * rank
    return x, torch.randint(0, 3, (8,), generator=gen)


def _ddp(rank: int) -> dict:
    module = _bn_module(0)
    # Rank 0's buffers before every forward: broadcast_buffers=True, DDP's default (renamed
    # forward_sync_buffers in newer torch).
    ddp_class = nn.parallel.DistributedDataParallel
    renamed = "forward_sync_buffers" in inspect.signature(ddp_class).parameters
    ddp = ddp_class(module, **({"forward_sync_buffers": True} if renamed else {"broadcast_buffers": True}))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return {
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "buffers": {n: b.clone() for n, b in module.named_buffers()},
    }


def _fdp(rank: int, comm: Comm, how: str) -> dict:
    # Each rank builds its model from its own seed: setup_state makes rank 0's everyone's.
    model, params, buffers = fdp.functionalize(_bn_module(seed=rank))
    loss_fn = fdp.cross_entropy_loss(model)
    plan = fdp.plan_buckets(
        fdp.planner_loss(loss_fn, buffers), params, _batch(rank, 0), bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0002
    )
    own = {n: p.clone() for n, p in params.items()}
    state = fdp.setup_state(params, buffers, fdp.sgd(LR), plan, comm=comm, seed=0)
    first = state
    step = fdp.make_train_step(loss_fn, fdp.sgd(LR), plan, comm=comm, sync_buffers=how)
    for i in range(STEPS):
        state, _ = step(state, _batch(rank, i))
    untouched = all(torch.equal(params[n], own[n]) for n in params)
    return {
        "params": state.params,
        "buffers": state.buffers,
        "start": first.params,
        "rng": first.rng,
        "inputs_untouched": untouched,
        "buckets": len(plan),
    }


def _on_two_ranks(rank: int, world: int) -> dict:
    comm = Comm()
    out = {"ddp": _ddp(rank)}
    for how in ("broadcast", "local"):
        out[how] = _fdp(rank, comm, how)

    # average: floating buffers averaged, integer ones rank 0's.
    mine = {
        "mean": torch.arange(4.0) * (rank + 1),
        "half": torch.full((3,), 1.5 + rank, dtype=torch.float16),
        "count": torch.tensor(5 + rank),
    }
    out["average"] = fdp.sync_buffers(mine, comm, "average")
    out["average_input"] = mine

    # Ranks that disagree on the seed are stopped, every one of them.
    model, params, buffers = fdp.functionalize(_bn_module(0))
    loss_fn = fdp.cross_entropy_loss(model)
    plan = fdp.plan_buckets(fdp.planner_loss(loss_fn, buffers), params, _batch(0, 0))
    try:
        fdp.setup_state(params, buffers, fdp.sgd(LR), plan, comm=comm, seed=rank)
        out["seed_error"] = None
    except ValueError as error:
        out["seed_error"] = str(error)
    # The first state of every ZeRO stage is made through the same check (fdp.update.base.Update.first_state).
    out["stage_seed_errors"] = {}
    for stage in (1, 2, 3):
        update = fdp.update.zero.update_for(stage, fdp.sgd(LR), plan, comm, model=model)
        try:
            update.first_state(params, buffers, None, comm, seed=rank)
            out["stage_seed_errors"][stage] = None
        except ValueError as error:
            out["stage_seed_errors"][stage] = str(error)
    return out


_RESULTS: list = []


@pytest.fixture
def two_ranks(run_ranks):
    if not _RESULTS:
        _RESULTS.extend(run_ranks(_on_two_ranks))
    return _RESULTS


def test_broadcast_buffers_train_as_ddp_with_broadcast_buffers(two_ranks):
    """4 SGD steps of a BatchNorm net on 2 ranks whose data differ: params and every rank's
    running statistics equal DDP's (broadcast_buffers=True, its default)."""
    for rank, result in enumerate(two_ranks):
        ddp, ours = result["ddp"], result["broadcast"]
        assert ours["buckets"] > 1
        assert ddp["params"].keys() == ours["params"].keys() and ddp["buffers"].keys() == ours["buffers"].keys()
        for name in ddp["params"]:
            torch.testing.assert_close(ours["params"][name], ddp["params"][name], rtol=0, atol=1e-6, msg=name)
        for name in ddp["buffers"]:
            torch.testing.assert_close(ours["buffers"][name], ddp["buffers"][name], rtol=0, atol=1e-6, msg=name)


def test_local_buffers_drift_apart_where_broadcast_keeps_rank_0s(two_ranks):
    ddp1, local1 = two_ranks[1]["ddp"], two_ranks[1]["local"]
    gap = (local1["buffers"]["1.running_mean"] - ddp1["buffers"]["1.running_mean"]).abs().max()
    assert gap > 0.1  # rank 1 kept statistics of its own (shifted) data
    local0, ddp0 = two_ranks[0]["local"], two_ranks[0]["ddp"]
    torch.testing.assert_close(
        local0["buffers"]["1.running_mean"], ddp0["buffers"]["1.running_mean"], rtol=0, atol=1e-6
    )
    for name in ddp1["params"]:  # gradients are averaged either way
        torch.testing.assert_close(local1["params"][name], ddp1["params"][name], rtol=0, atol=1e-6)


def test_average_takes_the_mean_of_floating_buffers_and_rank_0s_integers(two_ranks):
    a, b = (r["average_input"] for r in two_ranks)
    for result in two_ranks:
        got = result["average"]
        assert torch.equal(got["mean"], (a["mean"] + b["mean"]) / 2)
        assert got["half"].dtype == torch.float16 and torch.equal(got["half"], (a["half"] + b["half"]) / 2)
        assert got["count"].dtype == torch.int64 and got["count"].item() == 5
    assert not torch.equal(a["mean"], b["mean"])


def test_setup_state_starts_every_rank_from_rank_0s_params_with_its_own_generator(two_ranks):
    (r0, r1) = (r["broadcast"] for r in two_ranks)
    reference = _bn_module(0)
    for name, p in reference.named_parameters():
        assert torch.equal(r0["start"][name], p.detach()) and torch.equal(r1["start"][name], p.detach())
    for rank, r in enumerate((r0, r1)):
        assert torch.equal(r["rng"], torch.Generator().manual_seed(rank_seed(0, rank)).get_state())
        assert r["inputs_untouched"]
    assert not torch.equal(r0["rng"], r1["rng"])


def test_setup_state_refuses_ranks_with_different_seeds_on_every_rank(two_ranks):
    for result in two_ranks:
        message = result["seed_error"]
        assert message is not None and "\n" not in message
        assert message.startswith("seed differs between ranks (rank 0: 0, rank 1: 1)")


def test_every_zero_stage_s_first_state_refuses_ranks_with_different_seeds(two_ranks):
    for result in two_ranks:
        for stage, message in result["stage_seed_errors"].items():
            assert message is not None and message.startswith("seed differs between ranks (rank 0: 0, rank 1: 1)"), (
                stage
            )


def test_sync_buffers_on_a_world_of_one_returns_the_buffers_as_they_are():
    buffers = {"running_mean": torch.ones(3)}
    for how in fdp.BUFFER_SYNC:
        assert fdp.sync_buffers(buffers, Comm(), how) is buffers
    with pytest.raises(ValueError, match=r"^sync_buffers='rank0': expected broadcast, average or local$"):
        fdp.sync_buffers(buffers, Comm(), "rank0")
