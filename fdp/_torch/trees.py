"""Pytrees: torch's private ``_pytree`` (the tree specs checkpoints were written with), the public one where
it is missing.

>>> tree_flatten({"a": torch.zeros(1), "b": (1, 2)})[0]
[tensor([0.]), 1, 2]
"""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401 - the example above uses it

# The private module is the one whose tree specs the checkpoints were written with; the
# public one (torch >= 2.6 on some builds) serves where it is missing.
try:
    from torch.utils import _pytree as _pytree_impl
except ImportError:  # pragma: no cover - a torch without the private module
    from torch.utils import pytree as _pytree_impl  # type: ignore[no-redef]

tree_flatten = _pytree_impl.tree_flatten
tree_unflatten = _pytree_impl.tree_unflatten
tree_map = _pytree_impl.tree_map


def tree_paths(tree: Any) -> list[str]:
    """Each leaf's path in ``tree`` as text (``[1].mu['fc.weight']``), in ``tree_flatten``'s order.

    >>> tree_paths(({"b": 1, "a": 2}, 3))
    ["[0]['b']", "[0]['a']", '[1]']
    """
    return [_pytree_impl.keystr(path) for path, _ in _pytree_impl.tree_flatten_with_path(tree)[0]]
