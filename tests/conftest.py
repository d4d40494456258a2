"""Shared fixtures. ``run_ranks`` is the one way tests start several processes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fdp.launch import WorldLayout, init_distributed, spawn

torch.set_num_threads(1)

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
    """``run_ranks(fn, *args, world_size=2)`` runs ``fn(rank, world_size, *args)`` on gloo ranks.

    ``fn`` must be a module-level function (it is pickled into spawned workers). Returns
    the results as a list indexed by rank; a rank that raises fails the call.
    """

    def run(fn, *args, world_size: int = 2, timeout_s: float = COLLECTIVE_TIMEOUT_S):
        layout = WorldLayout("elastic", nproc_per_node=world_size, backend="gloo", timeout_s=timeout_s)
        results = spawn(_rank_entry, (fn, args, layout), layout)
        return [results[rank] for rank in range(world_size)]

    return run
