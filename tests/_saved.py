"""A run's checkpoint as one whole payload, whichever format wrote it."""

from __future__ import annotations

import os

from fdp.run.checkpoint import whole_payload


def saved(path: str | os.PathLike) -> dict:
    """The whole-file payload of the checkpoint ``path`` names (a run or checkpoints directory: its last): read as
    written (``trainer.checkpoint_format=whole``), or consolidated from its pieces (``sharded``, the default of a
    multi-rank run): ``fdp.run.checkpoint.whole_payload``."""
    return whole_payload(path)


def trained_state(run_dir: str | os.PathLike) -> dict:
    """The params and optimizer state of a run's last checkpoint, in either format."""
    payload = saved(run_dir)
    return {"params": payload["params"], "opt_state": payload["opt_state"]}


def same(a, b) -> bool:
    """Whether two nested states are equal to the bit, dtypes included."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
