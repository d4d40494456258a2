"""Every module of fdp whose docstrings show a ``>>>`` example is collected as a doctest by the default run.

A folder that pytest (or ruff, or a ``.gitignore`` template) takes for build output (``dist``, ``build``)
would drop its modules' examples silently: this counts them against pytest's own collection.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_with_an_example_is_collected_by_the_default_run():
    shown = {str(path.relative_to(ROOT)) for path in (ROOT / "fdp").rglob("*.py") if ">>> " in path.read_text()}
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
