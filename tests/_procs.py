"""What tests ask of the processes a run starts."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
