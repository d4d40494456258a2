"""Shared fixtures. ``run_ranks`` is the one way tests start several processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import fdp.run.world
from fdp.dist.launch import WorldLayout, init_distributed, spawn

torch.set_num_threads(1)

# Hugging Face models are built from configs and tokenizers from what ships in the package:
# nothing may reach for the Hub, here or in the processes tests start.
os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests need CUDA: skipped where there is none.

    The mark belongs on a whole module (``pytestmark``): the other modules hide the GPUs.
    """
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
    runs are covered too.
    """
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        patch.setattr(fdp.run.world, "visible_gpus", lambda: 0)
        yield


# Short enough that a broken collective fails the test well inside CI's budget.
COLLECTIVE_TIMEOUT_S = 60.0


def _rank_entry(fn, args, layout):
    comm = init_distributed(layout)
    torch.set_num_threads(1)
    try:
        return fn(comm.rank, comm.world_size, *args)
    finally:
        dist.destroy_process_group()


@pytest.fixture
def run_ranks():
    """``run_ranks(fn, *args, world_size=2)`` runs ``fn(rank, world_size, *args)`` on gloo ranks (CPU unless told).

    ``fn`` must be a module-level function (it is pickled into spawned workers). Returns
    the results as a list indexed by rank; a rank that raises fails the call.
    """

    def run(fn, *args, world_size: int = 2, timeout_s: float = COLLECTIVE_TIMEOUT_S, backend: str = "gloo", **devices):
        # ``devices``: ``accelerator`` and ``device_ids`` of the WorldLayout (GPU tests).
        layout = WorldLayout("elastic", nproc_per_node=world_size, backend=backend, timeout_s=timeout_s, **devices)
        results = spawn(_rank_entry, (fn, args, layout), layout)
        return [results[rank] for rank in range(world_size)]

    return run
