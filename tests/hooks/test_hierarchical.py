"""Hierarchical reduction on two simulated nodes of two processes, against the flat reduction."""

import pytest
import torch
from _saved import saved

from fdp import Comm
from fdp.errors import ConfigError
from fdp.hooks import allreduce, build_hook, hierarchical, node_comms
from fdp.hooks.base import init_hook_states
from fdp.plan import pack_into_buckets
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.step.chains import Reduction


def _buckets():
    return pack_into_buckets(
        [("a", (32, 16), "float32", "cpu"), ("b", (16,), "float32", "cpu"), ("c", (64, 32), "float32", "cpu")],
        bucket_cap_mb=0.001,
        first_bucket_cap_mb=0.001,
    )


def _reduce(hook, comm, plan, grads):
    reduction = Reduction(hook, comm, init_hook_states(hook, plan), plan)
    for flat in grads:
        reduction.start(flat.clone())
    out = [None] * len(plan.buckets)
    for index, bucket in reduction.finished():
        out[index] = bucket.buffer.clone()
    return out, reduction.stats().bytes_sent


def _hierarchical_2x2(rank, world):
    plan = _buckets()
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(b.numel, generator=g) for b in plan.buckets]
    comms = node_comms(2)
    flat, flat_bytes = _reduce(allreduce(), Comm(), plan, grads)
    two_level, two_level_bytes = _reduce(hierarchical(allreduce(), comms, 2), Comm(), plan, grads)
    # A chain whose buckets take different numbers of rounds (PowerSGD skips the small bucket).
    compressed, _ = _reduce(
        hierarchical(build_hook({"name": "powersgd", "rank": 1, "start_iter": 0}), comms, 2), Comm(), plan, grads
    )
    return len(plan.buckets), flat, flat_bytes, two_level, two_level_bytes, compressed


def test_hierarchical_on_two_nodes_of_two_equals_flat_allreduce(run_ranks):
    results = run_ranks(_hierarchical_2x2, world_size=4)
    for rank, (buckets, flat, flat_bytes, two_level, two_level_bytes, compressed) in enumerate(results):
        assert buckets == 3
        for a, b in zip(flat, two_level):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        # Only the node leaders (ranks 0 and 2) send across nodes, and each sends no more than a flat rank.
        assert (two_level_bytes > 0) == (rank % 2 == 0) and two_level_bytes <= flat_bytes
        for a, b in zip(compressed, results[0][5]):
            assert torch.equal(a, b)  # every rank of every node holds the leaders' result
    assert any(not torch.allclose(a, b) for a, b in zip(results[0][5], results[0][1]))  # PowerSGD did compress


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["world=local2", "world.hierarchical=true"], "world.hierarchical=true: expected more than one node"),
        (["world=local4", "world.hierarchical=true", "world.node_size=3"], "world.node_size=3: expected a divisor"),
    ],
)
def test_hierarchical_without_two_whole_nodes_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(compose(*overrides))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


# -- trainer.reduce_dtype on the leg across nodes -----------------------------------------------------
RUN = [
    "model=mlp",
    "model.hidden=16",
    "data.global_batch_size=16",
    "trainer.max_steps=3",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "trainer.precision=bf16-mixed",
    "world=local4",
    "world.backend=gloo",
    "world.hierarchical=true",
    "world.node_size=2",
]


def _final_params(run_dir):
    return saved(run_dir)["params"]


def test_reduce_dtype_bfloat16_sends_each_nodes_float32_sum_across_nodes_in_bfloat16_as_hooks_bf16(tmp_path):
    """At stage 0 the hook runs across nodes on each node's float32 sum: ``reduce_dtype=bfloat16`` casts that sum
    for the leg across nodes, which is what ``hooks=bf16`` does there; the float32 default differs."""
    from fdp.run.trainer import run

    runs = {
        "reduce_dtype": ["trainer.reduce_dtype=bfloat16"],
        "bf16_hook": ["hooks=bf16"],
        "float32": [],
    }
    params = {}
    for name, overrides in runs.items():
        run(compose(*RUN, *overrides), tmp_path / name)
        params[name] = _final_params(tmp_path / name)
    for key in params["float32"]:
        torch.testing.assert_close(params["reduce_dtype"][key], params["bf16_hook"][key], rtol=0, atol=0)
    assert any(not torch.equal(params["reduce_dtype"][k], params["float32"][k]) for k in params["float32"])
