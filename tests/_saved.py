"""A run's checkpoint as one whole payload, whichever format wrote it."""

from __future__ import annotations

import os

from fdp.run import checkpoint
from fdp.run.consolidate import consolidate


def saved(path: str | os.PathLike) -> dict:
    """The whole-file payload of the checkpoint ``path`` names (a run or checkpoints directory: its last): read as
    written (``trainer.checkpoint_format=whole``), or consolidated from its pieces (``sharded``, the default of a
    multi-rank run)."""
    found = checkpoint.resolve(path)
    return consolidate(found) if checkpoint.is_sharded(found) else checkpoint.load(found)
