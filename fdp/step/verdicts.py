"""Each step's verdict on its reduced gradients, read without stalling the device.

Reading a flag from a GPU at once waits for everything the host has queued, the whole
step: the GPU then idles while the host prepares the next one. So with
``nonfinite="raise"`` the flags are copied to pinned host memory behind an event and
read once the event is done, at the latest when the next step has queued its work. At
most one step's verdict is unread when a step returns; on the CPU none is (the flags
are ready at once, and the step raises itself). ``settle`` reads the last one.

>>> verdicts = DeferredVerdicts()
>>> verdicts.record(torch.tensor([True, True]), lambda late: FloatingPointError("never made"))
>>> verdicts.record(torch.tensor([True, False]), lambda late: FloatingPointError(f"bad (late={late})"))
Traceback (most recent call last):
...
FloatingPointError: bad (late=False)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

__all__ = ["DeferredVerdicts"]

Explain = Callable[[bool], FloatingPointError]  # the error; its argument says whether it comes a step late


class _Unread(NamedTuple):
    ok: torch.Tensor  # pinned host copy of the flags
    copied: Any  # the CUDA event behind the copy
    explain: Explain


class DeferredVerdicts:
    """The finiteness verdicts of one train step function's steps (see the module docstring)."""

    def __init__(self):
        self._unread: _Unread | None = None

    def record(self, ok: torch.Tensor, explain: Explain) -> None:
        """Take a step's flags (``explain(late)`` makes its error); raise for it, or for the step before."""
        self.settle()
        if ok.device.type == "cpu":
            if not bool(ok.all()):
                raise explain(False)
            return
        host = torch.empty(ok.shape, dtype=ok.dtype, pin_memory=True)
        host.copy_(ok, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._unread = _Unread(host, copied, explain)

    def settle(self) -> None:
        """Wait for the unread verdict, if any; raise if that step's gradients were non-finite."""
        unread, self._unread = self._unread, None
        if unread is not None:
            unread.copied.synchronize()
            if not bool(unread.ok.all()):
                raise unread.explain(True)
