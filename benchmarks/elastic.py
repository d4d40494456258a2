"""Time lost per lost rank: restarting the world from its last checkpoint against shrinking it in place.

The same run, four ways: fdp's trainer (``fdp.run.trainer.run``, what the recipe runs) on a
local world of 3 gloo ranks, a char transformer with dropout, Adam, a checkpoint every
25 steps; once rank 2 starts step 40 (15 steps after the last checkpoint) it is sent

* ``SIGKILL`` (a dead rank) or ``SIGSTOP`` (a hung one), under
* ``world.on_rank_loss=restart`` with ``world.max_restarts=1`` (torchelastic's model: every
  process is stopped and started again, and the world resumes from the last checkpoint),
  or ``world.on_rank_loss=shrink`` (the survivors go on with 2 ranks, ``fdp.dist.shrink``).

Time lost: from the signal until the world is back where it was, i.e. rank 0 has
completed step 40 (it starts step 41: ``<run dir>/ranks/rank0.txt``, polled every
millisecond). A restart pays detection (at once for a dead rank, which the agent sees
exit; ``world.timeout_s`` for a hung one, whose survivors' collective times out),
stopping every process (a stopped one only dies when the agent gives up waiting and
kills it), starting them again (interpreter, imports, model, plan), reading the
checkpoint and the 15 steps since it. A shrink pays detection, the heartbeat check
(~1.5 s), the new group and the step in flight. Also printed: the shrink's own
``seconds_lost`` (from its summary), each run's wall time, and restart / shrink.

    python -m benchmarks.elastic [--timeout 10] [--repeat 1]   # from the repo root; ~3 min
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from fdp.run.config import compose
from fdp.run.rundir import RankStatus
from fdp.run.trainer import run

RESULTS = Path(__file__).resolve().parent / "results" / "elastic.md"
STEPS, EVERY, AT, VICTIM = 80, 25, 40, 2
RUN = [
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
    "trainer.eval_every=0",
    "trainer.progress=false",
    f"trainer.max_steps={STEPS}",
    f"trainer.checkpoint_every={EVERY}",
    "world=local4",
    "world.nproc_per_node=3",
    "world.backend=gloo",
]
MODES = {"restart": ["world.on_rank_loss=restart", "world.max_restarts=1"], "shrink": ["world.on_rank_loss=shrink"]}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class _Watch(threading.Thread):
    """Signals the victim as it starts step ``AT``; then times how long until rank 0 starts step ``AT + 1``."""

    def __init__(self, run_dir: Path, sig: signal.Signals):
        super().__init__(daemon=True)
        self.run_dir, self.sig, self.lost_s, self.victim = run_dir, sig, None, None
        self.start()

    def run(self) -> None:
        while RankStatus.read(self.run_dir, VICTIM).get("step", 0) < AT:
            time.sleep(0.001)
        self.victim = RankStatus.read(self.run_dir, VICTIM)
        os.kill(self.victim["pid"], self.sig)
        sent = time.monotonic()
        while RankStatus.read(self.run_dir, 0).get("step", 0) <= AT:
            time.sleep(0.001)
        self.lost_s = time.monotonic() - sent


def _once(mode: str, sig: signal.Signals, timeout_s: float) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"elastic-{mode}-"))
    watch = _Watch(run_dir, sig)
    started = time.monotonic()
    try:
        summary = run(compose(*RUN, *MODES[mode], f"world.timeout_s={timeout_s}"), run_dir)
    finally:
        watch.join(5)
        if watch.victim and _alive(watch.victim["pid"]):
            os.kill(watch.victim["pid"], signal.SIGKILL)
    shrinks = summary.get("shrinks", [])
    return {
        "lost_s": watch.lost_s,
        "wall_s": time.monotonic() - started,
        "world": summary["world"],
        "reported_s": shrinks[0]["seconds_lost"] if shrinks else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="world.timeout_s (how long a hung rank takes to see)"
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows, ratios = [], []
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        measured = {}
        for mode in MODES:
            runs = [_once(mode, sig, args.timeout) for _ in range(args.repeat)]
            measured[mode] = {
                key: statistics.median(r[key] for r in runs) if runs[0][key] is not None else None for key in runs[0]
            }
            print(sig.name, mode, measured[mode], flush=True)
        ratio = measured["restart"]["lost_s"] / measured["shrink"]["lost_s"]
        ratios.append(ratio)
        for mode in MODES:
            m = measured[mode]
            reported = f"{m['reported_s']:.1f}" if m["reported_s"] is not None else "-"
            rows.append(
                f"| {sig.name} | {mode} | {m['lost_s']:.1f} | {reported} | {m['world']:.0f} | {m['wall_s']:.1f} |"
            )
        rows.append(f"| {sig.name} | restart / shrink | {ratio:.1f}x | | | |")
    load = os.getloadavg()[0]
    table = "\n".join(
        [
            "# Time lost per lost rank: restart against shrink (benchmarks/elastic.py)",
            "",
            f"3 gloo ranks of a local world (`world=local4 world.nproc_per_node=3`), char transformer d_model 64 x 2 "
            f"layers, dropout 0.1, Adam, global batch 24, {STEPS} steps, a checkpoint every {EVERY}; rank {VICTIM} is "
            f"signalled as it starts step {AT}; `world.timeout_s={args.timeout:g}`; median of {args.repeat}; torch "
            f"{torch.__version__}; {time.strftime('%Y-%m-%d')}; load average {load:.1f} at the end (2-core machine).",
            "",
            f"Time lost: from the signal until rank 0 has completed step {AT} again. Reported: the shrink's own "
            "`seconds_lost` (from the start of the dropped step until the smaller world starts it again).",
            "",
            "| signal | on_rank_loss | time lost (s) | reported (s) | final world | wall (s) |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"`python -m benchmarks.elastic --timeout {args.timeout:g} --repeat {args.repeat}`",
            "",
        ]
    )
    print(table)
    args.out.write_text(table)


if __name__ == "__main__":
    main()
