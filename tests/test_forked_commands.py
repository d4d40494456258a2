"""tests/_recipe.py runs ``python SCRIPT ARGS`` forked from the preloaded server: what the command prints, where
it runs, what it sees and how it exits are what a fresh interpreter gives, so the tests that run recipes that way
check what the shell would."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import _recipe
import pytest
from _procs import alive

SCRIPT = """
import atexit, os, sys
atexit.register(lambda: print("exit functions ran", flush=True))
import mine  # a module of the command's PYTHONPATH
print("argv", sys.argv, "cwd", os.getcwd(), "path0", sys.path[0], "env", os.environ.get("FORKED_TAG"), mine.NAME)
print("on stderr", file=sys.stderr, flush=True)
os.system("echo from a child process")  # a child's output goes where the command's does
if sys.argv[1] == "raise":
    raise ValueError("bad input")
sys.exit(None if sys.argv[1] == "none" else sys.argv[1] if sys.argv[1] == "text" else int(sys.argv[1]))
"""


@pytest.mark.parametrize("how", ["0", "3", "none", "text", "raise"])
def test_a_forked_command_prints_runs_and_exits_as_a_fresh_interpreter(tmp_path, how):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mine.py").write_text("NAME = 'mine'\n")
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "elsewhere").mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib"), "FORKED_TAG": how}
    argv = [sys.executable, str(tmp_path / "script.py"), how]
    fresh = _recipe.run(argv, env=env, cwd=tmp_path / "elsewhere", timeout=60, fresh=True)
    forked = _recipe.run(argv, env=env, cwd=tmp_path / "elsewhere", timeout=60)
    assert forked.returncode == fresh.returncode == {"0": 0, "3": 3, "none": 0, "text": 1, "raise": 1}[how]
    assert forked.stdout == fresh.stdout and "from a child process" in fresh.stdout
    assert f"'{how}'] cwd {tmp_path / 'elsewhere'} path0 {tmp_path} env {how} mine" in fresh.stdout
    if how == "raise":  # the traceback's frames differ (runpy's), its last line does not
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "ValueError: bad input"
    else:
        assert forked.stderr == fresh.stderr


CODE = """
import os, sys
def here(): pass
print("argv", sys.argv, "path0", repr(sys.path[0]), "main", __name__, here.__module__, "__file__" in globals())
print("cwd", os.getcwd(), "env", os.environ.get("FORKED_TAG"))
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_python_c_command_runs_as_a_fresh_interpreter_runs_it(tmp_path):
    """``python -c CODE ARGS``: argv[0] '-c', '' first on the path, the code's functions in ``__main__``."""
    env = {**os.environ, "FORKED_TAG": "c"}
    argv = [sys.executable, "-c", CODE, "3"]
    fresh = _recipe.run(argv, env=env, cwd=tmp_path, timeout=60, fresh=True)
    forked = _recipe.run(argv, env=env, cwd=tmp_path, timeout=60)
    assert forked.returncode == fresh.returncode == 3, forked.stderr
    assert (
        forked.stdout
        == fresh.stdout
        == f"argv ['-c', '3'] path0 '' main __main__ __main__ False\ncwd {tmp_path} env c\n"
    )
    assert forked.stderr == fresh.stderr == ""


def test_a_command_past_its_timeout_is_killed_with_its_group(tmp_path):
    (tmp_path / "script.py").write_text("import subprocess, time\nsubprocess.Popen(['sleep', '60'])\ntime.sleep(60)\n")
    started = _recipe.start([sys.executable, str(tmp_path / "script.py")], env=dict(os.environ), cwd=tmp_path)
    with pytest.raises(_recipe.subprocess.TimeoutExpired):
        started.communicate(timeout=1)
    assert started.poll() == -9
    deadline = time.monotonic() + 10  # the sleeping child went with it, once the init process has reaped it
    while time.monotonic() < deadline and any(alive(pid) for pid in _group(started.pid)):
        time.sleep(0.05)
    assert not [pid for pid in _group(started.pid) if alive(pid)]


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                found.append(int(entry.name))
        except OSError:
            continue
    return found
