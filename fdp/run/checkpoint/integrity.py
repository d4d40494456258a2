"""A checkpoint checked whole before a run uses it: every file present, whole and what it says it is.

``verify(path)`` reads a checkpoint of either format through once and raises one
``CheckpointError`` naming the first file that is wrong and what is wrong with it; a run
calls it (``fdp.run.config.validate``) before it writes anything into its directory, and
``fdp.run.checkpoint.consolidate`` before it reads the pieces. Each process that starts a run checks for
itself (under ``torchrun`` every rank), so every rank reaches the same verdict on the same files.

* A whole-file checkpoint (``step_<N>.pt``) is the zip archive ``torch.save`` writes, whose
  records carry a CRC-32 each: every record is read and checked (``torch.load`` itself does not,
  and loads a flipped byte silently), then the entries a run restores are looked for.
* A sharded checkpoint (``step_<N>/``, ``fdp.run.checkpoint.sharded``) holds ``manifest.json``,
  written into its directory before the directory is renamed into place (so with it): the size
  and SHA-256 of every other file, each rank's recorded by the rank that wrote it. Whatever the
  manifest says, the checkpoint must have each saving rank's ``rank<r>.pt``, DCP's ``.metadata``
  and every piece file ``.metadata`` names, long enough for the ranges it names: so a checkpoint
  written before manifests existed is checked as far as its own files allow.

>>> verify("/nonexistent/step_00000001.pt")
Traceback (most recent call last):
...
fdp.run.checkpoint.files.CheckpointError: checkpoint /nonexistent/step_00000001.pt does not exist
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import torch

from fdp.run.checkpoint.files import META, CheckpointError, load, read_meta

__all__ = ["MANIFEST", "file_entry", "verify", "write_manifest"]

MANIFEST = "manifest.json"  # a sharded checkpoint's record of its files: {"files": {name: {"size", "sha256"}}}
DCP_METADATA = ".metadata"  # DCP's index of the pieces (torch.distributed.checkpoint.filesystem)
WHOLE_ENTRIES = ("step", "params", "buffers", "opt_state", "ranks", "plan_fingerprint")  # what a resume reads
RANK_ENTRIES = ("hook_state", "rng")  # what each rank's part holds, in either format


def file_entry(path: str | os.PathLike, digest: Any = None) -> dict:
    """``{"size": bytes, "sha256": hex digest}`` of the file at ``path``: what a manifest records of it. ``digest``:
    a SHA-256 fed every byte of the file as it was written (``fdp._torch.digesting_writer``), so that the file is
    not read back.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "x"
    >>> _ = path.write_bytes(b"abc")
    >>> file_entry(path)["size"], file_entry(path)["sha256"][:12]
    (3, 'ba7816bf8f01')
    """
    if digest is None:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            # 1 MiB at a time: read(n) allocates n bytes first, and under a budget (world.memory_per_rank_mb) the
            # data limit counts them, touched or not (16 MiB blocks made a rank's write 16 MiB larger than its files)
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return {"size": os.path.getsize(path), "sha256": digest.hexdigest()}


def write_manifest(directory: str | os.PathLike, files: dict[str, dict]) -> Path:
    """Write ``directory/manifest.json`` recording ``files`` (name -> ``file_entry``), flushed to disk."""
    path = Path(directory) / MANIFEST
    with open(path, "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return path


def verify(path: str | os.PathLike) -> None:
    """Raise ``CheckpointError`` naming the file and the defect unless the checkpoint at ``path`` is whole
    (see the module docstring); it reads every byte once."""
    path = Path(path)
    if path.is_dir():
        _verify_sharded(path)
    else:
        _verify_whole(path)


def _verify_whole(path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # every record read and its CRC-32 checked
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupted?): not the archive torch.save writes ({error})"
        ) from None
    if bad is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: its record {bad} fails its checksum")
    payload = load(path, mmap=True)
    _require_entries(path, payload, WHOLE_ENTRIES, "an fdp checkpoint of a run")
    if not isinstance(payload["ranks"], list) or not payload["ranks"]:
        raise CheckpointError(f"checkpoint {path} is not an fdp checkpoint of a run: its 'ranks' entry is empty")
    for rank, mine in enumerate(payload["ranks"]):
        _require_entries(path, mine, RANK_ENTRIES, f"an fdp checkpoint of a run (rank {rank}'s part)")


def _require_entries(path: Path, payload: object, entries: tuple[str, ...], what: str) -> None:
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint {path} is not {what}: it holds a {type(payload).__name__}")
    missing = [key for key in entries if key not in payload]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not {what}: no {missing[0]!r} entry")


def _verify_sharded(path: Path) -> None:
    if not (path / META).is_file():
        raise CheckpointError(f"checkpoint {path / META} is missing (a sharded checkpoint's description)")
    meta = read_meta(path)  # fdp.pt: present, readable, with a step
    manifest = path / MANIFEST
    if manifest.exists():
        _check_manifest(path, manifest)
    world = meta.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise CheckpointError(f"checkpoint {path / META} is not an fdp checkpoint: no world size")
    for rank in range(world):
        mine = path / f"rank{rank}.pt"
        if not mine.is_file():
            raise CheckpointError(f"checkpoint {mine} is missing (the checkpoint was written by {world} ranks)")
        try:
            part = torch.load(mine, map_location="cpu", weights_only=True)
        except Exception as error:
            raise CheckpointError(
                f"checkpoint {mine} is unreadable (truncated or corrupted?): {type(error).__name__}"
            ) from None
        _require_entries(mine, part, RANK_ENTRIES, "a rank's part of an fdp checkpoint")
    _check_pieces(path)


def _check_manifest(path: Path, manifest: Path) -> None:
    try:
        files = json.loads(manifest.read_text())["files"]
        recorded = {str(name): (int(e["size"]), str(e["sha256"])) for name, e in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"checkpoint {manifest} is unreadable (truncated or corrupted?): {error!r}") from None
    for name, (size, sha256) in recorded.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {file} is missing (its {MANIFEST} lists it)")
        actual = file_entry(file)
        if actual["size"] != size:
            raise CheckpointError(
                f"checkpoint {file} is damaged: {actual['size']} bytes, {size} when it was saved (truncated?)"
            )
        if actual["sha256"] != sha256:
            raise CheckpointError(f"checkpoint {file} is damaged: its bytes differ from when it was saved (SHA-256)")


def _check_pieces(path: Path) -> None:
    """DCP's ``.metadata`` readable, and every piece file it names there and long enough."""
    import torch.distributed.checkpoint as dcp

    index = path / DCP_METADATA
    if not index.is_file():
        raise CheckpointError(f"checkpoint {index} is missing (DCP's index of the pieces)")
    try:
        stored = dcp.FileSystemReader(path).read_metadata().storage_data
    except Exception as error:
        raise CheckpointError(
            f"checkpoint {index} is unreadable (truncated or corrupted?): {type(error).__name__}"
        ) from None
    ends: dict[str, int] = {}
    for info in stored.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        piece = path / name
        if not piece.is_file():
            raise CheckpointError(f"checkpoint {piece} is missing (DCP's {DCP_METADATA} names it)")
        size = piece.stat().st_size
        if size < end:
            raise CheckpointError(
                f"checkpoint {piece} is damaged: {size} bytes, its pieces end at byte {end} (truncated?)"
            )
