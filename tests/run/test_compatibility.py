"""The compatibility page: every pair of features put to the config checks, the page generated from them."""

from pathlib import Path

from fdp.run.compatibility import FEATURES, Feature, compatibility_markdown, refusal

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "compatibility.md"


def test_the_compatibility_page_is_the_one_the_checks_generate():
    assert PAGE.read_text() == compatibility_markdown(), (
        "docs/reference/compatibility.md is out of date: python -c 'from fdp.run.compatibility import "
        'compatibility_markdown; open("docs/reference/compatibility.md", "w").write(compatibility_markdown())\''
    )


def test_a_refused_pair_gives_its_one_line_and_a_composing_pair_none():
    by_name = {f.name: f for f in FEATURES}
    assert refusal(by_name["reduce_dtype=bfloat16"], by_name["hooks=powersgd"]).startswith(
        "trainer.reduce_dtype='bfloat16': expected"
    )
    assert refusal(by_name["zero_stage=3"], by_name["compile=true"]) is None  # its blocks compile between the gathers
    assert refusal(by_name["zero_stage=3"], by_name["hierarchical"]) is None  # hybrid sharding composes
    unknown = Feature("typo", ("trainer.zero_stag=1",))
    assert refusal(unknown, unknown) is not None  # a misspelt key is refused, not read as composing
