"""The notebooks in notebooks/: they run top to bottom and draw their figures, and are committed clean.

Each notebook reads ``FDP_NOTEBOOK_SMALL=1`` in its size cell and shrinks to a smoke test
(a few steps, one or two two-rank runs), whose workers fork from the kernel (``FORK_WORKERS``).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.heavy  # run first (tests/conftest.py)

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
TESTS = Path(__file__).resolve().parents[1]
# name -> figures (image/png outputs) it must draw; the longest first (run two at a time)
FIGURES = {"buckets": 1, "quickstart": 1, "compression": 2, "fork": 1}


def _read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


def _code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


# Run by the kernel as it starts (IPython's startup files): local worlds' workers forked from the kernel
# (fdp.spawn's start_method="fork", as notebooks/fork.ipynb starts its ranks) instead of spawned, each of which
# imports torch and fdp again, most of a small notebook's time. The notebooks' code runs as written.
FORK_WORKERS = f"""
import os
import sys
sys.path.insert(0, {str(TESTS)!r})
import _recipe
_recipe._fork_workers()
sys.path.remove({str(TESTS)!r})
open(os.path.join(os.environ["TMPDIR"], "workers-fork"), "w").close()
"""


def _ipython_dir(tmp: Path) -> Path:
    """An IPython directory whose default profile runs ``FORK_WORKERS`` at the kernel's start."""
    startup = tmp / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-fork-workers.py").write_text(FORK_WORKERS)
    return tmp / "ipython"


def _execute(name: str, tmp: Path) -> tuple[nbformat.NotebookNode, BaseException | None]:
    """``name`` run top to bottom in a kernel of its own, its run directories under ``tmp``; the error, if a cell
    failed (CellExecutionError names the cell)."""
    env = {
        **os.environ,
        "FDP_NOTEBOOK_SMALL": "1",
        "TMPDIR": str(tmp),  # the notebooks' run directories land here
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "IPYTHONDIR": str(_ipython_dir(tmp)),
    }
    nb = _read(name)
    client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}})
    try:
        client.execute(env=env)
    except Exception as error:
        return nb, error
    return nb, None


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Every notebook run, two at a time: each kernel and the workers it starts spend most of their time
    importing torch, one core each, and two notebooks keep both cores busy."""
    tmps = {name: tmp_path_factory.mktemp(name) for name in FIGURES}
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(FIGURES, pool.map(_execute, FIGURES, tmps.values())))
    return {name: (*runs[name], tmps[name]) for name in FIGURES}


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_small_and_draws_its_figures(name, executed):
    nb, error, tmp_path = executed[name]
    if error is not None:
        raise error
    outputs = [out for cell in _code_cells(nb) for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    figures = sum("image/png" in out.get("data", {}) for out in outputs)
    assert figures >= FIGURES[name], f"{name}: {figures} figure(s), expected at least {FIGURES[name]}"
    # The run directories went to tmp_path, not into the repository.
    assert list(tmp_path.glob("fdp-*")), f"{name}: no run directory under TMPDIR"
    assert (tmp_path / "workers-fork").exists(), f"{name}: the kernel did not run FORK_WORKERS"


def test_committed_notebooks_have_no_outputs_or_execution_counts():
    found = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert found == sorted(FIGURES), f"notebooks/ holds {found}; tests/docs/test_notebooks.py knows {sorted(FIGURES)}"
    for name in found:
        nb = _read(name)
        nbformat.validate(nb)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            assert cell.outputs == [], f"{name}.ipynb cell {i} has outputs: strip them before committing"
            assert cell.execution_count is None, f"{name}.ipynb cell {i} has an execution count: strip it"
        # No widget state or other run leftovers in the metadata either.
        assert set(nb.metadata) <= {"kernelspec", "language_info"}, f"{name}.ipynb metadata: {sorted(nb.metadata)}"


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_starts_with_a_description_then_a_size_cell(name):
    nb = _read(name)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    size = nb.cells[1]
    assert size.cell_type == "code" and "FDP_NOTEBOOK_SMALL" in size.source, f"{name}: cell 1 is not the size cell"
