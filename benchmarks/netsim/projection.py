"""A time-to-loss model for N nodes: a real run's measured steps projected over a link.

A two-node run measures, per step, its compute seconds and the bytes it sent; what a
link of bandwidth ``B`` (bytes/s, per node and direction) and latency ``L`` adds to each
step is then the collective's time on a ring of N nodes:

* ``allreduce`` of a payload ``P`` (what each rank hands in): ``2 (N-1)/N * P / B + 2 (N-1) L``
  (reduce-scatter then allgather);
* ``allgather`` of ``P`` per rank (the low-bit codes of ``hooks=lowbit``): ``(N-1) * P / B + (N-1) L``:
  each node receives every other node's codes, so the traffic grows with N where an
  allreduce's stays near ``2 P``, and fp4 (about 1/7 of fp32) stops paying past N ~ 14.

A sync sent behind ``overlap`` steps is exposed only for what those steps' compute does
not cover. The time to a loss is the sum of projected step times up to the first step
whose window mean loss reaches it (the same samples per step on any N: the model keeps
each rank's batch, so N nodes see N/2 times the samples of the measured two).
``check_against`` holds the model to a run on the simulated cluster (``benchmarks/netsim``).

>>> round(collective_s("allreduce", 1e6, nodes=2, bandwidth=12.5e6, latency=0.0), 3)
0.08
"""

from __future__ import annotations

import statistics

__all__ = ["RATES", "collective_s", "projected_steps", "time_to", "check_against"]

RATES = {"100mbit": 100e6 / 8, "1gbit": 1e9 / 8, "10gbit": 10e9 / 8}  # bytes/s per node and direction


def collective_s(kind: str, payload: float, nodes: int, bandwidth: float, latency: float) -> float:
    """Seconds one collective of ``payload`` bytes per rank takes on a ring of ``nodes``."""
    if nodes < 2 or payload <= 0:
        return 0.0
    if kind == "allreduce":
        return 2 * (nodes - 1) / nodes * payload / bandwidth + 2 * (nodes - 1) * latency
    if kind == "allgather":
        return (nodes - 1) * payload / bandwidth + (nodes - 1) * latency
    raise ValueError(f"kind={kind!r}: expected allreduce or allgather")


def projected_steps(
    compute_s: list[float], sent: list[float], kind: str, nodes: int, bandwidth: float, latency: float, overlap: int = 0
) -> list[float]:
    """Each step's projected seconds: its compute, plus what its sync leaves exposed.

    ``sent[i]``: the bytes step ``i`` sent (measured on two ranks: the payload per rank).

    >>> projected_steps([0.1, 0.1], [0, 1.25e6], "allreduce", 2, 12.5e6, 0.0)
    [0.1, 0.2]
    """
    typical = statistics.median(compute_s)
    out = []
    for compute, payload in zip(compute_s, sent):
        comm = collective_s(kind, payload, nodes, bandwidth, latency)
        out.append(compute + max(0.0, comm - overlap * typical))
    return out


def time_to(target: float, losses: list[float], step_s: list[float], window: int, tolerance: float) -> tuple:
    """``(step, seconds)`` of the first step whose window mean loss is within ``tolerance`` of ``target``.

    >>> time_to(1.0, [3.0, 2.0, 1.0, 1.0], [1.0] * 4, window=2, tolerance=0.0)
    (4, 4.0)
    """
    elapsed = 0.0
    for step, seconds in enumerate(step_s, start=1):
        elapsed += seconds
        if step >= window and statistics.mean(losses[step - window : step]) <= target * (1 + tolerance):
            return step, elapsed
    return None, None


def check_against(
    measured_ms: float, compute_ms: float, payload: float, kind: str, rate: str, latency: float = 0.0
) -> dict:
    """The model's step time for a two-node run beside the one measured on the simulated cluster.

    >>> check_against(761, 126, 79.4e6, "allreduce", "1gbit")["model_ms"]
    761.2
    """
    model = compute_ms + 1e3 * collective_s(kind, payload, 2, RATES[rate], latency)
    return {"measured_ms": measured_ms, "model_ms": round(model, 1), "ratio": round(model / measured_ms, 3)}
