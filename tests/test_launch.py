"""Joining a world: a launched process is never silently a world of one."""
from __future__ import annotations

import pytest

from fdp.config import ConfigError, compose
from fdp.launch import WorldLayout, init_distributed
from fdp.trainer import layout_of


def test_launcher_none_under_a_launch_of_several_processes_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError) as error:
        init_distributed(WorldLayout(nproc_per_node=2))
    message = str(error.value)
    assert "\n" not in message
    assert "layout.launcher='none' makes a world of one" in message
    assert "rank 1 of WORLD_SIZE=2" in message and "WorldLayout('elastic'" in message


def test_launcher_none_alone_or_under_a_launch_of_one_is_a_world_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed(WorldLayout()).world_size == 1
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed(WorldLayout()).world_size == 1


def test_the_trainer_names_its_config_key_instead(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"^world=single: this process was started as one of WORLD_SIZE=4; expected world=torchrun$"):
        layout_of(compose("world=single"))
