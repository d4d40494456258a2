"""The Python examples in README.md run exactly as written."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from _paths import pythonpath_first

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## Using it from Python", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _env() -> dict:
    """This checkout first on the path, the caller's own entries (site dirs) kept."""
    return {**os.environ, "PYTHONPATH": pythonpath_first(ROOT)}


def _run(code: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    (cwd / "example.py").write_text(code)
    return subprocess.run([sys.executable, "example.py"], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def test_the_one_process_example_runs():
    (code,) = [block for block in _python_blocks() if "fdp.spawn(" not in block]
    done = subprocess.run([sys.executable, "-c", code + "\nassert state.step == 1 and metrics['loss'] > 0\n"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_two_process_example_trains_checkpoints_and_resumes_to_the_same_params(tmp_path):
    (code,) = [block for block in _python_blocks() if "fdp.spawn(" in block]
    done = _run(code, tmp_path, timeout=500)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "6 steps straight and 3 + 3 resumed: the same parameters on both ranks"
    assert [line.split(":")[0] for line in lines[:-1]] == ["step 3", "step 6", "step 6"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.pt", "step_00000003.pt", "step_00000006.pt"]
