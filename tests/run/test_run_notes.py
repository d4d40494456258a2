"""What a run says at its end and on its way: a summary that says it stopped early, no torch note on what
fdp asked for (fdp.run.trainer, fdp.run.checkpoint)."""

from __future__ import annotations

import warnings

from fdp.run.checkpoint.consolidate import consolidate
from fdp.run.config.compose import compose
from fdp.run.trainer import run

SMALL = ["model.hidden=16", "trainer.progress=false", "data.global_batch_size=32", "trainer.eval_batches=1"]


def test_a_run_ended_by_stop_at_says_so_in_its_summary(tmp_path):
    summary = run(compose(*SMALL, "trainer.max_steps=4", "trainer.stop_at=2"), tmp_path)
    assert summary["steps"] == 2 and summary["stopped"] == "stop_at", summary
    resumed = run(compose(*SMALL, "trainer.max_steps=4", "trainer.resume=true"), tmp_path)
    assert resumed["steps"] == 4 and "stopped" not in resumed  # ran to its last step


def test_one_process_sharded_saves_loads_and_consolidation_do_not_warn_that_torch_distributed_is_disabled(tmp_path):
    """One process writes and reads DCP's format without a process group, as fdp asks (no_dist): torch's note
    saying so is not the user's concern."""
    sharded = [*SMALL, "trainer.checkpoint_format=sharded"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(compose(*sharded, "trainer.max_steps=2", "trainer.checkpoint_every=1"), tmp_path)  # written by a thread
        run(compose(*sharded, "trainer.max_steps=3", "trainer.resume=true", "trainer.checkpoint_async=false"), tmp_path)
        whole = consolidate(tmp_path)
    assert whole["step"] == 3
    assert not [str(w.message) for w in caught if "torch.distributed is disabled" in str(w.message)]
