"""The pieces of the HSDP benchmarks (``benchmarks/hsdp_netsim.py``, ``hsdp_diloco.py``) that decide their figures,
without a simulated cluster: the bytes leaving a node per step, the time to a loss, the synthetic stream."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import hsdp_diloco, hsdp_netsim  # noqa: E402


@pytest.mark.parametrize("module", [hsdp_netsim, hsdp_diloco], ids=lambda m: m.__name__)
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_node_bytes_are_per_node_and_step():
    # node 0 sent 900 bytes over 3 steps, node 1 1500: 400 per node and step
    assert hsdp_netsim.node_bytes_per_step([100, 0], [1000, 1500], 3) == 400.0
    with pytest.raises(ValueError, match="one counter per node"):
        hsdp_netsim.node_bytes_per_step([100, 0], [1000], 3)


def test_time_to_a_loss_reads_the_window_not_one_step():
    losses, seconds = [5.0, 1.0, 5.0, 5.0], [1.0, 2.0, 3.0, 4.0]
    assert hsdp_diloco.time_to(losses, seconds, 2.0, window=1) == 2.0
    assert hsdp_diloco.time_to(losses, seconds, 2.0, window=2) is None  # one lucky batch is not the loss reached


def test_stream_is_the_same_batch_on_every_side_and_differs_between_ranks_and_steps():
    a, b = hsdp_diloco.stream_batch(3, 1), hsdp_diloco.stream_batch(3, 1)
    assert torch_equal(a, b)
    assert not torch_equal(a, hsdp_diloco.stream_batch(3, 2))
    assert not torch_equal(a, hsdp_diloco.stream_batch(4, 1))


def torch_equal(a, b) -> bool:
    return all(bool((x == y).all()) for x, y in zip(a, b))
