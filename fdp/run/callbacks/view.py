"""What a callback sees, read-only: the state and metrics with their mappings frozen and their lists made tuples
(``frozen``), and a write to one of their tensors told by its version counter, what autograd uses (``written``).

>>> seen = []
>>> shown = frozen({"w": torch.zeros(2)}, seen)
>>> shown["w"].add_(1) is not None, written(seen, {"state.params": shown})
(True, "state.params['w']")
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["frozen", "written"]


def frozen(tree: Any, seen: list) -> Any:
    """``tree`` with its mappings frozen and its lists made tuples; each tensor noted in ``seen`` with its
    version, to tell a write after the call."""
    if isinstance(tree, torch.Tensor):
        seen.append((tree, tree._version))
        return tree
    if isinstance(tree, (int, float, str, type(None))):
        return tree
    if isinstance(tree, dict):
        return MappingProxyType({k: frozen(v, seen) for k, v in tree.items()})
    if isinstance(tree, tuple):
        if hasattr(tree, "_fields"):  # a NamedTuple: its own type
            return type(tree)(*(frozen(v, seen) for v in tree))
        return tuple(frozen(v, seen) for v in tree)
    if isinstance(tree, (list, Mapping)):
        return frozen(dict(tree) if isinstance(tree, Mapping) else tuple(tree), seen)
    return tree


def _path_to(tree: Any, target: torch.Tensor, path: str) -> str | None:
    """Where ``target`` is in ``tree`` (``state.params['w']``), for the message; ``None`` if it is not."""
    if tree is target:
        return path
    if isinstance(tree, Mapping):
        items = ((f"{path}[{k!r}]", v) for k, v in tree.items())
    elif isinstance(tree, tuple) and hasattr(tree, "_fields"):
        items = ((f"{path}.{f}", v) for f, v in zip(tree._fields, tree))
    elif isinstance(tree, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(tree))
    else:
        return None
    return next((found for p, v in items if (found := _path_to(v, target, p)) is not None), None)


def written(seen: list, shown: dict[str, Any]) -> str | None:
    """Where a tensor noted in ``seen`` was written since (its version moved), among the ``shown`` trees."""
    tensor = next((t for t, version in seen if t._version != version), None)
    if tensor is None:
        return None
    return next((p for name, tree in shown.items() if (p := _path_to(tree, tensor, name)) is not None), "a tensor")
