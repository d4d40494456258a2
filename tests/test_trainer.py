"""The run loop through Hydra configs: world-size invariance and what a run writes."""
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from fdp.config import register_configs
from fdp.trainer import run

CONF = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()

SMALL = {
    "mlp": ["model=mlp", "model.hidden=64"],
    "convnet": ["model=convnet", "model.width=8"],
    "charlm": ["model=charlm", "data=stdlib_text", "model.d_model=32", "model.n_layer=2", "model.n_head=2",
               "data.block_size=16", "data.max_chars=20000", "optim=adamw", "optim.warmup_steps=5"],
}


def make_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=["trainer.progress=false", "trainer.eval_every=0", *overrides])


def final_params(run_dir):
    return torch.load(Path(run_dir) / "checkpoints" / "last.pt", weights_only=True)["params"]


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("model", ["mlp", "charlm", "convnet"])
def test_two_ranks_train_like_one_process_on_the_union_batch(tmp_path, model):
    """world=local2 ends with the params of world=single on the same global batches (20 steps).

    BatchNorm normalises over each rank's own shard, so for the conv net the one-process
    reference sees the same shards as micro-batches (accum_steps=2): equal math, as in DDP.
    """
    steps = ["trainer.max_steps=20", "data.global_batch_size=16", "trainer.bucket_cap_mb=0.05", "trainer.first_bucket_cap_mb=0.01"]
    reference = ["trainer.accum_steps=2"] if model == "convnet" else []
    summary_one = run(make_cfg(*SMALL[model], *steps, *reference), tmp_path / "single")
    summary_two = run(make_cfg(*SMALL[model], *steps, "world=local2"), tmp_path / "local2")
    assert summary_two["world"] == 2 and summary_one["world"] == 1
    assert max_diff(final_params(tmp_path / "single"), final_params(tmp_path / "local2")) <= 1e-5
    assert summary_two["bytes_per_step"] > 0 and summary_one["bytes_per_step"] == 0


def test_run_writes_metrics_summary_and_rank_logs(tmp_path):
    run(make_cfg(*SMALL["mlp"], "trainer.max_steps=6", "trainer.log_every=2", "world=local2", "trainer.eval_every=3",
                 "trainer.trace=true"), tmp_path)
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if "summary" not in l]
    assert [l["step"] for l in steps] == [2, 4, 6]
    for key in ("loss", "lr", "samples_per_s", "compute_ms", "comm_wait_ms", "bytes_sent"):
        assert all(key in l for l in steps), key
    assert "test_acc" in steps[-1]
    assert lines[-1]["summary"] and lines[-1]["steps"] == 6
    assert (tmp_path / "rank1.log").exists() and not (tmp_path / "rank0.log").exists()
    for rank in (0, 1):  # one timeline per rank
        trace = json.loads((tmp_path / "trace" / f"rank{rank}.json").read_text())
        assert sum(e["name"] == "optimizer" for e in trace["traceEvents"]) == 6
