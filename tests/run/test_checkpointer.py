"""A run's checkpoints have one owner (``fdp.run.checkpoint``): the component alone reads which format a world
writes and branches on it; the loop and the trainer save, resume, wait and prune through ``Checkpointer``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import fdp
from fdp import Comm, cross_entropy_loss, functionalize, plan_buckets, planner_loss, sgd
from fdp.errors import ConfigError
from fdp.run.checkpoint import Checkpointer, CheckpointFormat, format_of, resume, saved_steps
from fdp.run.config.compose import compose
from fdp.update import zero

PACKAGE = Path(fdp.__file__).parent
COMPONENT = PACKAGE / "run" / "checkpoint"
SETTINGS = {"checkpoint_format", "checkpoint_async", "keep_checkpoints"}
# What only the owner may name: a format's own writer and reader, and the test of which format a checkpoint is.
BRANCHES = {"is_sharded", "ShardedSaver", "load_sharded", "save_checkpoint", "load_checkpoint", "resolved_format"}


def _named(path: Path, names: set[str]) -> list[int]:
    """The lines of ``path`` that name one of ``names`` (an attribute, a name, or an imported name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in names or isinstance(node, ast.Name) and node.id in names:
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(alias.name in names for alias in node.names):
            found.append(node.lineno)
    return found


def _outside(names: set[str]) -> dict[str, list[int]]:
    """Modules that could import the component (the run package, and the modules of the layer above it: the
    ``fdp.checkpoint`` command) but lie outside it, naming one of ``names``, with the lines."""
    return {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in sorted([*(PACKAGE / "run").rglob("*.py"), PACKAGE / "checkpoint.py"])
        if COMPONENT not in path.parents and (lines := _named(path, names))
    }


def test_no_module_outside_the_checkpoint_component_reads_its_settings():
    # The schema declares them.
    readers = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if COMPONENT not in path.parents and path != PACKAGE / "run" / "config.py"
        if (
            lines := [
                node.lineno
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Attribute) and node.attr in SETTINGS
            ]
        )
    }
    assert readers == {}


def test_no_module_outside_the_checkpoint_component_branches_on_a_format():
    # (fdp/__init__.py makes the formats' own functions public names; fdp.update.zero's is_sharded is a state's.)
    assert _outside(BRANCHES) == {}


def _setup():
    model, params, buffers = functionalize(torch.nn.Linear(4, 3))
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    plan = plan_buckets(planner_loss(cross_entropy_loss(model), buffers), params, batch)
    update = zero.update_for(0, sgd(0.1, momentum=0.9), plan, Comm())
    return update, plan, lambda: update.first_state(params, buffers, None, Comm())


@pytest.mark.parametrize("kind", ["whole", "sharded"])
def test_the_owner_saves_keeps_the_last_and_resumes_either_format_into_the_built_state(kind, tmp_path):
    update, plan, fresh = _setup()
    cfg = compose(f"trainer.checkpoint_format={kind}", "trainer.keep_checkpoints=2")
    checkpoints = Checkpointer(cfg, Comm())
    assert checkpoints.format.name == kind and checkpoints.format.asynchronous is (kind == "sharded")
    states = {}
    for step in (1, 2, 3):
        state = fresh()
        state = state._replace(step=step, params={n: p + step for n, p in state.params.items()})
        states[step] = state
        written = checkpoints.save(tmp_path, state, update, plan, {"note": step})
        assert written.name == f"step_{step:08d}" + (".pt" if kind == "whole" else "")  # sharded: being written
    checkpoints.wait()
    assert saved_steps(tmp_path) == [2, 3]
    resumed = resume(tmp_path, fresh(), update, plan, Comm())
    assert resumed.step == 3
    for name, p in states[3].params.items():
        assert torch.equal(resumed.params[name], p)


def test_the_format_is_read_once_and_refused_naming_its_key():
    assert format_of(compose().trainer, 4).name == "sharded" and format_of(compose().trainer, 1).name == "whole"
    with pytest.raises(ConfigError, match=r"^trainer.checkpoint_format='dcp': expected auto, whole or sharded$"):
        format_of(compose("trainer.checkpoint_format=dcp").trainer, 1)
    with pytest.raises(ConfigError, match=r"^trainer.checkpoint_async=true: expected auto or false with trainer.*\)$"):
        format_of(compose("trainer.checkpoint_format=whole", "trainer.checkpoint_async=true").trainer, 1)
    # auto says why it is whole here: one process (under torchrun known only to the ranks, the same words).
    with pytest.raises(ConfigError, match=r"=whole \(.*\) \(trainer.checkpoint_format=auto on one process\)$"):
        format_of(compose("trainer.checkpoint_async=true").trainer, 1)
    assert format_of(compose("trainer.checkpoint_async=true").trainer, None) == CheckpointFormat("auto", True)
