"""The run configs tests build, through the one compose helper: ``fdp.run.config.compose.compose``, the config the
recipe would see for the overrides. ``quiet`` puts ``QUIET`` first, for runs that draw no progress bar and evaluate only
where a test asks (later overrides win)."""

from __future__ import annotations

from fdp.run.config.compose import compose

QUIET = ("trainer.progress=false", "trainer.eval_every=0")


def quiet(*overrides: str):
    """``compose(*QUIET, *overrides)``."""
    return compose(*QUIET, *overrides)
