"""The commands of examples/README.md, run from the shell as a user runs them."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import _recipe
from _paths import pythonpath_first

ROOT = Path(__file__).resolve().parents[1]


def example_command(package):
    """The first command of examples/README.md that trains ``package`` (as written, its lines joined), after
    PYTHONPATH= and the script."""
    text = (ROOT / "examples" / "README.md").read_text()
    block = [b for b in re.findall(r"```bash\n(.*?)\n```", text, re.S) if f"{package}.data.make" in b][0]
    command = shlex.split(block.replace("\\\n", " "))
    assert command[0] == "PYTHONPATH=examples" and command[1:3] == ["python", "recipes/train.py"]
    return command[3:]


def train_example(package, run_dir, *overrides, timeout=300):
    """The example's command as the shell runs it but for the imports (tests/_recipe.py), later overrides appended
    (they win); the summary line and the metrics records."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": pythonpath_first(ROOT / "examples"),
        "HF_HUB_OFFLINE": "1",
    }
    command = [
        sys.executable,
        str(ROOT / "recipes" / "train.py"),
        *example_command(package),
        "trainer.progress=false",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    proc = _recipe.run(command, env=env, cwd=ROOT, timeout=timeout)  # forked from the preloaded server
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("fdp: ")]
    assert len(summary) == 1, proc.stdout[-2000:]
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["summary"]
    return summary[0], records
