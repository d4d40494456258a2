"""Shared fixtures. ``run_ranks`` is the one way tests start several processes."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from pathlib import Path

import _recipe
import pytest
import torch
import torch.distributed as dist

import fdp.run.world
from fdp.procs.launch import WorldLayout, init_distributed, spawn

torch.set_num_threads(1)

# Hugging Face models are built from configs and tokenizers from what ships in the package:
# nothing may reach for the Hub, here or in the processes tests start.
os.environ["HF_HUB_OFFLINE"] = "1"


TESTS = Path(__file__).resolve().parent
# Marks a folder of tests/ gives every test in it (registered in pyproject.toml).
FOLDER_MARKS = {"e2e": pytest.mark.e2e, "docs": pytest.mark.docs}


def pytest_collection_modifyitems(session, config, items):
    """Tests in tests/e2e/ and tests/docs/ get their folder's mark; modules marked heavy go first.
    ``@pytest.mark.gpu`` tests need CUDA: skipped where there is none. ``session.collected_files``: every file this
    run collected a test or doctest from, before ``-k`` or ``-m`` deselect any (called before they are), paths from
    the root (tests/test_doctests.py reads it).

    The gpu mark belongs on a whole module (``pytestmark``): the other modules hide the GPUs.
    """
    session.collected_files = {item.nodeid.split("::", 1)[0] for item in items}
    # Modules marked heavy run first: the suite's two workers take whole modules, and one of a minute or more
    # handed out last would run alone while the other worker waits.
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else None
        if folder in FOLDER_MARKS:
            item.add_marker(FOLDER_MARKS[folder])
    loose = [
        item.nodeid
        for item in items
        if item.get_closest_marker("gpu") is not None
        and item.getparent(pytest.Module).get_closest_marker("gpu") is None
    ]
    if loose:
        raise pytest.UsageError(
            f"gpu mark on single tests {loose}: expected it on the module (pytestmark = pytest.mark.gpu)"
        )
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# This process's view of CUDA is fixed once, before any test hides the GPUs from the
# processes it starts: torch (and dynamo's device cache) would otherwise count the GPUs
# under whatever CUDA_VISIBLE_DEVICES the first caller happened to run with.
if torch.cuda.is_available():
    torch.cuda.init()
    torch.cuda.device_count()  # cached from here on, whatever CUDA_VISIBLE_DEVICES says later


@pytest.fixture(autouse=True, scope="module")
def _cpu_unless_marked_gpu(request):
    """Test modules not marked ``gpu`` (``pytestmark``) run on the CPU on any machine.

    They compare against CPU references to the bit, and ``world.accelerator=auto`` would
    take a GPU where there is one: the trainer sees no GPU, and neither do the processes
    a test starts (workers, recipes). Module-scoped, so a module's own fixtures that start
    runs are covered too. Local workers start from the forkserver below unless a layout says otherwise.
    """
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        patch.setattr(fdp.run.world, "visible_gpus", lambda: 0)
        patch.setattr(WorldLayout.__new__, "__defaults__", _FORKSERVER_DEFAULTS)
        # Started here, where no test's own environment is patched in yet: the server keeps this one.
        multiprocessing.forkserver.ensure_running()
        yield


# Workers this process starts (``run_ranks``, ``fdp.run.trainer.run`` on a local world) fork from one
# forkserver that imported torch and fdp once, instead of each spawned interpreter importing them again
# (5 s a worker on a loaded 2-core machine: most of the distributed tests' time). They are still fresh
# processes that get their rank, entry and arguments as spawned ones do. Only where the GPUs are hidden:
# the server keeps the environment it started with, so it starts as the first CPU-only module begins
# (CUDA_VISIBLE_DEVICES empty); GPU modules spawn their workers. A layout that names its method keeps it.
# What a forked worker prints goes where the server's output went (pytest -s shows it); its errors come back
# through the launcher, as a spawned worker's do.
multiprocessing.set_forkserver_preload(_recipe.PRELOAD)
_SPAWN_DEFAULTS = WorldLayout.__new__.__defaults__
_FORKSERVER_DEFAULTS = tuple(
    "forkserver" if name == "start_method" else WorldLayout._field_defaults[name]
    for name in WorldLayout._fields
    if name in WorldLayout._field_defaults
)


@pytest.fixture
def spawned_workers(monkeypatch):
    """Local workers spawned as the recipe starts them, for a test that measures what a worker adds once it runs
    (``world.memory_per_rank_mb``): a forked one has the server's imports already."""
    monkeypatch.setattr(WorldLayout.__new__, "__defaults__", _SPAWN_DEFAULTS)


# Short enough that a broken collective fails the test well inside CI's budget.
COLLECTIVE_TIMEOUT_S = 60.0


def _rank_entry(fn, args, layout):
    comm = init_distributed(layout)
    torch.set_num_threads(1)
    try:
        return fn(comm.rank, comm.world_size, *args)
    finally:
        dist.destroy_process_group()


def _run_ranks(
    fn, *args, world_size: int = 2, timeout_s: float = COLLECTIVE_TIMEOUT_S, backend: str = "gloo", **devices
):
    # ``devices``: ``accelerator`` and ``device_ids`` of the WorldLayout (GPU tests).
    layout = WorldLayout("elastic", nproc_per_node=world_size, backend=backend, timeout_s=timeout_s, **devices)
    results = spawn(_rank_entry, (fn, args, layout), layout)
    return [results[rank] for rank in range(world_size)]


@pytest.fixture
def run_ranks():
    """``run_ranks(fn, *args, world_size=2)`` runs ``fn(rank, world_size, *args)`` on gloo ranks (CPU unless told).

    ``fn`` must be a module-level function (it is pickled into spawned workers). Returns
    the results as a list indexed by rank; a rank that raises fails the call.
    """
    return _run_ranks


@pytest.fixture(scope="module")
def module_run_ranks():
    """``run_ranks`` for a module's fixture: ranks started once, whose results several tests read."""
    return _run_ranks
