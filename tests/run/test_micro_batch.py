"""``trainer.accum_steps=auto`` (fdp.run.memory.micro_batch): the largest micro-batch the forecast fits in the
budget, halved when a step runs out of memory anyway; the run equals runs with each micro-batch it ran at
fixed, bit for bit.

The runs are an MLP whose forward keeps 32 MiB of activations per 512 samples (a hidden layer of 16384), one
rank's share of 512 samples, on a local world (its ranks are this process's workers: their budgets are not this
process's). A budget is lowered mid-run by a callback on the CPU's limit (``RLIMIT_DATA``, what
``world.memory_per_rank_mb`` sets), as when other processes take a machine's memory meanwhile.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _saved import same, trained_state

from fdp.comm import Comm
from fdp.run.build import build_run
from fdp.run.config.compose import compose
from fdp.run.memory import forecast
from fdp.run.memory.micro_batch import accum_options, first_accum, halved
from fdp.run.memory.run_forecast import activations_of, run_forecasts
from fdp.run.trainer import run

SHARE = 512
COMMON = (
    "model=mlp",
    "model.hidden=16384",
    "model.depth=1",
    "optim=sgd",
    "optim.momentum=0.9",
    f"data.global_batch_size={SHARE}",
    "trainer.max_steps=3",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "trainer.progress=false",
)


def _lowers(rank: int, mib: float) -> str:
    return f"trainer.callbacks=[{{_target_: _loop_callbacks.LowersBudget, at: 1, rank: {rank}, mib: {mib}}}]"


def _fixed_runs(tmp: Path, chosen: list[dict], ranks: int) -> dict:
    """The state of runs with each micro-batch ``chosen`` fixed from the step it was chosen at: one run to the
    next choice's step (``trainer.stop_at``), resumed with the next micro-batch (no budget: nothing runs out)."""
    world = ("world=local2", f"world.nproc_per_node={ranks}")
    segments = {}
    for record in chosen:  # the last choice made before a step is the one the step ran with
        segments[record["step"]] = record["accum_steps"]
    starts = sorted(segments)
    run_dir = tmp / "fixed"
    for i, first in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else 0
        more = [f"trainer.stop_at={stop}"] if stop else []
        run(
            compose(*COMMON, *world, f"trainer.accum_steps={segments[first]}", *more, f"trainer.resume={bool(i)}"),
            run_dir,
        )
    return trained_state(run_dir)


def _steps_logged(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if "loss" in row and "summary" not in row]


def test_the_micro_batch_choices():
    assert accum_options(12) == [1, 2, 3, 4, 6, 12]
    assert first_accum(512, lambda micro: micro <= 300) == 2  # 256 samples
    assert first_accum(12, lambda micro: False) == 12  # one sample each: the steps confirm it
    assert [halved(12, a) for a in (1, 2, 3, 4, 6, 12)] == [2, 4, 6, 12, 12, None]


def _forecast_peak(cfg):
    """The forecast's peak (MiB) of ``cfg`` on one rank at a micro-batch, without the part a rank adds whatever the
    model (the run measures it in the rank: its log line says the sum)."""
    parts = build_run(cfg, Comm())
    acts = activations_of(cfg, parts)
    return lambda m: max(f.peak for f in run_forecasts(cfg, parts, 1, 0.0, acts, micro=m)) / forecast.MiB


def test_auto_takes_the_largest_micro_batch_the_forecast_fits_and_equals_the_fixed_run(tmp_path):
    """A budget between the forecasts of 256 and 512 samples per forward: the run starts at 256, the largest
    divisor of its share the forecast fits (``fdp.run.memory.forecast.largest_micro_batch`` agrees, with the part the
    rank measured), and equals a run with that micro-batch fixed (and with any its first steps halved it to, fixed
    from their step), params and optimizer state to the bit."""
    peak = _forecast_peak(compose(*COMMON))
    budget = round((peak(256) + peak(512)) / 2 + 10, 1)
    world = ("world=local2", "world.nproc_per_node=1")
    auto = (*COMMON, *world, "trainer.accum_steps=auto", f"world.memory_per_rank_mb={budget}")
    summary = run(compose(*auto), tmp_path / "auto")
    chosen = summary["micro_batches"]
    assert chosen[0]["step"] == 0 and chosen[0]["micro_batch"] == 256, chosen
    said = re.fullmatch(rf"forecast peak (\d+) MiB of {budget:g} MiB", chosen[0]["why"])
    assert said, chosen[0]["why"]
    fixed = int(said[1]) - peak(256)  # what this rank adds whatever the model, as the run measured it
    largest = forecast.largest_micro_batch(lambda m: peak(m) + fixed <= budget + 0.5, SHARE)
    assert max(a for a in (SHARE // d for d in accum_options(SHARE)) if a <= largest) == 256
    assert all(c["micro_batch"] < 256 and "ran out of memory" in c["why"] for c in chosen[1:]), chosen
    assert _steps_logged(tmp_path / "auto") == [1, 2, 3]
    assert same(trained_state(tmp_path / "auto"), _fixed_runs(tmp_path, chosen, ranks=1))


def test_a_step_out_of_memory_mid_run_is_done_again_with_half_the_micro_batch(tmp_path):
    """After step 1 the rank's budget drops to what it holds plus 48 MiB: step 2 runs out of memory in forward and
    backward and is done again with half the micro-batch until it fits. No step is lost or done twice, and the run
    equals one at the first micro-batch to step 1 resumed at the last one: params and optimizer state to the bit."""
    world = ("world=local2", "world.nproc_per_node=1")
    auto = (*COMMON, *world, "trainer.accum_steps=auto", "world.memory_per_rank_mb=2000", _lowers(0, 48))
    summary = run(compose(*auto), tmp_path / "auto")
    chosen = summary["micro_batches"]
    assert (chosen[0]["step"], chosen[0]["accum_steps"], chosen[0]["micro_batch"]) == (0, 1, SHARE), chosen
    assert len(chosen) > 1 and all(c["step"] == 1 for c in chosen[1:]), chosen  # all at step 2, none later
    assert all("rank 0 ran out of memory in forward and backward" in c["why"] for c in chosen[1:]), chosen
    assert _steps_logged(tmp_path / "auto") == [1, 2, 3]
    assert same(trained_state(tmp_path / "auto"), _fixed_runs(tmp_path, chosen, ranks=1))


HUNGRY = (
    "model=custom",
    "model._target_=_loop_callbacks.Hungry",
    "optim=sgd",
    "optim.momentum=0.9",
    "data.global_batch_size=128",
    "trainer.max_steps=3",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "trainer.progress=false",
    "world=local2",
)


@pytest.mark.parametrize("stage", [0, 3])
def test_one_rank_out_of_memory_and_every_rank_does_the_step_again(tmp_path, stage):
    """2 gloo ranks, no budget (the whole share of 64 samples per forward); after step 1 rank 1's model asks for 1 TiB
    on more than 20 samples: at step 2 rank 1 alone runs out, rank 0 (its backward done, reductions in flight; at
    stage 3 waiting on a gather rank 1 never makes) learns it at the agreement or from the store, and both do the
    step again at 32, then 16 samples. The run equals one at 64 to step 1 resumed at 16, to the bit."""
    common = (*HUNGRY, f"trainer.zero_stage={stage}")
    squeeze = "trainer.callbacks=[{_target_: _loop_callbacks.Squeezes, at: 1, rank: 1, samples: 20}]"
    summary = run(compose(*common, "trainer.accum_steps=auto", squeeze), tmp_path / "auto")
    chosen = [(c["step"], c["micro_batch"]) for c in summary["micro_batches"]]
    assert chosen == [(0, 64), (1, 32), (1, 16)], summary["micro_batches"]
    assert all("rank 1 ran out of memory" in c["why"] for c in summary["micro_batches"][1:])
    assert _steps_logged(tmp_path / "auto") == [1, 2, 3]
    run(compose(*common, "trainer.accum_steps=1", "trainer.stop_at=1"), tmp_path / "fixed")
    run(compose(*common, "trainer.accum_steps=4", "trainer.resume=true"), tmp_path / "fixed")
    assert same(trained_state(tmp_path / "auto"), trained_state(tmp_path / "fixed"))


COMPOSED = {  # what trainer.accum_steps=auto composes with, each on a world of its own
    "activation_checkpointing": (
        "trainer.activation_checkpointing=blocks",
        "trainer.activation_checkpointing_policy=[Linear]",
    ),
    "diloco": ("outer=diloco", "outer.sync_every=2"),
    "local_sgd": ("outer=local_sgd", "outer.sync_every=2"),
    "hsdp": ("world=local4", "world.hierarchical=true", "world.node_size=2", "trainer.zero_stage=3"),
}


@pytest.mark.parametrize("name", list(COMPOSED))
def test_auto_composes_and_equals_the_run_at_the_micro_batch_it_took(tmp_path, name):
    """Rank 1's model takes at most 10 samples per forward from the first step (no budget: the whole share is
    tried first): step 1 runs out of memory there, every rank does it again with half, then a quarter of the share,
    and the run equals one with that micro-batch fixed from the start, params and optimizer state to the bit."""
    squeeze = "trainer.callbacks=[{_target_: _loop_callbacks.Squeezes, at: 0, rank: 1, samples: 10}]"
    settings = ("data.global_batch_size=64", *COMPOSED[name])
    keys = {o.split("=")[0] for o in settings}
    common = (*(o for o in HUNGRY if o.split("=")[0] not in keys), *settings)
    summary = run(compose(*common, "trainer.accum_steps=auto", squeeze), tmp_path / "auto")
    per_rank = 64 // summary["world"]
    chosen = [(c["step"], c["micro_batch"]) for c in summary["micro_batches"]]
    assert chosen[0] == (0, per_rank) and all(step == 0 for step, _ in chosen), summary["micro_batches"]
    assert chosen[-1][1] <= 10 < chosen[-2][1], chosen
    assert all("rank 1 ran out of memory" in c["why"] for c in summary["micro_batches"][1:])
    assert _steps_logged(tmp_path / "auto") == [1, 2, 3]
    run(compose(*common, f"trainer.accum_steps={per_rank // chosen[-1][1]}"), tmp_path / "fixed")
    assert same(trained_state(tmp_path / "auto"), trained_state(tmp_path / "fixed"))
