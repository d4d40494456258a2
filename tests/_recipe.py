"""A shell command ``python SCRIPT ARGS...`` run as the shell runs it, minus the interpreter's start-up.

Tests that run many short recipe commands (the docs' commands, refusals that end before step 1) spend most
of their time importing torch, torch._dynamo and fdp again in each fresh interpreter: 5 s each on a loaded
2-core machine. ``start`` forks the command instead from the forkserver that tests/conftest.py keeps, which
imported them once, and runs the script there as the interpreter would: ``sys.argv``, ``sys.path`` (the
script's directory, then PYTHONPATH's entries), the environment and the working directory are the
command's own, the script runs as ``__main__`` (so the workers a local world spawns re-import it as they
do from the shell), its output goes to files through the process's own file descriptors (so what its
children print is captured too), an uncaught exception prints its traceback and exits 1, ``SystemExit``
gives the exit status, and the interpreter's exit functions run before it exits.

A local world's workers fork from the command's process unless ``workers`` says otherwise (fdp.spawn's
``start_method="fork"``): they keep its imports, output files, environment and process group. Spawned workers
stay covered where a test needs them: tests/e2e/test_interrupt.py (the terminal's signal to the group),
tests/run/test_forecast.py (a worker's measured peak from a fresh interpreter's start), and each group's one
``fresh`` command, which starts from a fresh interpreter as the shell does (``-m`` commands keep ``subprocess``).
The docs' Python examples start theirs from a forkserver of the command's own (``workers="forkserver"``): the
worker function must pickle and the script re-imports as a spawned worker's does, but torch and fdp are imported
once, not in each worker. A ``python -c CODE`` command runs its code as the interpreter does: in a new
``__main__`` module, ``sys.argv[0]`` is ``-c``, and the working directory ('') comes first on ``sys.path``.
"""

from __future__ import annotations

import atexit
import builtins
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
import types
from pathlib import Path

_CONTEXT = multiprocessing.get_context("forkserver")


def _exit_status(code) -> int:
    """What the interpreter exits with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# What the tests' forkserver (tests/conftest.py) and a command's own (``workers="forkserver"``) import once.
# torch._dynamo is imported by torch.func's first grad; inductor's compiler by the first compile (seconds: each
# forked run that compiles would import it again).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch._inductor.compile_fx", "fdp.run.trainer"]


def _start_workers_with(method: str) -> None:
    """Local worlds' workers started by ``method`` (fdp.spawn's ``start_method``) unless a layout names its own.

    ``fork``, what fdp.spawn offers notebooks, instead of spawned: a spawned worker imports torch and fdp again,
    5 s of a short run's time. A forked one keeps this process's output files, environment and process group, as a
    spawned one does. ``forkserver``: from a server of the command's own that imported ``PRELOAD`` once; a worker
    still gets its function and arguments pickled and re-imports the script as ``__mp_main__``, as a spawned one
    does. ``spawn``: unchanged."""
    from fdp.procs.launch import WorldLayout

    if method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)
    defaults = dict(
        zip(WorldLayout._fields[-len(WorldLayout.__new__.__defaults__) :], WorldLayout.__new__.__defaults__)
    )
    WorldLayout.__new__.__defaults__ = tuple({**defaults, "start_method": method}.values())


def _fork_workers() -> None:
    """Local worlds' workers forked from this process (``_start_workers_with("fork")``)."""
    _start_workers_with("fork")


def _run_code(code: str) -> None:
    """``python -c CODE``'s ``__main__``: a module of its own, whose functions live in ``__main__``."""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    exec(compile(code, "<string>", "exec"), main.__dict__)


def _run_script(argv: list[str], env: dict, cwd: str, out: str, err: str, workers: str) -> None:
    """The child: ``argv[0]`` is the script, or ``-c`` and ``argv[1]`` the code; never returns (``os._exit`` with
    its status)."""
    os.setsid()  # its own process group: a timeout stops its workers too
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code = argv[1] if argv[0] == "-c" else None
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = "" if code is not None else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [first, *extra, *(p for p in sys.path if p not in extra)]
    sys.argv[:] = ["-c", *argv[2:]] if code is not None else [argv[0], *argv[1:]]
    if "OMP_NUM_THREADS" in env:  # read by torch when it started, in the server: set as it would have been
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    _start_workers_with(workers)
    status = 0
    try:
        if code is not None:
            _run_code(code)
        else:
            runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")
    except SystemExit as done:
        status = _exit_status(done.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    # What the interpreter does on its way out: exit functions (atexit is process-wide, and the server
    # registered none the script would not have), then the streams; multiprocessing's child exit skips both.
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


class Started:
    """A command running in a forked child, used as a ``subprocess.Popen`` (``pid``, ``poll``, ``kill``,
    ``communicate``, ``returncode``) or through ``result(timeout)``, a ``CompletedProcess``. The child leads a
    session of its own (``Popen(start_new_session=True)``): a signal to its group reaches its workers too."""

    def __init__(self, argv: list[str], env: dict, cwd: Path | str, workers: str):
        self.args = list(argv)
        self.returncode = None
        self._dir = tempfile.TemporaryDirectory(prefix="recipe-")
        self._out, self._err = (os.path.join(self._dir.name, name) for name in ("stdout", "stderr"))
        self._process = _CONTEXT.Process(
            target=_run_script,
            args=(list(argv), dict(env), str(cwd), self._out, self._err, workers),
            daemon=False,
        )
        self._process.start()
        self.pid = self._process.pid

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        self.returncode = self._process.exitcode
        return self.returncode

    def kill(self) -> None:
        """SIGKILL to the command's process alone."""
        self._process.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for it; what it printed (stdout, stderr). On a timeout, its whole group is killed."""
        self._process.join(timeout)
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._process.join(10)
            raise subprocess.TimeoutExpired(self.args, timeout)
        return Path(self._out).read_text(errors="replace"), Path(self._err).read_text(errors="replace")

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        stdout, stderr = self.communicate(timeout)
        return subprocess.CompletedProcess(self.args, self.returncode, stdout, stderr)


class _Fresh(subprocess.Popen):
    """The same command from a fresh interpreter, with the same ``result(timeout)``."""

    def __init__(self, argv: list[str], env: dict, cwd: Path | str):
        super().__init__(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            stdout, stderr = self.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.communicate()
            raise
        return subprocess.CompletedProcess(self.args, self.returncode, stdout, stderr)


def start(argv: list[str], env: dict, cwd: Path | str, fresh: bool = False, workers: str = "fork") -> Started | _Fresh:
    """``argv`` is ``[sys.executable, SCRIPT, *ARGS]`` (the script a file) or ``[sys.executable, "-c", CODE, *ARGS]``
    as for ``subprocess``.
    ``fresh``: from a fresh interpreter instead (its local worlds spawn their workers), for the one case of a
    group that checks the real start-up. ``workers``: how its local worlds start their workers (``fork``,
    ``spawn`` as from the shell, or ``forkserver``: ``_start_workers_with``)."""
    assert argv[0] == sys.executable and (argv[1].endswith(".py") or argv[1] == "-c"), argv
    assert workers in ("fork", "spawn", "forkserver"), workers
    return _Fresh(argv, env, cwd) if fresh else Started(argv[1:], env, cwd, workers)


def run(
    argv: list[str], env: dict, cwd: Path | str, timeout: float = 300, fresh: bool = False, workers: str = "fork"
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``, forked
    unless ``fresh``."""
    return start(argv, env, cwd, fresh, workers).result(timeout)


def recipe(name: str, *overrides: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python recipes/NAME OVERRIDES...`` from a fresh interpreter in the repository's root, as the shell runs it."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(root / "recipes" / name), *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=root,
        env=env,
    )
