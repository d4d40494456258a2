"""What ``/proc`` says of this process that the memory benchmarks read: RSS and its peak."""

from __future__ import annotations

import re
from pathlib import Path


def status_mib(field: str) -> float:
    """``field`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in MiB."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def reset_peak() -> None:
    """Start ``VmHWM`` again from the RSS now (Linux ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")
