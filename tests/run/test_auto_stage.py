"""``trainer.zero_stage=auto`` (fdp.run.memory.auto_stage): the lowest ZeRO stage whose memory forecast fits the budget.

The run is an MLP of 4.2M params (16 MiB) in buckets of at most 2 MiB under Adam on 2 local ranks (their budgets are
not this process's), saved asynchronously at its end. Its forecast peaks over what a rank adds whatever the model
(``_peaks``): 90 MiB at stage 0 (its state and the gradients backward returns), 98 at stages 1 and 2 (the whole
params, gradients, gloo's buffers and the update), 53 at stage 3; the budgets lie half-way between two stages'
forecasts, over a fixed part of about 12 MiB.
"""

from __future__ import annotations

import json
import re

import pytest
from _saved import same, trained_state

from fdp.comm import Comm
from fdp.procs.launch import WorkerFailedError
from fdp.run.build import build_run
from fdp.run.config.compose import compose
from fdp.run.config.validate import allowed_stages
from fdp.run.memory import forecast
from fdp.run.memory.run_forecast import activations_of, run_forecasts
from fdp.run.trainer import run

COMMON = (
    "model=mlp",
    "model.hidden=1024",
    "model.depth=5",
    "trainer.bucket_cap_mb=2",
    "optim=adam",
    "data.global_batch_size=64",
    "trainer.max_steps=2",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "trainer.progress=false",
    "world=local2",
)
BUDGET = 88  # MiB per rank: over stage 3's forecast, under stage 2's
STAGE_0_BUDGET = 118  # MiB per rank: over stage 0's forecast


def _peaks(world: int) -> list[float]:
    """The forecast's peak (MiB) at each stage over ``world`` ranks, without what a rank adds whatever the model."""
    cfg = compose(*COMMON[:-1])
    parts = build_run(cfg, Comm())
    acts = activations_of(cfg, parts)
    per_rank = cfg.data.global_batch_size // world
    return [
        max(f.peak for f in run_forecasts(cfg, parts, world, 0.0, acts, stages=[s], micro=per_rank)) / forecast.MiB
        for s in range(4)
    ]


def test_the_stages_auto_may_take_are_those_the_other_settings_allow():
    assert allowed_stages(compose("trainer.zero_stage=auto")) == [0, 1, 2, 3]
    assert allowed_stages(compose("trainer.zero_stage=auto", "outer=diloco")) == [0]  # a flat world: one replica
    assert allowed_stages(compose("trainer.zero_stage=auto", "world=local2", "world.on_rank_loss=shrink")) == [0, 1]
    assert allowed_stages(compose("trainer.zero_stage=2")) == [2]


@pytest.fixture(scope="module")
def at_stage_3(tmp_path_factory):
    """The state of the run with trainer.zero_stage=3 set (no budget)."""
    run_dir = tmp_path_factory.mktemp("stage3")
    summary = run(compose(*COMMON, "trainer.zero_stage=3"), run_dir)
    assert "zero_stage" not in summary
    return trained_state(run_dir)


def test_auto_takes_the_lowest_stage_that_fits_and_equals_the_run_at_that_stage(tmp_path, at_stage_3):
    """Under a budget between the forecasts of stages 2 and 3 the run says so in one line at start, records the
    choice in its summary and metrics.jsonl, and trains as a run with trainer.zero_stage=3 set does, to the bit."""
    summary = run(compose(*COMMON, "trainer.zero_stage=auto", f"world.memory_per_rank_mb={BUDGET}"), tmp_path / "auto")
    chosen = summary["zero_stage"]
    assert chosen["stage"] == 3, chosen
    said = re.fullmatch(
        rf"forecast peak (\d+) MiB per rank of budget {BUDGET} MiB \(world.memory_per_rank_mb\); stage 2 needs (\d+)",
        chosen["why"],
    )
    assert said, chosen["why"]
    fits, needs = int(said[1]), int(said[2])
    assert fits <= BUDGET < needs
    peaks = _peaks(2)  # the same forecast in this process: the stages part by what they hold, not by the fixed part
    assert abs((needs - fits) - (peaks[2] - peaks[3])) <= 1.5, (fits, needs, peaks)
    records = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in records if r.get("zero_stage") is True] == [3]
    assert same(trained_state(tmp_path / "auto"), at_stage_3)


def test_a_resume_decides_again_and_reads_a_checkpoint_of_another_stage(tmp_path, at_stage_3):
    """Saved (sharded) at stage 0 after step 1, resumed under the budget: auto takes stage 3 and reads the
    checkpoint range by range into its slices, and ends where the run at stage 3 throughout does, to the bit."""
    saving = (*COMMON, "trainer.checkpoint_format=sharded")
    run(compose(*saving, "trainer.zero_stage=0", "trainer.stop_at=1"), tmp_path)
    summary = run(
        compose(*saving, "trainer.zero_stage=auto", f"world.memory_per_rank_mb={BUDGET}", "trainer.resume=true"),
        tmp_path,
    )
    assert summary["zero_stage"]["stage"] == 3 and summary["steps"] == 2, summary
    assert same(trained_state(tmp_path), at_stage_3)


def test_no_stage_that_fits_is_refused_before_training_naming_the_smallest_peak(tmp_path):
    with pytest.raises(WorkerFailedError) as refused:
        run(compose(*COMMON, "trainer.zero_stage=auto", "world.memory_per_rank_mb=40"), tmp_path / "refused")
    message = str(refused.value)
    assert refused.value.error_type == "RunDoesNotFit" and "\n" not in message, message
    said = re.match(
        r"trainer.zero_stage=auto: no stage fits the budget of 40 MiB per rank \(world.memory_per_rank_mb\) at 32 "
        r"samples per forward: the smallest forecast peak is (\d+) MiB \(stage 3\)",
        message,
    )
    assert said and int(said[1]) > 40, message
    assert not (tmp_path / "refused" / "checkpoints").exists() or not any(
        (tmp_path / "refused" / "checkpoints").iterdir()
    )


def test_under_a_budget_auto_takes_the_lowest_stage_that_fits_and_the_run_fits_its_asynchronous_save(tmp_path):
    """Under a budget over stage 0's forecast auto takes stage 0, and the run fits the budget to its end: the
    asynchronous save's staging copy of the rank's pieces, kept while the write and the last evaluation run
    (``fdp.run.memory.parts.piece_bytes``: what the save logs it staged). (Adam's update, stepped in place by the
    fused kernel, makes nothing at stage 0, where stage 1 gathers the whole params beside the old: on 2 ranks stage 0
    forecasts less than stage 1, and no budget fits stage 1 alone.)"""
    summary = run(
        compose(*COMMON, "trainer.zero_stage=auto", f"world.memory_per_rank_mb={STAGE_0_BUDGET}"), tmp_path / "auto"
    )
    chosen = summary["zero_stage"]
    assert chosen["stage"] == 0, chosen
    assert summary["peak_mib"] <= STAGE_0_BUDGET, summary
    cfg = compose(*COMMON, "trainer.zero_stage=0")
    parts = build_run(cfg, Comm())
    staged = run_forecasts(cfg, parts, 2, 0.0, activations_of(cfg, parts))[0].terms.staging / forecast.MiB
    logged = re.search(r"\(([\d.]+) MiB from rank 0 of 2\)", (tmp_path / "auto" / "train.log").read_text())
    assert logged and float(logged[1]) == round(staged, 1), (logged, staged)
