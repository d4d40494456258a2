"""The outer loop's settings and its schedule: which fragment syncs after which step.

Pure functions of ``OuterSpec`` and the step (``fdp.step.outer`` runs the syncs they
name), so a resumed run finds the same schedule from ``TrainState.step`` alone.

>>> spec = check_outer({"name": "diloco", "sync_every": 16, "start_step": 0, "lr": 0.7, "momentum": 0.9,
...     "nesterov": True, "overlap": 1, "fragments": 4, "fragment_schedule": "strided", "mix": 0.0})
>>> [s for s in range(1, 17) if sending_fragment(spec, s) is not None]
[4, 8, 12, 16]
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "OUTER",
    "SCHEDULES",
    "OuterSpec",
    "check_outer",
    "fragment_offsets",
    "is_sync_step",
    "join_boundaries",
    "landing_fragment",
    "sending_fragment",
]

OUTER = ("none", "local_sgd", "diloco")
SCHEDULES = ("strided", "sequential")
# What outer=local_sgd is (the mean of the params), not a default: it has no such settings.
_LOCAL_SGD = {"lr": 1.0, "momentum": 0.0, "nesterov": False}
# The settings each outer loop reads; their defaults live in fdp.run.config's schemas.
_SETTINGS = {
    "none": (),
    "local_sgd": ("sync_every", "start_step", "overlap", "fragments", "fragment_schedule", "mix"),
    "diloco": (
        "sync_every",
        "start_step",
        "lr",
        "momentum",
        "nesterov",
        "overlap",
        "fragments",
        "fragment_schedule",
        "mix",
    ),
}


class OuterSpec(NamedTuple):
    """The outer loop's settings (``conf/outer/*.yaml``, defaults in ``fdp.run.config``).

    ``name="none"`` syncs every step.

    ``fragments``: the model is synced in that many fragments (runs of buckets), each on
    its own steps, as ``fragment_schedule`` staggers them; ``overlap``: the inner steps a
    sync's communication runs behind (Streaming DiLoCo's tau); ``mix``: ``None`` keeps each
    rank's steps since the send on top of the new anchor, a number ``a`` sets the params to
    ``a * local + (1 - a) * new anchor`` (Streaming DiLoCo's and torchft's alpha).
    """

    name: str
    sync_every: int
    start_step: int
    lr: float
    momentum: float
    nesterov: bool
    overlap: int
    fragments: int
    fragment_schedule: str
    mix: float | None


def check_outer(spec: dict | OuterSpec) -> OuterSpec:
    """The outer settings as an ``OuterSpec``; a ``ValueError`` naming the first bad one.

    ``spec`` is the config's ``outer`` group as a dict (every setting its loop reads, as
    ``fdp.run.config.compose.compose("outer=diloco").outer`` has them).

    >>> from fdp.run.config.compose import compose
    >>> from omegaconf import OmegaConf
    >>> check_outer(OmegaConf.to_container(compose("outer=diloco", "outer.fragments=4").outer)).fragments
    4
    >>> check_outer({"name": "local_sgd", "sync_every": 0})
    Traceback (most recent call last):
    ValueError: outer.start_step: missing; expected the settings sync_every, start_step, overlap, fragments, \
fragment_schedule, mix (fdp.run.config.LocalSGDConfig has them)
    """
    if isinstance(spec, OuterSpec):
        spec = spec._asdict()
    spec = dict(spec)
    name = spec.get("name", "none")
    if name not in OUTER:
        raise ValueError(f"outer={name!r}: expected none, local_sgd or diloco")
    if name == "none":
        return OuterSpec("none", 1, 0, 1.0, 0.0, False, 0, 1, "strided", None)
    settings = _SETTINGS[name]
    for key in settings:
        if key not in spec:
            schema = "LocalSGDConfig" if name == "local_sgd" else "DiLoCoConfig"
            raise ValueError(
                f"outer.{key}: missing; expected the settings {', '.join(settings)} (fdp.run.config.{schema} has them)"
            )
    if name == "local_sgd":
        if any(spec.get(key, value) != value for key, value in _LOCAL_SGD.items()):
            raise ValueError(
                "outer=local_sgd: averages the params (lr=1, momentum=0); "
                "expected outer=diloco for other outer lr or momentum"
            )
        spec = {**spec, **_LOCAL_SGD}
    spec = OuterSpec(**spec)
    if spec.sync_every < 1:
        raise ValueError(f"outer.sync_every={spec.sync_every!r}: expected an integer >= 1")
    if spec.start_step < 0:
        raise ValueError(f"outer.start_step={spec.start_step!r}: expected an integer >= 0")
    if not (isinstance(spec.fragments, int) and 1 <= spec.fragments <= spec.sync_every):
        raise ValueError(
            f"outer.fragments={spec.fragments!r}: expected an integer in [1, outer.sync_every={spec.sync_every}]"
        )
    if spec.fragment_schedule not in SCHEDULES:
        raise ValueError(f"outer.fragment_schedule={spec.fragment_schedule!r}: expected strided or sequential")
    gap = _sync_gap(spec)
    if not 0 <= spec.overlap < gap:
        where = (
            f"outer.sync_every={spec.sync_every}"
            if spec.fragments == 1
            else f"{gap}, the steps between fragment syncs of outer.fragments={spec.fragments} "
            f"outer.fragment_schedule={spec.fragment_schedule}"
        )
        raise ValueError(f"outer.overlap={spec.overlap!r}: expected an integer in [0, {where})")
    if spec.mix is not None and not (isinstance(spec.mix, (int, float)) and 0 <= spec.mix <= 1):
        raise ValueError(f"outer.mix={spec.mix!r}: expected null or a number in [0, 1]")
    if not spec.lr > 0:
        raise ValueError(f"outer.lr={spec.lr!r}: expected a rate > 0")
    if not 0 <= spec.momentum < 1:
        raise ValueError(f"outer.momentum={spec.momentum!r}: expected a value in [0, 1)")
    if spec.nesterov and spec.momentum == 0:
        raise ValueError("outer.nesterov=true: expected outer.momentum > 0")
    return spec


def fragment_offsets(spec: OuterSpec) -> tuple[int, ...]:
    """Each fragment's offset: fragment ``f`` syncs after the steps ``s`` (past ``start_step``)
    with ``(s - start_step - offset_f) % sync_every == 0``.

    ``strided`` spreads the fragments evenly over the period, ``sequential`` puts them on
    consecutive steps; either way the last fragment syncs at the end of each period, and
    one fragment is plain DiLoCo's schedule.

    >>> fragment_offsets(OuterSpec("diloco", 16, 0, 0.7, 0.9, True, 0, 4, "strided", None))
    (4, 8, 12, 0)
    >>> fragment_offsets(OuterSpec("diloco", 16, 0, 0.7, 0.9, True, 0, 4, "sequential", None))
    (13, 14, 15, 0)
    """
    h, f = spec.sync_every, spec.fragments
    if spec.fragment_schedule == "sequential":
        return tuple((h - f + 1 + i) % h for i in range(f))
    return tuple((i + 1) * h // f % h for i in range(f))


def _sync_gap(spec: OuterSpec) -> int:
    """The fewest steps between two fragment syncs (``sync_every`` for one fragment)."""
    offsets = sorted(fragment_offsets(spec))
    return min((b - a) % spec.sync_every or spec.sync_every for a, b in zip(offsets, offsets[1:] + offsets[:1]))


def sending_fragment(spec: OuterSpec, step: int) -> int | None:
    """The fragment whose pseudo-gradient is sent after step ``step`` (counted from 1), or ``None``.

    >>> spec = OuterSpec("diloco", 4, 2, 0.7, 0.9, True, 0, 2, "strided", None)
    >>> [(s, sending_fragment(spec, s)) for s in range(1, 13) if sending_fragment(spec, s) is not None]
    [(4, 0), (6, 1), (8, 0), (10, 1), (12, 0)]
    """
    if step <= spec.start_step:
        return None
    phase = (step - spec.start_step) % spec.sync_every
    for fragment, offset in enumerate(fragment_offsets(spec)):
        if phase == offset:
            return fragment
    return None


def is_sync_step(spec: OuterSpec, step: int) -> bool:
    """Whether step ``step`` (counted from 1) ends by sending a pseudo-gradient (of some fragment).

    >>> [s for s in range(1, 13) if is_sync_step(OuterSpec("diloco", 4, 2, 0.7, 0.9, True, 0, 1, "strided", None), s)]
    [6, 10]
    """
    return sending_fragment(spec, step) is not None


def join_boundaries(spec: OuterSpec) -> tuple[int, int]:
    """``(period, phase)``: the steps ``s`` with ``s % period == phase``, after which a rank may join a world
    (``fdp.procs.grow``). Under an outer loop, once a period: after the step the last fragment's sync lands on
    (``overlap`` steps after its send; with fragments every other fragment's has landed by then too, as
    ``overlap`` is shorter than the steps between fragment syncs), so no sync is ever in flight there: one sent
    by the old world is the old world's average, which the new world cannot finish.

    >>> join_boundaries(OuterSpec("diloco", 4, 0, 0.7, 0.9, True, 1, 1, "strided", None))
    (4, 1)
    >>> join_boundaries(OuterSpec("none", 1, 0, 1.0, 0.0, False, 0, 1, "strided", None))
    (1, 0)
    """
    if spec.name == "none":
        return 1, 0
    return spec.sync_every, (spec.start_step + spec.overlap) % spec.sync_every


def landing_fragment(spec: OuterSpec, step: int) -> int | None:
    """The fragment whose sync is applied after step ``step`` (``overlap`` steps after it was sent), or ``None``.

    >>> spec = OuterSpec("diloco", 4, 2, 0.7, 0.9, True, 1, 1, "strided", None)
    >>> [s for s in range(1, 13) if landing_fragment(spec, s) is not None]
    [7, 11]
    """
    return sending_fragment(spec, step - spec.overlap)
