"""``trainer.compile``: the step's gradient computation under ``torch.compile``.

The function fdp differentiates is pure, ``grad_and_value(loss_fn)(params, buffers,
batch) -> (grads, (loss, aux))``, which is what a compiler wants: the whole forward and
backward become one graph (inductor fuses the elementwise work and, under autocast,
the weight casts). It is compiled on the first step (the time is logged once) and reused
after: params, buffers, the batch and the loss scale are graph inputs, so new values of
the same shapes do not recompile.

Only the ``after`` schedule is compiled. Under ``overlap`` the backward's tensor hooks
start collectives and hook chains from inside the transform, side effects the compiler
cannot put in a graph; a compiled step therefore reduces after backward (one log line
says so).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Callable

import torch

log = logging.getLogger("fdp")


def check_compile(compile: bool, device: str = "cpu") -> bool:
    """``compile`` if ``torch.compile`` can build code for ``device``; else ``ValueError`` naming it.

    On CPU inductor compiles C++ with the system compiler (``$CXX``, else ``g++``); on CUDA
    it needs triton.

    >>> check_compile(False)
    False
    """
    if not compile:
        return False
    if device == "cpu":
        candidates = [os.environ.get("CXX"), "g++", "clang++", "c++"]
        if not any(c and shutil.which(c) for c in candidates):
            raise ValueError("compile=True: torch.compile needs a C++ compiler on CPU (none of $CXX, g++, clang++, c++ found); expected compile=false")
    elif device == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ValueError("compile=True: torch.compile needs triton on CUDA and it is not installed; expected compile=false") from None
    return True


def compiled_schedule(schedule: str) -> str:
    """The schedule a compiled step runs: ``after`` (overlap's in-backward hooks do not compile).

    >>> compiled_schedule("after")
    'after'
    """
    if schedule == "overlap":
        log.info("trainer.compile: the overlap schedule does not compile (its backward hooks run collectives); reducing after backward")
        return "after"
    return schedule


def compile_grad(grad_fn: Callable) -> Callable:
    """``grad_fn`` under ``torch.compile``; the first call (which compiles) logs its time once."""
    compiled = torch.compile(grad_fn)
    first = True

    def run(*args):
        nonlocal first
        if not first:
            return compiled(*args)
        t0 = time.perf_counter()
        out = compiled(*args)
        first = False
        log.info(f"trainer.compile: compiled the gradient computation in {time.perf_counter() - t0:.1f} s")
        return out

    return run
