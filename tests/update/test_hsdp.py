"""Hybrid sharding (HSDP, ``world.hierarchical=true`` with a ZeRO stage) on two groups of two gloo ranks: equal to
flat ZeRO at the same stage and to one process on the union batch, a fraction of flat's bytes across the groups,
and checkpoints that move between hybrid and flat worlds."""

import dataclasses
import math
import shutil

import pytest
import torch
from _configs import quiet as _cfg
from _saved import saved

from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
from fdp.comm import Comm
from fdp.errors import ConfigError
from fdp.hooks import allreduce, int8, lowbit
from fdp.hooks.base import init_hook_states
from fdp.hooks.compress import reduced_in
from fdp.model.builtin import MLP
from fdp.model.functional import functionalize
from fdp.optim import adam, chain, clip_by_global_norm
from fdp.plan import plan_buckets, split_fragments
from fdp.run.checkpoint import last_of
from fdp.run.checkpoint.consolidate import consolidate
from fdp.run.config import DiLoCoConfig, LocalSGDConfig, register_configs
from fdp.run.config.validate import validate
from fdp.run.trainer import run
from fdp.step.chains import Reduction
from fdp.step.outer import init_outer_state, make_outer_step
from fdp.step.outer_spec import check_outer
from fdp.update import zero
from fdp.update.zero.scatter import ScatterComm

pytestmark = pytest.mark.heavy  # run first (tests/conftest.py)

register_configs()

STEPS = 4
MODEL = (13, 7, 2, 5)  # odd sizes and a tiny cap: buckets that do not split evenly over 2 or 4 ranks
CAP_MB = 60 * 4 / 2**20
NODE = 2


def _union_batches(world, per_rank=8, seed=0, steps=STEPS):
    g = torch.Generator().manual_seed(seed)
    n = per_rank * world
    return [
        (torch.randn(n, MODEL[0], generator=g), torch.randint(0, MODEL[-1], (n,), generator=g)) for _ in range(steps)
    ]


def _setup(rank, world, per_rank=8, seed=0, steps=STEPS):
    """The MLP, this rank's share of ``_union_batches`` and the plan: ``(loss_fn, params, buffers, batches, plan,
    model)``."""
    torch.manual_seed(0)
    model, params, buffers = functionalize(MLP(*MODEL))
    loss_fn = cross_entropy_loss(model)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    batches = [(x[mine], y[mine]) for x, y in _union_batches(world, per_rank, seed, steps)]
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB
    )
    return loss_fn, params, buffers, batches, plan, model


def _optimizer():
    return chain(clip_by_global_norm(0.05), adam(1e-2))  # the clip's norm sums every rank's slices


def _train(rank, world, stage, groups):
    loss_fn, params, buffers, batches, plan, model = _setup(rank, world)
    comm = Comm()
    update = zero.update_for(stage, _optimizer(), plan, comm, model=model, groups=groups)
    step = make_train_step(loss_fn, _optimizer(), plan, comm=comm, update=update, donate=True, model=model)
    state = update.first_state(params, buffers, None, comm)
    norms = []
    for batch in batches:
        state, metrics = step(state, batch)
        norms.append(float(metrics["grad_norm"]))
    held = sum(p.numel() for p in state.params.values())  # stage 3: this rank's slices alone
    whole = zero.whole_params(state, plan, update.comm)  # stage 3: gathered inside the group
    return {name: p.detach().clone() for name, p in whole.items()}, norms, held


def _reduce(hook, comm, plan, grads):
    reduction = Reduction(hook, comm, init_hook_states(hook, plan), plan)
    for flat in grads:
        reduction.start(flat.clone())
    out = [None] * len(plan.buckets)
    for index, bucket in reduction.finished():
        out[index] = bucket.buffer.clone()
    return out, reduction.stats().bytes_sent


def _hybrid_ranks(rank, world):
    groups = zero.shard_groups(NODE)
    trained = {stage: (_train(rank, world, stage, None), _train(rank, world, stage, groups)) for stage in (1, 2, 3)}
    # One reduction of random buckets: flat ZeRO's reduce-scatter against the hybrid one's two legs.
    plan = _setup(rank, world)[4]
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(b.numel, generator=g) for b in plan.buckets]
    mean, _ = _reduce(allreduce(), Comm(), plan, grads)
    _, flat_bytes = _reduce(allreduce(), ScatterComm(Comm(), plan), plan, grads)
    hybrid, hybrid_bytes = _reduce(zero.across_replicas(allreduce(), groups, plan), Comm(), plan, grads)
    bf16 = zero.across_replicas(reduced_in(torch.bfloat16, allreduce()), groups, plan)
    _, bf16_bytes = _reduce(bf16, Comm(), plan, grads)
    slices = [zero.padded_slice(m, *zero.slice_range(b, groups.shard.rank, NODE)) for m, b in zip(mean, plan.buckets)]
    # int8 keeps error feedback in its state: made for the slice, and the slice's mean within a rounding step.
    quantised = zero.across_replicas(int8(), groups, plan)
    errors = [state[0].error.numel() for state in init_hook_states(quantised, plan)]
    coarse, _ = _reduce(quantised, Comm(), plan, grads)
    # A replica's scale is its group's largest mean / 127, within twice the world's; the sum is off by half of it.
    step = max(s.abs().max().item() for s in slices) / 127
    int8_ok = errors == [s.numel() for s in slices] and all(
        (c - s).abs().max().item() <= step for c, s in zip(coarse, slices)
    )
    return trained, [b.numel for b in plan.buckets], slices, hybrid, flat_bytes, hybrid_bytes, bf16_bytes, int8_ok


def test_hybrid_sharding_equals_flat_zero_and_one_process(run_ranks):
    """Stages 1-3 on 2 groups x 2 ranks, 4 clipped Adam steps: equal to flat ZeRO at the same stage (<= 1e-5) and to
    one process on the union batch; each rank's slice of a reduction is its share of the world's mean, and what it
    sends across the groups is 1/2 of a flat rank's reduction (1/4 with trainer.reduce_dtype=bfloat16)."""
    world = 4
    results = run_ranks(_hybrid_ranks, world_size=world)
    loss_fn, params, buffers, _, plan, model = _setup(0, 1)
    step = make_train_step(loss_fn, _optimizer(), plan)
    state = init_train_state(params, buffers, _optimizer(), plan)
    reference_norms = []
    for batch in _union_batches(world):
        state, metrics = step(state, batch)
        reference_norms.append(float(metrics["grad_norm"]))
    for trained, numels, slices, hybrid, flat_bytes, hybrid_bytes, bf16_bytes, int8_ok in results:
        assert int8_ok
        assert any(n % NODE for n in numels) and len(numels) >= 3  # slices that pad and split parameters
        (_, _, flat_held), (_, _, hsdp_held) = trained[3]
        assert (flat_held, hsdp_held) == tuple(sum(math.ceil(n / k) for n in numels) for k in (world, NODE))
        for stage, ((flat, _, _), (hsdp, hsdp_norms, _)) in trained.items():
            assert max((flat[n] - hsdp[n]).abs().max().item() for n in flat) <= 1e-5, stage
            assert max((state.params[n] - hsdp[n]).abs().max().item() for n in flat) <= 1e-5, stage
            assert hsdp_norms == pytest.approx(reference_norms, rel=1e-5), stage
        for got, want in zip(hybrid, slices):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert flat_bytes == sum(numels) * 4
        assert hybrid_bytes == sum(math.ceil(n / NODE) for n in numels) * 4
        assert bf16_bytes == hybrid_bytes // 2


COMMON = [
    "optim=adam",
    "model.hidden=24",
    "trainer.max_steps=6",
    "data.global_batch_size=16",
    "trainer.bucket_cap_mb=0.01",
    "trainer.first_bucket_cap_mb=0.002",
    "trainer.checkpoint_every=3",
    "trainer.ema_decay=0.9",  # at stage 3 the average is sharded as the params are
]
HYBRID = ["world=local4", "world.hierarchical=true", f"world.node_size={NODE}"]


def _params(payload):
    return payload["params"]


def _diff(a, b):
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_checkpoints_move_between_hybrid_and_flat_worlds(tmp_path):
    """Stage 3 on 2 groups x 2 ranks trains as flat stage 3 on 4 (with the params' moving average); its whole-file
    checkpoint of step 3 resumes flat on 2 ranks at stage 2 and hybrid on 4 groups of 1 at stage 2, and flat's
    sharded one resumes hybrid at stage 3, each ending where the run that went on did. A hybrid sharded checkpoint
    has its slices written by group 0 alone, and consolidates whole."""
    hybrid, flat = tmp_path / "hybrid", tmp_path / "flat"
    run(_cfg(*COMMON, *HYBRID, "trainer.zero_stage=3", "trainer.checkpoint_format=whole"), hybrid)
    run(_cfg(*COMMON, "world=local4", "trainer.zero_stage=3", "trainer.checkpoint_format=sharded"), flat)
    hybrid_saved, flat_saved = saved(hybrid), consolidate(flat)
    hybrid_end, flat_end = _params(hybrid_saved), _params(flat_saved)
    assert _diff(hybrid_end, flat_end) <= 1e-5
    assert _diff(hybrid_saved["ema"], flat_saved["ema"]) <= 1e-5

    to_flat = tmp_path / "to_flat"
    run(
        _cfg(*COMMON, "world=local2", "trainer.zero_stage=2", f"trainer.resume={hybrid}/checkpoints/step_00000003.pt"),
        to_flat,
    )
    assert _diff(_params(saved(to_flat)), hybrid_end) <= 1e-5

    to_single_rank_nodes = tmp_path / "to_single_rank_nodes"  # 4 groups of 1: every rank holds every slice
    run(
        _cfg(
            *COMMON,
            "world=local4",
            "world.hierarchical=true",
            "world.node_size=1",
            "trainer.zero_stage=2",
            f"trainer.resume={hybrid}/checkpoints/step_00000003.pt",
        ),
        to_single_rank_nodes,
    )
    resumed = saved(to_single_rank_nodes)
    assert _diff(_params(resumed), hybrid_end) <= 1e-5

    to_hybrid = tmp_path / "to_hybrid"
    run(
        _cfg(
            *COMMON,
            *HYBRID,
            "trainer.zero_stage=3",
            "trainer.checkpoint_format=sharded",
            f"trainer.resume={flat}/checkpoints/step_00000003",
        ),
        to_hybrid,
    )
    written = consolidate(to_hybrid / "checkpoints" / "step_00000006")
    assert _diff(_params(written), flat_end) <= 1e-5 and _diff(written["ema"], flat_saved["ema"]) <= 1e-5
    # Params and Adam's moments are all slices at stage 3: written by group 0 (ranks 0, 1) alone.
    files = [to_hybrid / "checkpoints" / "step_00000006" / f"__{rank}_0.distcp" for rank in range(4)]
    sizes = [path.stat().st_size if path.exists() else 0 for path in files]
    assert min(sizes[:2]) > 10 * max(sizes[2:]), sizes
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["hooks=powersgd", "trainer.zero_stage=1"],
            "hooks 'powersgd' need the whole reduced bucket, which hybrid sharding",
        ),
    ],
)
def test_what_hybrid_sharding_cannot_take_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(_cfg(*HYBRID, *overrides))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("stage", [0, 3])
def test_hierarchical_worlds_take_a_reduce_dtype_at_every_stage(stage):
    validate(
        _cfg(*HYBRID, f"trainer.zero_stage={stage}", "trainer.precision=bf16-mixed", "trainer.reduce_dtype=bfloat16")
    )


def test_int8_error_feedback_moves_between_hybrid_and_flat_worlds(tmp_path):
    """hooks=int8 keeps its error feedback per slice in a hybrid world and per bucket in a flat one: a checkpoint
    of one resumes in the other, the moved residual started again (as a rank new to a world starts it)."""
    common = [*COMMON, "hooks=int8", "trainer.zero_stage=2", "trainer.max_steps=3"]
    run(_cfg(*common, *HYBRID, "trainer.checkpoint_format=whole"), tmp_path / "hybrid")
    summary = run(
        _cfg(
            *common,
            "world=local2",
            f"trainer.resume={tmp_path}/hybrid/checkpoints/step_00000003.pt",
            "trainer.max_steps=5",
        ),
        tmp_path / "flat",
    )
    assert summary["steps"] == 5 and math.isfinite(summary["loss"])


# -- an outer loop over hybrid-sharded replicas: each group of NODE ranks is one -------------------------------------
OUTER_STEPS = 7


def _outer_spec(name, **settings):
    schema = {"local_sgd": LocalSGDConfig, "diloco": DiLoCoConfig}[name]
    return check_outer(dataclasses.asdict(schema(**settings)))


OUTER_DATA = dict(per_rank=4, seed=1, steps=OUTER_STEPS)  # the outer-loop runs' batches


def _outer_run(rank, world, stage, spec, hook, groups):
    """Stage ``stage`` under the outer loop ``spec``: each rank's whole params and anchor slices at the end, and each
    step's (synced, bytes sent across the groups)."""
    loss_fn, params, buffers, batches, plan, model = _setup(rank, world, **OUTER_DATA)
    comm = Comm()
    update = zero.update_for(stage, adam(1e-2), plan, comm, model=model, groups=groups)
    state = update.first_state(params, buffers, hook, comm)
    replica = update.replica()
    state = state._replace(outer=init_outer_state(spec, replica.pieces(state.params), replica.plan, hook))
    step = make_outer_step(loss_fn, adam(1e-2), plan, spec, hook, comm, donate=stage != 2, update=update, model=model)
    trace = []
    for batch in batches:
        state, metrics = step(state, batch)
        trace.append((metrics["synced"], metrics["bytes_sent"]))
    whole = zero.whole_params(state, plan, update.comm)
    anchor = {key: a.clone() for key, a in state.outer.anchor.items()}
    return {name: p.detach().clone() for name, p in whole.items()}, trace, anchor


# key: (stage, outer loop, its settings, the pseudo-gradient's hook, the fragment sent after each step)
OUTER_RUNS = {
    **{f"diloco{stage}": (stage, "diloco", {"sync_every": 2}, None, {2: 0, 4: 0, 6: 0}) for stage in (1, 2, 3)},
    "local_sgd2": (2, "local_sgd", {"sync_every": 3}, None, {3: 0, 6: 0}),
    # Post-local: the gradients reduced over the world for two steps, then syncs after steps 4 and 6.
    "post_local1": (1, "diloco", {"sync_every": 2, "start_step": 2}, None, {4: 0, 6: 0}),
    # Streaming: two fragments, each sent behind the next step (landing after steps 3, 5, 7).
    **{
        f"streaming{stage}": (
            stage,
            "diloco",
            {"sync_every": 4, "fragments": 2, "overlap": 1},
            None,
            {2: 0, 4: 1, 6: 0},
        )
        for stage in (1, 3)
    },
    "fp4_3": (3, "diloco", {"sync_every": 4, "fragments": 2, "overlap": 1}, "fp4", {2: 0, 4: 1, 6: 0}),
}


def _outer_ranks(rank, world, runs):
    groups = zero.shard_groups(NODE)
    return {
        key: _outer_run(
            rank, world, stage, _outer_spec(name, **settings), lowbit(hook, block=16) if hook else allreduce(), groups
        )
        for key, (stage, name, settings, hook, _) in runs.items()
    }


def _torch_outer(world, fragments, sends, overlap, lr, momentum, nesterov, start_step=0):
    """The outer loop in plain torch, in one process: each group of NODE ranks one replica (Adam on the group's union
    batch, as DDP in the group steps); each fragment (param names) an anchor of its own, stepped by SGD with the
    mean of the replicas' ``anchor - params`` sent after the steps ``sends`` names it, ``overlap`` steps later, each
    replica keeping its steps since on top. Up to ``start_step`` every replica steps on the whole world's batch."""
    replicas = world // NODE
    modules = []
    for _ in range(replicas):
        torch.manual_seed(0)
        modules.append(MLP(*MODEL))
    named = [dict(m.named_parameters()) for m in modules]
    inner = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in modules]
    anchors = [[torch.nn.Parameter(named[0][n].detach().clone()) for n in names] for names in fragments]
    outers = [torch.optim.SGD(a, lr=lr, momentum=momentum, nesterov=nesterov) for a in anchors]
    in_flight, width = {}, 4 * NODE

    def land(sync):
        if sync is None:
            return
        f, mine, averaged = sync
        before = [a.detach().clone() for a in anchors[f]]
        for a, g in zip(anchors[f], averaged):
            a.grad = g
        outers[f].step()
        for r in range(replicas):
            for name, a, b, d in zip(fragments[f], anchors[f], before, mine[r]):
                if overlap:
                    named[r][name].add_((a - b) + d)
                else:
                    named[r][name].copy_(a)

    for step, (x, y) in enumerate(_union_batches(world, **OUTER_DATA), start=1):
        for g, opt in enumerate(inner):
            opt.zero_grad()
            part = slice(None) if step <= start_step else slice(g * width, (g + 1) * width)
            torch.nn.functional.cross_entropy(modules[g](x[part]), y[part]).backward()
            opt.step()
        with torch.no_grad():
            if step == start_step:
                for anchor, names in zip(anchors, fragments):
                    for a, n in zip(anchor, names):
                        a.copy_(named[0][n])
            land(in_flight.pop(step, None))
            if step in sends:
                f = sends[step]
                mine = [[(a - named[r][n]).detach() for a, n in zip(anchors[f], fragments[f])] for r in range(replicas)]
                averaged = [sum(d[i] for d in mine) / replicas for i in range(len(fragments[f]))]
                in_flight[step + overlap] = (f, mine, averaged)
            land(in_flight.pop(step, None))  # overlap=0: at once
    return named


def test_an_outer_loop_over_hybrid_sharded_replicas_equals_plain_torch_over_per_group_ddp(run_ranks):
    """2 groups x 2 ranks, each group one replica: DiLoCo at stages 1-3 (syncs after steps 2, 4, 6), local SGD at
    stage 2 (after 3, 6) and streaming DiLoCo at stages 1 and 3 (two fragments, sent behind a step) end where a
    plain-torch outer loop over two replicas stepping on their groups' union batches does (<= 1e-5, one step past the
    last sync), and send across the groups only at syncs, each rank its slices of the fragment: 1/NODE of it (as fp4
    codes and scales with hooks=lowbit, every replica's anchor then the same)."""
    world = 4
    results = run_ranks(_outer_ranks, OUTER_RUNS, world_size=world)
    plan = _setup(0, world, **OUTER_DATA)[4]
    split = split_fragments(zero.slice_plan(plan, NODE), 2)  # the fragments are runs of the slices' buckets
    streamed = [[n for i in buckets for n in plan.buckets[i].names] for buckets in split]
    slices = [[math.ceil(plan.buckets[i].numel / NODE) for i in buckets] for buckets in split]
    whole = [list(plan.names)]
    references = {
        "diloco": _torch_outer(world, whole, {2: 0, 4: 0, 6: 0}, 0, 0.7, 0.9, True),
        "local_sgd": _torch_outer(world, whole, {3: 0, 6: 0}, 0, 1.0, 0.0, False),
        "post_local": _torch_outer(world, whole, {4: 0, 6: 0}, 0, 0.7, 0.9, True, start_step=2),
        "streaming": _torch_outer(world, streamed, {2: 0, 4: 1, 6: 0}, 1, 0.7, 0.9, True),
    }
    for rank, ranks_runs in enumerate(results):
        for key, (params, trace, anchor) in ranks_runs.items():
            stage, name, settings, hook, sends = OUTER_RUNS[key]
            kind = "streaming" if "fragments" in settings else "post_local" if "start_step" in settings else name
            per_step = list(range(1, settings.get("start_step", 0) + 1))  # gradients reduced every step
            landed = [s + settings.get("overlap", 0) for s in sends]
            assert [s for s, (synced, _) in enumerate(trace, 1) if synced] == per_step + landed, key
            assert [s for s, (_, sent) in enumerate(trace, 1) if sent] == per_step + list(sends), key
            trace = trace[len(per_step) :]
            parts = slices if "fragments" in settings else [[math.ceil(b.numel / NODE) for b in plan.buckets]]
            if hook:  # 4 bits an entry and an fp32 scale a block of 16, per slice of the fragment's buckets
                sizes = [sum((n + (-n % 16)) // 2 + 4 * ((n + 15) // 16) for n in part) for part in parts]
            else:
                sizes = [4 * sum(part) for part in parts]
            assert [sent for _, sent in trace if sent] == [sizes[f] for f in sends.values()], key
            if hook:
                replica = results[(rank + NODE) % world][key][2]  # the rank holding the same slices in the other group
                assert all(torch.equal(anchor[k], replica[k]) for k in anchor), key
                continue
            reference = references[kind][rank // NODE]
            assert max((params[n] - reference[n].detach()).abs().max().item() for n in reference) <= 1e-5, key


OUTER_RUN = [
    "optim=adam",
    "model.hidden=24",
    "trainer.max_steps=6",
    "data.global_batch_size=16",
    "trainer.bucket_cap_mb=0.01",
    "trainer.first_bucket_cap_mb=0.002",
    "trainer.checkpoint_every=3",
    *HYBRID,
    "trainer.zero_stage=3",
    "outer=diloco",
    "outer.sync_every=2",
]


# Stopped after step 3 (syncs after 2, 4, 6); streaming at stage 1 stopped after step 4, its fragment 1 sent then and
# landing after step 5 (fragment syncs sent after 2, 4, 6), as fp4 codes with error feedback.
RESUMED = {
    "stage3": ([], 3),
    "stage1_streaming_fp4": (
        [
            "trainer.zero_stage=1",
            "outer.sync_every=4",
            "outer.fragments=2",
            "outer.overlap=1",
            "hooks=lowbit",
            "hooks.block=16",
        ],
        4,
    ),
}


@pytest.mark.parametrize("variant", list(RESUMED))
def test_an_outer_loop_over_hybrid_sharded_replicas_resumes_mid_period_as_uninterrupted(tmp_path, variant):
    """DiLoCo on 2 groups x 2 ranks stopped mid-period and resumed from its whole-file checkpoint: every rank ends as
    in the run that went on, to the bit. Mid-period each group saved its own params, whole; the anchor, the outer
    moments and a sync in flight are saved whole too, so any layout can read them."""
    overrides, stop = RESUMED[variant]
    runs = [*OUTER_RUN, *overrides, "trainer.checkpoint_format=whole"]
    run(_cfg(*runs), tmp_path / "whole")
    run(_cfg(*runs, f"trainer.stop_at={stop}"), tmp_path / "parts")
    halfway = torch.load(tmp_path / "parts" / "checkpoints" / f"step_{stop:08d}.pt", weights_only=True)
    ranks = halfway["ranks"]
    assert _diff(ranks[0]["params"], ranks[1]["params"]) == 0 and _diff(ranks[0]["params"], ranks[2]["params"]) > 0
    # The anchor comes first in the saved outer state, whole, in the model's order: as a stage-0 replica keeps it.
    in_model_order = sorted(halfway["params"], key=lambda n: (int(n.split(".")[1]), n.endswith("bias")))  # net.<i>
    shapes = [halfway["params"][name].shape for name in in_model_order]
    assert [a.shape for a in ranks[0]["outer"][: len(shapes)]] == shapes
    run(_cfg(*runs, "trainer.resume=true"), tmp_path / "parts")
    whole, parts = (torch.load(last_of(tmp_path / d / "checkpoints"), weights_only=True) for d in ("whole", "parts"))
    assert whole["step"] == parts["step"] == 6
    for mine, theirs in zip(whole["ranks"], parts["ranks"], strict=True):
        assert _diff(mine["params"], theirs["params"]) == 0
        for key in ("outer", "opt_state"):
            for a, b in zip(mine[key], theirs[key], strict=True):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, key


def test_a_flat_zero_world_is_one_replica_and_refuses_an_outer_loop():
    with pytest.raises(ConfigError) as error:
        validate(_cfg("world=local4", "trainer.zero_stage=2", "outer=diloco"))
    message = str(error.value)
    assert message.startswith(
        "trainer.zero_stage=2: expected 0 with outer=diloco, or world.hierarchical=true (a flat ZeRO world"
    )
    assert "is one replica" in message and "\n" not in message
    validate(_cfg(*HYBRID, "trainer.zero_stage=2", "outer=diloco", "outer.fragments=2", "hooks=lowbit"))


def test_an_outer_loop_over_hybrid_sharded_replicas_resumes_from_its_sharded_checkpoint_as_uninterrupted(tmp_path):
    """The multi-rank default format under DiLoCo at stage 3: each rank writes its own slices mid-period, and the run
    resumed on the same world ends where the one that went on did, to the bit; on another world it is refused in
    one line (those slices are laid out for the world that wrote them), nothing written."""
    run(_cfg(*OUTER_RUN, "trainer.checkpoint_format=whole"), tmp_path / "straight")
    run(_cfg(*OUTER_RUN, "trainer.stop_at=3"), tmp_path / "parts")
    assert (tmp_path / "parts" / "checkpoints" / "step_00000003").is_dir()  # sharded, the default on 4 ranks
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "parts", moved)
    run(_cfg(*OUTER_RUN, "trainer.resume=true", "trainer.checkpoint_format=whole"), tmp_path / "parts")
    straight, parts = (
        torch.load(tmp_path / d / "checkpoints" / "step_00000006.pt", weights_only=True) for d in ("straight", "parts")
    )
    for mine, theirs in zip(straight["ranks"], parts["ranks"], strict=True):
        assert _diff(mine["params"], theirs["params"]) == 0
    on_two = [*OUTER_RUN, "world=local2", "world.node_size=1", "trainer.resume=true"]
    with pytest.raises(Exception) as refused:
        run(_cfg(*on_two), moved)
    assert "holds an outer loop's own ZeRO slices per rank, written by 4 ranks" in str(refused.value)
