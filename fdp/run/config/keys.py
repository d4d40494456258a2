"""Which keys a config node takes: its schema's, and keys of one's own only where they go to one's own objects.

Hydra adds any ``+group.key=value`` to a composed config, schema or not. A key of one's
own means something only where it becomes an argument of the user's object: the
``model``, ``data`` and ``loss`` targets (``+model.width=256``), and any node whose schema
names a ``_target_`` of its own. Everywhere else (``trainer``, ``world``, ``optim``,
``hooks``, ``outer``, the top level) an extra key would be saved and ignored, so
``check_keys`` refuses it with the closest name, in its own group or another one
(``trainer.devices``: did you mean ``world.devices``?).

>>> closest_key("trainer", "devices")
'world.devices'
>>> takes_own_keys("trainer", {}), takes_own_keys("model", {"name": "mlp"})
(False, True)
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from fdp.errors import ConfigError
from fdp.run.config.schema import SCHEMAS, Config, TrainerConfig, WorldConfig

__all__ = ["OWN_KEY_GROUPS", "check_keys", "closest_key", "schema_of", "takes_own_keys", "unknown_key_line"]

OWN_KEY_GROUPS = ("model", "data", "loss")  # their extra keys are arguments of the user's own target
_FIXED = {"trainer": TrainerConfig, "world": WorldConfig}


def schema_of(group: str, node: Mapping | None = None) -> Any:
    """The dataclass behind ``group``'s node (its option's, by ``name``); ``None`` when there is none.

    >>> schema_of("optim", {"name": "adamw"}).__name__
    'AdamWConfig'
    """
    if not group:
        return Config
    if group in _FIXED:
        return _FIXED[group]
    name = node.get("name") if isinstance(node, Mapping) else None
    return SCHEMAS.get(group, {}).get(name)


def _fields(schema: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []


def _group_fields(group: str, node: Mapping | None) -> list[str]:
    """The keys ``group``'s node takes; where its option is not known, those of any of its options."""
    schema = schema_of(group, node)
    if schema is not None or node is not None:
        return _fields(schema)
    return list(dict.fromkeys(k for option in SCHEMAS.get(group, {}).values() for k in _fields(option)))


def takes_own_keys(group: str, node: Mapping | None = None) -> bool:
    """Whether ``group``'s node passes keys beyond its schema's to an object of the user's own."""
    return group in OWN_KEY_GROUPS or "_target_" in _fields(schema_of(group, node))


def closest_key(group: str, key: str, nodes: Mapping | None = None) -> str | None:
    """The dotted key closest to ``group.key``: a near spelling in ``group``, else ``key`` (or near it) elsewhere.

    ``nodes`` (a whole config) picks the option schemas of the groups that have options.
    """
    nodes = nodes or {}
    own = _fields(schema_of(group, nodes.get(group)))
    close = difflib.get_close_matches(key, own, n=1, cutoff=0.6)
    if close:
        return f"{group}.{close[0]}" if group else close[0]
    others = [g for g in dict.fromkeys(("trainer", "world", *SCHEMAS)) if g != group]
    for cutoff in (1.0, 0.8):  # the same name elsewhere first, then a near one
        for other in others:
            found = difflib.get_close_matches(key, _group_fields(other, nodes.get(other)), n=1, cutoff=cutoff)
            if found and found[0] not in ("name", "_target_"):
                return f"{other}.{found[0]}"
    return None


def _option_with(group: str, key: str, node: Mapping | None) -> str | None:
    """Another option of ``group`` whose schema has ``key`` (``hooks.rank``: ``powersgd``)."""
    current = node.get("name") if isinstance(node, Mapping) else None
    options = SCHEMAS.get(group, {}).items()
    return next((name for name, schema in options if name != current and key in _fields(schema)), None)


def unknown_key_line(group: str, key: str, nodes: Mapping | None = None, shown: str | None = None) -> str:
    """The one line for an unknown ``group.key`` (``shown``: how the user wrote it, e.g. the override)."""
    full = f"{group}.{key}" if group else key
    shown = shown or full
    where = group or "the config"
    close = closest_key(group, key, nodes)
    node = (nodes or {}).get(group) if group else None
    known = [k for k in _fields(schema_of(group, node)) if k != "name"]
    option = _option_with(group, key, node) if not close else None
    if close:
        parts = [f"did you mean {close}?"]
    elif option:
        parts = [f"{key} is a key of {group}={option};"]
    elif known:
        parts = [", ".join(known) + ";"]
    else:
        named = isinstance(node, Mapping) and node.get("name")
        parts = [f"{group}={node.get('name')} has none but its name;"] if named else []
    if group and takes_own_keys(group, node):
        parts.append(f"a key of your own is added as +{shown.lstrip('+')}")
    elif group:
        parts.append(f"{group} takes no keys of your own")
    hint = " ".join(parts).rstrip(";")
    return f"{shown}: unknown key; expected a key of {where}" + (f" ({hint})" if hint else "")


def check_keys(cfg: Mapping) -> None:
    """Refuse, in one line, a key that no schema has where no object of the user's own takes it.

    >>> from fdp.run.config.compose import compose
    >>> check_keys(compose("+trainer.devices=2"))  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
        ...
    fdp.errors.ConfigError: trainer.devices: unknown key; expected a key of trainer
    (did you mean world.devices? trainer takes no keys of your own)
    """
    for key in cfg:
        if str(key) not in _fields(Config):
            raise ConfigError(unknown_key_line("", str(key), cfg))
    for group in cfg:
        node = cfg[group]
        if not isinstance(node, Mapping) or takes_own_keys(str(group), node):
            continue
        schema = schema_of(str(group), node)
        if schema is None:
            continue  # an option without a schema: its own registry names what it takes
        known = _fields(schema)
        for key in node:
            if str(key) not in known:
                raise ConfigError(unknown_key_line(str(group), str(key), cfg))
