"""world=slurm: a task's place read from SLURM's or submitit's environment, and real jobs
through Hydra's submitit_local launcher and through SLURM's variables, against world=local2."""

import json
import os
import socket
import sys
from pathlib import Path

import _recipe
import pytest
import torch
from _saved import saved

from fdp.errors import ConfigError
from fdp.procs.launch import LOOPBACK, launch_rank
from fdp.procs.slurm import JobWorld, expand_nodelist, job_world, port_for_job, slurm_world


def _free_port() -> int:
    """A TCP port that was free on the loopback address a moment ago."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


ROOT = Path(__file__).resolve().parents[2]


def slurm_env(procid, localid, nodeid, ntasks=4, per_node="2(x2)", nodelist="gpu[07-08]", job_id="81234"):
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_TASKS_PER_NODE": per_node,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NUM_NODES": "2",
    }


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[9-11],b", ["a9", "a10", "a11", "b"]),
        ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
        ("gpu-[001-002],cpu[5]", ["gpu-001", "gpu-002", "cpu5"]),
        ("10.0.0.1,10.0.0.2", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_nodelists_expand_as_scontrol_show_hostnames(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[01-", "node[04-02]", "node[a-b]", ""])
def test_malformed_nodelists_are_refused(nodelist):
    with pytest.raises(ValueError):
        expand_nodelist(nodelist)


def test_every_task_of_a_two_node_job_finds_its_place_and_the_same_rendezvous():
    tasks = [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]  # procid, localid, nodeid as srun sets them
    worlds = [slurm_world(slurm_env(*t)) for t in tasks]
    assert [(w.rank, w.local_rank) for w in worlds] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert {(w.world_size, w.local_world_size, w.master_addr, w.master_port) for w in worlds} == {
        (4, 2, "gpu07", 11234)
    }
    assert worlds[3].environ() == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "11234",
    }


def test_uneven_nodes_and_explicit_rendezvous():
    # 5 tasks as "2(x2),1": the third node runs one; MASTER_ADDR/MASTER_PORT set by the user win.
    env = {**slurm_env(4, 0, 2, ntasks=5, per_node="2(x2),1"), "MASTER_PORT": "23456", "MASTER_ADDR": "head"}
    assert slurm_world(env) == JobWorld(4, 5, 0, 1, "head", 23456)
    # Without SLURM_TASKS_PER_NODE the tasks are assumed spread evenly over SLURM_JOB_NUM_NODES.
    env = slurm_env(3, 1, 1)
    del env["SLURM_TASKS_PER_NODE"]
    assert slurm_world(env).local_world_size == 2


def test_array_jobs_get_distinct_ports_in_a_range_below_the_ephemeral_ports():
    ports = {port_for_job(f"777_{i}") for i in range(50)}
    assert len(ports) == 50 and all(10000 <= p < 30000 for p in ports)


@pytest.mark.parametrize(
    "missing", ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID"]
)
def test_an_incomplete_job_environment_is_one_line_naming_what_is_missing(missing):
    env = slurm_env(0, 0, 0)
    del env[missing]
    with pytest.raises(ConfigError) as caught:
        slurm_world(env)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"world=slurm: the job environment lacks {missing} ")


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"SLURM_PROCID": "four"}, "unreadable job environment"),
        ({"SLURM_JOB_NODELIST": "node[01"}, "unbalanced brackets"),
        ({"SLURM_TASKS_PER_NODE": "2(y2)"}, "bad task count"),
        ({"SLURM_PROCID": "4"}, "task rank 4 is outside the job's 4 tasks"),
        ({"SLURM_LOCALID": "2"}, "local rank 2 is outside this node's 2 tasks"),
    ],
)
def test_inconsistent_job_environments_are_refused_in_one_line(change, expected):
    with pytest.raises(ConfigError, match=expected) as caught:
        slurm_world({**slurm_env(0, 0, 0), **change})
    assert "\n" not in str(caught.value)


def test_submitit_local_tasks_are_read_through_submitits_job_environment(monkeypatch):
    # What submitit's local executor sets for task 1 of 2 (it sets no SLURM variable).
    for name, value in {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_JOB_ID": "4321",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_LOCALID": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert job_world(os.environ) == JobWorld(1, 2, 1, 2, "127.0.0.1", port_for_job("4321"), local=True)
    assert launch_rank("slurm") == 1 and launch_rank("elastic") == 0


# -- real jobs ---------------------------------------------------------------------------------
RUN = [
    "model.hidden=32",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.checkpoint_every=3",
    "trainer.progress=false",
    "hooks=powersgd",
    "hooks.start_iter=2",
]


def _start(*overrides, env=None, fresh=False):
    """The recipe's command, forked from the preloaded server unless ``fresh`` (tests/_recipe.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    flags = [o for o in overrides if o.startswith("-")]  # before the overrides, as Hydra's parser wants
    args = [*flags, *RUN, *(o for o in overrides if not o.startswith("-"))]
    return _recipe.start([sys.executable, str(ROOT / "recipes" / "train.py"), *args], env=env, cwd=ROOT, fresh=fresh)


def _finish(started):
    proc = started.result(timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _params(run_dir):
    return saved(run_dir)["params"]


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if not r.get("summary")]


def test_slurm_jobs_through_submitit_local_and_srun_variables_equal_local2(tmp_path):
    """Two ranks on gloo three ways; all three reach the same parameters, bit for bit.

    * ``world=local2``: the reference, started by the elastic launcher.
    * Hydra's ``submitit_local`` launcher with ``tasks_per_node=2``: a real submitit job
      whose tasks read their place through ``submitit.JobEnvironment``.
    * Two processes given the variables ``srun`` sets for a two-task job on one node
      (this machine has no SLURM), sharing one run directory as the tasks of a job do.
    """
    local2, sweep, srun = tmp_path / "local2", tmp_path / "sweep", tmp_path / "srun"
    port = str(_free_port())
    procs = [
        _start("world=local2", f"hydra.run.dir={local2}"),
        _start(  # the sweep's own process, forked: submitit starts the tasks as fresh interpreters after it
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.tasks_per_node=2",
            "world=slurm",
            f"hydra.sweep.dir={sweep}",
        ),
        *(
            _start(
                "world=slurm",
                f"hydra.run.dir={srun}",
                env={
                    **slurm_env(rank, rank, 0, ntasks=2, per_node="2", nodelist="127.0.0.1", job_id="1"),
                    "MASTER_PORT": port,
                    "SLURM_JOB_NUM_NODES": "1",
                },
                fresh=rank == 1,  # as the shell starts it; its imports overlap the sweep's start-up
            )
            for rank in range(2)
        ),
    ]
    outputs = [_finish(p) for p in procs]
    job = sweep / "0"  # the sweep's one job: both of its tasks wrote here
    assert sorted(p.name for p in sweep.iterdir()) == [
        ".fdp-jobs",
        ".submitit",
        "0",
        "multirun.yaml",
    ]  # .fdp-jobs: each job's row of the sweep table
    for run_dir in (job, srun):
        assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["rank0.txt", "rank1.txt"]
        assert (run_dir / "rank1.log").exists() and not (run_dir / ".hydra" / "resume-1").exists()
        assert _losses(run_dir) == _losses(local2)
        reference, params = _params(local2), _params(run_dir)
        assert all(torch.equal(reference[k], params[k]) for k in reference), run_dir
    # The one summary line comes from rank 0 only: on stdout (srun) or in task 0's log (submitit).
    summaries = [line for line in "".join(outputs[2:]).splitlines() if line.startswith("fdp: ")]
    assert len(summaries) == 1 and "world=2 " in summaries[0]
    logs = {p.name: p.read_text() for p in (sweep / ".submitit").rglob("*_log.out")}
    assert sum("fdp: " in text and "world=2 " in text for text in logs.values()) == 1, sorted(logs)


def test_world_slurm_outside_a_job_exits_2_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = _recipe.run(
        [sys.executable, str(ROOT / "recipes" / "train.py"), "world=slurm", f"hydra.run.dir={tmp_path}"],
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: world=slurm: the job environment lacks SLURM_PROCID, SLURM_NTASKS")
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / ".hydra").exists()
