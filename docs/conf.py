"""Sphinx settings for fdp's site: Markdown pages (myst-parser), notebooks shown as saved (myst-nb, not executed:
tests/docs/test_notebooks.py runs them), and the API reference from the docstrings (autodoc, autosummary).

Build: python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's fdp, whatever is installed

project = "fdp"
author = "the fdp developers"
extensions = [
    "myst_nb",  # Markdown pages (myst-parser, which it loads) and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
]
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

# Notebooks are shown with their saved outputs; the tests execute them.
nb_execution_mode = "off"
myst_heading_anchors = 3

autosummary_generate = True
autodoc_default_options = {"members": False}
autodoc_typehints = "none"  # the signatures carry them; the docstrings say what each argument is
autodoc_member_order = "bysource"

html_theme = "alabaster"
html_title = "fdp"
