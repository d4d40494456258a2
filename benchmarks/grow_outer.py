"""A world that grows back under local SGD equals a run stopped and resumed at each new size (too long for the suite).

Three gloo ranks under ``outer=local_sgd outer.sync_every=4`` and ``world.respawn=true`` (the settings of
``tests/procs/test_grow.py``); rank 2 is SIGKILLed as it starts step 20: the world shrinks to two, the rank is started
again and joins at a sync step. The reference stops a run at the shrink's step, resumes it on two ranks to the
join's step, then on three ranks to the end. Printed: the steps and the largest difference of the final params
(goal: 0); written to ``benchmarks/results/grow_outer.md``.

    python benchmarks/grow_outer.py
"""

from __future__ import annotations

import datetime
import signal
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

LOCAL = ["outer=local_sgd", "outer.sync_every=4"]


def main() -> None:
    from test_grow import COMMON, KILL_AT, RESPAWN
    from test_shrink import Signaller, final_params

    from fdp.run.config.compose import compose
    from fdp.run.trainer import run

    base = Path(tempfile.mkdtemp())
    grown, reference = base / "grown", base / "reference"
    grown.mkdir()
    reference.mkdir()
    signaller = Signaller(grown, signal.SIGKILL, rank=2, step=KILL_AT)
    try:
        summary = run(compose(*COMMON, *RESPAWN, *LOCAL), grown)
    finally:
        signaller.done()
    (shrink,), (grow,) = summary["shrinks"], summary["grows"]
    run(compose(*COMMON, *RESPAWN, *LOCAL, f"trainer.stop_at={shrink['step']}"), reference)
    on_two = ["world.nproc_per_node=2", f"trainer.stop_at={grow['step']}", "trainer.resume=true"]
    run(compose(*COMMON, *RESPAWN, *LOCAL, *on_two), reference)
    run(compose(*COMMON, *RESPAWN, *LOCAL, "trainer.resume=true"), reference)
    a, b = final_params(grown), final_params(reference)
    gap = max((a[n] - b[n]).abs().max().item() for n in a)
    line = (
        f"shrink at step {shrink['step']}, join at step {grow['step']} (asked at {grow['asked']}), "
        f"world {summary['world']} at the end: largest |grown - stopped and resumed| = {gap:.3g}"
    )
    print(line)
    (REPO / "benchmarks" / "results" / "grow_outer.md").write_text(
        f"# Growing back under local SGD against a stopped and resumed run "
        f"({datetime.date.today().isoformat()})\n\n`python benchmarks/grow_outer.py`: {line}.\n"
    )


if __name__ == "__main__":
    main()
