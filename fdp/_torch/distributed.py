"""What torch.distributed keeps of its process groups and has no public getter for: the default store, a
group's timeout, the live groups."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def default_store() -> Any | None:
    """The default process group's key-value store, or ``None`` where torch hides it."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def group_timeout(group: Any = None) -> Any | None:
    """The collective timeout (a ``timedelta``) of ``group`` (default: the default group), or ``None``.

    torch has no public getter; a group made with ``new_group`` and no timeout of its own
    gets torch's default (30 minutes on gloo), not its parent's, so fdp passes this on.
    """
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def live_groups() -> list[Any]:
    """Every process group torch knows in this process (the default one included); ``[]`` where it hides them."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}) or {})
