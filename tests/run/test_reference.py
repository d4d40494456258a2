"""The reference pages: every config key's meaning read from the schemas, the generated page and ``--help``; the API
page lists every public name."""

import os
import re
import sys
from pathlib import Path

import _recipe

from fdp.run.config.compose import compose
from fdp.run.reference import help_text, key_docs, reference_markdown

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "config.md"


def test_every_config_key_has_a_meaning_in_its_schema():
    missing = [f"{doc.option or doc.key.split('.')[0]}: {doc.key}" for doc in key_docs() if not doc.meaning]
    assert not missing, f"schema fields without a comment saying what they mean (fdp/run/config/schema.py): {missing}"


def test_the_reference_page_is_the_one_the_schemas_generate():
    assert PAGE.read_text() == reference_markdown(), (
        "docs/reference/config.md is out of date: python -c 'from fdp.run.reference import reference_markdown; "
        'open("docs/reference/config.md", "w").write(reference_markdown())\''
    )


def test_help_lists_the_chosen_options_keys_with_their_values_and_meanings():
    text = help_text(compose("optim=adamw", "trainer.max_steps=7"))
    assert "  trainer.max_steps" in text and "= 7 " in text.split("trainer.max_steps", 1)[1].splitlines()[0]
    assert "decoupled weight decay" in text  # adamw's weight_decay, not sgd's
    assert "optim.momentum" not in text  # sgd's key, not chosen


def test_help_from_the_shell_prints_the_reference_and_exits_0(tmp_path):
    env = {**os.environ}
    proc = _recipe.run([sys.executable, "recipes/train.py", "--help", "hooks=powersgd"], env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python recipes/train.py")
    assert "hooks.rank" in proc.stdout and "the rank of each gradient matrix's approximation" in proc.stdout
    assert "error" not in proc.stderr


def test_the_api_page_lists_every_public_name_of_fdp_once():
    """docs/reference/api.md's autosummary is fdp.__all__: a public name added or removed shows on the site."""
    import fdp

    text = (ROOT / "docs" / "reference" / "api.md").read_text()
    listed = re.findall(r"^   (\w+)$", text.split(".. autosummary::", 1)[1], re.M)
    assert sorted(listed) == sorted(fdp.__all__), sorted(set(listed) ^ set(fdp.__all__))
