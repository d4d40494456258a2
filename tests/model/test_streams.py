"""Each sample's random stream (fdp.model.streams): masks that depend on the sample, not on the rank or the
micro-batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _saved import saved

from fdp import adam, functionalize, make_train_step, plan_buckets, planner_loss
from fdp.comm import Comm
from fdp.data import global_batch, load_digits, load_stdlib_text, rank_share
from fdp.errors import ConfigError
from fdp.model import streams_functions
from fdp.model.builtin import CharTransformer
from fdp.model.losses import cross_entropy_loss
from fdp.model.streams import SampleStreams
from fdp.model.streams_functions import by_function, taking
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.run.rank_loss import rank_loss_of
from fdp.run.trainer import run
from fdp.state.replicas import setup_state
from fdp.update import zero

SEED = 11


def _draws(x: torch.Tensor) -> list[torch.Tensor]:
    """Every kind of random op the streams replace, applied to a batch ``x`` of shape (B, 4, 6)."""
    q = x.view(x.shape[0], 2, 4, 3)
    attention = F.scaled_dot_product_attention(q, q, q, dropout_p=0.4)
    out, mask = torch.native_dropout(x, 0.3, True)
    return [
        F.dropout(x, 0.5, training=True),
        attention,
        out,
        mask,
        torch.rand_like(x),
        torch.randn_like(x),
        torch.bernoulli(torch.full_like(x, 0.25)),
        torch.empty_like(x).uniform_(-2, 3),
        torch.empty_like(x).normal_(1, 2),
        torch.rand(x.shape[0], 5),
        torch.randn(x.shape[0], 5, dtype=torch.float64),
    ]


def _on_streams(step: int, first: int, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    streams = SampleStreams(SEED)
    draws = streams.wrap(_draws)
    streams.begin(step, first, sizes)
    outs = [draws(part) for part in x.split(sizes)]
    return [torch.cat(parts) for parts in zip(*outs)]


def test_a_samples_values_do_not_depend_on_the_batch_or_micro_batch_it_is_in():
    x = torch.randn(6, 4, 6)
    whole = _on_streams(3, 0, x, [6])
    # Samples 2..5 on another rank, as two micro-batches of 2.
    share = _on_streams(3, 2, x[2:], [2, 2])
    for a, b in zip(whole, share):
        assert torch.equal(a[2:], b)
    # A different step, or other samples, draw other values.
    other_step = _on_streams(4, 0, x, [6])
    assert not torch.equal(whole[0], other_step[0])
    assert not torch.equal(whole[4][0], whole[4][1])
    # Two ops of one forward draw different values (the op's number is in the key).
    assert not torch.equal(whole[4], (whole[8] - 1) / 2)


def test_the_draws_have_the_distributions_asked_for():
    streams = SampleStreams(0)
    streams.begin(1, 0, [64])
    x = torch.ones(64, 5000)
    kept, uniform, normal = streams.wrap(
        lambda x: (F.dropout(x, 0.1, True) != 0, torch.rand_like(x), torch.randn_like(x))
    )(x)
    assert abs(kept.float().mean().item() - 0.9) < 0.005
    assert abs(uniform.mean().item() - 0.5) < 0.005 and abs(uniform.var().item() - 1 / 12) < 0.002
    assert 0.0 <= uniform.min().item() and uniform.max().item() < 1.0
    assert abs(normal.mean().item()) < 0.01 and abs(normal.std().item() - 1.0) < 0.01


def test_ops_that_are_not_per_sample_draw_from_the_generator():
    streams = SampleStreams(0)
    noise = streams.wrap(lambda x: (torch.rand(3, 3), torch.randperm(5), F.dropout(x, 0.5, True)))
    torch.manual_seed(5)
    expected = torch.rand(3, 3), torch.randperm(5)
    torch.manual_seed(5)
    streams.begin(1, 0, [6])
    fixed, perm, _ = noise(torch.ones(6, 2))
    assert torch.equal(fixed, expected[0]) and torch.equal(perm, expected[1])


def test_a_forward_that_draws_nothing_runs_without_the_mode_after_the_first():
    streams = SampleStreams(0)
    plain = streams.wrap(lambda x: x * 2)
    streams.begin(1, 0, [2])
    plain(torch.ones(2))
    assert streams.draws is False
    drawing = SampleStreams(0)
    drawing.begin(1, 0, [2])
    drawing.wrap(lambda x: F.dropout(x, 0.5, True))(torch.ones(2, 3))
    assert drawing.draws is True


# -- the train step: two ranks with dropout train the one-process run ------------------------
GLOBAL, STEPS = 8, 6


def _charlm_run(comm: Comm, accum_steps: int, sample_seed):
    data = load_stdlib_text(block_size=8, max_chars=4000)
    torch.manual_seed(0)
    model, params, buffers = functionalize(CharTransformer(data.num_classes, 8, 16, 1, 2, dropout=0.3))
    loss_fn = cross_entropy_loss(model)
    batches = [rank_share(global_batch(data, s, GLOBAL, 0), comm.rank, comm.world_size) for s in range(STEPS)]
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, batches[0])
    state = setup_state(params, buffers, adam(1e-3), plan, comm=comm, seed=0)
    step = make_train_step(loss_fn, adam(1e-3), plan, comm=comm, accum_steps=accum_steps, sample_seed=sample_seed)
    for batch in batches:
        state, _ = step(state, batch)
    return state.params


def _two_ranks(rank, world):
    return {seed: _charlm_run(Comm(), 2, seed) for seed in (SEED, None)}


def test_dropout_on_two_ranks_trains_what_one_process_trains(run_ranks):
    one = {seed: _charlm_run(Comm(), 1, seed) for seed in (SEED, None)}
    two = run_ranks(_two_ranks, world_size=2)
    gap = {seed: max((one[seed][n] - two[0][seed][n]).abs().max().item() for n in one[seed]) for seed in (SEED, None)}
    assert gap[SEED] <= 1e-5, gap
    assert gap[None] > 1e-3, gap  # each rank's own generator: other masks, other params


def test_world_single_and_local2_train_the_same_params_with_dropout(tmp_path):
    common = [
        "model=charlm",
        "data=stdlib_text",
        "model.d_model=16",
        "model.n_layer=1",
        "model.n_head=2",
        "model.dropout=0.2",
        "data.block_size=8",
        "data.max_chars=5000",
        "data.global_batch_size=8",
        "optim=adam",
        "trainer.eval_every=0",
        "trainer.progress=false",
        "trainer.max_steps=12",
        "world.backend=gloo",
        "trainer.sample_streams=true",
    ]
    params = {}
    for world in ("single", "local2"):
        run(compose(*common, f"world={world}"), tmp_path / world)
        params[world] = saved(tmp_path / world)["params"]
    for name, value in params["single"].items():
        torch.testing.assert_close(params["local2"][name], value, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, streams",
    [
        ((), False),  # auto: each rank's generator, no dispatch mode's host cost
        (("world=local2", "world.on_rank_loss=shrink"), True),  # auto: the survivors must draw the lost world's masks
        (("trainer.sample_streams=true",), True),
        (("world=local2", "world.on_rank_loss=shrink", "trainer.sample_streams=false"), False),
    ],
)
def test_sample_streams_auto_draws_per_sample_where_the_world_may_shrink(overrides, streams):
    cfg = compose("model=charlm", "data=stdlib_text", "model.dropout=0.1", *overrides)
    validate(cfg)
    assert rank_loss_of(cfg.world).sample_streams(cfg.trainer.sample_streams) is streams


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (("trainer.sample_streams=maybe",), "trainer.sample_streams='maybe': expected auto, true or false"),
        (
            ("trainer.sample_streams=true", "trainer.compile=true", "trainer.zero_stage=3"),
            "trainer.compile=True: expected auto or false with per-sample streams (trainer.sample_streams, on with "
            "world.on_rank_loss=shrink): ZeRO stage 3 compiles each block between eager gathers",
        ),
        (
            ("trainer.sample_streams=true", "trainer.compile=true", "trainer.activation_checkpointing=blocks"),
            "trainer.compile=True: expected auto or false with per-sample streams (trainer.sample_streams, on with "
            "world.on_rank_loss=shrink): activation checkpointing replays",
        ),
    ],
)
def test_sample_streams_settings_that_cannot_run_are_refused_in_one_line(overrides, expected):
    with pytest.raises(ConfigError) as error:
        validate(compose(*overrides))
    assert str(error.value).startswith(expected), str(error.value)


def test_zero_stage_3s_recording_forward_leaves_the_steps_dropout_masks_alone():
    """Stage 3 learns when to gather from one extra forward on its first step (and again in a world that changed):
    it draws the samples' streams without taking them, so the step's masks are the samples' own, as at stage 0."""
    data = load_stdlib_text(block_size=8, max_chars=4000)
    batch = global_batch(data, 0, GLOBAL, 0)
    trained = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model, params, buffers = functionalize(CharTransformer(data.num_classes, 8, 16, 1, 2, dropout=0.3))
        loss_fn = cross_entropy_loss(model)
        plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
        update = zero.update_for(stage, adam(1e-3), plan, Comm(), model=model)
        step = make_train_step(loss_fn, adam(1e-3), plan, comm=Comm(), update=update, model=model, sample_seed=SEED)
        state, _ = step(update.first_state(params, buffers, None, Comm()), batch)
        trained[stage] = zero.whole_params(state, plan, update.comm)
    for name, value in trained[0].items():
        torch.testing.assert_close(trained[3][name], value, rtol=0, atol=1e-6)


def test_a_traced_forward_draws_what_the_dispatch_mode_draws_bit_for_bit():
    """The compiled step's streams (fdp.model.streams_functions, a function mode) remake every kind of draw the eager
    step's dispatch mode replaces from the same keys and op numbers: the same values, bit for bit."""
    x = torch.randn(6, 4, 6)
    streams = SampleStreams(SEED)
    streams.begin(3, 0, [6])
    eager = streams.wrap(_draws)(x)
    streams.begin(3, 0, [6])
    traced = taking(streams, streams_functions.traced(streams, _draws))(x)
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)


def _dropout_mlp_run(sample_seed, compile: bool = False):
    data = load_digits()
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 10)
    )
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, global_batch(data, 0, GLOBAL, 0))
    state = setup_state(params, buffers, adam(1e-2), plan, comm=Comm(), seed=0)
    step = make_train_step(loss_fn, adam(1e-2), plan, sample_seed=sample_seed, compile=compile)
    for s in range(3):
        state, _ = step(state, global_batch(data, s, GLOBAL, 0))
    return state.params


def test_a_compiled_step_on_sample_streams_trains_what_the_eager_step_trains():
    """trainer.compile with per-sample streams: the step compiles as one graph (no break, no recompile for a new
    step's keys) and draws the eager step's dropout masks (the params agree; the generator's masks give others)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = _dropout_mlp_run(SEED, compile=True)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    eager = _dropout_mlp_run(SEED)
    for name, value in eager.items():
        torch.testing.assert_close(compiled[name], value, rtol=0, atol=1e-5)
    other = _dropout_mlp_run(None)
    assert max((other[n] - eager[n]).abs().max().item() for n in eager) > 1e-3


def _more_draws(x: torch.Tensor) -> list[torch.Tensor]:
    """Draws an eager function mode takes besides ``_draws``': causal attention dropout, dropout in place and from
    torch, and functions that draw inside themselves (run under the dispatch mode for their call)."""
    q = x.view(x.shape[0], 2, 4, 3)
    return [
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.2, is_causal=True, scale=0.3),
        F.dropout(x.clone(), 0.25, training=True, inplace=True),
        torch.dropout(x, 0.6, True),
        F.dropout2d(x.view(x.shape[0], 4, 2, 3), 0.5, training=True),
        F.rrelu(x, training=True),
        F.dropout(x[0], 0.5, training=True),  # not batch-shaped: the generator's
        *_draws(x),
    ]


def test_an_eager_forward_by_function_draws_what_the_dispatch_mode_draws_bit_for_bit():
    """The eager step's function mode (by_function): its first forward runs under the dispatch mode, watched, the
    next ones by function; each micro-batch's values are the dispatch mode's, bit for bit."""
    x = torch.randn(12, 4, 6)
    torch.manual_seed(1)
    streams = SampleStreams(SEED)
    streams.begin(3, 0, [6, 6])
    reference = [streams.wrap(_more_draws)(part) for part in x.split(6)]
    torch.manual_seed(1)
    streams = SampleStreams(SEED)
    streams.begin(3, 0, [6, 6])
    run = by_function(streams, _more_draws)
    first = run(x[:6])
    assert streams.by_function is True  # the watched forward saw every draw in a function the mode takes
    second = run(x[6:])
    for expected, got in zip(reference, (first, second)):
        for a, b in zip(expected, got):
            assert torch.equal(a, b)


def _charlm_steps(wrap) -> dict:
    """Three SGD steps of a char transformer with dropout and attention dropout, its forward on ``wrap``'s streams."""
    data = load_stdlib_text(block_size=8, max_chars=4000)
    torch.manual_seed(0)
    model, params, buffers = functionalize(CharTransformer(data.num_classes, 8, 16, 2, 2, dropout=0.3))
    loss_fn = cross_entropy_loss(model)
    streams = SampleStreams(SEED)
    grad = torch.func.grad(wrap(streams, loss_fn), has_aux=True)
    for step in range(1, 4):
        batch = global_batch(data, step, GLOBAL, 0)
        streams.begin(step, 0, [GLOBAL // 2, GLOBAL // 2])
        for half in zip(*(part.split(GLOBAL // 2) for part in batch)):
            grads, _ = grad(params, buffers, half)
            params = {name: value - 0.1 * grads[name] for name, value in params.items()}
    return params, streams.by_function


def test_a_model_with_dropout_trains_the_same_params_by_function_as_under_the_dispatch_mode():
    dispatch, _ = _charlm_steps(lambda streams, loss_fn: streams.wrap(loss_fn))
    functions, by_functions = _charlm_steps(by_function)
    assert by_functions is True
    for name, value in dispatch.items():
        assert torch.equal(functions[name], value), name


class _Twice(torch.autograd.Function):
    """Dropout inside an autograd.Function: under torch.func, its forward runs out of a function mode's sight."""

    @staticmethod
    def forward(x):
        return F.dropout(x, 0.5, training=True) * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def _noisy(x):
    """A function of a library's that takes torch functions itself: what it calls is out of a function mode's sight."""
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(_noisy, (x,), x)
    return x + torch.rand_like(x)


def _twice(w, x):
    return (_Twice.apply(x * w) + F.dropout(x, 0.3, training=True)).sum()


def _noisy_twice(w, x):
    return (_noisy(x * w) + F.dropout(x, 0.3, training=True)).sum()


@pytest.mark.parametrize("loss, by_functions", [(_twice, True), (_noisy_twice, False)])
def test_draws_inside_a_function_are_the_dispatch_modes_or_the_forward_keeps_it(loss, by_functions):
    """An autograd.Function's forward runs under the dispatch mode for its call; a draw the function mode cannot see
    at all keeps the dispatch mode for every forward. The gradients are the dispatch mode's either way."""
    x, w = torch.randn(4, 5), torch.tensor(1.5)
    grads = {}
    for name, wrap in (("dispatch", lambda s: s.wrap(loss)), ("functions", lambda s: by_function(s, loss))):
        streams = SampleStreams(SEED)
        streams.begin(2, 0, [4, 4])
        grad = torch.func.grad(wrap(streams))
        grads[name] = [grad(w, x), grad(w, x)]
    assert streams.by_function is by_functions
    assert grads["functions"] == grads["dispatch"]
