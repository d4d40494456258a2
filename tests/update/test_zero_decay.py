"""``optim.decay_filter`` at every ZeRO stage: each rank's slices decay where the plan says their params do.

References: torch.optim with two param groups (decay and no decay, the same filter), one process on the union batch.
"""

import pytest
import torch
from torch import nn

from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
from fdp.comm import Comm
from fdp.model.functional import functionalize
from fdp.optim import adam, adamw, decay_rule, embedding_names, sgd
from fdp.plan import pack_into_buckets, plan_buckets
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.update import zero
from fdp.update.zero.decay import slice_decay

STEPS = 6
VOCAB, WIDTH, SHARE = 11, 8, 16
CAP_MB = 100 * 4 / 2**20  # about 100 elements a bucket: slices start and end inside parameters


class _TinyLM(nn.Module):
    """An embedding, a norm, a hidden layer and a head: what ``decay_filter=weights`` exempts and what it decays."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.norm = nn.Embedding(VOCAB, WIDTH), nn.LayerNorm(WIDTH)
        self.fc, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(self.norm(self.embed(x)))))


def _union_batches(world):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, VOCAB, (SHARE * world,), generator=g), torch.randint(0, VOCAB, (SHARE * world,), generator=g))
        for _ in range(STEPS)
    ]


OPTIMIZERS = {  # fdp's optimizer with the filter, and torch's with the same two param groups
    "adamw": (
        lambda mask: adamw(1e-2, weight_decay=0.5, decay_mask=mask),
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.5, foreach=False),
    ),
    "adam_l2": (
        lambda mask: adam(1e-2, weight_decay=0.5, decay_mask=mask),
        lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.5, foreach=False),
    ),
    "sgd_l2": (
        lambda mask: sgd(0.1, momentum=0.9, weight_decay=0.5, decay_mask=mask),
        lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.5, foreach=False),
    ),
}
FILTERS = {"weights": "weights", "patterns": ["*.bias", "norm.*"]}


def _torch_reference(world, make_torch, decayed):
    module = _TinyLM()
    groups = [
        {"params": [p for k, p in module.named_parameters() if k in decayed]},
        {"params": [p for k, p in module.named_parameters() if k not in decayed], "weight_decay": 0.0},
    ]
    optimizer = make_torch(groups)
    for x, y in _union_batches(world):
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
    return {k: p.detach() for k, p in module.named_parameters()}


def _fdp(rank, world, stage, make_opt, decay_filter, donate):
    module = _TinyLM()
    rule = decay_rule(decay_filter, embedding_names(module))
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    batches = [
        (x[rank * SHARE : (rank + 1) * SHARE], y[rank * SHARE : (rank + 1) * SHARE]) for x, y in _union_batches(world)
    ]
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB
    )
    optimizer, comm = make_opt(rule), Comm()
    step = make_train_step(
        loss_fn, optimizer, plan, comm=comm, donate=donate, zero_stage=stage, model=model, schedule="overlap"
    )
    if stage:
        state = zero.init_state(params, buffers, optimizer, plan, comm, stage=stage)
    else:
        state = init_train_state(params, buffers, optimizer, plan)
    for batch in batches:
        state, _ = step(state, batch)
    decayed = {name for name, p in params.items() if rule(name, p)}
    return zero.whole_params(state, plan, comm), decayed, plan


def _decay_at_every_stage(rank, world):
    out = {}
    for opt_name, (make_opt, make_torch) in OPTIMIZERS.items():
        for filter_name, decay_filter in FILTERS.items():
            reference = None
            for stage in (0, 1, 2, 3):
                for donate in (True, False):
                    if opt_name != "adamw" and (filter_name != "weights" or stage == 0):
                        continue  # stage 0 and the patterns: tests/optim/test_optim.py; here every stage's masks
                    params, decayed, plan = _fdp(rank, world, stage, make_opt, decay_filter, donate)
                    if reference is None:
                        reference = _torch_reference(world, make_torch, decayed)
                        undecayed = _torch_reference(world, make_torch, set(params))
                    diff = max((params[k] - reference[k]).abs().max().item() for k in reference)
                    out[(opt_name, filter_name, stage, donate)] = (
                        diff,
                        max((params[k] - undecayed[k]).abs().max().item() for k in reference),
                        decayed,
                    )
    inside = any(
        0 < zero.slice_range(b, r, world)[0] - s.offset < s.numel
        for b in plan.buckets
        for r in range(world)
        for s in b.slots
    )
    return out, inside or world == 1


@pytest.mark.parametrize("world_size", [1, 2])
def test_decay_filter_at_every_stage_equals_torch_param_groups(run_ranks, world_size):
    """AdamW (decoupled), Adam and SGD (L2) with a no-decay group, stepped in place and pure, at stages 0-3."""
    for out, inside in run_ranks(_decay_at_every_stage, world_size=world_size):
        assert inside  # a slice starts inside a parameter: a mask of mixed decay
        for key, (diff, from_all, decayed) in out.items():
            assert diff <= 1e-6, (key, diff)
            assert from_all > 1e-4, key  # the filter mattered: decaying every param ends elsewhere
            assert decayed and "embed.weight" not in decayed or key[1] == "patterns"


def test_each_slice_decays_exactly_the_elements_of_decayed_params_at_any_world_size():
    """Every rank's runs together cover the decayed params' elements of each bucket, once, and nothing else."""
    shapes = [("embed.weight", (11, 8)), ("norm.weight", (8,)), ("norm.bias", (8,)), ("fc.weight", (8, 8))]
    shapes += [("fc.bias", (8,)), ("head.weight", (11, 8)), ("head.bias", (11,))]
    plan = pack_into_buckets(
        [(n, s, "float32", "cpu") for n, s in shapes], bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB
    )
    rule = decay_rule("weights", {"embed.weight"})
    for world in (1, 2, 3, 4):
        for bucket in plan.buckets:
            expected = torch.zeros(zero.slice_range(bucket, world - 1, world)[1], dtype=torch.bool)
            for slot in bucket.slots:
                expected[slot.offset : slot.stop] = rule(slot.name, torch.empty(slot.shape))
            got = torch.zeros_like(expected)
            for rank in range(world):
                start, stop = zero.slice_range(bucket, rank, world)
                answer = slice_decay(plan, rule, rank, world)[zero.slice_key(bucket.index)]
                runs = [(0, stop - start)] if answer is True else [] if answer is False else answer
                for low, high in runs:
                    assert not got[start + low : start + high].any()
                    got[start + low : start + high] = True
            real = slice(0, bucket.numel)
            assert torch.equal(got[real], expected[real]), (world, bucket.index)


def test_decay_filter_is_accepted_at_every_zero_stage():
    for stage in (1, 2, 3):
        validate(compose("world=local2", "optim=adamw", "optim.decay_filter=weights", f"trainer.zero_stage={stage}"))


def _mirror_with_decay(rank, world):
    """Stage 1 with a mirror of the next rank's slices (a world that may shrink), Adam with L2 decay by name (the
    moments then depend on which elements decay): each rank's optimizer state and mirror after 4 steps."""
    module = _TinyLM()
    rule = decay_rule("weights", embedding_names(module))
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    x, y = _union_batches(world)[0]
    batch = (x[rank * SHARE : (rank + 1) * SHARE], y[rank * SHARE : (rank + 1) * SHARE])
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    optimizer, comm = adam(1e-2, weight_decay=0.5, decay_mask=rule), Comm()
    state = zero.init_state(params, buffers, optimizer, plan, comm, stage=1, mirror=True)
    step = make_train_step(loss_fn, optimizer, plan, comm=comm, zero_stage=1)
    for x, y in _union_batches(world)[:4]:
        state, _ = step(state, (x[rank * SHARE : (rank + 1) * SHARE], y[rank * SHARE : (rank + 1) * SHARE]))
    return state.opt_state, state.mirror


def test_a_mirror_steps_the_next_ranks_slices_with_that_ranks_decay_runs(run_ranks):
    results = run_ranks(_mirror_with_decay, world_size=3)
    for rank, (_, mirror) in enumerate(results):
        owner = results[(rank + 1) % 3][0]
        for key in owner.mu:
            assert torch.equal(mirror.mu[key], owner.mu[key]) and torch.equal(mirror.nu[key], owner.nu[key]), key
