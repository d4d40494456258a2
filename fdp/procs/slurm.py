"""A rank's place in a SLURM job (or a submitit job), read from the job's environment.

``world=slurm`` runs one rank per task: ``srun``/``sbatch``, or Hydra's submitit launcher
(``hydra/launcher=submitit_slurm``, and ``submitit_local`` on one machine). Each task reads
its rank, the world size, its local rank and the rendezvous from its environment:

* under SLURM: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
  ``SLURM_TASKS_PER_NODE``, and the first host of ``SLURM_JOB_NODELIST`` as the master;
* under submitit's local executor (no SLURM variables there): what
  ``submitit.JobEnvironment`` reads, with the master on 127.0.0.1.

``MASTER_PORT`` is taken from the environment when set, else derived from the job id, so
every task of a job picks the same port without talking to the others.
"""

from __future__ import annotations

import itertools
import re
from typing import Mapping, NamedTuple

from fdp.errors import ConfigError

LOOPBACK = "127.0.0.1"
# Below Linux's ephemeral range (32768-60999), where the OS hands out client ports.
_PORT_BASE, _PORT_SPAN = 10000, 20000
_SLURM_NEEDED = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")


class JobWorld(NamedTuple):
    """One task's place in its job; ``environ()`` gives it as torchrun's variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    local: bool = False  # every task on this machine (submitit's local executor)

    def environ(self) -> dict[str, str]:
        """The variables ``torch.distributed``'s ``env://`` rendezvous and fdp read.

        >>> JobWorld(3, 8, 1, 2, "node01", 12345).environ()["MASTER_ADDR"]
        'node01'
        """
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list, in order (what ``scontrol show hostnames`` prints).

    >>> expand_nodelist("node[01-03,07],gpu-a[1-2]-x")
    ['node01', 'node02', 'node03', 'node07', 'gpu-a1-x', 'gpu-a2-x']
    """
    hosts: list[str] = []
    for name in _split_top_level(nodelist.strip()):
        # "rack[1-2]-n[01-02]": each bracket is a set of choices; the names are their product.
        parts = re.split(r"(\[[^\]]*\])", name)
        choices = [_expand_range(p[1:-1]) if p.startswith("[") else [p] for p in parts if p]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    if not hosts:
        raise ValueError(f"no host in node list {nodelist!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at the commas that are not inside brackets."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    names.append(text[start:])
    if depth != 0:
        raise ValueError(f"unbalanced brackets in node list {text!r}")
    return [n for n in names if n]


def _expand_range(spec: str) -> list[str]:
    out = []
    for item in spec.split(","):
        low, _, high = item.partition("-")
        if not high:
            out.append(low)
            continue
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise ValueError(f"bad range {item!r} in node list")
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return out


def _expand_counts(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` ("2(x3),1") as one count per node: [2, 2, 2, 1]."""
    counts = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ValueError(f"bad task count {item!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def port_for_job(job_id: str) -> int:
    """The rendezvous port every task of job ``job_id`` agrees on without talking.

    >>> port_for_job("4242"), port_for_job("4242_7")
    (14242, 14249)
    """
    digits = [int(d) for d in re.findall(r"\d+", job_id)]
    if not digits:
        raise ValueError(f"job id {job_id!r} has no number")
    return _PORT_BASE + sum(digits) % _PORT_SPAN


def slurm_world(env: Mapping[str, str]) -> JobWorld:
    """This task's ``JobWorld`` from SLURM's variables in ``env``.

    >>> env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
    ...        "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_NODELIST": "node[01-04]", "SLURM_JOB_ID": "777"}
    >>> slurm_world(env)  # doctest: +NORMALIZE_WHITESPACE
    JobWorld(rank=5, world_size=8, local_rank=1, local_world_size=2, master_addr='node01',
             master_port=10777, local=False)
    """
    missing = [name for name in _SLURM_NEEDED if not env.get(name)]
    if missing:
        raise ConfigError(
            f"world=slurm: the job environment lacks {', '.join(missing)} "
            "(run it as a SLURM task, through srun or hydra/launcher=submitit_slurm, or use another world)"
        )
    try:
        rank, world_size, local_rank = (int(env[k]) for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
        master = expand_nodelist(env["SLURM_JOB_NODELIST"])[0]
        counts = _expand_counts(env["SLURM_TASKS_PER_NODE"]) if env.get("SLURM_TASKS_PER_NODE") else []
        node = int(env.get("SLURM_NODEID") or 0)
        nodes = int(env.get("SLURM_JOB_NUM_NODES") or 1)
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else port_for_job(env["SLURM_JOB_ID"])
    except ValueError as error:
        raise ConfigError(f"world=slurm: unreadable job environment: {error}") from None
    # Without SLURM_TASKS_PER_NODE (an older or hand-made environment), assume an even spread.
    local_world_size = counts[node] if node < len(counts) else max(1, world_size // max(1, nodes))
    return _within_job(JobWorld(rank, world_size, local_rank, local_world_size, env.get("MASTER_ADDR") or master, port))


def submitit_world(job, env: Mapping[str, str]) -> JobWorld:
    """This task's ``JobWorld`` from a ``submitit.JobEnvironment`` (``job``) and ``env``.

    Under submitit's SLURM executor the SLURM variables are there and ``slurm_world`` reads
    them; its local executor sets only its own, which ``job`` reads.
    """
    if job.cluster != "local":
        return slurm_world(env)
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else port_for_job(str(job.job_id))
    per_node = job.num_tasks // max(1, job.num_nodes)
    return _within_job(JobWorld(job.global_rank, job.num_tasks, job.local_rank, per_node, LOOPBACK, port, local=True))


def _within_job(world: JobWorld) -> JobWorld:
    if not 0 <= world.rank < world.world_size:
        raise ConfigError(f"world=slurm: task rank {world.rank} is outside the job's {world.world_size} tasks")
    if not 0 <= world.local_rank < world.local_world_size:
        raise ConfigError(
            f"world=slurm: local rank {world.local_rank} is outside this node's {world.local_world_size} tasks"
        )
    return world


def job_world(env: Mapping[str, str]) -> JobWorld:
    """This task's ``JobWorld``: through submitit when it started the task, else SLURM's variables."""
    if env.get("SUBMITIT_EXECUTOR"):
        import submitit

        return submitit_world(submitit.JobEnvironment(), env)
    return slurm_world(env)
