"""A run's checkpoints directory, whichever format wrote it: the names of its checkpoints, the newest, reading
either format's description, and keeping the newest and the best.

A directory holds whole-file checkpoints (``step_<N>.pt``, ``fdp.run.checkpoint.whole``) and sharded ones
(``step_<N>/``, ``fdp.run.checkpoint.sharded``) alike: a run resumed on another number of ranks may write the
other format. ``last``, a small file replaced atomically once a checkpoint is whole, names the newest
(``last_of``); ``best/`` holds the best ones by the monitored metric (``keep_best``, ``trainer.keep_best``).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from fdp.run.checkpoint.atomic import atomic_copy, atomic_link_tree, fsync_dir

LAST = "last.pt"  # a copy of the newest step file, as runs saved before ``last`` named it (still read)
POINTER = "last"  # a small file naming the newest complete checkpoint: a step file, or a sharded step directory
META = "fdp.pt"  # a sharded checkpoint's own description (step, plan, stage, world size, config)
CHECKPOINTS = "checkpoints"  # a run directory's folder of them (fdp.run.rundir)
BEST = "best"  # a checkpoints directory's folder of the best ones (trainer.keep_best)
_STEP_FILE = re.compile(r"step_(\d+)\.pt$")
_STEP_DIR = re.compile(r"step_(\d+)$")
_BEST = re.compile(r"^step=(\d+)-")  # a best checkpoint: a file, or a sharded step directory


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


def step_files(directory: str | os.PathLike) -> dict[int, Path]:
    """The step checkpoints in ``directory``, by step, in step order: the one place their names are read.

    >>> step_files("/nonexistent")
    {}
    """
    directory = Path(directory)
    found = {int(m.group(1)): p for p in directory.glob("step_*.pt") if (m := _STEP_FILE.search(p.name))}
    return dict(sorted(found.items()))


def sharded_steps(directory: str | os.PathLike) -> dict[int, Path]:
    """The complete sharded checkpoints (``step_<N>/`` directories) in ``directory``, by step, in step order."""
    directory = Path(directory)
    found = {int(m.group(1)): p for p in directory.glob("step_*") if p.is_dir() and (m := _STEP_DIR.search(p.name))}
    return dict(sorted(found.items()))


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint's directory (``fdp.run.checkpoint.sharded``)."""
    return Path(path).is_dir() and (Path(path) / META).is_file()


def read_meta(path: str | os.PathLike) -> dict:
    """A sharded checkpoint's ``fdp.pt`` (step, plan fingerprint, stage, world size, config, the loop's state)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_sharded(path):
        raise CheckpointError(f"checkpoint {path} is not an fdp checkpoint (a directory without {META})")
    try:
        meta = torch.load(path / META, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path / META} is unreadable (truncated or corrupted?): {type(e).__name__}")
    if not isinstance(meta, dict) or "step" not in meta:
        raise CheckpointError(f"checkpoint {path / META} is not an fdp checkpoint (no 'step' entry)")
    return meta


def load(path: str | os.PathLike, mmap: bool = False) -> dict:
    """Read a whole-file checkpoint (``fdp.run.checkpoint.whole``), or a sharded one's description (``read_meta``);
    any defect is a ``CheckpointError`` naming the file.

    ``mmap=True`` maps the tensors' bytes instead of reading them (``fdp.run.checkpoint.integrity`` reads every byte).
    """
    path = Path(path)
    if path.is_dir():  # a sharded checkpoint: its description (the tensors are read by each rank, in pieces)
        return read_meta(path)
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


def saved_config(path: str | os.PathLike) -> dict | None:
    """The run config a checkpoint was written with (its ``config`` entry, as a run saves it), or ``None``.

    Cheap: the tensors are mapped, not read.
    """
    from omegaconf import OmegaConf

    text = load(path, mmap=True).get("config")
    return OmegaConf.to_container(OmegaConf.create(text), resolve=False) if isinstance(text, str) else None


def prune(directory: str | os.PathLike, keep: int, current: Path) -> None:
    """Remove all but the newest ``keep`` checkpoints in ``directory``, step files and sharded step directories
    alike (a run resumed on another number of ranks may write the other format), never ``current``: a resumed run
    saving a step below the newest kept, which ``last`` names.

    >>> import tempfile
    >>> directory = Path(tempfile.mkdtemp())
    >>> (directory / "step_00000001").mkdir(); _ = (directory / "step_00000002.pt").write_bytes(b"")
    >>> prune(directory, 1, directory / "step_00000002.pt"); sorted(p.name for p in directory.iterdir())
    ['step_00000002.pt']
    """
    directory = Path(directory)
    found = sorted([*step_files(directory).items(), *sharded_steps(directory).items()], key=lambda entry: entry[0])
    for _, old in found[: -keep or None]:
        if old == current:
            continue
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def point_last(directory: str | os.PathLike, name: str) -> None:
    """Make ``directory/last`` name ``name`` (a step file or step directory in ``directory``), atomically:
    a reader sees the name before or the new one, and the rename survives a crash."""
    directory = Path(directory)
    scratch = directory / f".{POINTER}.tmp"
    scratch.write_text(name + "\n")
    with open(scratch, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(scratch, directory / POINTER)
    fsync_dir(directory)


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint ``path`` names: a file or step directory itself, or a checkpoints or run directory's last.

    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> (run / CHECKPOINTS).mkdir()
    >>> resolve(run) == run / CHECKPOINTS / LAST, resolve(run / "x.pt") == run / "x.pt"
    (True, True)
    """
    path = Path(path)
    if not path.is_dir() or is_sharded(path) or _STEP_DIR.fullmatch(path.name):
        return path
    if not (path / LAST).exists() and not (path / POINTER).exists() and (path / CHECKPOINTS).is_dir():
        path = path / CHECKPOINTS
    return last_of(path)


def last_of(checkpoints: str | os.PathLike) -> Path:
    """The newest complete checkpoint in a checkpoints directory: the one ``last`` names, or the ``last.pt``
    copy of a run saved before ``last`` existed. A ``last`` that names no step is itself the answer, so that
    reading it names the damaged file.

    >>> last_of("/nonexistent").name
    'last.pt'
    """
    checkpoints = Path(checkpoints)
    pointer = checkpoints / POINTER
    if pointer.is_file():
        try:
            name = pointer.read_text(errors="replace").strip()
        except OSError:
            return pointer
        return checkpoints / name if _STEP_FILE.fullmatch(name) or _STEP_DIR.fullmatch(name) else pointer
    return checkpoints / LAST


def saved_steps(directory: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints in ``directory``, of either format, in order.

    >>> saved_steps("/nonexistent")
    []
    """
    return sorted({*step_files(directory), *sharded_steps(directory)})


def keep_best(checkpoints: str | os.PathLike, written: Path | None, step: int, best: dict[int, str]) -> None:
    """Keep ``written`` (the checkpoint of ``step``, complete: a file, or a sharded step directory) in
    ``checkpoints/best/`` under its name in ``best`` (step -> name, the best ones ranked so far) where it is among
    them, as a copy or a directory of hard links (no bytes copied), atomically; those ranked out go.

    >>> import tempfile
    >>> directory = Path(tempfile.mkdtemp())
    >>> _ = (directory / "step_00000002.pt").write_bytes(b"x")
    >>> keep_best(directory, directory / "step_00000002.pt", 2, {2: "step=2-val_loss=0.5"})
    >>> sorted(p.name for p in (directory / BEST).iterdir())
    ['step=2-val_loss=0.5.pt']
    """
    directory = Path(checkpoints) / BEST
    name = best.get(step)
    if written is not None and name is not None:
        if written.is_dir():
            atomic_link_tree(written, directory / name)
        else:
            atomic_copy(written, directory / f"{name}.pt")
    for old in directory.iterdir() if directory.is_dir() else ():  # none yet: no evaluation has ranked
        match = _BEST.match(old.name)
        if match and int(match.group(1)) not in best:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
