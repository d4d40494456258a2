"""Atomic, self-describing checkpoints of the whole train state.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, so
``torch.load(path, weights_only=True)`` reads it without unpickling any code. Its
``params`` entry maps parameter names to tensors. Structured state (optimizer and hook
NamedTuples) is stored as flat lists of leaves and rebuilt against the live state's
structure, which also checks that the run being resumed is the same kind of run.

Files are written to a temporary name in the same directory, flushed to disk and then
renamed, so a crash mid-write leaves the previous checkpoint intact.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from fdp._torch import tree_flatten, tree_unflatten
from fdp.train import TrainState

LAST = "last.pt"
_STEP_FILE = re.compile(r"step_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(payload: dict, path: str | os.PathLike) -> Path:
    """Write ``payload`` to ``path`` so that readers see the old file or the new one, never half.

    >>> atomic_save({"step": 3}, "/tmp/fdp-example.pt").name
    'fdp-example.pt'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load(path: str | os.PathLike, mmap: bool = False) -> dict:
    """Read a checkpoint written by ``save``; any defect is a ``CheckpointError`` naming the file.

    ``mmap=True`` maps the tensors' bytes instead of reading them (see ``check_readable``).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises many kinds for a truncated or foreign file
        # The first sentence: torch's longer messages go on to speculate about causes.
        reason = str(e).strip().splitlines()[0].split(". ")[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated or corrupted?): {reason}") from None
    if not isinstance(payload, dict) or "step" not in payload or "params" not in payload:
        raise CheckpointError(f"checkpoint {path} is not an fdp checkpoint (no 'step'/'params' entries)")
    return payload


def check_readable(path: str | os.PathLike) -> None:
    """Raise ``CheckpointError`` unless ``path`` is a whole fdp checkpoint; cheap (tensors are mapped, not read)."""
    try:
        load(path, mmap=True)
    except CheckpointError:
        load(path)  # the plain reader names the defect better (mmap refuses non-zip files first)


def _leaves(tree: Any) -> list:
    return tree_flatten(tree)[0]


def _rebuild(template: Any, leaves: list, what: str, path: Path) -> Any:
    spec = tree_flatten(template)[1]
    if spec.num_leaves != len(leaves):
        raise CheckpointError(
            f"checkpoint {path}: {what} has {len(leaves)} entries, this run expects {spec.num_leaves} "
            "(different optimizer, hooks or bucket plan?)"
        )
    return tree_unflatten(leaves, spec)


def state_payload(state: TrainState, per_rank: list[dict], extra: dict | None = None) -> dict:
    """The dict saved for ``state``; ``per_rank`` holds each rank's ``rank_payload``."""
    return {
        "step": state.step,
        "params": dict(state.params),
        "buffers": dict(state.buffers),
        "opt_state": _leaves(state.opt_state),
        "ranks": per_rank,
        **(extra or {}),
    }


def rank_payload(state: TrainState) -> dict:
    """What differs between ranks and must be saved for each: hook state (error feedback) and RNG."""
    return {"hook_state": _leaves(state.hook_state), "rng": state.rng}


def restore(payload: dict, template: TrainState, rank: int, path: str | os.PathLike = "checkpoint") -> TrainState:
    """Rebuild the ``TrainState`` of ``rank`` from ``payload``, shaped like ``template``."""
    path = Path(path)
    ranks = payload["ranks"]
    missing = sorted(set(template.params) ^ set(payload["params"]))
    if missing:
        raise CheckpointError(f"checkpoint {path}: parameters differ from this model's: {missing[:5]}")
    # A world larger than the one that saved: the new ranks start their hook state and RNG fresh.
    mine = ranks[rank] if rank < len(ranks) else {"hook_state": _leaves(template.hook_state), "rng": template.rng}
    return TrainState(
        step=int(payload["step"]),
        params={name: payload["params"][name] for name in template.params},
        buffers={name: payload["buffers"][name] for name in template.buffers},
        opt_state=_rebuild(template.opt_state, payload["opt_state"], "optimizer state", path),
        hook_state=_rebuild(template.hook_state, mine["hook_state"], "hook state", path),
        rng=mine["rng"],
    )


def save(directory: str | os.PathLike, payload: dict, keep: int = 2) -> Path:
    """Save ``payload`` as ``step_<N>.pt`` and ``last.pt`` in ``directory``; keep the newest ``keep`` step files."""
    directory = Path(directory)
    path = atomic_save(payload, directory / f"step_{int(payload['step']):08d}.pt")
    # last.pt is a hard link swapped in by rename: no second copy of the bytes.
    tmp = directory / f".{LAST}.link"
    if tmp.exists():
        tmp.unlink()
    os.link(path, tmp)
    os.replace(tmp, directory / LAST)
    _fsync_dir(directory)
    for old in sorted(p for p in directory.iterdir() if _STEP_FILE.search(p.name))[:-keep or None]:
        old.unlink()
    # Temporaries of a writer that was killed mid-save (only one process saves, and it is done).
    for stale in directory.glob(".step_*.tmp"):
        stale.unlink(missing_ok=True)
    return path
