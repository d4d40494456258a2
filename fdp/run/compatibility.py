"""Which features compose: every pair of them put to the config checks, the page of those refused.

The page is not written by hand: ``compatibility_markdown`` composes each pair of
``FEATURES`` on a world of two local ranks and runs ``fdp.run.config.validate.validate`` on it, so
a refusal the checks make is on the page with the reason its owner states, and a refusal
removed from the code leaves the page (``tests/run/test_compatibility.py`` holds
``docs/reference/compatibility.md`` to what this module generates).

>>> [f.name for f in FEATURES][:3]
['zero_stage=1', 'zero_stage=2', 'zero_stage=3']
>>> refusal(FEATURES[0], FEATURES[0]) is None  # ZeRO stage 1 on two ranks
True
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

__all__ = ["Feature", "FEATURES", "refusal", "pair_configs", "refused_pairs", "compatibility_markdown"]

BASE = ("world=local2", "trainer.progress=false")


class Feature(NamedTuple):
    """One setting of a feature, as the overrides that turn it on."""

    name: str
    overrides: tuple[str, ...]


def _f(name: str, *overrides: str) -> Feature:
    return Feature(name, overrides or (f"trainer.{name}",))


FEATURES = (
    _f("zero_stage=1"),
    _f("zero_stage=2"),
    _f("zero_stage=3"),
    _f("zero_stage=auto"),
    _f("compile=true"),
    _f("precision=bf16-mixed"),
    _f("precision=16-mixed"),
    _f("reduce_dtype=bfloat16", "trainer.precision=bf16-mixed", "trainer.reduce_dtype=bfloat16"),
    _f("hooks=powersgd", "hooks=powersgd"),
    _f("hooks=topk", "hooks=topk"),
    _f("hooks=lowbit", "hooks=lowbit"),
    _f("outer=local_sgd", "outer=local_sgd"),
    _f("outer=diloco", "outer=diloco"),
    _f("outer.overlap=1", "outer=diloco", "outer.overlap=1"),
    _f("on_rank_loss=shrink", "world.on_rank_loss=shrink"),
    _f("respawn", "world.on_rank_loss=shrink", "world.respawn=true"),
    _f("hierarchical", "world=local4", "world.hierarchical=true", "world.node_size=2"),
    _f("checkpoint_format=sharded"),
    _f(
        "activation_checkpointing=blocks", "model=charlm", "data=stdlib_text", "trainer.activation_checkpointing=blocks"
    ),
    _f("ema_decay=0.9"),
    _f("early_stopping", "trainer.early_stopping.patience=2"),
    _f("keep_best=1"),
    _f("max_time", "trainer.max_time=3600"),
)


def _merged(a: Feature, b: Feature) -> list[str]:
    """Both features' overrides, a later key winning (``world=local4`` over the base's ``world=local2``)."""
    out: dict[str, str] = {}
    for override in (*BASE, *a.overrides, *b.overrides):
        key = override.split("=", 1)[0]
        out.pop(key, None)
        out[key] = override
    if "model=charlm" in out.values():  # a char model reads text
        out["data"] = "data=stdlib_text"
    return list(out.values())


def refusal(a: Feature, b: Feature) -> str | None:
    """The config checks' one line for ``a`` with ``b`` on two local ranks, or ``None`` where they compose."""
    return _checked(a, b)[1]


def _checked(a: Feature, b: Feature) -> tuple[object, str | None]:
    """The config ``a`` with ``b`` composes to (``None`` where Hydra refuses it) and the checks' line for it."""
    from fdp.errors import ConfigError
    from fdp.run.config.compose import compose
    from fdp.run.config.validate import validate

    try:
        cfg = compose(*_merged(a, b))
    except Exception as error:  # Hydra's or OmegaConf's refusal of a key or value
        return None, str(error).strip().splitlines()[0]
    try:
        validate(cfg)
    except (ConfigError, ValueError) as error:
        return cfg, str(error).strip().splitlines()[0]
    return cfg, None


def pair_configs() -> list[tuple[Feature, Feature, object, str | None]]:
    """Every pair of ``FEATURES`` (each feature alone too) as ``(a, b, config, refusal)``: the config both compose
    to, and the checks' one line for it (``None`` where the pair composes; the config ``None`` where Hydra refused
    it). ``tests/test_pairwise.py`` trains the pairs that compose; the page lists those refused.

    Composed once in a process (the page and the pairwise test read the same); each call gets its own configs."""
    import copy

    return [(a, b, copy.deepcopy(cfg), line) for a, b, cfg, line in _composed_pairs()]


@functools.cache
def _composed_pairs() -> tuple[tuple[Feature, Feature, object, str | None], ...]:
    """``pair_configs``, composed (``fdp.run.config.compose.compose`` runs Hydra once for each choice of config
    groups)."""
    return tuple((a, b, *_checked(a, b)) for a, b in itertools.combinations_with_replacement(FEATURES, 2))


def refused_pairs() -> list[tuple[Feature, Feature, str]]:
    """Every pair of ``FEATURES`` (each feature alone too) the checks refuse, with the line they give."""
    return [(a, b, line) for a, b, _, line in _composed_pairs() if line is not None]


def compatibility_markdown() -> str:
    """The compatibility page: the pairs refused and why, and how many pairs compose."""
    refused = refused_pairs()
    pairs = len(FEATURES) * (len(FEATURES) + 1) // 2
    lines = [
        "# Which features compose",
        "",
        "Generated by `fdp.run.compatibility` from the config checks themselves: each pair of the features",
        "below is composed on two local ranks (`world=local2`; `hierarchical` on `world=local4`, two nodes of",
        "two) and validated. Do not edit: `tests/run/test_compatibility.py` fails when this page and the checks part.",
        "",
        f"Features: {', '.join(f'`{f.name}`' for f in FEATURES)}.",
        "",
        f"Of {pairs} pairs (each feature with itself included), {pairs - len(refused)} compose; "
        f"{len(refused)} are refused:",
        "",
        "| feature | with | refused because |",
        "|---|---|---|",
    ]
    for a, b, line in refused:
        lines.append(f"| `{a.name}` | `{b.name}` | {line.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"
