"""``trainer.zero_stage=auto`` (fdp.run.auto_stage): the lowest ZeRO stage whose memory forecast fits the budget.

The run is an MLP of 4.9M params (19 MiB) under Adam on 2 local ranks (their budgets are not this process's).
"""

from __future__ import annotations

import re

import pytest

from fdp.procs.launch import WorkerFailedError
from fdp.run.config import compose
from fdp.run.trainer import run
from fdp.run.validate import allowed_stages

COMMON = (
    "model=mlp",
    "model.hidden=65536",
    "model.depth=1",
    "optim=adam",
    "data.global_batch_size=64",
    "trainer.max_steps=2",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "trainer.progress=false",
    "world=local2",
)


def test_the_stages_auto_may_take_are_those_the_other_settings_allow():
    assert allowed_stages(compose("trainer.zero_stage=auto")) == [0, 1, 2, 3]
    assert allowed_stages(compose("trainer.zero_stage=auto", "outer=diloco")) == [0]  # a flat world: one replica
    assert allowed_stages(compose("trainer.zero_stage=auto", "world=local2", "world.on_rank_loss=shrink")) == [0, 1]
    assert allowed_stages(compose("trainer.zero_stage=2")) == [2]


def test_no_stage_that_fits_is_refused_before_training_naming_the_smallest_peak(tmp_path):
    with pytest.raises(WorkerFailedError) as refused:
        run(compose(*COMMON, "trainer.zero_stage=auto", "world.memory_per_rank_mb=60"), tmp_path / "refused")
    message = str(refused.value)
    assert refused.value.error_type == "RunDoesNotFit" and "\n" not in message, message
    said = re.match(
        r"trainer.zero_stage=auto: no stage fits the budget of 60 MiB per rank \(world.memory_per_rank_mb\) at 32 "
        r"samples per forward: the smallest forecast peak is (\d+) MiB \(stage 3\)",
        message,
    )
    assert said and int(said[1]) > 60, message
    assert not (tmp_path / "refused" / "checkpoints").exists() or not any(
        (tmp_path / "refused" / "checkpoints").iterdir()
    )
