"""Loop callbacks (fdp.run.callbacks): the events at their steps and ranks, their state across a resume in both
checkpoint formats, a failing one in one line with exit 2, from the config and from Python, at ZeRO stage 3 on
two ranks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import _recipe
import pytest
import torch
from _loop_callbacks import KeepsWhole, Recorder
from _paths import pythonpath_first
from _saved import saved

from fdp.comm import Comm
from fdp.errors import ConfigError
from fdp.run.callbacks import Callbacks
from fdp.run.callbacks.base import Callback, CallbackError
from fdp.run.checkpoint.consolidate import consolidate
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.run.trainer import run

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]  # the helpers: _loop_callbacks
SMALL = [
    "model=mlp",
    "model.hidden=32",
    "trainer.progress=false",
    "data.global_batch_size=16",
    "trainer.bucket_cap_mb=0.01",
    "trainer.first_bucket_cap_mb=0.005",
    "trainer.eval_batches=2",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=3",
    "trainer.checkpoint_every=2",
]


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def recorder_spec(path: Path, **settings) -> str:
    inner = ",".join(f"{k}:{v}" for k, v in {"path": f"'{path}'", **settings}.items())
    return f"{{_target_:_loop_callbacks.Recorder,{inner}}}"


# -- two ranks at ZeRO stage 3, chosen from the config -------------------------------------------------
@pytest.fixture(scope="module")
def stage3(tmp_path_factory):
    """One run on two ranks at stage 3 (sharded checkpoints), a rank-0 and an every-rank recorder from the config."""
    tmp = tmp_path_factory.mktemp("stage3")
    specs = [
        recorder_spec(tmp / "rank0.jsonl"),
        recorder_spec(tmp / "every.jsonl", every_rank="true", whole_to=f"'{tmp / 'whole.pt'}'"),
    ]
    cfg = compose(
        *SMALL,
        "world=local2",
        "trainer.zero_stage=3",
        "trainer.checkpoint_format=sharded",
        f"trainer.callbacks=[{','.join(specs)}]",
    )
    summary = run(cfg, tmp / "run")
    return tmp, summary


def test_events_fire_at_their_steps_on_the_ranks_each_declares(stage3):
    tmp, summary = stage3
    assert summary["steps"] == 6
    rank0 = events(tmp / "rank0.jsonl")
    assert {e["rank"] for e in rank0} == {0} and {e["world"] for e in rank0} == {2}
    # Per step: its end; the evaluation, then the save (this callback keeps state and hears evaluations: the
    # checkpoint holds what the evaluation did to it); the run's end last.
    assert [(e["event"], e["step"]) for e in rank0] == [
        ("step_end", 1),
        ("step_end", 2),
        ("save", 2),
        ("step_end", 3),
        ("evaluation_end", 3),
        ("step_end", 4),
        ("save", 4),
        ("step_end", 5),
        ("step_end", 6),
        ("evaluation_end", 6),
        ("save", 6),
        ("run_end", 6),
    ]
    seq = [(e["event"], e["step"]) for e in rank0]
    saves = [e for e in rank0 if e["event"] == "save"]
    assert all(e["exists"] and e["checkpoint"].endswith(f"step_{e['step']:08d}") for e in saves)  # complete
    every = events(tmp / "every.jsonl")
    for rank in (0, 1):
        mine = [(e["event"], e["step"]) for e in every if e["rank"] == rank]
        assert mine == seq, rank  # the same events on each rank
    # Stage 3: each rank is shown its slices of the buckets, not the params by name.
    assert {tuple(e["params"]) for e in every if e["event"] == "step_end"} == {("bucket0", "bucket1", "bucket2")}


def test_at_stage_3_whole_params_gathers_what_the_checkpoint_holds(stage3):
    tmp, _ = stage3
    whole = torch.load(tmp / "whole.pt", weights_only=True)
    saved = consolidate(tmp / "run" / "checkpoints" / "step_00000006")["params"]
    assert sorted(whole) == sorted(saved) and "net.0.weight" in whole
    assert all(torch.equal(whole[name], saved[name]) for name in whole)


def test_every_rank_state_is_saved_per_rank_and_restored_on_resume_at_stage_3_from_python(stage3):
    tmp, _ = stage3
    # The same run stopped at step 3 and resumed (sharded checkpoints, two ranks), its recorder given from Python
    # (each rank unpickles a copy): each rank's goes on from its own saved state and ends where the uninterrupted
    # one's did.
    common = [*SMALL, "world=local2", "trainer.zero_stage=3", "trainer.checkpoint_format=sharded"]
    given = [Recorder(str(tmp / "resumed.jsonl"), every_rank=True)]
    run(compose(*common, "trainer.stop_at=3"), tmp / "resumed", callbacks=given)
    run(compose(*common, "trainer.resume=true"), tmp / "resumed", callbacks=given)
    straight = {e["rank"]: e["state"] for e in events(tmp / "every.jsonl") if e["event"] == "run_end"}
    resumed = [e for e in events(tmp / "resumed.jsonl") if e["event"] == "run_end"]
    assert len(resumed) == 4  # the stopped invocation's two ranks, then the resumed one's
    ends = {e["rank"]: e["state"] for e in resumed[-2:]}
    assert ends == straight
    assert straight[0]["loss_sum"] != straight[1]["loss_sum"]  # each rank its own share's losses


# -- one process, from Python, both formats ------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["whole", "sharded"])
def test_state_is_restored_exactly_on_resume_from_python(tmp_path, fmt):
    common = [*SMALL, f"trainer.checkpoint_format={fmt}"]
    straight = Recorder(str(tmp_path / "straight.jsonl"))
    run(compose(*common), tmp_path / "straight", callbacks=[straight])
    first, second = Recorder(str(tmp_path / "first.jsonl")), Recorder(str(tmp_path / "second.jsonl"))
    run(compose(*common, "trainer.stop_at=3"), tmp_path / "resumed", callbacks=[first])
    assert first.counts["step_end"] == 3
    run(compose(*common, "trainer.resume=true"), tmp_path / "resumed", callbacks=[second])
    assert second.state_dict() == straight.state_dict()
    assert straight.counts == {"step_end": 6, "evaluation_end": 2, "save": 3}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_at_every_stage_a_callback_sees_the_params_the_checkpoint_holds(tmp_path, stage):
    keeps = KeepsWhole()
    run(compose(*SMALL, f"trainer.zero_stage={stage}"), tmp_path, callbacks=[keeps])
    params = saved(tmp_path)["params"]
    assert sorted(keeps.params) == sorted(params)
    assert all(torch.equal(keeps.params[name], params[name]) for name in params)
    # What it was shown: the params by name, or at stage 3 this rank's slices by bucket.
    assert keeps.shown == (["bucket0", "bucket1", "bucket2"] if stage == 3 else sorted(params))


# -- failures ----------------------------------------------------------------------------------------
class KeepsAnObject(Callback):
    def on_step_end(self, event):
        pass

    def state_dict(self):
        return {"seen": {1, 2}}  # torch.save would write it; a checkpoint loads with weights_only=True


def test_a_state_that_would_not_load_is_refused_when_saved():
    with pytest.raises(CallbackError, match=r"state_dict\(\)\['seen'\] is of type set; expected plain values"):
        Callbacks([KeepsAnObject()]).payload(Comm())


def test_something_not_a_callback_given_from_python_is_refused_before_the_run(tmp_path):
    with pytest.raises(ConfigError, match=r"callbacks\[0\]: the class Recorder \(an instance is called for"):
        run(compose(*SMALL), tmp_path / "run", callbacks=[Recorder])
    assert not (tmp_path / "run").exists()


def _recipe_run(tmp_path, *overrides):
    env = {**os.environ, "PYTHONPATH": pythonpath_first(ROOT, TESTS)}
    argv = [sys.executable, "recipes/train.py", *SMALL, f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    return _recipe.run(argv, env=env, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("world", ["single", "local2"])
def test_a_failing_callback_ends_the_run_in_one_line_naming_it_with_exit_2(tmp_path, world):
    done = _recipe_run(tmp_path, f"world={world}", "trainer.callbacks=[{_target_:_loop_callbacks.Fails,at:2}]")
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        "error: callback '_loop_callbacks.Fails' failed at step_end (step 2): ValueError: no good at step 2"
    )
    assert "Traceback" not in done.stdout + done.stderr
    log = (tmp_path / "run" / "train.log").read_text()
    assert "Traceback" in log and "no good at step 2" in log


def test_a_callback_that_writes_to_the_state_is_stopped(tmp_path):
    done = _recipe_run(tmp_path, "trainer.callbacks=[{_target_:_loop_callbacks.Writes}]")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        "error: callback '_loop_callbacks.Writes' failed at step_end (step 1): it wrote to "
        "state.params['net.0.weight'] in place; a callback only reads (clone what it changes)"
    )


@pytest.mark.parametrize(
    ("spec", "line"),
    [
        ("[{path:x}]", r"trainer\.callbacks\[0\]=\{'path': 'x'\}: expected a mapping with a _target_"),
        ("[{_target_:_loop_callbacks.Nope}]", r"trainer\.callbacks\[0\]\._target_='_loop_callbacks\.Nope': module "),
        (
            "[{_target_:_loop_callbacks.Recorder,pth:x}]",
            r"trainer\.callbacks\[0\]\._target_='_loop_callbacks\.Recorder': does not take pth='x'",
        ),
        ("[{_target_:torch.nn.Linear}]", r"trainer\.callbacks\[0\]\._target_='torch\.nn\.Linear': expected a callback"),
    ],
)
def test_bad_callback_settings_are_refused_before_the_run(spec, line):
    with pytest.raises(ConfigError, match=line):
        validate(compose(f"trainer.callbacks={spec}"))
