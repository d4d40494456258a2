"""A choice is branched on by its owner alone: the checkpoint format (whole or sharded) in fdp/run/checkpoint/, what a
lost rank does (restart or shrink) in fdp/run/rank_loss.py. Every other module asks their objects
(``CheckpointFormat``, ``RankLoss``) what it needs, instead of comparing their names."""

import re
from pathlib import Path

FDP = Path(__file__).resolve().parents[1] / "fdp"
OWNERS = ("run/checkpoint/", "run/rank_loss.py")
NAME = r"""["'](?:whole|sharded|restart|shrink)["']"""
# A name compared (==, !=) or looked for in a collection (in ("whole", ...)); a message naming it is not a branch.
COMPARED = re.compile(rf"(?:==|!=|\bin)\s*[(\[{{]?\s*{NAME}|{NAME}\s*(?:==|!=)")


def test_no_module_but_the_owners_compares_a_checkpoint_format_or_rank_loss_name():
    offenders = [
        f"{path.relative_to(FDP.parent)}:{number}: {line.strip()}"
        for path in sorted(FDP.rglob("*.py"))
        if not path.relative_to(FDP).as_posix().startswith(OWNERS)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if COMPARED.search(line.split("#")[0]) and ">>>" not in line
    ]
    assert not offenders, "\n".join(offenders)


def test_the_pattern_finds_a_comparison_and_passes_a_message():
    assert COMPARED.search('sharded = checkpoint_format == "sharded"')
    assert COMPARED.search("if mode in ('restart', 'shrink'):")
    assert not COMPARED.search('f"a larger budget, or trainer.checkpoint_format=sharded"')
