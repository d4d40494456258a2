"""The outer loop (local SGD, DiLoCo) against plain torch, and resumed in the middle of a period."""
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from fdp import Comm, adam, functionalize, init_train_state, plan_buckets, sgd
from fdp.config import ConfigError, compose
from fdp.validate import validate
from fdp.hooks import allreduce
from fdp.outer import OuterSpec, check_outer, init_outer_state, make_outer_step
from fdp.plan import pack_into_buckets
from fdp import cross_entropy_loss, planner_loss
from fdp.launch import spawn
from fdp.trainer import run, train_worker
from fdp.world import layout_of

STEPS = 8


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches(rank, steps=STEPS):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(steps)]


def _fdp(spec, optimizer, rank, donate, hook=None, steps=STEPS):
    """Train with the outer step; return the final params and each step's (synced, bytes_sent)."""
    model, params, buffers = functionalize(_module())
    loss_fn = cross_entropy_loss(model)
    batches = _batches(rank, steps)
    # Small caps: several buckets, so the pseudo-gradient crosses the plan as gradients do.
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0001)
    assert len(plan.buckets) > 1
    hook = hook or allreduce()
    state = init_train_state(params, buffers, optimizer, plan, hook)
    state = state._replace(outer=init_outer_state(spec, params, plan, hook))
    step = make_outer_step(loss_fn, optimizer, plan, spec, hook, Comm(), donate=donate)
    trace = []
    for batch in batches:
        state, metrics = step(state, batch)
        trace.append((metrics["synced"], metrics["bytes_sent"]))
    return {name: p.clone() for name, p in state.params.items()}, trace, state


def _mean_(tensor, world):
    dist.all_reduce(tensor)
    return tensor.div_(world)


def _torch_parameter_averaging(rank, world, momentum):
    module = _module()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=momentum)
    for x, y in _batches(rank):
        opt.zero_grad()
        F.cross_entropy(module(x), y).backward()
        opt.step()
        with torch.no_grad():
            for p in module.parameters():
                _mean_(p, world)
    return dict(module.named_parameters())


def _torch_gradient_averaging(rank, world):
    module = _module()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for x, y in _batches(rank):
        opt.zero_grad()
        F.cross_entropy(module(x), y).backward()
        for p in module.parameters():
            _mean_(p.grad, world)
        opt.step()
    return dict(module.named_parameters())


def _local_sgd_every_step(rank, world):
    spec = check_outer({"name": "local_sgd", "sync_every": 1})
    with_momentum, _, _ = _fdp(spec, sgd(0.1, momentum=0.9), rank, donate=False)
    plain, trace, _ = _fdp(spec, sgd(0.1), rank, donate=True)
    return (
        _diff(with_momentum, _torch_parameter_averaging(rank, world, 0.9)),
        _diff(plain, _torch_parameter_averaging(rank, world, 0.0)),
        _diff(plain, _torch_gradient_averaging(rank, world)),
        trace,
    )


def _diff(ours, reference):
    assert ours.keys() == reference.keys()
    return max((ours[k] - reference[k].detach()).abs().max().item() for k in ours)


def test_local_sgd_every_step_equals_per_step_parameter_and_gradient_averaging(run_ranks):
    for momentum_diff, params_diff, grads_diff, trace in run_ranks(_local_sgd_every_step):
        assert momentum_diff < 1e-6 and params_diff < 1e-6 and grads_diff < 1e-6
        assert all(synced == 1 and sent > 0 for synced, sent in trace)


def _torch_diloco(rank, world, sync_every, start_step):
    """DiLoCo written out in torch: Adam inside, Nesterov SGD on the averaged pseudo-gradient outside."""
    module = _module()
    inner = torch.optim.Adam(module.parameters(), lr=0.01)
    anchor = [torch.nn.Parameter(p.detach().clone()) for p in module.parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    for step, (x, y) in enumerate(_batches(rank), start=1):
        inner.zero_grad()
        F.cross_entropy(module(x), y).backward()
        if step <= start_step:
            for p in module.parameters():
                _mean_(p.grad, world)
        inner.step()
        with torch.no_grad():
            if step == start_step:
                for a, p in zip(anchor, module.parameters()):
                    a.copy_(p)
            if step > start_step and (step - start_step) % sync_every == 0:
                for a, p in zip(anchor, module.parameters()):
                    a.grad = _mean_(a - p, world)
                outer.step()
                for a, p in zip(anchor, module.parameters()):
                    p.copy_(a)
    return dict(module.named_parameters())


def _diloco(rank, world):
    spec = check_outer({"name": "diloco", "sync_every": 3, "start_step": 2, "lr": 0.7, "momentum": 0.9, "nesterov": True})
    params, trace, state = _fdp(spec, adam(0.01), rank, donate=True)
    return _diff(params, _torch_diloco(rank, world, 3, 2)), trace, state.outer.syncs


def test_diloco_matches_a_plain_torch_reference_and_sends_only_at_syncs(run_ranks):
    for diff, trace, syncs in run_ranks(_diloco):
        assert diff < 1e-5
        # Steps 1-2 reduce gradients; then steps 5 and 8 sync; the others send nothing.
        assert [step for step, (synced, sent) in enumerate(trace, 1) if sent > 0] == [1, 2, 5, 8]
        assert [synced for synced, _ in trace] == [1, 1, 0, 0, 1, 0, 0, 1]
        assert syncs == 2


# -- overlap: a sync applied some steps after it was sent ------------------------------------
def _torch_delayed_outer(rank, world, inner, outer_kwargs, sync_every, start_step, overlap, steps):
    """The delayed outer update written out in torch.

    The pseudo-gradient sent after step s is averaged and steps the anchor after step
    s + overlap; each rank then adds (new anchor - old anchor) + its own pseudo-gradient
    to its params, which keeps its steps since s on top of the new anchor.
    """
    module = _module()
    params = list(module.parameters())
    inner = inner(params)
    anchor = [torch.nn.Parameter(p.detach().clone()) for p in params]
    outer = torch.optim.SGD(anchor, **outer_kwargs)
    sent_at, mine, averaged = None, None, None
    for step, (x, y) in enumerate(_batches(rank, steps), start=1):
        inner.zero_grad()
        F.cross_entropy(module(x), y).backward()
        if step <= start_step:
            for p in params:
                _mean_(p.grad, world)
        inner.step()
        with torch.no_grad():
            if step == start_step:
                for a, p in zip(anchor, params):
                    a.copy_(p)
            if sent_at is not None and step == sent_at + overlap:
                before = [a.detach().clone() for a in anchor]
                for a, g in zip(anchor, averaged):
                    a.grad = g
                outer.step()
                for p, a, b, d in zip(params, anchor, before, mine):
                    p.add_((a - b) + d)
                sent_at = None
            if step > start_step and (step - start_step) % sync_every == 0:
                mine = [(a - p).detach() for a, p in zip(anchor, params)]
                averaged = [_mean_(d.clone(), world) for d in mine]
                sent_at = step
    return dict(module.named_parameters())


def _overlapped(rank, world):
    steps = 12
    diloco = check_outer({"name": "diloco", "sync_every": 3, "start_step": 1, "lr": 0.7, "momentum": 0.9,
                          "nesterov": True, "overlap": 2})
    diloco_params, trace, state = _fdp(diloco, adam(0.01), rank, donate=True, steps=steps)
    diloco_reference = _torch_delayed_outer(rank, world, lambda p: torch.optim.Adam(p, lr=0.01),
                                            dict(lr=0.7, momentum=0.9, nesterov=True), 3, 1, 2, steps)
    local = check_outer({"name": "local_sgd", "sync_every": 4, "overlap": 3})
    local_params, _, _ = _fdp(local, sgd(0.1, momentum=0.9), rank, donate=False, steps=steps)
    local_reference = _torch_delayed_outer(rank, world, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                           dict(lr=1.0), 4, 0, 3, steps)
    return _diff(diloco_params, diloco_reference), _diff(local_params, local_reference), trace, state.outer.syncs


def test_an_overlapped_sync_matches_a_plain_torch_delayed_update(run_ranks):
    for diloco_diff, local_diff, trace, syncs in run_ranks(_overlapped):
        assert diloco_diff < 1e-5 and local_diff < 1e-5
        # Step 1 reduces gradients; syncs are sent after steps 4, 7 and 10 and applied two steps later.
        assert [step for step, (synced, sent) in enumerate(trace, 1) if sent > 0] == [1, 4, 7, 10]
        assert [step for step, (synced, sent) in enumerate(trace, 1) if synced] == [1, 6, 9, 12]
        assert syncs == 3


# -- resume in the middle of a period ----------------------------------------------------
RUN = ["model.hidden=16", "data.global_batch_size=16", "trainer.progress=false", "trainer.eval_every=0",
       "world=local2", "world.backend=gloo", "world.timeout_s=60", "trainer.max_steps=10",
       "outer=diloco", "outer.sync_every=4", "hooks=powersgd", "hooks.start_iter=1", "hooks.min_compression_rate=1"]


def _checkpoint(run_dir):
    return torch.load(Path(run_dir) / "checkpoints" / "last.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(overlap)``: the last checkpoint of the run of RUN without a stop, made once per overlap."""
    made = {}

    def last_checkpoint(overlap):
        if overlap not in made:
            made[overlap] = tmp_path_factory.mktemp(f"whole-overlap{overlap}")
            run(compose(*RUN, f"outer.overlap={overlap}"), made[overlap])
        return _checkpoint(made[overlap])

    return last_checkpoint


def _assert_each_rank_as_uninterrupted(whole, parts):
    assert parts["step"] == whole["step"] == 10
    for rank in (0, 1):
        for key in ("params", "buffers"):
            for name, value in whole["ranks"][rank][key].items():
                assert torch.equal(parts["ranks"][rank][key][name], value), (rank, key, name)
        for key in ("outer", "opt_state", "hook_state"):
            for a, b in zip(whole["ranks"][rank][key], parts["ranks"][rank][key], strict=True):
                assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), (rank, key)


@pytest.mark.parametrize("overlap", [0, 3])
def test_resume_in_the_middle_of_a_period_is_bit_exact(tmp_path, uninterrupted, overlap):
    """Stopped after step 6 (syncs at 4 and 8) and resumed: each rank ends as in one uninterrupted run.

    With ``overlap=3`` the sync sent after step 4 is still in flight at the stop (applied
    after step 7): the resumed run sends it again from the checkpoint.
    """
    runs = [*RUN, f"outer.overlap={overlap}"]
    run(compose(*runs, "trainer.stop_at=6"), tmp_path)
    halfway = _checkpoint(tmp_path)
    assert halfway["step"] == 6
    # Mid-period the ranks have stepped apart, and each rank's own params were saved.
    assert any(not torch.equal(halfway["ranks"][0]["params"][k], halfway["ranks"][1]["params"][k]) for k in halfway["params"])
    run(compose(*runs, "trainer.resume=true"), tmp_path)
    _assert_each_rank_as_uninterrupted(uninterrupted(overlap), _checkpoint(tmp_path))


def _killed_when_saving(cfg, run_dir, step):
    """``train_worker``, except that in the first world rank 0 is SIGKILLed as it starts saving checkpoint ``step``."""
    if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        real_save = torch.save

        def save(obj, *args, **kwargs):
            if isinstance(obj, dict) and obj.get("step") == step:
                Path(run_dir, "killed").write_text(str(step))
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(obj, *args, **kwargs)

        torch.save = save
    return train_worker(cfg, run_dir)


def test_a_restarted_world_keeps_the_schedule_with_a_sync_in_flight(tmp_path, uninterrupted):
    """Rank 0 dies at checkpoint 8; the restarted world resumes from checkpoint 6, where the
    sync sent after step 4 is in flight (``overlap=3``), and ends as the uninterrupted run."""
    cfg = compose(*RUN, "outer.overlap=3", "trainer.checkpoint_every=2", "world.max_restarts=1")
    validate(cfg, tmp_path)
    results = spawn(_killed_when_saving, (OmegaConf.to_container(cfg, resolve=True), str(tmp_path), 8), layout_of(cfg))
    assert (tmp_path / "killed").read_text() == "8" and results[0]["steps"] == 10
    _assert_each_rank_as_uninterrupted(uninterrupted(3), _checkpoint(tmp_path))


# -- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["outer=local_sgd", "outer.sync_every=0"], "outer.sync_every=0: expected an integer >= 1"),
        (["outer=diloco", "outer.start_step=-1"], "outer.start_step=-1: expected an integer >= 0"),
        (["outer=diloco", "outer.momentum=1.5"], "outer.momentum=1.5: expected a value in [0, 1)"),
        (["outer=local_sgd", "outer.sync_every=4", "outer.overlap=4"], "outer.overlap=4: expected an integer in [0, outer.sync_every=4)"),
    ],
)
def test_bad_outer_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(compose(*overrides))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_an_outer_step_needs_an_outer_schedule():
    with pytest.raises(ValueError, match="outer=none"):
        make_outer_step(lambda *a: None, sgd(0.1), pack_into_buckets([("w", (2,), "float32", "cpu")]), OuterSpec())
