"""Files that readers see whole or not at all: written to a temporary name beside them, flushed, renamed.

A crash or SIGKILL mid-write leaves the previous file (and no partial one under its name);
the directory is flushed too, so the rename itself survives a power loss.

>>> import tempfile
>>> path = atomic_save({"step": 3}, Path(tempfile.mkdtemp()) / "fdp-example.pt")
>>> atomic_copy(path, path.with_name("copy.pt")).name
'copy.pt'
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

__all__ = ["atomic_bytes", "atomic_copy", "atomic_link_tree", "atomic_save", "fsync_dir"]


def fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries to disk, so that a rename into it survives a crash.

    >>> fsync_dir(Path(tempfile.mkdtemp()))
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, write: Callable) -> Path:
    """``write(file)`` into a temporary beside ``path``, flushed, then renamed to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_save(payload: dict, path: str | os.PathLike) -> Path:
    """``torch.save(payload)`` to ``path`` so that readers see the old file or the new one, never half.

    >>> atomic_save({"step": 3}, Path(tempfile.mkdtemp()) / "fdp-example.pt").name
    'fdp-example.pt'
    """
    return _write_atomically(Path(path), lambda f: torch.save(payload, f))


def atomic_copy(source: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Copy ``source`` to ``path`` as ``atomic_save`` writes: readers see the old file or the whole new one."""

    def copy(f) -> None:
        with open(source, "rb") as src:
            shutil.copyfileobj(src, f, 16 << 20)

    return _write_atomically(Path(path), copy)


def atomic_bytes(data: bytes, path: str | os.PathLike) -> Path:
    """Write ``data`` to ``path`` as ``atomic_save`` writes: readers see the old file or the whole new one.

    >>> atomic_bytes(b"abc", Path(tempfile.mkdtemp()) / "x.bin").read_bytes()
    b'abc'
    """
    return _write_atomically(Path(path), lambda f: f.write(data))


def atomic_link_tree(source: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Make directory ``path`` hold ``source``'s files (a complete checkpoint directory), whole or not at all.

    Each file is hard-linked (no bytes copied; copied where the two lie on different file
    systems) into a temporary directory beside ``path``, which is then renamed: a reader
    sees no ``path`` or all of it. A ``path`` that exists already is left as it is.

    >>> src = Path(tempfile.mkdtemp()); _ = (src / "a.bin").write_bytes(b"x")
    >>> sorted(p.name for p in atomic_link_tree(src, src.parent / (src.name + "-kept")).iterdir())
    ['a.bin']
    """
    source, path = Path(source), Path(path)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        for file in source.iterdir():
            try:
                os.link(file, tmp / file.name)
            except OSError:  # another file system, or one without hard links
                shutil.copy2(file, tmp / file.name)
        fsync_dir(tmp)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)
    return path
