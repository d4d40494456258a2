"""A module's own parameter and buffer dicts, to run its forward on other tensors."""

from __future__ import annotations

from typing import Any

import torch


def tensor_slots(module: torch.nn.Module, names) -> dict[str, tuple[dict, str]] | None:
    """Where each dotted parameter or buffer name of ``names`` lives: ``{name: (owner's dict, key)}``.

    The dicts are the owning submodules' ``_parameters`` / ``_buffers``, so a forward can
    run on other tensors by putting them there (``swap_into``), which is what
    ``torch.func.functional_call`` does, less its per-call name resolution and checks.
    ``None`` when a name is not a registered parameter or buffer.

    >>> slots = tensor_slots(torch.nn.Linear(2, 3), ["weight", "bias"])
    >>> sorted(slots), slots["bias"][1]
    (['bias', 'weight'], 'bias')
    """
    slots = {}
    for name in names:
        owner_name, _, key = name.rpartition(".")
        try:
            owner = module.get_submodule(owner_name)
        except AttributeError:
            return None
        held = owner.__dict__.get("_parameters", {}), owner.__dict__.get("_buffers", {})
        found = next((d for d in held if d.get(key) is not None), None)
        if found is None:
            return None
        slots[name] = (found, key)
    return slots


def swap_into(slots: dict[str, tuple[dict, str]], tensors: dict[str, torch.Tensor]) -> list[tuple[dict, str, Any]]:
    """Put ``tensors`` in their ``slots``; return what was there, for ``swap_back``.

    >>> module = torch.nn.Linear(2, 1)
    >>> slots = tensor_slots(module, ["bias"])
    >>> taken = swap_into(slots, {"bias": torch.zeros(1)})
    >>> module.bias.tolist()
    [0.0]
    >>> swap_back(taken); isinstance(module.bias, torch.nn.Parameter)
    True
    """
    taken = []
    try:
        for name, tensor in tensors.items():
            owner, key = slots[name]
            taken.append((owner, key, owner[key]))
            owner[key] = tensor
    except BaseException:
        swap_back(taken)
        raise
    return taken


def swap_back(taken: list[tuple[dict, str, Any]]) -> None:
    """Undo ``swap_into`` (last in, first out, so a name given twice ends as it began)."""
    for owner, key, tensor in reversed(taken):
        owner[key] = tensor
