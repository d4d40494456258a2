"""Below autograd: leaving a ``torch.func`` transform from a hook, dispatch modes, and the operator an
``autograd.Function`` runs as under a transform."""

from __future__ import annotations

import contextlib

import torch

# -- torch.func -----------------------------------------------------------------------------
_DisableFuncTorch = getattr(getattr(torch, "_C", None), "_DisableFuncTorch", None)
HAS_DISABLE_FUNCTORCH = _DisableFuncTorch is not None


def disable_functorch() -> contextlib.AbstractContextManager:
    """A context in which code running inside a ``torch.func`` transform sees plain tensors.

    A tensor hook that starts a bucket's reduction during backward needs it: tensors the
    hook chain creates (and keeps in its state) must not be the transform's wrappers.
    Where torch lacks it, the overlapped schedule is unavailable (``HAS_DISABLE_FUNCTORCH``).
    """
    if _DisableFuncTorch is None:
        raise RuntimeError("this torch build cannot leave a torch.func transform from a hook; use the 'after' schedule")
    return _DisableFuncTorch()


# -- dispatch modes ------------------------------------------------------------------------
# A mode sees every op below autograd (inside a torch.func transform too, on plain tensors):
# ZeRO stage 3 learns from one forward which op reads which bucket's params.
try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - a torch without Python dispatch modes
    TorchDispatchMode = None  # type: ignore[assignment,misc]

# An autograd.Function's call under a torch.func transform, as a function mode sees it (its forward runs inside,
# out of the mode's sight); None where torch has no such operator (the call is then not a function of its own).
try:
    from torch._functorch.autograd_function import custom_function_call as CUSTOM_FUNCTION_CALL
except ImportError:  # pragma: no cover - a torch whose autograd.Function runs torch.func another way
    CUSTOM_FUNCTION_CALL = None
