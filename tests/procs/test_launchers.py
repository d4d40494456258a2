"""fdp.procs.launchers: each launcher answers what depends on how the ranks were started, a new one is
one class and one registry entry, and no module but fdp.procs.launchers compares a launcher's name."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Mapping

import pytest

import fdp
from fdp.errors import ConfigError
from fdp.procs.interrupt import stop_signal_names
from fdp.procs.launch import launch_rank
from fdp.procs.launchers import LAUNCHERS, Launched, Launcher, launcher_of, register_launcher
from fdp.procs.shrink import launched_world
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.run.world import layout_of, placement_of

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "81234",
}


def test_each_launcher_answers_from_its_environment():
    none, elastic, torchrun, slurm = (launcher_of(name) for name in ("none", "elastic", "torchrun", "slurm"))
    # The rank of the process running the start-up: 0 unless the launcher started every rank.
    assert [k.rank_before_joining(TORCHRUN) for k in (none, elastic, torchrun)] == [0, 0, 5]
    assert slurm.rank_before_joining(SLURM) == 3
    assert torchrun.launched(TORCHRUN) == Launched(5, 8) and slurm.launched(SLURM) == Launched(3, 4)
    # Processes on this node and the world's layout.
    assert (torchrun.local_world_size(TORCHRUN, 1), slurm.local_world_size(SLURM, 1)) == (4, 2)
    assert (none.local_world_size(TORCHRUN, 3), elastic.local_world_size(TORCHRUN, 3)) == (None, None)
    assert torchrun.nodes(TORCHRUN, 1, 4) == (2, 4) and slurm.nodes(SLURM, 1, 1) == (2, 2)
    assert [k.fixed_processes(3, 4) for k in (none, elastic, torchrun, slurm)] == [None, 3, 4, 4]
    assert none.for_processes(1) is none and none.for_processes(2) is elastic
    # Who starts the processes, who forms a group, who keeps a lost rank's process to the end.
    answers = [(k.spawned, k.starts_ranks, k.joins_group, k.lost_rank_stays) for k in (none, elastic, torchrun, slurm)]
    assert answers == [
        (False, False, False, False),
        (True, False, True, False),
        (False, True, True, True),
        (False, True, True, True),
    ]
    # The environment torch's rendezvous reads: SLURM's made into torch's variables.
    assert slurm.environ(SLURM)["RANK"] == "3" and slurm.environ(SLURM)["MASTER_ADDR"] == "gpu07"
    assert torchrun.environ(TORCHRUN) == {} and elastic.local_only({}) and not torchrun.local_only(TORCHRUN)
    # Stop and requeue signals: only SLURM warns before the end, and only there is a run requeued.
    assert stop_signal_names("slurm", "SIGUSR1") == ("SIGINT", "SIGTERM", "SIGUSR1")
    assert stop_signal_names("torchrun", "SIGUSR1") == ("SIGINT", "SIGTERM")
    assert slurm.requeues("SIGUSR1", "SIGUSR1") and not slurm.requeues("SIGTERM", "SIGUSR1")
    assert not torchrun.requeues("SIGUSR1", "SIGUSR1") and not slurm.requeues("SIGUSR1", "none")
    assert slurm.held_at_start("SIGUSR1") and not torchrun.held_at_start("SIGUSR1")
    assert none.alone and not elastic.alone


def test_an_unknown_launcher_is_one_line_naming_the_setting_and_the_registered_ones():
    with pytest.raises(
        ConfigError,
        match=r"^world\.launcher='mpirun': expected one of \('none', 'elastic', "
        r"'torchrun', 'slurm'\)$",
    ):
        validate(compose("world.launcher=mpirun"))


class OpenMPI(Launcher):
    """Ranks started by Open MPI's ``mpirun``, which sets its own variables, not torch's."""

    name = "openmpi"
    starts_ranks = True
    starter = "mpirun"

    def launched(self, environ: Mapping[str, str]) -> Launched:
        return Launched(int(environ["OMPI_COMM_WORLD_RANK"]), int(environ["OMPI_COMM_WORLD_SIZE"]))

    def local_world_size(self, environ: Mapping[str, str], nproc_per_node: int) -> int | None:
        return int(environ["OMPI_COMM_WORLD_LOCAL_SIZE"])

    def nodes(self, environ: Mapping[str, str], nnodes: int, nproc_per_node: int) -> tuple[int, int]:
        local = int(environ["OMPI_COMM_WORLD_LOCAL_SIZE"])
        return int(environ["OMPI_COMM_WORLD_SIZE"]) // local, local

    def environ(self, environ: Mapping[str, str]) -> dict[str, str]:
        return {
            "RANK": environ["OMPI_COMM_WORLD_RANK"],
            "WORLD_SIZE": environ["OMPI_COMM_WORLD_SIZE"],
            "LOCAL_RANK": environ["OMPI_COMM_WORLD_LOCAL_RANK"],
        }


def test_a_new_launcher_is_one_class_and_one_registry_entry(monkeypatch):
    monkeypatch.setattr(fdp.procs.launchers, "LAUNCHERS", dict(LAUNCHERS))  # registered for this test only
    register_launcher(OpenMPI)
    for name, value in {
        "OMPI_COMM_WORLD_RANK": "6",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    }.items():
        monkeypatch.setenv(name, value)
    cfg = compose("world=torchrun", "world.launcher=openmpi", "world.accelerator=cpu")
    validate(cfg)  # accepted as a launcher that starts every rank: the world size is the launched processes'
    assert launch_rank("openmpi") == 6 and launched_world("openmpi") == Launched(6, 8)
    placement = placement_of(cfg)
    assert (placement.launcher, placement.nproc_per_node) == ("openmpi", 4)
    layout = layout_of(cfg)
    assert (layout.launcher, layout.nnodes, layout.nproc_per_node, type(layout.kind)) == ("openmpi", 2, 4, OpenMPI)
    assert launcher_of("openmpi").environ(os.environ)["LOCAL_RANK"] == "2"
    with pytest.raises(ConfigError, match="expected 4, the number of processes mpirun starts"):
        placement_of(compose("world=torchrun", "world.launcher=openmpi", "world.accelerator=cpu", "world.devices=2"))


def _names_compared(tree: ast.AST, source: str) -> list[str]:
    """``launcher == "slurm"``-like comparisons: a launcher's name against an expression naming a launcher."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = [s.value for s in sides if isinstance(s, ast.Constant) and s.value in LAUNCHERS]
        names += [
            e.value
            for s in sides
            if isinstance(s, (ast.Tuple, ast.List, ast.Set))
            for e in s.elts
            if isinstance(e, ast.Constant) and e.value in LAUNCHERS
        ]
        if names and any("launcher" in ast.get_source_segment(source, s) for s in sides):
            found.append(f"line {node.lineno}: {ast.get_source_segment(source, node)}")
        if any("LAUNCHERS" in ast.get_source_segment(source, s) for s in node.comparators):
            found.append(f"line {node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_no_module_but_the_launchers_compares_a_launchers_name():
    package = Path(fdp.__file__).parent
    compared = {}
    for path in sorted(package.rglob("*.py")):
        if path.name == "launchers.py":
            continue
        source = path.read_text()
        found = _names_compared(ast.parse(source), source)
        if found:
            compared[str(path.relative_to(package))] = found
    assert compared == {}
    # The finder finds what it looks for.
    source = 'if w.launcher in ("torchrun", "slurm") or layout.launcher != "elastic" or outer.name == "none": pass'
    assert len(_names_compared(ast.parse(source), source)) == 2
    source = 'ok = w.launcher in LAUNCHERS and launcher == "none"'
    assert len(_names_compared(ast.parse(source), source)) == 2
