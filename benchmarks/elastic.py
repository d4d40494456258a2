"""Time lost per lost rank: restarting the world, shrinking it, shrinking and growing back, and torchft.

The same run, each way: fdp's trainer (``fdp.run.trainer.run``, what the recipe runs) on a
local world of 3 gloo ranks, a char transformer with dropout, Adam, a checkpoint every
25 steps; once rank 2 starts step 40 (15 steps after the last checkpoint) it is sent
``SIGKILL`` (``--hung`` adds ``SIGSTOP``, a hung rank, for restart and shrink), under

* ``world.on_rank_loss=restart`` with ``world.max_restarts=1`` (torchelastic's model: every
  process is stopped and started again, and the world resumes from the last checkpoint);
* ``world.on_rank_loss=shrink`` (the survivors go on with 2 ranks, ``fdp.procs.shrink``);
* ``shrink`` with ``world.respawn=true`` (``grow``: the lost rank's keeper starts it again at
  once, it joins at a step boundary and heals from the survivors, ``fdp.procs.grow``);
* ``torchft`` 0.2.0: three replica groups of one process each (``benchmarks._torchft_replica``:
  the same model, data split, Adam and gloo) under its ``Manager`` with a lighthouse in this
  process (a quorum every step, DDP-style fault tolerance: a step whose all-reduce failed is
  not committed); the killed replica is started again at once and heals from a peer over HTTP.

Time lost per failure: from the signal until the world is back at full size and has
completed a step there (restart: rank 0 completed step 40 again; grow: the first step
after the join; torchft: the restarted replica's first step committed with 3
participants). A shrink never gets back to full size: its column is the time until it
steps again on 2 ranks. Steps computed twice: the steps the world had done at the
signal that it computes again. Per step while nothing fails: the median step time of an
uninterrupted run of each (fdp under ``restart``, and under ``shrink`` with ``respawn``,
which looks for a joiner in the store at every step boundary; torchft with its quorum).

    python -m benchmarks.elastic [--timeout 10] [--repeat 1] [--hung]   # from the repo root; ~10 min
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from fdp.run.config.compose import compose
from fdp.run.rundir import RankStatus
from fdp.run.trainer import run

RESULTS = Path(__file__).resolve().parent / "results" / "elastic.md"
STEPS, EVERY, AT, VICTIM = 200, 25, 40, 2  # long enough after the kill for a restarted process to rejoin
MODEL = [
    "model=charlm",
    "data=stdlib_text",
    "model.d_model=64",
    "model.n_layer=2",
    "model.n_head=4",
    "model.dropout=0.1",
    "data.block_size=32",
    "data.max_chars=50000",
    "data.global_batch_size=24",
    "optim=adam",
    "optim.lr=1e-3",
    f"trainer.max_steps={STEPS}",
]
RUN = [
    *MODEL,
    "trainer.eval_every=0",
    "trainer.progress=false",
    f"trainer.checkpoint_every={EVERY}",
    "world=local4",
    "world.nproc_per_node=3",
    "world.backend=gloo",
]
MODES = {
    "restart": ["world.on_rank_loss=restart", "world.max_restarts=1"],
    "shrink": ["world.on_rank_loss=shrink"],
    "grow": ["world.on_rank_loss=shrink", "world.respawn=true", "world.respawn_delay_s=0"],
}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class _Watch(threading.Thread):
    """Signals the victim as it starts step ``AT`` (``sig=None``: never); records when rank 0 started each step."""

    def __init__(self, run_dir: Path, sig: signal.Signals | None):
        super().__init__(daemon=True)
        self.run_dir, self.sig, self.victim, self.sent, self.done = run_dir, sig, None, None, threading.Event()
        self.started: dict[int, float] = {}  # rank 0's step -> when it started it (the last time: a restart redoes)
        self.start()

    def run(self) -> None:
        seen = None
        while not self.done.is_set():
            status = RankStatus.read(self.run_dir, VICTIM)
            if self.sig is not None and self.sent is None and status.get("step", 0) >= AT:
                self.victim = status
                os.kill(status["pid"], self.sig)
                self.sent = time.monotonic()
                self.rank0_at_kill = RankStatus.read(self.run_dir, 0).get("step", 1)  # the step rank 0 was on
            step = RankStatus.read(self.run_dir, 0).get("step")
            if step is not None and step != seen:  # a new step (a restarted rank 0 starts again from its checkpoint)
                self.started[step], seen = time.monotonic(), step
            time.sleep(0.001)

    def step_done(self, step: int) -> float | None:
        """When rank 0 completed ``step`` (started the next) after the signal."""
        after = [t for s, t in self.started.items() if s > step and t >= (self.sent or 0)]
        return min(after) if after else None


def _fdp(mode: str, sig: signal.Signals | None, timeout_s: float, base: tuple[str, ...] = tuple(RUN)) -> dict:
    """One fdp run of ``base`` under ``mode`` (``MODES``), ``sig`` sent to rank ``VICTIM`` at step ``AT``."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"elastic-{mode}-"))
    watch = _Watch(run_dir, sig)
    started = time.monotonic()
    try:
        summary = run(compose(*base, *MODES[mode], f"world.timeout_s={timeout_s}"), run_dir)
    finally:
        watch.done.set()
        watch.join(5)
        if watch.victim and _alive(watch.victim["pid"]):
            os.kill(watch.victim["pid"], signal.SIGKILL)
    out = {
        "wall_s": time.monotonic() - started,
        "world": summary["world"],
        "loss": summary["loss"],
        "step_ms": summary["step_ms"],
        "lost_s": None,
        "redone": None,
        "full": True,
    }
    if sig is None:
        return out
    done_at_kill = watch.rank0_at_kill - 1  # the steps rank 0 had completed
    shrinks, grows = summary.get("shrinks", []), summary.get("grows", [])
    if mode == "restart":
        back = watch.step_done(AT)
        out["redone"] = max(0, done_at_kill - (AT // EVERY) * EVERY)
    elif mode == "shrink":
        back = watch.step_done(shrinks[0]["step"] + 1)  # a step done again, on fewer ranks
        out["redone"], out["full"] = max(0, done_at_kill - shrinks[0]["step"]), False
    else:
        back = watch.step_done(grows[0]["step"] + 1) if grows else None  # a step done on 3 ranks again
        out["redone"], out["full"] = max(0, done_at_kill - shrinks[0]["step"]), bool(grows)
    out["lost_s"] = back - watch.sent if back is not None else None
    return out


def _torchft(kill: bool, timeout_s: float) -> dict:
    """Three torchft replica groups; with ``kill``, replica ``VICTIM`` is SIGKILLed as it starts step ``AT`` and
    started again at once."""
    from torchft.coordination import LighthouseServer

    folder = Path(tempfile.mkdtemp(prefix="elastic-torchft-"))
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address(), "RUST_LOG": "error"}

    def start(replica: int) -> subprocess.Popen:
        command = [
            sys.executable,
            "-m",
            "benchmarks._torchft_replica",
            "--replica",
            str(replica),
            "--timeout",
            str(timeout_s),
            "--out",
            str(folder / f"r{replica}.txt"),
            "--",
            *MODEL,
        ]
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def lines(replica: int) -> list[list[str]]:
        path = folder / f"r{replica}.txt"
        return [line.split() for line in path.read_text().splitlines()] if path.exists() else []

    began = time.monotonic()
    procs = {r: start(r) for r in range(3)}
    if kill:
        while True:  # a line per committed step: the victim starts step AT once it wrote step AT - 1
            steps = [int(w[1]) for w in lines(VICTIM) if w[0] != "start"]
            if steps and steps[-1] >= AT - 1:
                break
            time.sleep(0.001)
        procs[VICTIM].kill()
        sent_wall = time.time()
        procs[VICTIM].wait()
        procs[VICTIM] = start(VICTIM)
    for proc in procs.values():
        proc.wait()
    wall = time.monotonic() - began
    lighthouse.shutdown()
    records = {r: [w for w in lines(r) if w[0] != "start"] for r in range(3)}
    last = [float(records[r][-1][3]) for r in range(3)]
    times = [float(w[0]) for w in records[0]]
    steady = [b - a for a, b in zip(times[10:], times[11:])]
    out = {
        "wall_s": wall,
        "world": int(records[0][-1][2]),
        "loss": sum(last) / 3,
        "lost_s": None,
        "redone": None,
        "full": True,
        "step_ms": 1000 * statistics.median(steady),
    }
    if kill:
        restarted = False
        back = None
        for w in lines(VICTIM):
            if w[0] == "start" and float(w[1]) > sent_wall:
                restarted = True
            elif restarted and w[0] != "start" and int(w[2]) == 3:
                back = float(w[0])
                break
        out["lost_s"] = back - sent_wall if back is not None else None
        # Steps replica 0 had committed at the signal and ran again: those not committed after it (a line repeating
        # the step before it).
        after = [int(w[1]) for w in records[0] if float(w[0]) >= sent_wall]
        out["redone"] = sum(1 for a, b in zip(after, after[1:]) if a == b)
    return out


def _lookup_us(calls: int = 2000) -> tuple[float, float]:
    """What a world that may grow pays per step for it (``GrowingWorld.due`` on a loopback store): microseconds per
    call on rank 0 (it counts the requests) and on another rank (it looks for rank 0's schedule)."""
    import datetime

    import torch.distributed as dist

    from fdp.procs.grow import GrowingWorld

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    out = []
    for me in (0, 1):
        world = GrowingWorld(store, me, 3, "gloo", 30.0)
        try:
            began = time.perf_counter()
            for step in range(calls):
                world.due(step)
            out.append(1e6 * (time.perf_counter() - began) / calls)
        finally:
            world.close()
    return out[0], out[1]


def _tries(measure, *args, attempts: int = 2) -> dict:
    """``measure(*args)``, tried again once if the run failed (a machine shared with others may starve a rank past
    its heartbeat: then the run says so and ends)."""
    for attempt in range(attempts):
        try:
            return measure(*args)
        except Exception as error:  # noqa: BLE001 - reported, then tried again
            print(f"{measure.__name__}{args}: attempt {attempt + 1} failed: {str(error).splitlines()[0][:200]}")
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _median(runs: list[dict]) -> dict:
    return {
        key: (statistics.median(r[key] for r in runs) if all(r[key] is not None for r in runs) else None)
        if not isinstance(runs[0][key], bool)
        else all(r[key] for r in runs)
        for key in runs[0]
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _calm(timeout_s: float, repeat: int) -> dict:
    """The uninterrupted runs, interleaved over ``repeat`` rounds (a shared machine's load moves between them): fdp
    under ``restart``, fdp under ``shrink`` + ``respawn``, torchft; the median of each."""
    ways = {
        "fdp, on_rank_loss=restart": lambda: _tries(_fdp, "restart", None, timeout_s),
        "fdp, shrink + respawn (a store look-up per step)": lambda: _tries(_fdp, "grow", None, timeout_s),
        "torchft (a quorum per step)": lambda: _tries(_torchft, False, timeout_s),
    }
    runs: dict[str, list[dict]] = {key: [] for key in ways}
    for _ in range(repeat):
        for key, measure in ways.items():
            runs[key].append(measure())
            print("no failure:", key, runs[key][-1], flush=True)
    return {key: _median(done) for key, done in runs.items()}


def _calm_rows(calm: dict) -> list[str]:
    """The table's rows: each run's step, its ratio to fdp's ``restart`` and to torchft's, its final loss."""
    base, ft = calm["fdp, on_rank_loss=restart"]["step_ms"], calm["torchft (a quorum per step)"]["step_ms"]
    return [
        f"| {key} | {m['step_ms']:.1f} | {m['step_ms'] / base:.2f} | {m['step_ms'] / ft:.2f} | {m['loss']:.3f} |"
        for key, m in calm.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="world.timeout_s (how long a hung rank takes to see)"
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--hung", action="store_true", help="also SIGSTOP (a hung rank) under restart and shrink")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--calm",
        action="store_true",
        help="only the uninterrupted runs (the step while nothing fails), printed; the results file is left as it is",
    )
    args = parser.parse_args()
    if args.calm:
        for row in _calm_rows(_calm(args.timeout, args.repeat)):
            print(row)
        print(f"load average {os.getloadavg()[0]:.1f} at the end", flush=True)
        return
    rows, measured = [], {}
    ways = [("SIGKILL", mode) for mode in (*MODES, "torchft")]
    ways += [("SIGSTOP", mode) for mode in ("restart", "shrink")] if args.hung else []
    for name, mode in ways:
        sig = signal.Signals[name]
        if mode == "torchft":
            runs = [_tries(_torchft, True, args.timeout) for _ in range(args.repeat)]
        else:
            runs = [_tries(_fdp, mode, sig, args.timeout) for _ in range(args.repeat)]
        measured[name, mode] = m = _median(runs)
        print(name, mode, m, flush=True)
        note = "" if m["full"] else " (on 2 ranks)"
        rows.append(
            f"| {name} | {mode} | {_fmt(m['lost_s'], '.1f')}{note} | {_fmt(m['redone'], '.0f')} | {m['world']:.0f} "
            f"| {m['loss']:.3f} | {m['wall_s']:.1f} |"
        )
    fdp_grow, ft = measured["SIGKILL", "grow"]["lost_s"], measured["SIGKILL", "torchft"]["lost_s"]
    ratio = ft / fdp_grow if fdp_grow and ft else None
    calm = _calm(args.timeout, args.repeat)
    lookup0, lookup1 = _lookup_us()
    print(f"per-step look-up for a joiner: {lookup0:.0f} us on rank 0, {lookup1:.0f} us on the others", flush=True)
    calm_rows = _calm_rows(calm)
    load = os.getloadavg()[0]
    table = "\n".join(
        [
            "# Time lost per lost rank: restart, shrink, shrink + grow back, torchft (benchmarks/elastic.py)",
            "",
            f"3 gloo ranks (fdp: a local world, `world=local4 world.nproc_per_node=3`; torchft 0.2.0: 3 replica groups "
            f"of one process under its `Manager`, a lighthouse with `min_replicas=2`), char transformer d_model 64 x 2 "
            f"layers, dropout 0.1, Adam, global batch 24 split in 3, {STEPS} steps, fdp checkpoints every {EVERY}; "
            f"rank {VICTIM} is signalled as it starts step {AT} and (grow, torchft) started again at once; "
            f"timeouts {args.timeout:g} s; median of {args.repeat}; torch {torch.__version__}; "
            f"{time.strftime('%Y-%m-%d')}; load average {load:.1f} at the end (2-core machine shared with others).",
            "",
            "Time lost: from the signal until the world is back at full size and completed a step there (shrink: "
            "until it steps again, on 2 ranks). Redone: steps done at the signal that are computed again. Loss: the "
            "last step's (fdp: the world's mean; torchft: the mean of the replicas').",
            "",
            "| signal | way | time lost (s) | redone steps | final world | final loss | wall (s) |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"torchft / fdp grow, time lost per failure: {_fmt(ratio, '.1f')}x.",
            "",
            "While nothing fails (the same run, uninterrupted): median step time.",
            "",
            "| run | step (ms) | / fdp restart | / torchft | final loss |",
            "|---|---|---|---|---|",
            *calm_rows,
            "",
            "fdp under `shrink` draws dropout per sample (`fdp.model.streams_functions`, docs: 0.99x a step's CPU at "
            "d_model 128, 1.56x at tiny widths) and looks for a joiner once per step; that look-up alone "
            "(`GrowingWorld.due` on a loopback "
            f"store, {2000} calls): {lookup0:.0f} us a step on rank 0, {lookup1:.0f} us on the others. torchft's "
            "quorum runs during the forward (`use_async_quorum`), its commit after the backward.",
            "",
            f"`python -m benchmarks.elastic --timeout {args.timeout:g} --repeat {args.repeat}"
            + (" --hung`" if args.hung else "`"),
            "",
        ]
    )
    print(table)
    args.out.write_text(table)


if __name__ == "__main__":
    main()
