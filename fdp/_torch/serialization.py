"""``torch.save``'s records written without their own CRC-32."""

from __future__ import annotations

import contextlib
import threading

import torch

_CRC_SWITCH = threading.Lock()
_crc_off = {"callers": 0, "was": True}  # the callers inside records_without_crc, and torch's switch before the first


@contextlib.contextmanager
def records_without_crc():
    """Inside, ``torch.save`` writes its records without computing their CRC-32 (the field is 0; ``torch.load``
    does not read it): for files whose every byte a checksum of the caller's own covers already, so that writing
    them costs one checksum per byte, not two. torch's switch is process-wide: a ``torch.save`` in another thread
    meanwhile writes no CRC-32 either (fdp writes none then: a run's checkpoints are of one format); it is back as
    it was once the last caller inside has left.

    >>> with records_without_crc():
    ...     torch.serialization.get_crc32_options()
    False
    >>> torch.serialization.get_crc32_options()
    True
    """
    with _CRC_SWITCH:
        if not _crc_off["callers"]:
            _crc_off["was"] = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_off["callers"] += 1
    try:
        yield
    finally:
        with _CRC_SWITCH:
            _crc_off["callers"] -= 1
            if not _crc_off["callers"]:
                torch.serialization.set_crc32_options(_crc_off["was"])
