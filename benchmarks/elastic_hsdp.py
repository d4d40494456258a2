"""Time lost to a killed rank at ZeRO stage 3 under HSDP: the node steps out (shrink), comes back (respawn), or
the world restarts from its last checkpoint; and torchft's HSDP recovery.

``benchmarks.elastic``'s run and measures (``_fdp``: the trainer, rank 2 sent ``SIGKILL`` as it
starts step 40, 15 steps after the last checkpoint) on 4 gloo ranks in two simulated nodes
of two (``world.hierarchical=true world.node_size=2``) at ``trainer.zero_stage=3``: each
node holds a replica of every slice, sharded inside the node. Under ``shrink`` the lost
rank's node steps out whole and the other node trains on alone (nothing re-split, sent or
read from disk); with ``world.respawn=true`` both ranks of the node are started again, join
at a step boundary and heal from their replicas in the other node; under ``restart`` every
process is stopped and started again from the checkpoint.

torchft 0.2.0's side (``_torchft_hsdp``): the same model, data split and Adam on 2 replica
groups of 2 processes (``benchmarks._torchft_replica --group-size 2``: FSDP2 ``fully_shard``
inside the group, each reduce-scattered gradient slice all-reduced across the groups by its
``Manager``), a lighthouse here with ``min_replicas=1``; the groups are kept as torchrun keeps
them (``_Group``: a process that dies takes its group down, the group is started again), the
restarted group heals each rank's slices from the same rank of the other group over HTTP.
Time lost: from the signal until both ranks of the restarted group committed a step with
both groups participating.

    python -m benchmarks.elastic_hsdp [--timeout 10]   # from the repo root; ~15 min on a loaded 2-core machine
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.elastic import AT, EVERY, MODEL, MODES, RUN, STEPS, VICTIM, _fdp, _fmt, _tries

RESULTS = Path(__file__).resolve().parent / "results" / "elastic_hsdp.md"
HSDP = (
    *[o for o in RUN if not o.startswith("world.nproc_per_node")],
    "world.nproc_per_node=4",
    "world.hierarchical=true",
    "world.node_size=2",
    "trainer.zero_stage=3",
)


GROUPS, GROUP_SIZE = 2, 2
# torchft's run is longer than fdp's, so that the group started anew (a fresh interpreter, as torchrun starts one:
# tens of seconds of imports on a loaded machine) is back before the group left alone finishes; its loss is the one
# at step STEPS, as fdp's.
TORCHFT_STEPS = 2 * STEPS
MONITOR_S = 0.1  # how often the launcher looks at its processes (torchrun's --monitor-interval default)


class _Group:
    """One torchft replica group of GROUP_SIZE processes, kept as torchrun keeps a group: the launcher hosts the
    group's store, and once one of its processes dies it stops the others (SIGTERM) and starts the group again."""

    def __init__(self, index: int, folder: Path, env: dict, timeout_s: float, model: list[str], restarts: int):
        self.index, self.folder, self.env, self.timeout_s, self.model = index, folder, env, timeout_s, model
        self.procs: list[subprocess.Popen] = []
        self.restarts, self.max_restarts = 0, restarts
        self.launched: list[float] = []  # when each start began (time.time())
        self.start()

    def start(self) -> None:
        import torch.distributed as dist

        self.launched.append(time.time())
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks._torchft_replica",
                    *("--replica", str(self.index), "--replicas", str(GROUPS)),
                    *("--group-size", str(GROUP_SIZE), "--group-rank", str(rank)),
                    *("--store-port", str(self.store.port), "--timeout", str(self.timeout_s)),
                    *("--out", str(self.folder / f"r{self.index * GROUP_SIZE + rank}.txt")),
                    "--",
                    *self.model,
                ],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=open(self.folder / f"g{self.index}.{self.restarts}.{rank}.err", "w"),  # noqa: SIM115
            )
            for rank in range(GROUP_SIZE)
        ]

    def poll(self) -> bool:
        """Whether the group finished; a process that died takes the group down and it starts again."""
        codes = [p.poll() for p in self.procs]
        if all(c == 0 for c in codes):
            return True
        if any(c not in (None, 0) for c in codes):
            if self.restarts == self.max_restarts:
                raise RuntimeError(f"torchft group {self.index} failed again: exit codes {codes}")
            for p in self.procs:
                if p.poll() is None:
                    p.terminate()
            for p in self.procs:
                p.wait()
            self.restarts += 1
            self.start()
        return False


def _lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _torchft_hsdp(
    kill: bool, timeout_s: float, model: tuple[str, ...] = (*MODEL, f"trainer.max_steps={TORCHFT_STEPS}")
) -> dict:
    """torchft's HSDP: GROUPS replica groups of GROUP_SIZE ranks (FSDP2 inside, torchft's manager across); with
    ``kill``, launch rank VICTIM is SIGKILLed as it starts step AT and its group is started again."""
    os.environ["RUST_LOG"] = "error"  # the lighthouse in this process: its errors only
    from torchft.coordination import LighthouseServer

    folder = Path(tempfile.mkdtemp(prefix="elastic-hsdp-torchft-"))
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)  # the group left trains on alone, as shrink does
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address(), "RUST_LOG": "error"}
    world = GROUPS * GROUP_SIZE
    began = time.monotonic()
    groups = [_Group(g, folder, env, timeout_s, list(model), int(kill)) for g in range(GROUPS)]
    sent_wall = None
    try:
        done = [False] * GROUPS
        while not all(done):
            if kill and sent_wall is None:
                steps = [int(w[1]) for w in _lines(folder / f"r{VICTIM}.txt") if w[0] != "start"]
                if steps and steps[-1] >= AT - 1:  # the victim starts step AT once it wrote step AT - 1
                    groups[VICTIM // GROUP_SIZE].procs[VICTIM % GROUP_SIZE].kill()
                    sent_wall = time.time()
            done = [d or g.poll() for d, g in zip(done, groups)]
            time.sleep(MONITOR_S if sent_wall or not kill else 0.001)
    finally:
        for g in groups:
            for p in g.procs:
                if p.poll() is None:
                    p.kill()
        lighthouse.shutdown()
    wall = time.monotonic() - began
    records = {r: [w for w in _lines(folder / f"r{r}.txt") if w[0] != "start"] for r in range(world)}
    times = [float(w[0]) for w in records[0]]
    out = {
        "wall_s": wall,
        "world": GROUP_SIZE * int(records[0][-1][2]),
        "loss": statistics.mean(
            float([w for w in records[r] if int(w[1]) <= STEPS][-1][3]) for r in range(world)
        ),  # at step STEPS
        "lost_s": None,
        "redone": None,
        "full": True,
        "step_ms": 1000 * statistics.median(b - a for a, b in zip(times[10:], times[11:])),
    }
    if kill:
        backs, starts = [], []
        for r in range(VICTIM // GROUP_SIZE * GROUP_SIZE, (VICTIM // GROUP_SIZE + 1) * GROUP_SIZE):
            restarted, back = False, None
            for w in _lines(folder / f"r{r}.txt"):
                if w[0] == "start" and float(w[1]) > sent_wall:
                    restarted = True
                    starts.append(float(w[1]))
                elif restarted and w[0] != "start" and int(w[2]) == GROUPS:
                    back = float(w[0])
                    break
            backs.append(back)
        out["lost_s"] = max(backs) - sent_wall if None not in backs else None
        relaunched = groups[VICTIM // GROUP_SIZE].launched[-1]
        out["detect_s"] = relaunched - sent_wall  # until the launcher saw the loss and started the group again
        out["startup_s"] = max(starts) - relaunched if starts else None  # a fresh interpreter: imports and build
        after = [int(w[1]) for w in records[0] if float(w[0]) >= sent_wall]
        out["redone"] = sum(1 for a, b in zip(after, after[1:]) if a == b)  # a step the survivors ran again
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=10.0, help="world.timeout_s")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows, lost = [], {}
    for mode in (*MODES, "torchft"):
        if mode == "torchft":
            m = _tries(_torchft_hsdp, True, args.timeout)
        else:
            m = _tries(_fdp, mode, signal.SIGKILL, args.timeout, HSDP)
        print(mode, m, flush=True)
        lost[mode], measured = m["lost_s"], m
        note = "" if m["full"] else " (on 2 ranks)"
        rows.append(
            f"| {mode} | {_fmt(m['lost_s'], '.1f')}{note} | {_fmt(m['redone'], '.0f')} | {m['world']:.0f} "
            f"| {m['loss']:.3f} | {m['step_ms']:.1f} | {m['wall_s']:.1f} |"
        )
    ratios = ", ".join(
        f"{mode} {_fmt(lost[mode] / lost['torchft'] if lost[mode] and lost['torchft'] else None, '.2f')}x"
        for mode in MODES
    )
    print(f"time lost / torchft's: {ratios}", flush=True)
    load = os.getloadavg()[0]
    width = next(o.split("=")[1] for o in MODEL if o.startswith("model.d_model"))
    table = "\n".join(
        [
            "# Time lost to a killed rank at ZeRO stage 3 under HSDP (benchmarks/elastic_hsdp.py)",
            "",
            "4 gloo ranks in two simulated nodes of two (`world=local4 world.hierarchical=true world.node_size=2 "
            f"trainer.zero_stage=3`), char transformer d_model {width} x 2 layers, dropout 0.1, Adam, global batch 24, "
            f"{STEPS} steps, checkpoints every {EVERY}; launch rank {VICTIM} is sent SIGKILL as it starts step {AT} "
            f"and (respawn, torchft) started again at once; timeouts {args.timeout:g} s; one run each; "
            f"torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; "
            f"load average {load:.1f} at the end (2-core machine shared with others).",
            "",
            "Time lost: from the signal until the world is back at 4 ranks and completed a step there (shrink: until "
            "the node left steps again, on 2 ranks; torchft: until the restarted group committed a step with both "
            "groups). Redone: steps done at the signal that are computed again. Step: "
            "the run's median step time (over its sizes).",
            "",
            "| way | time lost (s) | redone steps | final world | final loss | step (ms) | wall (s) |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            "`restart` is `world.on_rank_loss=restart world.max_restarts=1`; `shrink` is `world.on_rank_loss=shrink`; "
            "`grow` adds `world.respawn=true world.respawn_delay_s=0`. The final losses of shrink and grow are equal "
            "(per-sample dropout streams; restart draws from each rank's generator).",
            "",
            "`torchft` is torchft 0.2.0's HSDP: 2 replica groups of 2 processes, FSDP2 `fully_shard` (per block and "
            "the root) on each group's mesh, every reduce-scattered gradient slice all-reduced across the groups by "
            "its `Manager` (`set_all_reduce_hook`; a quorum through the lighthouse every step, `min_replicas=1`), the "
            "same model, data split and Adam; a group is kept as torchrun keeps it (the launcher looks every "
            "0.1 s; once a process died it stops the group and starts it again), the restarted group heals its "
            "slices from the other group over HTTP (`benchmarks._torchft_replica --group-size 2`). Its step is the "
            f"median interval between rank 0's committed steps. It runs {TORCHFT_STEPS} steps (its loss is the one at "
            f"step {STEPS}) so that the group started anew is back before the other group ends. Of its time lost, "
            f"{_fmt(measured.get('detect_s'), '.1f')} s until the launcher started the group again and "
            f"{_fmt(measured.get('startup_s'), '.1f')} s until both new processes had imported torch, torchft and fdp "
            "and built the model (a fresh interpreter, as torchrun starts one; fdp's keeper forks its rank anew from a "
            "process that has them), leaving "
            + _fmt(
                measured["lost_s"] - measured["detect_s"] - measured["startup_s"]
                if None not in (measured.get("lost_s"), measured.get("startup_s"))
                else None,
                ".1f",
            )
            + " s for its quorum, the heal and the first step with both groups.",
            "",
            f"Time lost / torchft's: {ratios}.",
            "",
            f"`python -m benchmarks.elastic_hsdp --timeout {args.timeout:g}`",
            "",
        ]
    )
    print(table)
    args.out.write_text(table)


if __name__ == "__main__":
    main()
