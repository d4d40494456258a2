"""The run loop through Hydra configs: world-size invariance and what a run writes."""

import json
import os
from pathlib import Path

import pytest
import torch
from _configs import quiet as make_cfg
from _paths import pythonpath_first
from _saved import saved

from fdp.run.config import register_configs
from fdp.run.trainer import run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
register_configs()

SMALL = {
    "mlp": ["model=mlp", "model.hidden=64"],
    "convnet": ["model=convnet", "model.width=8"],
    "charlm": [
        "model=charlm",
        "data=stdlib_text",
        "model.d_model=32",
        "model.n_layer=2",
        "model.n_head=2",
        "data.block_size=16",
        "data.max_chars=20000",
        "optim=adamw",
        "optim.warmup_steps=5",
    ],
    # examples/my_project: a user's own model and map-style datasets, read through a DataLoader.
    "custom": [
        "model=custom",
        "model._target_=my_project.models.Net",
        "+model.width=16",
        "+model.depth=2",
        "data=custom",
        "data._target_=my_project.data.make",
        "+data.n_train=300",
        "+data.n_test=64",
    ],
}


@pytest.fixture
def examples_on_path(monkeypatch):
    """examples/ importable here and in the workers, as ``PYTHONPATH=examples`` does from the shell."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", pythonpath_first(EXAMPLES))


def final_params(run_dir):
    return saved(Path(run_dir))["params"]


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("model", ["mlp", "charlm", "convnet", "custom"])
def test_two_ranks_train_like_one_process_on_the_union_batch(tmp_path, model, examples_on_path):
    """world=local2 ends with the params of world=single on the same global batches (20 steps).

    BatchNorm normalises over each rank's own share, so for the conv net the one-process
    reference sees the same shares as micro-batches (accum_steps=2): equal math, as in DDP.
    """
    steps = [
        "trainer.max_steps=20",
        "data.global_batch_size=16",
        "trainer.bucket_cap_mb=0.05",
        "trainer.first_bucket_cap_mb=0.01",
    ]
    reference = ["trainer.accum_steps=2"] if model == "convnet" else []
    summary_one = run(make_cfg(*SMALL[model], *steps, *reference), tmp_path / "single")
    summary_two = run(make_cfg(*SMALL[model], *steps, "world=local2"), tmp_path / "local2")
    assert summary_two["world"] == 2 and summary_one["world"] == 1
    assert max_diff(final_params(tmp_path / "single"), final_params(tmp_path / "local2")) <= 1e-5
    norms = [
        [
            line["grad_norm"]
            for line in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
            if "grad_norm" in line
        ]
        for run in ("single", "local2")
    ]
    assert len(norms[0]) == 2 and norms[1] == pytest.approx(norms[0], rel=1e-4)  # steps 10 and 20, as one process
    assert summary_two["bytes_per_step"] > 0 and summary_one["bytes_per_step"] == 0


def test_run_writes_metrics_summary_and_rank_logs(tmp_path):
    run(
        make_cfg(
            *SMALL["mlp"],
            "trainer.max_steps=6",
            "trainer.log_every=2",
            "world=local2",
            "trainer.eval_every=3",
            "trainer.trace=true",
        ),
        tmp_path,
    )
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in lines if "summary" not in record]
    assert [record["step"] for record in steps] == [2, 3, 4, 6]  # logged every 2 steps, evaluated every 3
    for key in ("loss", "lr", "grad_norm", "samples_per_s", "compute_ms", "comm_wait_ms", "bytes_sent"):
        assert all(key in record for record in steps), key
    assert [record["step"] for record in steps if "val_acc" in record] == [3, 6]
    assert [record["step"] for record in steps if "test_acc" in record] == [6]
    assert lines[-1]["summary"] and lines[-1]["steps"] == 6
    assert (tmp_path / "rank1.log").exists() and not (tmp_path / "rank0.log").exists()
    for rank in (0, 1):  # one timeline per rank
        trace = json.loads((tmp_path / "trace" / f"rank{rank}.json").read_text())
        assert sum(e["name"] == "optimizer" for e in trace["traceEvents"]) == 6


def test_custom_data_stopped_and_resumed_equals_an_uninterrupted_run(tmp_path, examples_on_path):
    """A run stopped at step 7 and resumed (with DataLoader worker processes this time) ends on the same bits."""
    steps = [*SMALL["custom"], "trainer.max_steps=15", "data.global_batch_size=32"]
    whole = run(make_cfg(*steps), tmp_path / "whole")
    run(make_cfg(*steps, "trainer.stop_at=7"), tmp_path / "parts")
    resumed = run(make_cfg(*steps, "trainer.resume=true", "data.num_workers=2"), tmp_path / "parts")
    a, b = final_params(tmp_path / "whole"), final_params(tmp_path / "parts")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["steps"] == whole["steps"] == 15 and resumed["model"] == "my_project.models.Net"
    assert 0.0 <= whole["test_acc"] <= 1.0 and whole["test_loss"] == resumed["test_loss"]


def test_loss_setting_picks_the_training_loss(tmp_path, examples_on_path):
    steps = [*SMALL["custom"], "trainer.max_steps=6"]
    run(make_cfg(*steps), tmp_path / "default")
    run(make_cfg(*steps, "loss=custom", "loss._target_=torch.nn.functional.cross_entropy"), tmp_path / "torch")
    run(make_cfg(*steps, "+loss.label_smoothing=0.3"), tmp_path / "smoothed")
    default, torch_ce, smoothed = (final_params(tmp_path / d) for d in ("default", "torch", "smoothed"))
    assert all(torch.equal(default[k], torch_ce[k]) for k in default)  # the same function, reached by its path
    assert max_diff(default, smoothed) > 1e-4
    # Regression: real-valued targets, mean squared error, no accuracy.
    summary = run(
        make_cfg(*steps, "loss=mse", "+data.target=radius", "optim.lr=0.01", "trainer.log_every=1"), tmp_path / "mse"
    )
    assert "test_acc" not in summary and summary["test_loss"] > 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "mse" / "metrics.jsonl").read_text().splitlines()[:-1]]
    assert losses[-1] < losses[0]


def _checkpoint(run_dir):
    return saved(Path(run_dir))


def test_own_hook_and_optimizer_from_config_resume_exactly_at_zero_stage_two(tmp_path, examples_on_path):
    """hooks=custom (a clipping stage with per-bucket counts, then allreduce; shardable) and optim=custom (Lion) on
    two ranks at ZeRO stage 2: stopped at step 5 and resumed, the params, optimizer and each rank's hook state are
    those of the uninterrupted run, bit for bit."""
    steps = [
        *SMALL["mlp"],
        "world=local2",
        "trainer.zero_stage=2",
        "trainer.max_steps=10",
        "trainer.checkpoint_every=5",
        "hooks=custom",
        "hooks._target_=my_project.hooks.clip_then_allreduce",
        "+hooks.max_norm=0.5",
        "optim=custom",
        "optim._target_=my_project.optim.lion",
        "optim.lr=1e-3",
        "+optim.b1=0.95",
        "optim.lr_schedule=wsd",
        "optim.decay_fraction=0.5",
    ]
    whole = run(make_cfg(*steps), tmp_path / "whole")
    run(make_cfg(*steps, "trainer.stop_at=5"), tmp_path / "parts")
    assert _checkpoint(tmp_path / "parts")["step"] == 5
    run(make_cfg(*steps, "trainer.resume=true"), tmp_path / "parts")
    a, b = _checkpoint(tmp_path / "whole"), _checkpoint(tmp_path / "parts")
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert all(torch.equal(x, y) for x, y in zip(a["opt_state"], b["opt_state"]) if isinstance(x, torch.Tensor))
    for rank in (0, 1):  # each bucket's (steps seen, steps clipped): a resumed count that restarted would read 5
        counts = [int(t) for t in b["ranks"][rank]["hook_state"]]
        assert counts == [int(t) for t in a["ranks"][rank]["hook_state"]]
        assert counts[0::2] == [10] * (len(counts) // 2) and 0 < sum(counts[1::2])
    assert whole["steps"] == 10


def _start_recipe(run_dir, *overrides):
    """``python recipes/train.py OVERRIDES`` into ``run_dir``, started forked from the preloaded server
    (tests/_recipe.py): ``result(timeout)`` waits for it."""
    import sys

    import _recipe as recipe

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [
        sys.executable,
        str(Path(__file__).resolve().parents[2] / "recipes" / "train.py"),
        "trainer.progress=false",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    return recipe.start(argv, env=env, cwd=Path.cwd())


def test_a_memory_budget_counts_what_the_run_adds_and_an_overrun_names_its_phase(tmp_path):
    """world.memory_per_rank_mb=300 and an MLP whose state takes ~110 MiB: the data loaded before the budget
    does not count, the final evaluation takes training's batch (8 samples, not 256 at once), and the run ends
    with its checkpoint and test metrics. A budget nothing fits is refused in one line naming the part that
    ran out and what to change (exit 2, no run directory left). Both forked from the preloaded server (the budget
    counts what a process adds once it is set, not what it imported before) and run side by side."""
    common = [
        "model.hidden=131072",
        "model.depth=1",
        "optim=sgd",
        "data.global_batch_size=8",
        "trainer.max_steps=2",
        "trainer.eval_every=0",
    ]
    fits = _start_recipe(tmp_path / "fits", *common, "world.memory_per_rank_mb=300")
    refused = _start_recipe(tmp_path / "refused", *common, "world.memory_per_rank_mb=1").result(240)
    done = fits.result(240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "test_acc=" in done.stdout and (tmp_path / "fits" / "checkpoints" / "step_00000002.pt").exists()
    assert refused.returncode == 2, refused.stderr[-3000:]
    (line,) = [text for text in refused.stderr.splitlines() if text.strip()]
    assert line.startswith("error: rank 0 ran out of memory building the model and its train state ("), line
    assert line.endswith(
        "); the run does not fit world.memory_per_rank_mb=1: expected more ranks, a higher "
        "trainer.zero_stage (now 0; 3 shards the params too) or a smaller model"
    ), line
    assert not (tmp_path / "refused").exists()


def test_evaluation_in_pieces_gives_the_whole_batches_result():
    from fdp import functionalize
    from fdp.data import load_digits
    from fdp.run.evaluate import evaluate

    torch.manual_seed(0)
    model, params, buffers = functionalize(
        torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    )
    whole = evaluate(model, params, buffers, load_digits(), max_batches=2)
    assert evaluate(model, params, buffers, load_digits(), max_batches=2, fits=7) == pytest.approx(whole, rel=1e-6)


def test_out_of_memory_lines_name_the_phase_and_what_to_change():
    from fdp.procs.budget import MemoryPhase
    from fdp.run.memory.out_of_memory import out_of_memory_message

    common = ["world.memory_per_rank_mb=500", "data.global_batch_size=64", "trainer.accum_steps=2"]
    cfg = make_cfg(*common, "trainer.checkpoint_format=whole")
    phase = MemoryPhase()
    expected = {
        "data": "loading the data (MemoryError); the run does not fit world.memory_per_rank_mb=500: expected more "
        "free memory or a smaller data set (loading it is not counted in world.memory_per_rank_mb)",
        "step": "at step 7 (MemoryError); the run does not fit world.memory_per_rank_mb=500: expected a smaller "
        "batch per forward (now 16 samples: data.global_batch_size=64 over 2 ranks and trainer.accum_steps=2), "
        "trainer.activation_checkpointing=blocks, a higher trainer.zero_stage or a smaller model",
        "evaluation": "evaluating after step 7 (MemoryError); the run does not fit world.memory_per_rank_mb=500: "
        "expected a smaller batch per forward (evaluation takes training's, 16 samples: "
        "data.global_batch_size=64 over 2 ranks and trainer.accum_steps=2) or a smaller model",
        "save": "saving the checkpoint of step 7 (MemoryError); the run does not fit world.memory_per_rank_mb=500: "
        "expected a larger budget, or trainer.checkpoint_format=sharded: rank 0 holds the whole state while it "
        "writes it (trainer.zero_stage=0)",
    }
    for name, text in expected.items():
        with pytest.raises(MemoryError):
            with phase(name, 7):
                raise MemoryError
        assert out_of_memory_message(cfg, 1, 2, phase, MemoryError()) == f"rank 1 ran out of memory {text}"
    # A sharded save: what an asynchronous one stages, or what a synchronous one holds.
    for asynchronous, hint in (
        ("true", "trainer.checkpoint_async=false: an asynchronous save stages a copy of this rank's state"),
        ("false", "a larger budget, or more ranks: each rank writes its own share, copying each piece"),
    ):
        sharded = make_cfg("trainer.checkpoint_format=sharded", f"trainer.checkpoint_async={asynchronous}")
        assert hint in out_of_memory_message(sharded, 1, 2, phase, MemoryError())
    # The default format is sharded on two ranks (asynchronous) and whole on one.
    assert "trainer.checkpoint_async=false" in out_of_memory_message(make_cfg(*common), 1, 2, phase, MemoryError())
    assert "rank 0 holds the whole state" in out_of_memory_message(make_cfg(*common), 0, 1, phase, MemoryError())


# The asynchronous write of a sharded save runs out in its own thread: rank 0 pickles the checkpoint's meta (here a
# 64 MiB text, made before the budget), which takes more than the budget has left once the pieces are staged.
_LATE_PROBE = """
import re, resource, tempfile, torch
from fdp import cross_entropy_loss, functionalize, plan_buckets, planner_loss, sgd
from fdp.comm import Comm
from fdp.procs.allocator import budget_accounting
from fdp.run.checkpoint.sharded import ShardedSaver
from fdp.update import zero

model, params, buffers = functionalize(torch.nn.Linear(4, 3))
batch = (torch.randn(8, 4), torch.randint(3, (8,)))
plan = plan_buckets(planner_loss(cross_entropy_loss(model), buffers), params, batch)
update = zero.update_for(0, sgd(0.1), plan, Comm())
state = update.first_state(params, buffers, None, Comm())
saver, text = ShardedSaver(Comm()), "x" * (64 << 20)
held = int(re.search(r"VmData:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_DATA, (held + (24 << 20), resource.RLIM_INFINITY))
budget_accounting()
saver.save(tempfile.mkdtemp(), state._replace(step=3), update, plan, extra={"note": text})
try:
    saver.wait()
except MemoryError as error:
    print(type(error).__name__, error.phase, error.step, error)
"""


def test_an_asynchronous_write_that_runs_out_of_memory_is_the_saves_out_of_memory_line():
    """Found where the loop waits for it (the next save, the run's end: another phase), it names the save that ran
    out and its step, not an empty "the asynchronous checkpoint write failed:"."""
    import subprocess
    import sys

    from fdp.procs.budget import LateOutOfMemory, MemoryPhase
    from fdp.run.memory.out_of_memory import out_of_memory_message

    env = {**os.environ, "PYTHONPATH": pythonpath_first()}
    out = subprocess.run([sys.executable, "-c", _LATE_PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert out.stdout.split()[:3] == ["LateOutOfMemory", "save", "3"], out.stdout + out.stderr[-2000:]
    assert "the asynchronous checkpoint write: MemoryError" in out.stdout, out.stdout
    phase = MemoryPhase()
    with pytest.raises(MemoryError), phase("evaluation", 4):
        raise MemoryError
    late = LateOutOfMemory("save", 3, "the asynchronous checkpoint write", MemoryError())
    cfg = make_cfg("world.memory_per_rank_mb=500", "trainer.checkpoint_format=sharded")
    assert out_of_memory_message(cfg, 0, 2, phase, late) == (
        "rank 0 ran out of memory saving the checkpoint of step 3 (the asynchronous checkpoint write: MemoryError); "
        "the run does not fit world.memory_per_rank_mb=500: expected a larger budget, or "
        "trainer.checkpoint_async=false: an asynchronous save stages a copy of this rank's state on the CPU while it "
        "is written"
    )


def test_a_whole_checkpoint_resumed_under_too_small_a_budget_is_the_resumes_out_of_memory_line(tmp_path):
    """Rank 0 sends a whole-file checkpoint to every rank pickled: under a budget the run fits (the MLP's 19 MiB of
    params under Adam) but the pickled state does not, torch's save into its buffer fails as "I/O operation on closed
    file" while it handles the out-of-memory; the line names the resume and what to change."""
    common = (
        "model=mlp",
        "model.hidden=65536",
        "model.depth=1",
        "optim=adam",
        "data.global_batch_size=64",
        "trainer.max_steps=2",
        "trainer.eval_every=0",
        "world=local2",
        "trainer.checkpoint_format=whole",
    )
    run(make_cfg(*common, "trainer.stop_at=1"), tmp_path)
    from fdp.procs.launch import WorkerFailedError

    with pytest.raises(WorkerFailedError) as failed:
        run(make_cfg(*common, "trainer.resume=true", "world.memory_per_rank_mb=150"), tmp_path)
    assert str(failed.value).startswith(
        "rank 0 ran out of memory resuming from its checkpoint (MemoryError); the run does not fit "
        "world.memory_per_rank_mb=150: expected a larger budget, or a checkpoint saved with "
        "trainer.checkpoint_format=sharded"
    ), str(failed.value)
