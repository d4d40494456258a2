"""The run config for a list of overrides, as ``recipes/train.py`` composes it: from Python, a notebook or a test.

Hydra composes each choice of config groups once a process (``_composed_groups``); the ``key=value`` settings are
applied to a copy as Hydra applies them. The schemas the config files extend are ``fdp.run.config``'s.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fdp.run.config.schema import SCHEMAS, register_configs

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
_GROUPS = frozenset({*SCHEMAS, "trainer"})  # the config groups of conf/ (trainer: its one file, default)


def compose(*overrides: str, config_dir: str | Path = CONF_DIR) -> DictConfig:
    """The run config for ``overrides``, as ``recipes/train.py`` would see it (from Python or a notebook).

    Hydra composes the choice of config groups (``model=charlm``) once a process; each call applies its
    ``key=value`` settings to a copy as Hydra applies them (``OmegaConf.update`` with merging, on the struct
    config), so a test or notebook composing hundreds of configs pays Hydra's start once per choice of groups
    (a compose is most of a short in-process run's time). Anything else (``+key``, ``~key``, a sweep, a
    ``hydra.`` key) and any setting Hydra would refuse go through Hydra whole: its errors are its own.

    >>> cfg = compose("model=convnet", "trainer.max_steps=50")
    >>> cfg.model.name, cfg.trainer.max_steps
    ('convnet', 50)
    """
    split = _groups_and_settings(overrides)
    if split is not None:
        groups, settings = split
        cfg = copy.deepcopy(_composed_groups(groups, str(config_dir)))
        try:
            for key, value in settings:
                OmegaConf.update(cfg, key, value, merge=True)
            return cfg
        except Exception:  # noqa: BLE001 - Hydra composes it again and says what is wrong, in its words
            pass
    return _hydra_compose(overrides, str(config_dir))


def _hydra_compose(overrides: tuple[str, ...] | list[str], config_dir: str) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose("config", overrides=list(overrides))


@functools.lru_cache(maxsize=64)
def _composed_groups(groups: tuple[str, ...], config_dir: str) -> DictConfig:
    """The config of a choice of config groups (read-only: ``compose`` copies it)."""
    return _hydra_compose(groups, config_dir)


def _groups_and_settings(overrides) -> tuple[tuple[str, ...], list[tuple[str, Any]]] | None:
    """``overrides`` as the group choices (in order) and the ``(key, value)`` settings Hydra would apply after
    them, values parsed by Hydra's own grammar; ``None`` where one is not a plain group choice or setting."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - Hydra says what it cannot parse
        return None
    groups, settings = [], []
    for override, line in zip(parsed, overrides):
        plain = not (override.is_add() or override.is_force_add() or override.is_delete() or override.package)
        if not plain or override.is_sweep_override() or override.key_or_group.startswith("hydra"):
            return None
        if override.key_or_group in _GROUPS:
            groups.append(line)
        else:
            settings.append((override.key_or_group, override.value()))
    return tuple(groups), settings
