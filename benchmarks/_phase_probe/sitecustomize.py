"""What ``world.memory_per_rank_mb`` counts on the CPU (the data segment, ``VmData``), by phase of a rank's run.

Imported by every Python process that finds this folder first on ``PYTHONPATH`` (``benchmarks/beyond_one_rank.py
--phases``); does nothing unless ``FDP_PHASES`` names a folder. In a rank of a run it reads ``VmData`` when the budget
starts (``fdp.procs.budget.limit_memory``), at the start and end of each phase (``MemoryPhase``) and at every bucket
buffer given memory or released (``fdp.plan.buckets.regrow`` / ``release``: ZeRO stage 3's gathers and gradient
buckets), and writes, at exit, each phase's highest reading over the budget's start to ``FDP_PHASES/<pid>.json``.
Readings between those points are not seen: a phase's figure is a lower bound of its peak.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.util
import json
import os
import re
import sys

_OUT = os.environ.get("FDP_PHASES")
_seen: dict = {"base": None, "phase": "start", "peaks": {}, "order": []}


def _vm_data_mib() -> float:
    with open("/proc/self/status") as status:
        return int(re.search(r"VmData:\s+(\d+)", status.read()).group(1)) / 1024


def _read() -> None:
    if _seen["base"] is None:
        return
    held, phase = _vm_data_mib() - _seen["base"], _seen["phase"]
    if phase not in _seen["peaks"]:
        _seen["order"].append(phase)
    _seen["peaks"][phase] = max(_seen["peaks"].get(phase, held), held)


def _patch_devices(module) -> None:
    limit, phase_call = module.limit_memory, module.MemoryPhase.__call__

    def limit_memory(*args, **kwargs):
        limit(*args, **kwargs)
        _seen["base"] = _vm_data_mib()

    @contextlib.contextmanager
    def call(self, name, step=None):
        before = _seen["phase"]
        _seen["phase"] = name if name != "step" or step is None or step > 1 else "step 1"
        _read()
        try:
            with phase_call(self, name, step):
                yield
        finally:  # a phase that ran out of memory is written too
            _read()
            _seen["phase"] = before
            _write()

    module.limit_memory, module.MemoryPhase.__call__ = limit_memory, call


def _patch_buckets(module) -> None:
    regrow, release = module.regrow, module.release

    def regrow_read(buffer, zero=False):
        regrow(buffer, zero)
        _read()

    def release_read(buffer):
        _read()
        release(buffer)

    module.regrow, module.release = regrow_read, release_read


_PATCHES = {"fdp.procs.devices": _patch_devices, "fdp.plan.buckets": _patch_buckets}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            _PATCHES[name](module)

        spec.loader.exec_module = patched
        return spec


def _write() -> None:
    if _seen["base"] is not None:
        with open(os.path.join(_OUT, f"{os.getpid()}.json"), "w") as out:
            json.dump({phase: round(_seen["peaks"][phase], 1) for phase in _seen["order"]}, out)


if _OUT:
    sys.meta_path.insert(0, _Finder())
    atexit.register(_write)
