"""Every module of fdp whose docstrings show a ``>>>`` example is collected as a doctest by the default run, and
only there.

A folder that pytest (or ruff, or a ``.gitignore`` template) takes for build output (``dist``, ``build``)
would drop its modules' examples silently: this counts them against pytest's own collection. A test that runs
fdp's examples itself (``doctest.testmod``) would run them a second time.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_with_an_example_is_collected_by_the_default_run(request):
    shown = {str(path.relative_to(ROOT)) for path in (ROOT / "fdp").rglob("*.py") if ">>> " in path.read_text()}
    if request.config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        # This is the default run (no paths given): what it collected itself (tests/conftest.py), instead of a
        # second collection that imports torch and every module of fdp again.
        collected = request.session.collected_files
    else:
        listing = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "fdp"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout
        collected = {line.split("::", 1)[0] for line in listing.splitlines() if "::" in line}
    assert shown and not shown - collected, f"examples pytest does not collect: {sorted(shown - collected)}"
    assert any(path.startswith("fdp/procs/") for path in collected)


def test_no_test_runs_fdps_examples_a_second_time():
    """A test function that imports a module of fdp and calls doctest on it repeats the default run's doctests
    (``benchmarks/``' examples are not collected by it: tests/benchmarks/test_netsim.py runs them)."""
    twice = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)) if "doctest" in text else ():
            if not isinstance(node, ast.FunctionDef):
                continue
            imports_fdp = any(
                (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "fdp" for a in n.names))
                or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "fdp")
                for n in ast.walk(node)
            )
            calls_doctest = any(
                isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "doctest"
                for n in ast.walk(node)
            )
            if imports_fdp and calls_doctest:
                twice.append(f"{path.relative_to(ROOT)}::{node.name}")
    assert not twice, f"fdp's examples run again by {twice}: the default run collects them (--doctest-modules)"
