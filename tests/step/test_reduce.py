"""The data-parallel reduction on 2 gloo ranks: against DDP, both schedules, start-up checks, timeouts."""

import time

import pytest
import torch
from torch import nn

from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
from fdp.comm import Comm
from fdp.data import global_batch, load_digits, rank_share
from fdp.hooks import Hook, allreduce
from fdp.model.builtin import MLP, ConvNet
from fdp.model.functional import functionalize
from fdp.optim import sgd
from fdp.plan import pack_into_buckets, plan_buckets
from fdp.procs.launch import check_same_plan
from fdp.step.chains import Reduction

STEPS = 20


def _fdp_and_ddp(rank, world, model_name, schedule, accum_steps, donate):
    torch.manual_seed(0)
    make = (lambda: MLP(64, 64, 3, 10)) if model_name == "mlp" else ConvNet
    module = make()
    reference = make()
    reference.load_state_dict(module.state_dict())
    ddp = nn.parallel.DistributedDataParallel(reference, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    data = load_digits(flatten=False)
    example = rank_share(global_batch(data, 0, 32, 0), rank, world)
    # Small caps so several buckets are in flight at once.
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, example, bucket_cap_mb=0.02, first_bucket_cap_mb=0.005)
    comm = Comm()
    step = make_train_step(
        loss_fn,
        sgd(0.05, momentum=0.9),
        plan,
        allreduce(),
        comm,
        accum_steps=accum_steps,
        schedule=schedule,
        donate=donate,
    )
    state = init_train_state(params, buffers, sgd(0.05, momentum=0.9), plan)
    first_params = dict(state.params)
    sent = []
    for i in range(STEPS):
        x, y = rank_share(global_batch(data, i, 32, 0), rank, world)
        state, metrics = step(state, (x, y))
        sent.append(metrics["bytes_sent"])
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    diff = max((state.params[n] - p.detach()).abs().max().item() for n, p in ddp.module.named_parameters())
    in_place = all(state.params[n] is t for n, t in first_params.items())
    return diff, len(plan), sent[-1], plan.nbytes, in_place


@pytest.mark.parametrize(
    "model_name,schedule,accum_steps,donate",
    [
        ("mlp", "after", 1, False),
        ("mlp", "after", 1, True),
        ("mlp", "overlap", 1, False),
        ("mlp", "overlap", 1, True),
        ("convnet", "overlap", 1, True),
        ("mlp", "overlap", 2, True),
    ],
)
def test_fdp_matches_ddp(run_ranks, model_name, schedule, accum_steps, donate):
    """Same model, data and SGD: fdp's params equal DDP's within 1e-5 after 20 steps.

    ``donate=True`` runs the trainer's path: SGD updates each bucket's params in place as
    soon as that bucket is reduced.
    """
    results = run_ranks(_fdp_and_ddp, model_name, schedule, accum_steps, donate)
    for diff, buckets, sent, nbytes, in_place in results:
        assert buckets > 1
        assert diff <= 1e-5
        assert sent == nbytes  # allreduce sends each gradient byte once per step
        assert in_place == donate


def _mismatched_plans(rank, world):
    torch.manual_seed(0)
    module = MLP(64, 32 if rank == 0 else 48, 2, 10)
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    batch = (torch.randn(4, 64), torch.randint(0, 10, (4,)))
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    try:
        check_same_plan(plan, Comm())
    except RuntimeError as e:
        return str(e)
    return None


def test_plan_mismatch_stops_every_rank_naming_the_parameter(run_ranks):
    messages = run_ranks(_mismatched_plans)
    for message in messages:
        assert message is not None and "rank 1" in message
        assert "net." in message and "shape" in message


SILENT_S = 20  # how long the silent peer stays alive at most: a timeout not kept shows as a wait this long
# The world's timeout. It also bounds joining the group: 2 s failed a rank's join once, two ranks starting 2 s
# apart while the suite's other worker loaded the cores.
TIMEOUT_S = 5.0


def _stay_silent(done):
    """Alive without joining the collective (its socket stays open: no error but the timeout's can end the wait),
    until rank 0 is done waiting or ``SILENT_S`` passed."""
    deadline = time.monotonic() + SILENT_S
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _timed_allreduce(comm, done):
    start = time.perf_counter()
    try:
        comm.allreduce(torch.ones(4)).wait()
        outcome = "no error"
    except RuntimeError as e:
        outcome = str(e)
    waited = time.perf_counter() - start
    done.touch()
    return outcome, waited


def _silent_peer(rank, world, done):
    if rank == 1:
        return _stay_silent(done)  # never joins the collective
    return _timed_allreduce(Comm(), done)


def test_collective_timeout_is_an_error_not_a_hang(run_ranks, tmp_path):
    result = run_ranks(_silent_peer, tmp_path / "done", timeout_s=TIMEOUT_S)[0]
    message, waited = result
    assert message != "no error"
    assert waited < TIMEOUT_S + 8 < SILENT_S


def _silent_peer_on_a_group_of_its_own(rank, world, done):
    comm = Comm().on_own_group()  # torch would give a new group 30 minutes, not the world's few seconds
    if rank == 1:
        return _stay_silent(done)
    return _timed_allreduce(comm, done)


def test_a_group_of_its_own_times_out_as_the_world_does(run_ranks, tmp_path):
    message, waited = run_ranks(_silent_peer_on_a_group_of_its_own, tmp_path / "done", timeout_s=TIMEOUT_S)[0]
    assert message != "no error"
    assert waited < TIMEOUT_S + 8 < SILENT_S


def _three_rounds():
    """A chain of three allreduces per bucket, recording the order its collectives are issued in."""
    issued = []

    def apply(state, grads, comm):
        buffer = grads.buffer
        for stage in range(3):
            issued.append((grads.index, stage))
            buffer = (yield comm.allreduce(buffer)) + 1
        return grads._replace(buffer=buffer), state

    return Hook(lambda bucket: (), apply), issued


def _polled_while_peer_waits(rank, world):
    # 1 KB per tensor, 1 KB caps: four buckets, each chain three collectives long.
    plan = pack_into_buckets(
        [(f"w{i}", (256,), "float32", "cpu") for i in range(4)], bucket_cap_mb=0.001, first_bucket_cap_mb=0.001
    )
    hook, issued = _three_rounds()
    reduction = Reduction(hook, Comm(), ((),) * len(plan.buckets), plan)
    for index in range(len(plan.buckets)):
        reduction.start(torch.full((256,), float(rank + index)))
    if rank == 0:  # polls whatever has landed, many times, while the peer resumes in its own time
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:
            reduction.poll()
            time.sleep(0.001)
    else:
        time.sleep(0.05)
    results = {index: bucket.buffer[0].item() for index, bucket in reduction.finished()}
    return len(plan.buckets), issued, results


def test_a_polled_reduction_issues_collectives_in_the_order_finished_does(run_ranks):
    (buckets, polled, results0), (_, waited, results1) = run_ranks(_polled_while_peer_waits)
    # Round by round, in plan order: every bucket's first collective, then every second one, ...
    assert polled == waited == [(index, stage) for stage in range(3) for index in range(buckets)]
    # Bucket i starts at i on rank 0 and i + 1 on rank 1: 2i + 2 after the first round,
    # then x -> 2x + 1 twice: 8i + 11.
    expected = {index: 8 * index + 11 for index in range(buckets)}
    assert results0 == results1 == expected
