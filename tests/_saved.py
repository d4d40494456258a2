"""A run's checkpoint as one whole payload, whichever format wrote it."""

from __future__ import annotations

import os

from fdp.run.checkpoint import whole_payload


def saved(path: str | os.PathLike) -> dict:
    """The whole-file payload of the checkpoint ``path`` names (a run or checkpoints directory: its last): read as
    written (``trainer.checkpoint_format=whole``), or consolidated from its pieces (``sharded``, the default of a
    multi-rank run): ``fdp.run.checkpoint.whole_payload``."""
    return whole_payload(path)
