"""A world that grows back (world.respawn=true, fdp.procs.grow, fdp.state.heal).

Three gloo ranks train a tiny character transformer with dropout under Adam
(world-size-invariant: per-sample streams under ``shrink``); a rank is SIGKILLed once it
starts step 10 of 40. The world shrinks to two, the lost rank's keeper starts it again,
it joins at a step boundary, takes the state from the survivors (no checkpoint is read)
and the run ends on three ranks with the uninterrupted run's params.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _procs import alive
from test_shrink import RUN, Signaller, assert_close_params, final_params, records

from fdp.errors import ConfigError
from fdp.procs.grow import GrowingWorld, JoinRefused
from fdp.procs.shrink import died_key
from fdp.run.checkpoint import last_of
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.run.rundir import RankStatus
from fdp.run.trainer import run

pytestmark = pytest.mark.heavy  # run first (tests/conftest.py)

STEPS, KILL_AT, TIMEOUT_S = 40, 10, 10  # a dead rank is seen at once: the timeout only bounds start-up
# Steps of ~0.2 s, so that the rank started again (its keeper imports what its first step needs, it builds its
# model alone) is back long before the run's end; SGD with momentum (a state to heal), whose result does not
# amplify the rounding of sums split over 2 or 3 ranks as Adam's does on a model this size.
SLOWER = ["model.d_model=64", "model.n_layer=2", "data.block_size=64", "data.global_batch_size=48", "optim=sgd"]
COMMON = [
    *[
        o
        for o in RUN
        if not o.startswith(
            (
                "trainer.max_steps",
                "model.d_model",
                "model.n_layer",
                "data.block_size",
                "data.global_batch_size",
                "optim",
            )
        )
    ],
    *SLOWER,
    f"trainer.max_steps={STEPS}",
    "world=local4",
    "world.nproc_per_node=3",
    "world.backend=gloo",
    f"world.timeout_s={TIMEOUT_S}",
    "world.on_rank_loss=shrink",
]
RESPAWN = ["world.respawn=true", "world.respawn_delay_s=0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("reference")
    summary = run(compose(*COMMON, *RESPAWN), run_dir)
    assert summary["world"] == 3 and "grows" not in summary and "shrinks" not in summary
    return final_params(run_dir)


def _lost_and_back(tmp_path_factory, rank):
    return _lost_and_back_with(tmp_path_factory.mktemp(f"lost{rank}"), rank, [*COMMON, *RESPAWN])


def _lost_and_back_with(run_dir, rank, settings):
    run_dir.mkdir(exist_ok=True)
    signaller = Signaller(run_dir, signal.SIGKILL, rank=rank, step=KILL_AT)
    try:
        summary = run(compose(*settings), run_dir)
    finally:
        signaller.done()
    return {"dir": run_dir, "summary": summary, "victim": signaller.victim}


@pytest.fixture(scope="module")
def lost2(tmp_path_factory):
    return _lost_and_back(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def lost0(tmp_path_factory):
    return _lost_and_back(tmp_path_factory, 0)


def _check_grown_back(result, reference, rank):
    summary, victim = result["summary"], result["victim"]
    assert victim is not None and victim["step"] >= KILL_AT and not alive(victim["pid"])
    assert summary["steps"] == STEPS and summary["world"] == 3, summary
    (shrink,) = summary["shrinks"]
    (grow,) = summary["grows"]
    assert shrink["lost"] == [rank] and shrink["world"] == 2
    assert grow["joined"] == [rank] and grow["world"] == 3 and shrink["step"] <= grow["asked"] < grow["step"] < STEPS
    # Admitted at a boundary two steps after rank 0 saw the request (made while a step ran): never inside one.
    assert grow["step"] == grow["asked"] + 2
    grows = [r for r in records(result["dir"]) if r.get("grow")]
    assert [{k: r[k] for k in ("grow", "step", "joined", "world", "seconds")} for r in grows] == [
        {"grow": True, **{k: grow[k] for k in ("step", "joined", "world", "seconds")}}
    ]
    # Nothing read: the only checkpoint is the one written at the end.
    assert sorted(p.name for p in (result["dir"] / "checkpoints").glob("step_*")) == [f"step_{STEPS:08d}"]
    assert_close_params(final_params(result["dir"]), reference)


def test_rank_2_killed_is_started_again_rejoins_and_the_run_ends_on_three_ranks(lost2, reference):
    _check_grown_back(lost2, reference, 2)
    # The rank started again says so in its own log (it was left empty).
    (joined,) = [line for line in (lost2["dir"] / "rank2.log").read_text().splitlines() if "joined" in line]
    step = lost2["summary"]["grows"][0]["step"]
    assert joined == f"[rank2] started again and joined the running world at step {step}: rank 2 of 3", joined


def test_rank_0_killed_rejoins_and_the_run_keeps_its_owner_and_summary(lost0, reference):
    """Launch rank 0 joins last (rank 2 of the new world): launch rank 1 stays the world's rank 0, writing the
    records; the run's summary is that rank's, whichever process the launcher reads first."""
    _check_grown_back(lost0, reference, 0)
    lines = records(lost0["dir"])
    assert lines[-1]["summary"] and lines[-1]["grows"] == lost0["summary"]["grows"]
    assert [r["step"] for r in lines if "loss" in r and "step" in r][-1] == STEPS


# DiLoCo whose syncs are sent after steps 4, 8, ... and land a step later (outer.overlap=1): no sync is in flight
# after steps 1, 5, 9, ..., where a rank may join.
OVERLAP = ["outer=diloco", "outer.sync_every=4", "outer.overlap=1"]


def test_under_an_overlapped_outer_loop_a_rank_joins_after_a_sync_landed_as_a_run_resumed_there(tmp_path):
    """The join waits for the boundary after a sync in flight has landed; the world then goes on as a run stopped
    at the shrink's step, resumed on two ranks to the join's step and resumed on three (the joiner takes rank 0's
    params, inner and outer states, as a rank new to a resumed world does)."""
    settings = [*COMMON, *RESPAWN, *OVERLAP, "trainer.checkpoint_format=whole"]  # each rank's entries read below
    grown = _lost_and_back_with(tmp_path / "grown", 2, settings)
    summary = grown["summary"]
    (shrink,) = summary["shrinks"]
    (grow,) = summary["grows"]
    assert shrink["lost"] == [2] and grow["joined"] == [2] and summary["world"] == 3 and summary["steps"] == STEPS
    assert grow["step"] % 4 == 1, grow  # a sync sent after step 4n landed after step 4n + 1
    reference = tmp_path / "reference"
    run(compose(*settings, f"trainer.stop_at={shrink['step']}"), reference)
    run(
        compose(*settings, "world.nproc_per_node=2", f"trainer.stop_at={grow['step']}", "trainer.resume=true"),
        reference,
    )
    run(compose(*settings, "trainer.resume=true"), reference)
    ours, theirs = [torch.load(last_of(d / "checkpoints"), weights_only=True) for d in (grown["dir"], reference)]
    for rank in range(3):
        assert_close_params(ours["ranks"][rank]["params"], theirs["ranks"][rank]["params"])


def test_max_time_counts_the_training_time_across_a_shrink_and_a_join(tmp_path):
    """The clock goes on through the shrink and the join: the run stops on three ranks at one step, its time spent,
    the rank that joined having taken the training time so far from the world's rank 0. The rank is lost early
    (step 5, ~2 s in): its return takes a few steps (~1 s), well inside the clock's 12 s."""
    limit = 12
    signaller = Signaller(tmp_path, signal.SIGKILL, rank=2, step=5)
    try:
        settings = [o for o in COMMON if not o.startswith("trainer.max_steps")]
        clock = ["trainer.max_steps=100000", f"trainer.max_time={limit}", "trainer.checkpoint_format=whole"]
        summary = run(compose(*settings, *RESPAWN, *clock), tmp_path)
    finally:
        signaller.done()
    assert summary["stopped"] == "max_time" and summary["world"] == 3, summary
    assert [s["lost"] for s in summary["shrinks"]] == [[2]] and [g["joined"] for g in summary["grows"]] == [[2]]
    saved = torch.load(last_of(tmp_path / "checkpoints"), weights_only=True)
    assert saved["step"] == summary["steps"] > summary["grows"][0]["step"]
    assert limit <= saved["loop"]["elapsed_s"] < limit + 15, saved["loop"]
    assert {RankStatus.read(tmp_path, rank)["step"] for rank in range(3)} == {summary["steps"]}


# -- the admission, on a real store --------------------------------------------------------------------
@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _world(store, me, members, max_ranks):
    return GrowingWorld(store, me, len(members), "gloo", TIMEOUT_S, max_ranks=max_ranks)


def _asking(store, me, max_ranks, wait_s=3.0):
    """A joiner in a thread: what it got (``None``: no answer within ``wait_s``, or the exception)."""
    out = {}

    def ask():
        try:
            out["world"] = GrowingWorld.join(store, me, "gloo", TIMEOUT_S, max_ranks=max_ranks, wait_s=wait_s)
        except Exception as error:
            out["error"] = error

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread, out


def test_a_join_beyond_max_ranks_is_refused_in_one_line_on_the_joining_side(store):
    world = _world(store, 0, (0, 1, 2), 3)
    try:
        with pytest.raises(JoinRefused) as caught:
            GrowingWorld.join(store, 3, "gloo", TIMEOUT_S, max_ranks=3)
    finally:
        world.close()
    assert str(caught.value) == (
        "world.max_ranks=3: expected room for one more rank; the world already has 3 (launch ranks 0, 1, 2), "
        "so launch rank 3 cannot join"
    )


def test_of_two_joins_at_once_with_room_for_one_the_second_is_refused_by_the_world(store):
    world = _world(store, 0, (0, 1), 3)
    try:
        first, got_first = _asking(store, 2, 3, wait_s=2.0)
        time.sleep(0.3)
        second, got_second = _asking(store, 3, 3)
        time.sleep(0.3)
        assert not world.due(10)  # seen after step 10, scheduled for step 12
        second.join(5)
        assert str(got_second["error"]) == (
            "world.max_ranks=3: expected room for one more rank; the world already has 2 (launch ranks 0, 1), "
            "so launch rank 3 cannot join"
        )
        first.join(5)
        assert got_first == {"world": None}  # no answer: the world never reached its boundary here
    finally:
        world.close()


def test_a_rank_that_asks_to_join_clears_the_death_its_keeper_told_of(store):
    """Else a later failure would name the new process lost at once (``ShrinkingWorld.silent``)."""
    world = _world(store, 0, (0, 1), 3)
    try:
        store.set(died_key(2), "killed by SIGKILL")
        joiner, got = _asking(store, 2, 3, wait_s=0.5)
        joiner.join(5)
        assert got == {"world": None} and not store.check([died_key(2)])
    finally:
        world.close()


@pytest.mark.parametrize("period, asked, at", [(1, 7, 9), (4, 5, 12), (4, 8, 16)])
def test_a_join_asked_during_a_step_waits_for_the_scheduled_boundary_on_every_rank(store, period, asked, at):
    """Rank 0 schedules the join two boundaries (outer-loop periods) ahead: every rank, at most one boundary
    apart from it, sees the schedule before it gets there; none admits it earlier."""
    ranks = [_world(store, me, (0, 1, 2), 4) for me in (0, 1, 2)]
    try:
        joiner, _ = _asking(store, 3, 4, wait_s=1.0)
        time.sleep(0.3)
        for step in range(asked, at + 1):
            due = [world.due(step, period) for world in ranks]
            assert due == [step == at] * 3, (step, due)
        joiner.join(5)
    finally:
        for world in ranks:
            world.close()


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["world.max_ranks=2"],
            r"world\.max_ranks=2: expected 0 \(the starting size\) or at least the world's 3 ranks",
        ),
        (["world.on_rank_loss=restart"], r"world\.respawn=True: expected false unless world\.on_rank_loss=shrink"),
        (["world.max_respawns=-1"], r"world\.max_respawns=-1: expected an integer >= 0"),
        (["world.max_ranks=5"], r"data\.global_batch_size=48: expected a multiple of every world size from "),
    ],
)
def test_settings_a_growing_world_cannot_run_are_refused_in_one_line(overrides, expected):
    import re

    with pytest.raises(ConfigError) as caught:
        validate(compose(*COMMON, *RESPAWN, *overrides))
    assert re.match(expected, str(caught.value)) and "\n" not in str(caught.value), str(caught.value)
