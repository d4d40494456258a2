"""A lost rank under world.hierarchical=true, at every ZeRO stage (fdp.procs.shrink.whole_groups, fdp.state.heal).

Four gloo ranks in two nodes of two (``world.node_size=2``) train a tiny character transformer
with dropout (per-sample streams: the result does not depend on the world size). Launch rank
2 or 3 is SIGKILLed once it starts step 12 of 40: its node steps out whole (the other rank of it
leaves too) and the node left, which holds a replica of every slice of the state, trains on
alone, nothing re-split, sent or read from disk. With ``world.respawn=true`` both ranks of the
node are started again, join together and take their state from their replicas in the other
node, and the run ends on four ranks. Each run must end with the uninterrupted run's params.
"""

from __future__ import annotations

import re
import signal

import pytest
from _procs import alive
from test_grow import RESPAWN, SLOWER
from test_shrink import RUN, Signaller, assert_close_params, final_params, records

from fdp.errors import ConfigError
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.run.trainer import run

STEPS, KILL_AT, TIMEOUT_S = 40, 12, 10
COMMON = [
    *[o for o in RUN if not o.startswith(("trainer.max_steps", *(s.split("=")[0] for s in SLOWER)))],
    *SLOWER,
    f"trainer.max_steps={STEPS}",
    "world=local4",
    "world.backend=gloo",
    f"world.timeout_s={TIMEOUT_S}",
    "world.on_rank_loss=shrink",
    "world.hierarchical=true",
    "world.node_size=2",
]


def _run(tmp_path_factory, name, *overrides, kill=None):
    run_dir = tmp_path_factory.mktemp(name)
    signaller = Signaller(run_dir, signal.SIGKILL, rank=kill, step=KILL_AT) if kill is not None else None
    try:
        summary = run(compose(*COMMON, *overrides), run_dir)
    finally:
        if signaller is not None:
            signaller.done()
    return {"dir": run_dir, "summary": summary, "victim": signaller and signaller.victim}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (hybrid ZeRO-2 on the two nodes)."""
    result = _run(tmp_path_factory, "reference", "trainer.zero_stage=2")
    assert result["summary"]["world"] == 4 and "shrinks" not in result["summary"]
    return final_params(result["dir"])


def _check_stepped_out(result, reference, world):
    summary, victim = result["summary"], result["victim"]
    assert victim is not None and victim["step"] >= KILL_AT and not alive(victim["pid"])
    assert summary["steps"] == STEPS and summary["world"] == world, summary
    (shrink,) = summary["shrinks"]
    assert shrink["lost"] == [2, 3] and shrink["world"] == 2, shrink  # the killed rank and the rest of its node
    assert KILL_AT - 1 <= shrink["step"] <= victim["step"]
    assert [r for r in records(result["dir"]) if r.get("shrink")] == [{"shrink": True, **shrink}]
    # Nothing read: the only checkpoint is the one written at the end.
    written = (result["dir"] / "checkpoints").glob("step_*")  # a file (whole) or a directory (sharded, the default)
    assert sorted(p.name.removesuffix(".pt") for p in written) == [f"step_{STEPS:08d}"]
    assert_close_params(final_params(result["dir"]), reference, atol=1e-4)
    return shrink


def test_zero_2_a_killed_rank_steps_its_node_out_and_the_other_node_finishes_the_run(tmp_path_factory, reference):
    result = _run(tmp_path_factory, "zero2", "trainer.zero_stage=2", kill=2)
    shrink = _check_stepped_out(result, reference, 2)
    assert shrink["seconds_lost"] < TIMEOUT_S  # a dead peer's socket closes at once: no timeout waited for


def test_zero_3_with_respawn_the_node_is_started_again_healed_from_its_replicas_and_ends_on_four(
    tmp_path_factory, reference
):
    result = _run(tmp_path_factory, "zero3", "trainer.zero_stage=3", *RESPAWN, kill=2)
    shrink = _check_stepped_out(result, reference, 4)
    (grow,) = result["summary"]["grows"]
    # The node's two ranks are admitted together, never one without the other.
    assert sorted(grow["joined"]) == [2, 3] and grow["world"] == 4, grow
    assert shrink["step"] <= grow["asked"] < grow["step"] < STEPS


def test_zero_0_the_hook_across_nodes_goes_on_over_the_node_left(tmp_path_factory, reference):
    """Stage 0 (each node's sum, the hook across the nodes) keeps whole nodes too: a node's mean averaged over the
    nodes is the world's mean only when the nodes are the same size."""
    result = _run(tmp_path_factory, "zero0", "trainer.zero_stage=0", kill=3)
    shrink = _check_stepped_out(result, reference, 2)
    assert shrink["seconds_lost"] < TIMEOUT_S  # the collectives across and inside the nodes end at the report


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_shrinks_under_hierarchical(stage):
    validate(compose(*COMMON, f"trainer.zero_stage={stage}", *RESPAWN))


def test_flat_stages_2_and_3_are_refused_with_the_reason_and_the_way_out():
    flat = [o for o in COMMON if not o.startswith("world.hierarchical")]
    with pytest.raises(ConfigError) as caught:
        validate(compose(*flat, "trainer.zero_stage=3"))
    assert re.fullmatch(
        r"trainer\.zero_stage=3: expected 0 or 1 with world\.on_rank_loss=shrink unless world\.hierarchical=true "
        r"\(.*\)",
        str(caught.value),
    ), str(caught.value)


def test_a_batch_that_only_whole_nodes_split_is_accepted():
    """Under hierarchical a shrink leaves 2 or 4 ranks, never 3: 8 is enough (12 would be asked of a flat world);
    a world that may grow to 6 asks for 12."""
    validate(compose(*COMMON, "data.global_batch_size=8", "trainer.zero_stage=2"))
    with pytest.raises(ConfigError, match=r"to 6 in whole nodes of world\.node_size=2 .*\(e\.g\. 12, a multiple of 12"):
        validate(compose(*COMMON, "data.global_batch_size=8", "world.max_ranks=6", "trainer.zero_stage=2"))
