"""The outer loop (local SGD, DiLoCo) against plain torch, and resumed in the middle of a period."""

import dataclasses
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _saved import saved
from omegaconf import OmegaConf

from fdp import Comm, adam, cross_entropy_loss, functionalize, init_train_state, plan_buckets, planner_loss, sgd
from fdp.errors import ConfigError
from fdp.hooks import allreduce, lowbit
from fdp.plan import pack_into_buckets, split_fragments
from fdp.procs.launch import spawn
from fdp.run.checkpoint import last_of
from fdp.run.checkpoint.files import is_sharded
from fdp.run.config import DiLoCoConfig, LocalSGDConfig
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.run.trainer import run, run_rank
from fdp.run.world import layout_of
from fdp.step.outer import init_outer_state, make_outer_step
from fdp.step.outer_spec import check_outer, fragment_offsets, sending_fragment

STEPS = 8


def _outer(name, **settings):
    """The outer settings of ``name`` with the schema's defaults (``fdp.run.config``) under ``settings``."""
    schema = {"local_sgd": LocalSGDConfig, "diloco": DiLoCoConfig}[name]
    return check_outer(dataclasses.asdict(schema(**settings)))


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
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0001
    )
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
    spec = _outer("local_sgd", sync_every=1)
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
    spec = _outer("diloco", sync_every=3, start_step=2)
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
    diloco = _outer("diloco", sync_every=3, start_step=1, overlap=2)
    diloco_params, trace, state = _fdp(diloco, adam(0.01), rank, donate=True, steps=steps)
    diloco_reference = _torch_delayed_outer(
        rank, world, lambda p: torch.optim.Adam(p, lr=0.01), dict(lr=0.7, momentum=0.9, nesterov=True), 3, 1, 2, steps
    )
    local = _outer("local_sgd", sync_every=4, overlap=3)
    local_params, _, _ = _fdp(local, sgd(0.1, momentum=0.9), rank, donate=False, steps=steps)
    local_reference = _torch_delayed_outer(
        rank, world, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), dict(lr=1.0), 4, 0, 3, steps
    )
    return _diff(diloco_params, diloco_reference), _diff(local_params, local_reference), trace, state.outer.syncs


def test_an_overlapped_sync_matches_a_plain_torch_delayed_update(run_ranks):
    for diloco_diff, local_diff, trace, syncs in run_ranks(_overlapped):
        assert diloco_diff < 1e-5 and local_diff < 1e-5
        # Step 1 reduces gradients; syncs are sent after steps 4, 7 and 10 and applied two steps later.
        assert [step for step, (synced, sent) in enumerate(trace, 1) if sent > 0] == [1, 4, 7, 10]
        assert [step for step, (synced, sent) in enumerate(trace, 1) if synced] == [1, 6, 9, 12]
        assert syncs == 3


# -- fragments: streaming DiLoCo ----------------------------------------------------------
def _torch_streaming(rank, world, fragments, sends, overlap, mix, steps):
    """Streaming DiLoCo written out in torch: each fragment (a list of param names) has its own
    anchor and Nesterov SGD; ``sends`` maps a step to the fragment sent after it; the sync
    lands ``overlap`` steps later, keeping the steps since (``mix=None``) or mixing
    ``mix * local + (1 - mix) * anchor``."""
    module = _module()
    named = dict(module.named_parameters())
    inner = torch.optim.Adam(module.parameters(), lr=0.01)
    anchors = [[torch.nn.Parameter(named[n].detach().clone()) for n in names] for names in fragments]
    outers = [torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True) for anchor in anchors]
    in_flight = {}  # landing step -> (fragment, this rank's pseudo-gradient, the average)
    for step, (x, y) in enumerate(_batches(rank, steps), start=1):
        inner.zero_grad()
        F.cross_entropy(module(x), y).backward()
        inner.step()
        with torch.no_grad():
            _land(in_flight.pop(step, None), anchors, outers, fragments, named, mix)
            if step in sends:
                f = sends[step]
                mine = [(a - named[n]).detach() for a, n in zip(anchors[f], fragments[f])]
                in_flight[step + overlap] = (f, mine, [_mean_(d.clone(), world) for d in mine])
            _land(in_flight.pop(step, None), anchors, outers, fragments, named, mix)  # overlap=0: at once
    return dict(module.named_parameters())


def _land(sync, anchors, outers, fragments, named, mix):
    if sync is None:
        return
    f, mine, averaged = sync
    before = [a.detach().clone() for a in anchors[f]]
    for a, g in zip(anchors[f], averaged):
        a.grad = g
    outers[f].step()
    for name, a, b, d in zip(fragments[f], anchors[f], before, mine):
        p = named[name]
        if mix is None:
            p.add_((a - b) + d)
        else:
            p.copy_(mix * p + (1 - mix) * a)


def _fragment_names(spec, rank):
    """The fragments' param names as the plan of ``_fdp`` splits them."""
    model, params, buffers = functionalize(_module())
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, _batches(rank, 1)[0], bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0001
    )
    split = split_fragments(plan, spec.fragments)
    names = [[n for i in buckets for n in plan.buckets[i].names] for buckets in split]
    return [[n for n in params if n in group] for group in names], [[plan.buckets[i].numel for i in b] for b in split]


def _streaming(rank, world):
    steps, out = 12, {}
    cases = {
        # Two fragments spread over the period, each sent behind the next step, progress kept.
        "strided": (
            _outer("diloco", sync_every=4, fragments=2, overlap=1),
            True,
            {2: 0, 4: 1, 6: 0, 8: 1, 10: 0, 12: 1},
        ),
        # Three fragments on consecutive steps, applied at once and mixed half and half.
        "sequential": (
            _outer("diloco", sync_every=6, fragments=3, fragment_schedule="sequential", mix=0.5),
            False,
            {4: 0, 5: 1, 6: 2, 10: 0, 11: 1, 12: 2},
        ),
        # Sent behind two steps and mixed as torchft does (alpha=0: the local steps since are dropped).
        "mixed": (_outer("diloco", sync_every=6, fragments=2, overlap=2, mix=0.0), True, {3: 0, 6: 1, 9: 0, 12: 1}),
    }
    for name, (spec, donate, sends) in cases.items():
        params, trace, state = _fdp(spec, adam(0.01), rank, donate=donate, steps=steps)
        fragments, sizes = _fragment_names(spec, rank)
        reference = _torch_streaming(rank, world, fragments, sends, spec.overlap, spec.mix, steps)
        schedule = {s: sending_fragment(spec, s) for s in range(1, steps + 1) if sending_fragment(spec, s) is not None}
        out[name] = (_diff(params, reference), trace, state.outer.syncs, schedule == sends, fragments, sizes)
    # 4-bit outer gradients: a fragment's sync sends its buckets' codes and scales only.
    spec = _outer("diloco", sync_every=4, fragments=2, overlap=1)
    params, trace, state = _fdp(spec, adam(0.01), rank, donate=True, hook=lowbit("fp4", block=16), steps=steps)
    out["fp4"] = (trace, {n: a.clone() for n, a in state.outer.anchor.items()}, state.outer.hook_state)
    return out


_STREAMING: list = []  # one 2-rank run shared by the tests below


@pytest.fixture
def streaming(run_ranks):
    if not _STREAMING:
        _STREAMING.extend(run_ranks(_streaming))
    return _STREAMING


def test_fragments_are_contiguous_runs_of_buckets_balanced_by_size():
    plan = pack_into_buckets(
        [(f"w{i}", (n,), "float32", "cpu") for i, n in enumerate([10, 10, 10, 10, 40, 5, 5])],
        bucket_cap_mb=16 / 2**20,
        first_bucket_cap_mb=16 / 2**20,
    )
    assert [len(b.names) for b in plan.buckets] == [1] * 7
    assert split_fragments(plan, 2) == (range(0, 4), range(4, 7))  # 40 | 50 entries
    assert split_fragments(plan, 3) == (range(0, 4), range(4, 5), range(5, 7))  # 40 | 40 | 10: no run over 40
    assert split_fragments(plan, 7) == tuple(range(i, i + 1) for i in range(7))
    with pytest.raises(ValueError, match=r"outer.fragments=8: expected an integer in \[1, 7\]"):
        split_fragments(plan, 8)


def test_fragment_offsets_stagger_the_syncs_over_the_period():
    strided = _outer("diloco", sync_every=16, fragments=4)
    assert fragment_offsets(strided) == (4, 8, 12, 0)
    assert [sending_fragment(strided, s) for s in (4, 8, 12, 16, 20, 32)] == [0, 1, 2, 3, 0, 3]
    sequential = _outer("diloco", sync_every=16, fragments=4, fragment_schedule="sequential", start_step=2)
    assert [s for s in range(1, 40) if sending_fragment(sequential, s) is not None] == [15, 16, 17, 18, 31, 32, 33, 34]
    assert fragment_offsets(_outer("diloco", sync_every=16)) == (0,)  # one fragment: DiLoCo's own schedule


def test_streaming_fragments_match_a_plain_torch_reference_and_sync_on_their_steps(streaming):
    for rank in streaming:
        for name in ("strided", "sequential", "mixed"):
            diff, trace, syncs, on_schedule, fragments, sizes = rank[name]
            assert on_schedule, name
            assert diff < 1e-5, (name, diff)
            assert len(fragments) == {"strided": 2, "sequential": 3, "mixed": 2}[name] and all(fragments)
            assert syncs == {"strided": 5, "sequential": 6, "mixed": 3}[name]  # landed by step 12
        sent = [step for step, (_, b) in enumerate(rank["strided"][1], 1) if b > 0]
        landed = [step for step, (synced, _) in enumerate(rank["strided"][1], 1) if synced]
        assert sent == [2, 4, 6, 8, 10, 12] and landed == [3, 5, 7, 9, 11]


def test_fp4_outer_gradients_send_each_fragment_alone_and_keep_ranks_agreed(streaming):
    (trace0, anchor0, hook_state0), (trace1, anchor1, _) = (rank["fp4"] for rank in streaming)
    assert all(torch.equal(anchor0[n], anchor1[n]) for n in anchor0)  # the same fp32 sum on every rank
    _, _, _, _, _, sizes = streaming[0]["strided"]
    # Each sync: one allgather per bucket of its fragment, 4 bits per entry plus an fp32 scale per 16.
    expected = [sum((n + (-n % 16)) // 2 + 4 * ((n + 15) // 16) for n in part) for part in sizes]
    assert [b for _, b in trace0 if b > 0] == [b for _, b in trace1 if b > 0] == expected * 3
    whole = 4 * sum(map(sum, sizes))  # plain DiLoCo's sync: the model in fp32
    assert max(expected) <= whole / 2 / 4  # at most 1/F of it, with room to spare
    assert all(state[0].error.dtype == torch.float32 for state in hook_state0)


# -- resume in the middle of a period ----------------------------------------------------
RUN = [
    "model.hidden=16",
    "data.global_batch_size=16",
    "trainer.progress=false",
    "trainer.eval_every=0",
    "world=local2",
    "world.backend=gloo",
    "world.timeout_s=60",
    "trainer.max_steps=10",
    "outer=diloco",
    "outer.sync_every=4",
]
POWERSGD = ["hooks=powersgd", "hooks.start_iter=1", "hooks.min_compression_rate=1"]


def _checkpoint(run_dir):
    return saved(Path(run_dir))


# Streaming: two fragments (syncs after steps 2, 6, 10 and 4, 8), each sent behind the next step,
# as fp4 codes with error feedback; small buckets so that the plan has several. streaming_mix
# lands each sync on the new anchor, as benchmarks/streaming.py's settings to start from (outer.mix=0).
STREAMING = [
    "outer.fragments=2",
    "outer.overlap=1",
    "hooks=lowbit",
    "hooks.block=16",
    "trainer.bucket_cap_mb=0.002",
    "trainer.first_bucket_cap_mb=0.001",
]
VARIANTS = {
    "overlap0": [*POWERSGD, "outer.overlap=0"],
    "overlap3": [*POWERSGD, "outer.overlap=3"],
    "streaming": STREAMING,
    "streaming_mix": [*STREAMING, "outer.mix=0", "outer.lr=0.7", "outer.momentum=0.7"],
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(variant)``: the last checkpoint of the run of RUN without a stop, made once per variant."""
    made = {}

    def last_checkpoint(variant):
        if variant not in made:
            made[variant] = tmp_path_factory.mktemp(f"whole-{variant}")
            run(compose(*RUN, *VARIANTS[variant], "trainer.checkpoint_format=whole"), made[variant])
        return _checkpoint(made[variant])

    return last_checkpoint


def _assert_each_rank_as_uninterrupted(whole, parts):
    assert parts["step"] == whole["step"] == 10
    for rank in (0, 1):
        for key in ("params", "buffers"):
            for name, value in whole["ranks"][rank][key].items():
                assert torch.equal(parts["ranks"][rank][key][name], value), (rank, key, name)
        for key in ("outer", "opt_state", "hook_state"):
            for a, b in zip(_by_path(whole["ranks"][rank], key), _by_path(parts["ranks"][rank], key), strict=True):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (rank, key)


def _by_path(mine, key):
    """A rank's saved leaves of ``key``, the optimizer state's in the order of its paths (a consolidated sharded
    checkpoint lists them in the order its pieces were stored)."""
    if key != "opt_state":
        return mine[key]
    by_path = dict(zip(mine["opt_state_paths"], mine["opt_state"], strict=True))
    return [by_path[path] for path in sorted(by_path)]


@pytest.mark.parametrize("variant, fmt", [*((v, "auto") for v in VARIANTS), ("overlap3", "whole")])
def test_resume_in_the_middle_of_a_period_is_bit_exact(tmp_path, uninterrupted, variant, fmt):
    """Stopped after step 6 (syncs at 4 and 8) and resumed: each rank ends as in one uninterrupted run, whether
    its checkpoints are sharded (two ranks' default: each rank's own params, optimizer state, in-flight
    pseudo-gradient and hook state beside the anchor and outer optimizer state they share) or whole.

    With ``overlap=3`` the sync sent after step 4 is still in flight at the stop (applied
    after step 7): the resumed run sends it again from the checkpoint. Streaming: fragment
    0's fp4 sync sent after step 6 is in flight at the stop, with both fragments' outer
    optimizer states and every bucket's error feedback in the checkpoint.
    """
    runs = [*RUN, *VARIANTS[variant], f"trainer.checkpoint_format={fmt}"]
    run(compose(*runs, "trainer.stop_at=6"), tmp_path)
    assert is_sharded(last_of(tmp_path / "checkpoints")) == (fmt == "auto")
    halfway = _checkpoint(tmp_path)
    assert halfway["step"] == 6
    # Mid-period the ranks have stepped apart, and each rank's own params were saved.
    assert any(
        not torch.equal(halfway["ranks"][0]["params"][k], halfway["ranks"][1]["params"][k]) for k in halfway["params"]
    )
    run(compose(*runs, "trainer.resume=true"), tmp_path)
    _assert_each_rank_as_uninterrupted(uninterrupted(variant), _checkpoint(tmp_path))


def _killed_when_saving(cfg, run_dir, step):
    """``run_rank``, except that in the first world rank 0 is SIGKILLed as it starts saving checkpoint ``step``."""
    if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        real_save = torch.save

        def save(obj, *args, **kwargs):
            if isinstance(obj, dict) and obj.get("step") == step:
                Path(run_dir, "killed").write_text(str(step))
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(obj, *args, **kwargs)

        torch.save = save
    return run_rank(cfg, run_dir)


def test_a_restarted_world_keeps_the_schedule_with_a_sync_in_flight(tmp_path, uninterrupted):
    """Rank 0 dies at checkpoint 8; the restarted world resumes from checkpoint 6, where the
    sync sent after step 4 is in flight (``overlap=3``), and ends as the uninterrupted run."""
    cfg = compose(*RUN, *VARIANTS["overlap3"], "trainer.checkpoint_every=2", "world.max_restarts=1")
    validate(cfg, tmp_path)
    results = spawn(_killed_when_saving, (OmegaConf.to_container(cfg, resolve=True), str(tmp_path), 8), layout_of(cfg))
    assert (tmp_path / "killed").read_text() == "8" and results[0]["steps"] == 10
    _assert_each_rank_as_uninterrupted(uninterrupted("overlap3"), _checkpoint(tmp_path))


# -- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["outer=local_sgd", "outer.sync_every=0"], "outer.sync_every=0: expected an integer >= 1"),
        (["outer=diloco", "outer.start_step=-1"], "outer.start_step=-1: expected an integer >= 0"),
        (["outer=diloco", "outer.momentum=1.5"], "outer.momentum=1.5: expected a value in [0, 1)"),
        (
            ["outer=local_sgd", "outer.sync_every=4", "outer.overlap=4"],
            "outer.overlap=4: expected an integer in [0, outer.sync_every=4)",
        ),
        (
            ["outer=diloco", "outer.sync_every=4", "outer.fragments=5"],
            "outer.fragments=5: expected an integer in [1, outer.sync_every=4]",
        ),
        (
            ["outer=diloco", "outer.fragments=2", "outer.fragment_schedule=random"],
            "outer.fragment_schedule='random': expected strided or sequential",
        ),
        (
            ["outer=diloco", "outer.sync_every=16", "outer.fragments=4", "outer.overlap=4"],
            "outer.overlap=4: expected an integer in [0, 4, the steps between fragment syncs of outer.fragments=4 "
            "outer.fragment_schedule=strided)",
        ),
        (
            ["outer=diloco", "outer.fragments=4", "outer.fragment_schedule=sequential", "outer.overlap=1"],
            "outer.overlap=1: expected an integer in [0, 1, the steps between fragment syncs",
        ),
        (["outer=local_sgd", "outer.mix=1.5"], "outer.mix=1.5: expected null or a number in [0, 1]"),
        (["hooks=lowbit", "hooks.format=fp2"], "hooks.format='fp2': expected int8, fp8, int4, fp4"),
    ],
)
def test_bad_outer_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(compose(*overrides))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_an_outer_step_needs_an_outer_schedule():
    with pytest.raises(ValueError, match="outer=none"):
        make_outer_step(
            lambda *a: None, sgd(0.1), pack_into_buckets([("w", (2,), "float32", "cpu")]), check_outer({"name": "none"})
        )
