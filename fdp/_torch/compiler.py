"""torch.compile's modules and cache: dynamo imported ahead of a fork, inductor's default cache directory."""

from __future__ import annotations

import importlib


def preload_compiler() -> None:
    """Import what ``torch.func``'s first gradient imports (dynamo), ahead of a fork that should start with it."""
    importlib.import_module("torch._dynamo")


def inductor_default_cache_dir() -> str | None:
    """The cache directory inductor picks when ``TORCHINDUCTOR_CACHE_DIR`` is not set (``None`` if unknown).

    Importing ``torch._dynamo`` already writes that default into the environment, so a
    set variable alone does not say that someone chose it.
    """
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return default_cache_dir()
