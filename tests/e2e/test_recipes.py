"""The shell entry points, run as a user runs them, and every config in conf/."""

import json
import os
import re
import sys
from pathlib import Path

import _recipe
import pytest
from _examples import train_example
from _recipe import recipe
from omegaconf import OmegaConf

from fdp.run.checkpoint import last_of
from fdp.run.config import SCHEMAS, register_configs
from fdp.run.config.compose import compose

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
register_configs()


def group_options():
    for group in ("model", "data", "loss", "optim", "hooks", "world", "trainer"):
        for path in sorted((CONF / group).glob("*.yaml")):
            yield group, path.stem


@pytest.mark.parametrize("group,option", list(group_options()))
def test_every_config_composes_against_its_schema(group, option):
    cfg = compose(f"{group}={option}")
    node = cfg[group]
    if group in SCHEMAS and group != "world":
        assert node.name in SCHEMAS[group]
    assert OmegaConf.to_container(cfg, resolve=True)


def test_default_recipe_trains_from_the_shell(tmp_path):
    proc = recipe("train.py", "trainer.max_steps=40", "trainer.eval_every=20", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("fdp: ")]
    assert len(summary) == 1 and "test_acc=" in summary[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["summary"] and records[-1]["test_acc"] > 0.8
    assert {"step", "loss", "lr", "samples_per_s", "data_wait_ms"} <= set(records[0])
    assert records[-1]["data_wait_ms"] >= 0  # the summary's: how long the steps waited for their batches
    assert last_of(tmp_path / "checkpoints").exists()
    # What the run printed is in Hydra's train.log too: the start-up line and the summary.
    log = (tmp_path / "train.log").read_text()
    startup = [line for line in proc.stdout.splitlines() if line.startswith("[rank0] mlp: ")]
    assert len(startup) == 1 and startup[0] in log and summary[0] in log


def test_plan_recipe_prints_a_table_and_fingerprint(tmp_path):
    out = tmp_path / "plan.json"
    proc = recipe(
        "plan.py",
        "model=charlm",
        "data=stdlib_text",
        "trainer.bucket_cap_mb=0.25",
        "world=local2",
        f"+plan_json={out}",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert re.fullmatch(
        r"model=charlm: [\d,]+ params in \d+ buckets, for world=local2 \(2 ranks\) at trainer\.zero_stage=0", lines[0]
    ), lines[0]
    assert lines[1].startswith("buckets in backward order") and "params" in lines[2]
    assert any(line.startswith("fingerprint: ") for line in lines)
    assert lines[lines.index("") - 1].startswith("fingerprint: ")  # then the forecast (tests/run/test_forecast.py)
    assert len(json.loads(out.read_text())["buckets"]) > 1


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["model=charlm"], "error: data='digits': expected stdlib_text for model=charlm"),
        (["trainer.bucket_cap_mb=0"], "error: trainer.bucket_cap_mb=0.0: expected a size in MiB > 0"),
        (["model=mlpp"], r"error: model=mlpp: expected one of charlm, convnet, custom, mlp (did you mean model=mlp?)"),
    ],
)
def test_plan_recipe_refuses_in_one_line_and_writes_no_directory(tmp_path, overrides, expected):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    # Forked from the preloaded server (tests/_recipe.py); test_plan_recipe_prints... starts plan.py fresh.
    proc = _recipe.run([sys.executable, str(ROOT / "recipes" / "plan.py"), *overrides], env=env, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == expected, proc.stderr[-3000:]
    assert not list(tmp_path.iterdir())  # Hydra's outputs/<date>/<time>/ neither


def test_the_example_project_trains_with_the_command_in_its_readme(tmp_path):
    """examples/README.md's command, as written, with a shorter run appended (later overrides win)."""
    line, records = train_example("my_project", tmp_path, "trainer.max_steps=60", "trainer.eval_every=30")
    assert "model=my_project.models.Net" in line
    assert records[-1]["steps"] == 60 and records[-1]["test_acc"] > 0.6  # chance: 1/3


def test_the_torchvision_example_trains_resnet18_on_two_processes_from_its_readme(tmp_path):
    """torchvision's resnet18 (BatchNorm, 11M parameters) on 16x16 digit images, 2 ranks: it learns and is evaluated."""
    line, records = train_example(
        "vision", tmp_path, "+data.size=16", "trainer.max_steps=8", "trainer.eval_every=0", "trainer.log_every=1"
    )
    assert "model=torchvision.models.resnet18 world=2" in line
    losses = [r["loss"] for r in records[:-1]]
    assert records[-1]["steps"] == 8 and losses[-1] < 0.7 * losses[0]
    assert 0.0 <= records[-1]["test_acc"] <= 1.0 and records[-1]["test_loss"] > 0
