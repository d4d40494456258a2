"""trainer.compile: auto's decision, the run's compile record and the compile cache kept across restarts."""

import os
import sys
from pathlib import Path

import _recipe
import pytest
from _configs import quiet as _cfg
from _paths import pythonpath_first

from fdp.errors import ConfigError
from fdp.run.config import register_configs
from fdp.run.config.validate import validate
from fdp.run.trainer import run
from fdp.step import compiled
from fdp.step.compiled import CompileChoice, CompileCosts, check_compile, costs_from, decide_compile

REPO = Path(__file__).resolve().parents[2]
register_configs()
KNOWN = CompileCosts(compile_s=25.0, saving_s=0.004, measured=False)


@pytest.mark.parametrize(
    "setting,device,steps,costs,missing,expected",
    [
        (True, "cpu", 1, KNOWN, None, True),  # an explicit setting is obeyed, short run or not
        (False, "cuda", 10**9, KNOWN, None, False),
        ("auto", "cpu", 10**9, KNOWN, None, False),  # never on the CPU
        ("auto", "cuda", 300, KNOWN, None, False),  # 1.2 s saved < 25 s compile
        ("auto", "cuda", 10_000, KNOWN, None, True),  # 40 s saved > 25 s
        ("auto", "cuda", 10_000, KNOWN, "no triton", False),
        (
            "auto",
            "cuda",
            300,
            CompileCosts(2.0, 0.01, measured=True),
            None,
            True,
        ),  # a warm cache: 2 s to compile, 3 s saved
    ],
)
def test_auto_compiles_on_a_gpu_when_the_planned_steps_repay_the_compile(
    setting, device, steps, costs, missing, expected
):
    decision, reason = decide_compile(setting, device, steps, costs, missing)
    assert decision is expected
    assert "\n" not in reason and reason
    if setting == "auto" and device == "cuda" and not missing:
        assert f"{steps} steps" in reason and ("measured" in reason) == costs.measured
    if missing:
        assert reason == "auto: no triton"


def test_costs_come_from_what_the_run_measured_else_the_known_defaults():
    known = costs_from({})
    assert known.compile_s == compiled.KNOWN_COMPILE_S and not known.measured
    assert known.saving_s == pytest.approx(compiled.KNOWN_GPU_STEP_S * compiled.KNOWN_SAVING)
    both = costs_from({"compile_s": 3.0, "step_s": {"eager": 0.05, "compiled": 0.02}})
    assert both.compile_s == 3.0 and both.saving_s == pytest.approx(0.03) and both.measured
    eager_only = costs_from({"step_s": {"eager": 0.1}})
    assert (
        eager_only.saving_s == pytest.approx(0.1 * compiled.KNOWN_SAVING)
        and eager_only.compile_s == compiled.KNOWN_COMPILE_S
    )
    assert costs_from({"step_s": {"eager": 0.01, "compiled": 0.02}}).saving_s == 0.0  # compiling made it slower


def test_the_record_keeps_each_mode_s_step_time_and_the_compile_time(tmp_path):
    first = compiled.write_record(tmp_path, CompileChoice(False, "", {}), first_step_s=0.3, step_s=0.05)
    second = compiled.write_record(tmp_path, CompileChoice(True, "", first), first_step_s=20.02, step_s=0.02)
    assert compiled.read_record(tmp_path) == second == {"step_s": {"eager": 0.05, "compiled": 0.02}, "compile_s": 20.0}
    (compiled.cache_dir(tmp_path) / compiled.COSTS_FILE).write_text("{not json")
    assert compiled.read_record(tmp_path) == {}


@pytest.mark.parametrize("value", ["yes", 1, "True"])
def test_compile_takes_auto_true_or_false_and_names_anything_else_in_one_line(value):
    with pytest.raises(ValueError) as error:
        check_compile(value)
    assert str(error.value) == f"compile={value!r}: expected auto, true or false"
    assert check_compile("auto") == "auto" and check_compile(False) is False
    with pytest.raises(ConfigError) as error:
        validate(_cfg("trainer.compile=yes"))
    assert str(error.value) == "trainer.compile='yes': expected auto, true or false"


def test_a_run_logs_its_choice_once_and_records_its_step_time(tmp_path, capsys):
    assert _cfg().trainer.compile == "auto"  # the default
    run(_cfg("model=mlp", "model.hidden=16", "trainer.max_steps=4"), tmp_path)
    lines = [line for line in capsys.readouterr().out.splitlines() if "trainer.compile" in line]
    assert lines == [
        "[rank0] trainer.compile=auto: not compiling the gradient computation "
        "(auto: not on cpu (compiling pays on a GPU, where the host's time per step shows))"
    ]
    record = compiled.read_record(tmp_path)
    assert set(record) == {"step_s"} and record["step_s"]["eager"] > 0


_COMPILE_ONCE = """
import sys, torch
from torch._dynamo.utils import counters
from fdp.step.compiled import choose, compile_grad
choice = choose(True, sys.argv[1], "cpu", planned_steps=1)
grad = compile_grad(torch.func.grad_and_value(lambda w, x: (x @ w).square().mean()))
grad(torch.ones(3, 2), torch.ones(4, 3))
print(choice.compile, counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""


def test_a_restarted_run_reads_its_compiled_graph_from_the_run_directory(tmp_path):
    """Two processes, as a run and its restart: the second finds the first's graph in <run dir>/compile_cache.
    Forked from the tests' preloaded server (tests/_recipe.py), which imported torch but compiled nothing: each
    starts with no compiled graph in memory, as a fresh interpreter does."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["PYTHONPATH"] = pythonpath_first(REPO)
    script = tmp_path / "compile_once.py"
    script.write_text(_COMPILE_ONCE)

    def compile_once():
        out = _recipe.run([sys.executable, str(script), str(tmp_path)], env=env, cwd=tmp_path, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    assert compile_once() == ["True", "0", "1"]  # compiled from scratch
    assert any((tmp_path / "compile_cache").rglob("*")), "nothing cached in the run directory"
    assert compile_once() == ["True", "1", "0"]  # the restart hits the cache


def _stage_three(rank, world, compile):
    """Three stage-3 steps (two micro-batches each) of a two-block char transformer on this rank's batches:
    ``(losses, whole params, log lines)``; compiled, the blocks run as compiled regions between the gathers."""
    import logging

    import torch

    from fdp import cross_entropy_loss, make_train_step, planner_loss
    from fdp.comm import Comm
    from fdp.model.builtin import CharTransformer
    from fdp.model.functional import functionalize
    from fdp.optim import sgd
    from fdp.plan import plan_buckets
    from fdp.update import zero

    torch.manual_seed(0)
    model, params, buffers = functionalize(
        CharTransformer(vocab_size=11, block_size=8, d_model=16, n_layer=2, n_head=2)
    )
    loss_fn = cross_entropy_loss(model)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        tokens = torch.randint(0, 11, (4 * world, 9), generator=g)[rank * 4 : (rank + 1) * 4]
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    cap = 60 * 4 / 2**20
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=cap * 8, first_bucket_cap_mb=cap
    )
    comm = Comm()
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("fdp").addHandler(handler)
    logging.getLogger("fdp").setLevel(logging.INFO)
    step = make_train_step(
        loss_fn, sgd(0.5, momentum=0.9), plan, comm=comm, accum_steps=2, zero_stage=3, model=model, compile=compile
    )
    state = zero.init_state(params, buffers, sgd(0.5, momentum=0.9), plan, comm, stage=3)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, zero.whole_params(state, plan, comm), len(plan), lines


def test_stage_three_compiles_its_blocks_between_the_gathers_and_equals_the_uncompiled_step(run_ranks):
    """2 gloo ranks: compiled stage 3 (each block a compiled region, the gathers and reduce-scatters outside)
    against uncompiled stage 3, on the same batches and the same several-bucket plan. SGD: Adam divides each
    gradient by its own scale, so where one is tiny the compiled kernels' other order of summing shows (1.3e-5
    after three steps of Adam at lr 1e-2)."""
    for eager, regions in zip(run_ranks(_stage_three, False), run_ranks(_stage_three, True)):
        assert eager[2] > 2  # buckets gathered one by one, not the whole model at once
        assert regions[0] == pytest.approx(eager[0], abs=1e-5)
        assert max((regions[1][n] - eager[1][n]).abs().max().item() for n in eager[1]) <= 1e-5
        assert any("compiling 2 regions" in line for line in regions[3]), regions[3]
