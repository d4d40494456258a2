"""Settings refused before the run starts, in one line saying why: those ``validate`` checks, and those
the build checks once the data, the model and its bucket plan are known (before anything is announced).
Each is ``error: ...`` on stderr, exit status 2, nothing on stdout and no run directory left
(fdp.run.config.validate, fdp.run.build, fdp.run.loop_controls, fdp.run.cli)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import _recipe
import pytest
from torch import nn

from fdp.errors import ConfigError
from fdp.model import remat
from fdp.run.rundir import TRAIN_LOG, own_run_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = ["trainer.max_steps=2", "trainer.progress=false"]

CASES = [
    # Known once the plan is: the build refuses them before the first state is made.
    (
        ["outer=local_sgd", "outer.fragments=8"],
        r"outer\.fragments=8: expected an integer in \[1, 1\] \(the plan's buckets; a smaller "
        r"trainer\.bucket_cap_mb makes more\)",
    ),
    (
        ["hooks=lowbit", "hooks.block=100000000"],
        r"hooks\.block=100000000: expected at most 85002, the entries of the plan's largest bucket \(.*\)",
    ),
    (
        ["optim=adamw", "optim.decay_filter=[*.bias,nomatch]"],
        r"optim\.decay_filter=\['\*\.bias', 'nomatch'\]: expected patterns that each match a param's name "
        r"\(nomatch matches none of net\.0\.weight, .*\)",
    ),
    # Monitored metrics: checked against what the evaluations report, before step 1.
    (
        ["trainer.early_stopping.monitor=val_los", "trainer.early_stopping.patience=1", "trainer.eval_every=1"],
        r"trainer\.early_stopping\.monitor='val_los': expected a metric of the evaluations: val_loss, val_acc "
        r"or loss",
    ),
    (
        ["trainer.checkpoint_monitor=ema_val_loss", "trainer.keep_best=1"],  # no trainer.ema_decay: no average
        r"trainer\.checkpoint_monitor='ema_val_loss': expected a metric of the evaluations: val_loss, val_acc "
        r"or loss",
    ),
    # A policy alone turns activation checkpointing on, so the classes it names are checked.
    (
        ["trainer.activation_checkpointing_policy=[Block]"],
        r"trainer\.activation_checkpointing_policy=\['Block'\]: expected the model's classes \(none is Block; "
        r"it has Linear, MLP, ReLU, Sequential\)",
    ),
    # Settings that would do nothing, or contradict another.
    (
        ["trainer.activation_checkpointing=blocks", "trainer.activation_checkpointing_k=3"],
        r"trainer\.activation_checkpointing_k=3: expected it unset with trainer\.activation_checkpointing=blocks "
        r"\(k picks every k-th block under every_k\)",
    ),
    (
        ["world=local2", "world.on_rank_loss=shrink", "world.respawn=true", "world.max_respawns=0"],
        r"world\.max_respawns=0: expected an integer >= 1 with world\.respawn=true \(0 starts no rank again: "
        r"set world\.respawn=false\)",
    ),
    (
        ["world.on_rank_loss=shrink", "world.respawn=true"],
        r"world\.respawn=True: expected false on one process \(a lost rank leaves no world to rejoin; "
        r"world=local2 or more\)",
    ),
    (
        ["trainer.max_time=00:99:00"],
        r"trainer\.max_time='00:99:00': expected seconds >= 0 or DD:HH:MM:SS \(e\.g\. 00:12:00:00 for 12 hours\); "
        r"its minutes field is 99, not below 60",
    ),
    (
        ["trainer.checkpoint_async=true"],
        r"trainer\.checkpoint_async=true: expected auto or false with trainer\.checkpoint_format=whole \(.*\)",
    ),
    # Refusals that say why, in the config's words.
    (["trainer.loggers=csv"], r"trainer\.loggers=csv: expected a list in brackets \(trainer\.loggers=\[csv\]\)"),
    (
        ["world=local4", "world.hierarchical=true", "world.node_size=2", "trainer.zero_stage=2", "hooks=powersgd"],
        r"hooks 'powersgd' need the whole reduced bucket, which hybrid sharding \(world\.hierarchical=true with a "
        r"ZeRO stage\) splits over each node; expected hooks allreduce, fp16, bf16, topk, int8, lowbit, noop",
    ),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every case at once, each forked from the preloaded server (tests/_recipe.py) in a directory of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    runs = []
    for overrides, _ in CASES:
        cwd = tmp_path_factory.mktemp("cwd")
        command = [sys.executable, str(ROOT / "recipes" / "train.py"), *overrides, *TINY]
        runs.append((cwd, _recipe.start(command, env=env, cwd=cwd)))
    return [(cwd, started.result(timeout=300)) for cwd, started in runs]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[" ".join(o) for o, _ in CASES])
def test_a_setting_is_refused_before_the_run_in_one_line_saying_why(refused, case):
    cwd, proc = refused[case]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and re.fullmatch(f"error: {CASES[case][1]}", lines[0]), lines
    assert not proc.stdout.strip()  # refused before the run announced itself
    assert not list(cwd.glob("outputs/*/*")), sorted(map(str, cwd.rglob("*")))


def test_a_policy_alone_turns_activation_checkpointing_on():
    """As Lightning's ``activation_checkpointing_policy`` does: with the mode left at none, the classes it names
    are checkpointed (they were ignored)."""
    net = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(3)])
    chosen = remat.from_config("none", ["Linear"], None, net)
    assert chosen == [block[0] for block in net]
    assert remat.from_config("none", [], None, net) == []


def test_a_low_bit_hook_inside_a_chain_is_refused_by_its_place_in_the_chain():
    """The block a chain's lowbit hook takes is checked against the plan as a lone one's is, named by its key."""
    from fdp.plan import pack_into_buckets
    from fdp.run.build import check_plan_settings
    from fdp.run.config.compose import compose

    plan = pack_into_buckets([("w", (3,), "float32", "cpu")])
    cfg = compose("hooks=fp16_powersgd", "hooks.chain=[fp16_compress,{name:lowbit,block:8},fp16_decompress]")
    with pytest.raises(ConfigError, match=r"^hooks\.chain\[1\]\.block=8: expected at most 3, the entries of"):
        check_plan_settings(cfg, plan, ["w"])


def test_a_refusal_after_a_kept_checkpoint_is_written_to_train_log(tmp_path):
    """A run refused once it trained and saved keeps what it made; its train.log then says why it ended."""
    with pytest.raises(ConfigError):
        with own_run_dir(tmp_path):
            (tmp_path / "checkpoints").mkdir()
            (tmp_path / "checkpoints" / "step_00000002.pt").write_bytes(b"saved")
            raise ConfigError("trainer.checkpoint_monitor='x': expected a metric of the evaluations: test_loss")
    log = (tmp_path / TRAIN_LOG).read_text().splitlines()
    assert log[-1].endswith(" error: trainer.checkpoint_monitor='x': expected a metric of the evaluations: test_loss")
