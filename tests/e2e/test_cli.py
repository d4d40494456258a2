"""Mistakes Hydra catches, through the real shell entry: one ``error:`` line naming the key
and what was expected (the closest valid name for a misspelling), exit status 2, and no
run directory left behind (fdp.run.cli, fdp.run.rundir)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import _recipe
import pytest

from fdp.run.cli import hydra_error_line
from fdp.run.config.compose import compose

ROOT = Path(__file__).resolve().parents[2]
TINY = ["trainer.max_steps=2", "trainer.progress=false"]

# (overrides, the one line on stderr). Each runs from its own empty directory, with Hydra's
# default run directory (outputs/<date>/<time>/) unless the case names one.
CASES = [
    (
        ["hooks=powersdg"],
        r"error: hooks=powersdg: expected one of allreduce, batched_powersgd, bf16, custom, fp16, fp16_powersgd, "
        r"int8, lowbit, noop, powersgd, topk \(did you mean hooks=powersgd\?\)",
    ),
    (
        ["trainer.max_stpes=5"],
        r"error: trainer\.max_stpes=5: unknown key; expected a key of trainer \(did you mean "
        r"trainer\.max_steps\? trainer takes no keys of your own\)",
    ),
    # Keys of one's own only where they reach one's own objects: elsewhere Hydra would add them, and nothing read them.
    (
        ["+trainer.anything=1"],
        r"error: trainer\.anything: unknown key; expected a key of trainer \(max_steps, .*, progress; "
        r"trainer takes no keys of your own\)",
    ),
    (
        ["+world.devices_=2"],
        r"error: world\.devices_: unknown key; expected a key of world \(did you mean world\.devices\? "
        r"world takes no keys of your own\)",
    ),
    (
        ["trainer.devices=2"],
        r"error: trainer\.devices=2: unknown key; expected a key of trainer \(did you mean world\.devices\? "
        r"trainer takes no keys of your own\)",
    ),
    (["optim.lr=abc"], r"error: optim\.lr=abc: expected a number"),
    (
        ["trainer.resume=/some/file.pt"],
        r"error: trainer\.resume='/some/file\.pt': expected true, false or the path of a "
        r"checkpoint \(a step_<N>\.pt file, or a run directory for its last checkpoint\); "
        r"/some/file\.pt does not exist",
    ),
    (
        ["trainer.resume=5"],
        r"error: trainer\.resume=5: expected true, false or the path of a checkpoint \(a step_<N>\.pt "
        r"file, or a run directory for its last checkpoint\)",
    ),
    (["hooks=powersgd", "hooks.rank=four"], r"error: hooks\.rank=four: expected an integer"),
    (
        ["+trainer.max_steps=3"],
        r"error: \+trainer\.max_steps=3: expected a new key, but trainer\.max_steps exists "
        r"\(set it without the \+: trainer\.max_steps=3\)",
    ),
    (["trainer.max_steps=[1"], r"error: trainer\.max_steps=\[1: expected key=value in Hydra's override grammar \(.*\)"),
    (
        ["hydra.run.dir=/proc/x"],
        r"error: hydra\.run\.dir=/proc/x: expected a directory this process can create and write \(.*\)",
    ),
    # Refused by fdp once the run is built: the run directory Hydra made is removed again.
    (
        ["model=custom", "model._target_=torch.nn.Identity"],
        r"error: model\._target_='torch\.nn\.Identity': built a module without parameters \(Identity\); "
        r"expected a model with parameters to train",
    ),
    (["model.hidden=0"], r"error: model\.hidden=0: expected an integer >= 1"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every case at once, each from a directory of its own. The first from a fresh interpreter, as the shell
    starts it; the others forked from one that imported torch and fdp already (tests/_recipe.py): a refusal
    takes a moment once the imports are done, and they were most of each case's time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    runs = []
    for case, (overrides, _) in enumerate(CASES):
        cwd = tmp_path_factory.mktemp("cwd")
        command = [sys.executable, str(ROOT / "recipes" / "train.py"), *overrides, *TINY]
        runs.append((cwd, _recipe.start(command, env=env, cwd=cwd, fresh=case == 0)))
    return [(cwd, started.result(timeout=300)) for cwd, started in runs]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[" ".join(o) for o, _ in CASES])
def test_a_mistake_is_one_error_line_with_exit_status_2_and_no_run_directory(refused, case):
    overrides, expected = CASES[case]
    cwd, proc = refused[case]
    stdout, stderr = proc.stdout, proc.stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, stderr[-3000:]
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), lines
    assert "_schema" not in stderr and "HYDRA_FULL_ERROR" not in stderr
    assert not stdout.strip()
    assert not list(cwd.glob("outputs/*/*")), sorted(map(str, cwd.rglob("*")))


def test_hydra_full_error_still_gives_hydras_own_report(tmp_path):
    """Hydra's documented switch: with HYDRA_FULL_ERROR=1 the user gets the full trace."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    proc = _recipe.run([sys.executable, str(ROOT / "recipes" / "train.py"), "trainer.max_stpes=5"], env, tmp_path, 120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ConfigCompositionException" in proc.stderr


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["model.hiden=3"],
            "model.hiden=3: unknown key; expected a key of model (did you mean model.hidden? "
            "a key of your own is added as +model.hiden=3)",
        ),
        (
            ["foo=1"],
            "foo=1: unknown key; expected a key of the config (model, data, loss, optim, hooks, outer, world, trainer, "
            "seed)",
        ),
        (
            ["optim.warmup_step=3"],
            "optim.warmup_step=3: unknown key; expected a key of optim (did you mean optim.warmup_steps? "
            "optim takes no keys of your own)",
        ),
        (
            ["trainer.lr=3"],
            "trainer.lr=3: unknown key; expected a key of trainer (did you mean optim.lr? "
            "trainer takes no keys of your own)",
        ),
        (
            ["hooks=fp16_powersgd", "hooks.stages=[fp16]"],
            "hooks.stages=[fp16]: unknown key; expected a key of hooks (chain; hooks takes no keys of your own)",
        ),
        (["trainer=fast"], "trainer=fast: expected one of default"),
        (["trainer.progress=maybe"], "trainer.progress=maybe: expected true or false"),
        (["optim.clip_norm=x"], "optim.clip_norm=x: expected a number or null"),
    ],
)
def test_hydra_errors_translate_in_process(overrides, expected):
    with pytest.raises(Exception) as caught:
        compose(*overrides)
    assert hydra_error_line(caught.value, overrides) == expected


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            "+trainer.max_stpes=5",
            "trainer.max_stpes: unknown key; expected a key of trainer (did you mean trainer.max_steps? "
            "trainer takes no keys of your own)",
        ),
        (
            "+optim.b1=0.8",
            "optim.b1: unknown key; expected a key of optim (b1 is a key of optim=adam; optim takes no keys of your "
            "own)",
        ),
        (
            "+hooks.rank=2",
            "hooks.rank: unknown key; expected a key of hooks (rank is a key of hooks=powersgd; "
            "hooks takes no keys of your own)",
        ),
        (
            "+outer.sync=2",
            "outer.sync: unknown key; expected a key of outer (outer=none has none but its name; "
            "outer takes no keys of your own)",
        ),
        ("+seeds=1", "seeds: unknown key; expected a key of the config (did you mean seed?)"),
    ],
)
def test_a_key_of_ones_own_is_refused_where_nothing_reads_it(override, expected):
    from fdp.errors import ConfigError
    from fdp.run.config.validate import validate

    with pytest.raises(ConfigError) as caught:
        validate(compose(override))
    assert str(caught.value) == expected
    validate(compose("+model.unused=1", "+loss.label_smoothing=0.1"))  # these reach the user's (or fdp's) targets
