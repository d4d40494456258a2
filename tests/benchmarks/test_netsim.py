"""The simulated cluster of the multi-node benchmarks (``benchmarks/netsim``), without building one.

Building namespaces needs root and changes the host, so these tests cover what decides
whether and how a cluster is built: the settings, the one-line refusals, the torchrun
environment of a node, and the relay's forwarding rules.
"""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from _paths import pythonpath_first  # noqa: E402

from benchmarks.netsim import cluster, projection, relay  # noqa: E402
from benchmarks.netsim.cluster import NetsimError  # noqa: E402


def cli(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=pythonpath_first(REPO))
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.netsim", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("module", [cluster, relay, projection])
def test_module_examples_hold(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_the_time_to_loss_model_holds_to_the_simulated_clusters_two_node_runs():
    """The model's step time (compute + a ring allreduce of the 79.4 MB model) against the runs on the
    simulated cluster at 1 Gbit/s and 100 Mbit/s (results/slow_links*.json): within 15%."""
    import json
    import statistics

    for name, rate in (("slow_links", "1gbit"), ("slow_links_100mbit", "100mbit")):
        rows = {
            r["variant"]: r for r in json.loads((REPO / "benchmarks" / "results" / f"{name}.json").read_text())["rows"]
        }
        compute_ms = rows["local SGD H=16"]["median_ms"]  # a step without a sync
        synced_ms = statistics.median(
            ms for i, ms in enumerate(rows["local SGD H=16"]["step_ms_all"], 1) if i % 16 == 0
        )
        for measured in (rows["DDP allreduce"]["median_ms"], synced_ms):
            check = projection.check_against(measured, compute_ms, 4 * 19.85e6, "allreduce", rate)
            assert 0.85 <= check["ratio"] <= 1.15, (name, check)
    # N nodes: an allreduce's traffic stays near 2 P, an allgather's grows as (N - 1) P.
    assert projection.collective_s("allreduce", 1e6, 64, 1e6, 0) < 2
    assert projection.collective_s("allgather", 1e6, 64, 1e6, 0) == 63


@pytest.mark.parametrize(
    "text,bps",
    [("1gbit", 10**9), ("2.5gbit", 2_500_000_000), ("100mbit", 10**8), ("64kbit", 64_000), ("NONE", 0), ("0", 0)],
)
def test_rate_parses_tc_notation(text, bps):
    assert cluster.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["fast", "1gb", "1 gbit", "-1gbit", "gbit"])
def test_bad_rate_is_refused_naming_the_setting(text):
    with pytest.raises(NetsimError, match=r"^rate must look like .*got"):
        cluster.parse_rate(text)


@pytest.mark.parametrize("text,seconds", [("500us", 5e-4), ("0.5ms", 5e-4), ("2", 2e-3), ("1s", 1.0), ("0", 0.0)])
def test_delay_parses_with_units(text, seconds):
    assert cluster.parse_delay(text) == pytest.approx(seconds)


def test_bad_delay_is_refused_naming_the_setting():
    with pytest.raises(NetsimError, match=r"^delay must look like"):
        cluster.parse_delay("soon")


def _tools(tmp_path: Path, *names: str) -> str:
    for name in names:
        tool = tmp_path / name
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(0o755)
    return str(tmp_path)


def test_prerequisites_name_exactly_what_is_missing(tmp_path):
    only_ip = _tools(tmp_path, "ip")
    assert (
        cluster.missing_prerequisites(euid=0, path=only_ip)
        == "the simulated cluster needs iproute2 (`tc` is not on PATH)"
    )
    both = _tools(tmp_path, "tc")
    assert cluster.missing_prerequisites(euid=0, path=both) is None
    assert (
        cluster.missing_prerequisites(euid=1000, path=both)
        == "the simulated cluster needs root (network namespaces, tc)"
    )


def test_cli_without_iproute2_refuses_in_one_line(tmp_path):
    proc = cli("status", path=str(tmp_path))  # an empty PATH directory: no `ip`, no `tc`
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("netsim: the simulated cluster needs")
    assert "`ip` and `tc` are not on PATH" in lines[0]
    assert ("root" in lines[0]) == (os.geteuid() != 0)


@pytest.mark.parametrize(
    "args,setting",
    [
        (["up", "0"], "nodes"),
        (["up", "2", "--rate", "fast"], "rate"),
        (["up", "2", "--delay", "soon"], "delay"),
        (["run", "2"], "no command"),
    ],
)
def test_cli_bad_arguments_exit_2_in_one_line(args, setting, tmp_path):
    proc = cli(*args, path=str(tmp_path))  # refused before anything on PATH is needed
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2
    assert len(lines) == 1 and lines[0].startswith("netsim: ") and setting in lines[0]


def test_cli_options_after_the_separator_belong_to_the_command():
    from benchmarks.netsim.__main__ import parse_args

    a = parse_args(["run", "2", "--rate", "1gbit", "--", "python", "train.py", "--rate", "x"])
    assert (a.nodes, a.rate, a.command) == (2, "1gbit", ["python", "train.py", "--rate", "x"])


def test_node_env_is_torchrun_one_rank_per_node_over_the_simulated_link():
    envs = [cluster.node_env(k, 3, 29600) for k in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["MASTER_ADDR"] for e in envs} == {cluster.address(0)} == {"10.77.0.1"}
    assert all(e["WORLD_SIZE"] == "3" and e["LOCAL_RANK"] == "0" and e["MASTER_PORT"] == "29600" for e in envs)
    assert all(e["GLOO_SOCKET_IFNAME"] == cluster.IFNAME for e in envs)
    assert cluster.node_command(2, ["python"], prefix="x") == ["ip", "netns", "exec", "x-node2", "python"]


def test_a_cluster_owns_only_its_own_namespaces():
    names = cluster.Names("fdpsim")
    assert all(names.owns(ns) for ns in ("fdpsim-node0", "fdpsim-node12", "fdpsim-sw", "fdpsim-probe77"))
    assert not any(names.owns(ns) for ns in ("fdpsim2-node0", "nsim-node0", "fdpsim-node", "xfdpsim-sw"))


def _packet(dst: tuple[int, int, int, int], version: int = 4) -> bytes:
    return bytes(relay.VNET_HDR_BYTES) + bytes([version << 4 | 5]) + bytes(15) + bytes(dst) + bytes(20)


def test_relay_forwards_only_to_the_nodes():
    subnet = bytes([10, 77, 0])
    assert relay.destination(_packet((10, 77, 0, 1)), subnet, nodes=3) == 0
    assert relay.destination(_packet((10, 77, 0, 3)), subnet, nodes=3) == 2
    for dst in ((10, 77, 0, 4), (10, 77, 0, 255), (10, 77, 0, 0), (10, 77, 1, 1), (8, 8, 8, 8)):
        assert relay.destination(_packet(dst), subnet, nodes=3) is None
    assert relay.destination(_packet((10, 77, 0, 1), version=6), subnet, nodes=3) is None
    assert relay.destination(_packet((10, 77, 0, 1))[:20], subnet, nodes=3) is None


def test_relay_serialises_a_downlink_at_its_rate_after_the_delay():
    rate, size, delay = 1e9, 64_000, 1e-3
    first = relay.departure(0.0, size, 0.0, delay, rate)
    second = relay.departure(0.0, size, first, delay, rate)  # arrives together, waits for the first
    assert first == pytest.approx(delay + size * 8 / rate)
    assert second - first == pytest.approx(size * 8 / rate)
    later = relay.departure(1.0, size, first, delay, rate)  # the link is idle again
    assert later == pytest.approx(1.0 + delay + size * 8 / rate)
    assert relay.departure(0.5, size, 9.0, delay, 0.0) == pytest.approx(0.5 + delay)  # unlimited
