"""What a lost rank does has one owner (``fdp.run.rank_loss``): no other module reads its settings."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fdp
from fdp.errors import ConfigError
from fdp.procs.launchers import launcher_of
from fdp.run.config.compose import compose
from fdp.run.rank_loss import Restart, ShrinkAndRespawn, ShrinkWorld, check_rank_loss, rank_loss_of

PACKAGE = Path(fdp.__file__).parent
SETTINGS = {"on_rank_loss", "respawn", "max_respawns", "respawn_delay_s"}
# The owner, and the schema that declares the settings.
OWNERS = {PACKAGE / "run" / "rank_loss.py", PACKAGE / "run" / "config.py"}


def _readers() -> dict[str, list[int]]:
    """Modules of fdp outside the owners that read a rank-loss setting (``x.on_rank_loss``), with the lines."""
    found: dict[str, list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in OWNERS:
            continue
        lines = [
            node.lineno
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in SETTINGS
        ]
        if lines:
            found[str(path.relative_to(PACKAGE.parent))] = lines
    return found


def test_no_module_outside_the_owner_reads_what_a_lost_rank_does():
    assert _readers() == {}


@pytest.mark.parametrize(
    "overrides, kind",
    [
        ((), Restart),
        (("world=local2", "world.on_rank_loss=shrink"), ShrinkWorld),
        (("world=local2", "world.on_rank_loss=shrink", "world.respawn=true"), ShrinkAndRespawn),
    ],
)
def test_each_setting_gives_its_rank_loss_and_only_a_shrinking_world_keeps_the_state_before(overrides, kind):
    loss = rank_loss_of(compose(*overrides).world)
    assert type(loss) is kind
    assert loss.keeps_before is (kind is not Restart)
    # Every step donates (a shrinking world keeps a copy of the state before), but an outer loop's in a shrinking world.
    assert loss.donates_state() is True
    assert loss.donates_state(outer_loop=True) is (kind is Restart)
    assert (loss.respawner() is not None) is (kind is ShrinkAndRespawn)
    assert loss.mirrors(shards_optimizer=True) is (kind is not Restart)
    assert loss.mirrors(shards_optimizer=True, hierarchical=True) is False


def test_a_rank_loss_setting_is_refused_by_its_owner_naming_the_key():
    with pytest.raises(ConfigError, match=r"^world.max_restarts=1: expected 0 with world.on_rank_loss=shrink"):
        check_rank_loss(compose("world.on_rank_loss=shrink", "world.max_restarts=1"), launcher_of("none"))
