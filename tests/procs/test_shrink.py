"""A world that loses a rank and goes on in place (world.on_rank_loss=shrink, fdp.procs.shrink, fdp.procs.keeper).

Three gloo ranks train a tiny character transformer with dropout under Adam; rank 2 is
SIGKILLed (or SIGSTOPped) from outside once it starts step 30 of 60, through the pid in
``<run dir>/ranks/rank2.txt``. The survivors must finish the run on two ranks by
themselves, without a checkpoint to read, with the parameters of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from _loop_callbacks import Addresses
from _procs import alive
from _saved import saved

from fdp.errors import ConfigError
from fdp.procs.keeper import LostRank
from fdp.procs.launch import WorkerFailedError
from fdp.procs.shrink import ShrinkingWorld, check_shrinkable_batch, keep_rank, shrink_store
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.run.rundir import RankStatus
from fdp.run.trainer import run

pytestmark = pytest.mark.heavy  # run first (tests/conftest.py)

STEPS, KILL_AT, TIMEOUT_S = 60, 30, 5
RUN = [
    "model=charlm",
    "data=stdlib_text",
    "model.d_model=16",
    "model.n_layer=1",
    "model.n_head=2",
    "model.dropout=0.1",
    "data.block_size=8",
    "data.max_chars=5000",
    "data.global_batch_size=12",
    "optim=adam",
    "optim.lr=1e-3",
    "trainer.eval_every=0",
    "trainer.progress=false",
    f"trainer.max_steps={STEPS}",
    "trainer.checkpoint_every=0",
]
COMMON = [
    *RUN,
    "world=local4",
    "world.nproc_per_node=3",
    "world.backend=gloo",
    f"world.timeout_s={TIMEOUT_S}",
    "world.on_rank_loss=shrink",
]


class Signaller:
    """Sends ``sig`` to launch rank ``rank`` of the run in ``run_dir`` once it starts step ``step`` (from a thread)."""

    def __init__(self, run_dir, sig, rank=2, step=KILL_AT):
        import threading

        self.run_dir, self.sig, self.rank, self.step = run_dir, sig, rank, step
        self.victim, self.at = None, None
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def _send(self):
        deadline = time.monotonic() + 120
        while RankStatus.read(self.run_dir, self.rank).get("step", 0) < self.step:
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)
        self.victim = RankStatus.read(self.run_dir, self.rank)
        os.kill(self.victim["pid"], self.sig)
        self.at = time.monotonic()

    def done(self):
        self.thread.join(5)
        if self.sig == signal.SIGSTOP and self.victim and alive(self.victim["pid"]):
            os.kill(self.victim["pid"], signal.SIGKILL)  # never left behind, whatever the test found
        return self


def final_params(run_dir):
    return saved(Path(run_dir))["params"]


def records(run_dir, name="metrics.jsonl"):
    return [json.loads(line) for line in (Path(run_dir) / name).read_text().splitlines()]


def assert_close_params(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    gap = max((a[n] - b[n]).abs().max().item() for n in a)
    assert gap <= atol, gap


def _interrupted_run(tmp_path_factory, name, sig, *overrides):
    run_dir = tmp_path_factory.mktemp(name)
    signaller = Signaller(run_dir, sig)
    started = time.monotonic()
    try:
        summary = run(compose(*COMMON, *overrides), run_dir)
    finally:
        signaller.done()
    return {
        "dir": run_dir,
        "summary": summary,
        "victim": signaller.victim,
        "signalled_at": signaller.at,
        "ended_at": time.monotonic(),
        "started_at": started,
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (the same settings, nobody lost)."""
    run_dir = tmp_path_factory.mktemp("reference")
    summary = run(compose(*COMMON), run_dir, callbacks=[Addresses(str(run_dir / "addresses.jsonl"))])
    return {"dir": run_dir, "summary": summary, "params": final_params(run_dir)}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    return _interrupted_run(tmp_path_factory, "killed", signal.SIGKILL)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    return _interrupted_run(tmp_path_factory, "stopped", signal.SIGSTOP)


def test_the_uninterrupted_run_never_shrinks(reference):
    assert reference["summary"]["world"] == 3 and reference["summary"]["steps"] == STEPS
    assert "shrinks" not in reference["summary"]


def test_a_world_ready_to_shrink_steps_its_state_in_place_with_no_new_tensors(reference):
    # A donated step (fused optimizer, in place); the state before it is kept by a copy into buffers of its own.
    steps = records(reference["dir"], "addresses.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["at"] == steps[0]["at"] for s in steps)


def _check_shrunk_run(result, reference):
    summary, victim = result["summary"], result["victim"]
    assert victim is not None and victim["step"] >= KILL_AT
    assert summary["steps"] == STEPS and summary["world"] == 2
    (shrink,) = summary["shrinks"]
    assert shrink["lost"] == [2] and shrink["world"] == 2
    assert KILL_AT - 1 <= shrink["step"] <= victim["step"]
    # Nothing to read: the only checkpoint is the one written at the end.
    assert sorted(p.name for p in (result["dir"] / "checkpoints").glob("step_*")) == [f"step_{STEPS:08d}"]
    assert [r for r in records(result["dir"]) if r.get("shrink")] == [{"shrink": True, **shrink}]
    assert_close_params(final_params(result["dir"]), reference["params"])
    assert shrink["seconds_lost"] <= TIMEOUT_S + 10
    assert not alive(victim["pid"])
    return shrink


def test_a_killed_rank_leaves_two_that_finish_the_uninterrupted_run(killed, reference):
    shrink = _check_shrunk_run(killed, reference)
    assert shrink["seconds_lost"] < TIMEOUT_S  # a dead peer's socket closes at once: no timeout waited for


def test_a_hung_rank_is_dropped_after_the_timeout_and_killed_by_its_keeper(stopped, reference):
    shrink = _check_shrunk_run(stopped, reference)
    assert TIMEOUT_S - 1 <= shrink["seconds_lost"]  # the survivors' collective timed out first


# -- settings a shrinking world refuses --------------------------------------------------------------
REFUSED = [
    (["world.on_rank_loss=ignore"], r"^world\.on_rank_loss='ignore': expected restart or shrink$"),
    (["world.min_ranks=0"], r"^world\.min_ranks=0: expected an integer >= 1$"),
    (["world.min_ranks=4"], r"^world\.min_ranks=4: expected at most the world's 3 ranks$"),
    (["world.max_restarts=1"], r"^world\.max_restarts=1: expected 0 with world\.on_rank_loss=shrink"),
    (["trainer.zero_stage=2"], r"^trainer\.zero_stage=2: expected 0 or 1 with world\.on_rank_loss=shrink"),
    (
        ["data.global_batch_size=9"],
        r"^data\.global_batch_size=9: expected a multiple of every world size from "
        r"world\.min_ranks=1 to 3 times trainer\.accum_steps=1 \(e\.g\. 12, a multiple of 6, "
        r"their least common multiple\)",
    ),
]


def test_the_batch_suggested_for_a_shrinking_world_is_the_nearest_that_every_world_splits():
    """32 on 4 ranks with 2 micro-batches: every world from 1 to 4 splits 48 (the least common multiple of 2, 4, 6, 8
    is 24), not only a multiple of 32 such as 96."""
    with pytest.raises(ValueError, match=r"\(e\.g\. 48, a multiple of 24, their least common multiple\)"):
        check_shrinkable_batch(32, 4, 1, accum_steps=2)
    check_shrinkable_batch(48, 4, 1, accum_steps=2)


@pytest.mark.parametrize("overrides, expected", REFUSED)
def test_settings_a_shrinking_world_cannot_run_are_refused_in_one_line(overrides, expected):
    with pytest.raises(ConfigError) as caught:
        validate(compose(*COMMON, *overrides))
    assert re.search(expected, str(caught.value)) and "\n" not in str(caught.value), str(caught.value)


# -- ZeRO stage 1, and local SGD --------------------------------------------------------------------
@pytest.fixture(scope="module")
def zero1_killed(tmp_path_factory):
    return _interrupted_run(tmp_path_factory, "zero1", signal.SIGKILL, "trainer.zero_stage=1")


def test_zero_stage_1_keeps_the_lost_ranks_slices_and_trains_the_uninterrupted_run(zero1_killed, reference):
    """Each rank mirrors the next rank's optimizer-state slices: rank 1 held rank 2's, so the
    survivors split the whole optimizer state again between them and train on."""
    _check_shrunk_run(zero1_killed, reference)


# PowerSGD compresses the pseudo-gradient with each rank's own error feedback (a per-rank hook state).
LOCAL_SGD = ["outer=local_sgd", "outer.sync_every=4", "hooks=powersgd", "hooks.start_iter=2"]


@pytest.fixture(scope="module")
def local_sgd_killed(tmp_path_factory):
    return _interrupted_run(tmp_path_factory, "local_sgd", signal.SIGKILL, *LOCAL_SGD)


def test_local_sgd_goes_on_as_a_run_stopped_there_and_resumed_on_two_ranks(local_sgd_killed, tmp_path):
    """Under local SGD the ranks' params differ between syncs, so the result depends on the world
    size: the survivors must train what a run stopped at that step and resumed on two ranks does
    (each keeps its own params, inner optimizer state, outer state and PowerSGD error feedback; the
    lost rank's progress since the last sync and its error feedback are dropped)."""
    summary, victim = local_sgd_killed["summary"], local_sgd_killed["victim"]
    (shrink,) = summary["shrinks"]
    assert shrink["lost"] == [2] and summary["world"] == 2 and summary["steps"] == STEPS
    assert KILL_AT - 1 <= shrink["step"] <= victim["step"] + 1
    assert shrink["seconds_lost"] <= TIMEOUT_S + 10
    run(compose(*COMMON, *LOCAL_SGD, f"trainer.stop_at={shrink['step']}"), tmp_path)
    run(compose(*COMMON, *LOCAL_SGD, "world.nproc_per_node=2", "trainer.resume=true"), tmp_path)
    assert_close_params(final_params(local_sgd_killed["dir"]), final_params(tmp_path))


# Streaming DiLoCo: two fragments sent behind the next step as fp4 codes (each rank's own error feedback).
STREAMING = [
    "outer=diloco",
    "outer.sync_every=4",
    "outer.fragments=2",
    "outer.overlap=1",
    "hooks=lowbit",
    "hooks.block=16",
    "trainer.bucket_cap_mb=0.002",
    "trainer.first_bucket_cap_mb=0.001",
]


@pytest.fixture(scope="module")
def streaming_killed(tmp_path_factory):
    return _interrupted_run(tmp_path_factory, "streaming", signal.SIGKILL, *STREAMING)


def test_streaming_diloco_goes_on_as_a_run_stopped_there_and_resumed_on_two_ranks(streaming_killed, tmp_path):
    """As under local SGD, with fragments: each survivor keeps its fragments' outer states, the sync in
    flight and its fp4 error feedback, and trains what a run stopped at that step and resumed does."""
    summary = streaming_killed["summary"]
    (shrink,) = summary["shrinks"]
    assert shrink["lost"] == [2] and summary["world"] == 2 and summary["steps"] == STEPS
    run(compose(*COMMON, *STREAMING, f"trainer.stop_at={shrink['step']}"), tmp_path)
    run(compose(*COMMON, *STREAMING, "world.nproc_per_node=2", "trainer.resume=true"), tmp_path)
    assert_close_params(final_params(streaming_killed["dir"]), final_params(tmp_path))


# -- fewer than world.min_ranks ------------------------------------------------------------------------
def test_a_world_under_min_ranks_ends_in_one_line_with_a_checkpoint_to_resume(tmp_path):
    two = ["world.nproc_per_node=2", "world.min_ranks=2"]
    signaller = Signaller(tmp_path, signal.SIGKILL, rank=1, step=20)
    try:
        with pytest.raises(WorkerFailedError) as caught:
            run(compose(*COMMON, *two), tmp_path)
    finally:
        signaller.done()
    # The lost rank's keeper lets the launcher stop it: torch's agent would wait 30 s for one that holds SIGTERM.
    assert time.monotonic() - signaller.at < 20
    message = str(caught.value)
    match = re.fullmatch(
        r"rank 1 lost by step (\d+): 1 left, fewer than world\.min_ranks=2; the last checkpoint is "
        r"step (\d+) \(continue with trainer\.resume=true\) \(rank 0\)",
        message,
    )
    assert match, message
    step = int(match[2])
    assert int(match[1]) == step + 1 and 19 <= step <= signaller.victim["step"]
    assert saved(tmp_path)["step"] == step
    # Usable: the run goes on from it (here on one process) to the end.
    resumed = run(compose(*RUN, "world=single", "trainer.resume=true"), tmp_path)
    assert resumed["steps"] == STEPS and resumed["world"] == 1


# -- under torchrun --------------------------------------------------------------------------------------
def test_under_torchrun_losing_rank_0_leaves_two_that_finish_and_print_the_summary(tmp_path, reference):
    """``torchrun --max-restarts 0``: rank 0's process owns the run directory and prints the summary;
    its rank is killed, its keeper stays until the others are done and prints theirs."""
    import sys

    import _recipe
    from _paths import pythonpath_first

    root = Path(__file__).resolve().parents[2]
    overrides = [o for o in COMMON if not o.startswith("world=") and "nproc_per_node" not in o]
    command = [  # torchrun itself forked from the preloaded server (tests/_torchrun.py); its ranks start fresh
        sys.executable,
        str(root / "tests" / "_torchrun.py"),
        "--standalone",
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "0",
        str(root / "recipes" / "train.py"),
        "world=torchrun",
        *overrides,
        f"hydra.run.dir={tmp_path}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath_first(root)}
    signaller = Signaller(tmp_path, signal.SIGKILL, rank=0)
    try:
        done = _recipe.run(command, env=env, cwd=root, timeout=240)
    finally:
        signaller.done()
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    match = re.fullmatch(
        r"fdp: model=charlm world=2 device=cpu steps=60 .* shrinks=\[\{'step': (\d+), 'lost': \[0\], "
        r"'world': 2, 'seconds_lost': [\d.]+\}\]",
        last,
    )
    assert match, done.stdout[-2000:]
    assert KILL_AT - 1 <= int(match[1]) <= signaller.victim["step"]
    assert_close_params(final_params(tmp_path), reference["params"])


# -- a collective that waits on a live peer -------------------------------------------------------------
WAIT_TIMEOUT_S = 8


def _wait_on_a_live_peer(rank, world_size):
    """Rank 0 never joins the all-reduce (its peers wait on it, alive) and reports the world broken 1 s after they
    are about to wait (each says so first: a peer slow to start would otherwise have waited less)."""
    world = ShrinkingWorld(shrink_store(WAIT_TIMEOUT_S), rank, world_size, "gloo", WAIT_TIMEOUT_S)
    try:
        if rank == 0:
            world.store.wait([f"waiting/{peer}" for peer in range(1, world_size)])
            time.sleep(1.0)
            world.report_broken()
            world.store.wait(["waited/1", "waited/2"])  # alive until the others are done: no socket closes
            return None
        comm = world.comm()
        world.store.set(f"waiting/{rank}", "1")
        started = time.monotonic()
        try:
            comm.allreduce(torch.ones(4)).wait()
            outcome = "the all-reduce returned"
        except RuntimeError as error:
            outcome = str(error)
        world.store.set(f"waited/{rank}", "1")
        return outcome, time.monotonic() - started
    finally:
        world.close()


def test_a_rank_waiting_on_a_live_peer_stops_once_the_world_is_reported_broken(run_ranks):
    """gloo fails a collective only where a peer's socket closed; the others would wait for the timeout."""
    results = run_ranks(_wait_on_a_live_peer, world_size=3, timeout_s=WAIT_TIMEOUT_S)
    for message, waited in results[1:]:
        assert message == "rank 0 reported a lost rank (generation 0)", message
        assert 0.9 <= waited < 3, waited  # at the report, not at the 8 s timeout


def _named_lost(rank, world_size):
    """Rank 2 dies once every rank's world exists; the others ask at once who was lost, and how long that took."""
    world = ShrinkingWorld(shrink_store(WAIT_TIMEOUT_S), rank, world_size, "gloo", WAIT_TIMEOUT_S)
    try:
        world.store.set(f"ready/{rank}", "1")
        world.store.wait([f"ready/{r}" for r in range(world_size)])
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        return world.silent(), time.monotonic() - started
    finally:
        world.close()


def _kept(rank, world_size):
    return keep_rank(_named_lost, rank, world_size, launcher="elastic", timeout_s=WAIT_TIMEOUT_S)


def test_a_killed_rank_is_named_as_its_keeper_sees_it_die_without_waiting_for_its_heartbeat(run_ranks):
    """The heartbeats need three beats (1.5 s) to tell a dead rank; its keeper tells at once."""
    results = run_ranks(_kept, world_size=3, timeout_s=WAIT_TIMEOUT_S)
    assert isinstance(results[2], LostRank) and results[2].how == "killed by SIGKILL", results[2]
    for silent, took in results[:2]:
        assert silent == [2] and took < 1.0, (silent, took)


def test_the_fault_tolerance_pages_shrink_commands_are_accepted_as_written():
    """The fault-tolerance page's commands for a shrinking world (which tests/docs/test_docs.py does not run: a rank
    must be lost) pass validation."""
    page = Path(__file__).resolve().parents[2] / "docs" / "guide" / "fault-tolerance.md"
    text = page.read_text().replace("\\\n", " ")
    commands = [
        line
        for line in text.splitlines()
        if "recipes/train.py" in line and "on_rank_loss=shrink" in line and not line.lstrip().startswith(("Under", "`"))
    ]
    assert len(commands) == 2, commands
    for command in commands:
        words = command.split()
        overrides = [w for w in words[words.index("recipes/train.py") + 1 :] if "=" in w]
        cfg = compose(*overrides)
        validate(cfg)
        nproc = (
            int(words[words.index("--nproc-per-node") + 1]) if "--nproc-per-node" in words else cfg.world.nproc_per_node
        )
        check_shrinkable_batch(cfg.data.global_batch_size, nproc, cfg.world.min_ranks, cfg.trainer.accum_steps)
