"""Paths for the processes tests start."""

from __future__ import annotations

import os
from pathlib import Path


def pythonpath_first(*dirs: str | Path) -> str:
    """A PYTHONPATH with ``dirs`` first and this process's own entries after them.

    Replacing PYTHONPATH instead would drop the entries that hold fdp's dependencies where
    they are not installed in site-packages (a ``--target`` directory on a GPU machine).
    """
    return os.pathsep.join(filter(None, [*map(str, dirs), os.environ.get("PYTHONPATH")]))
