"""Learning-rate schedules: functions from the update count to a rate, evaluated in the optimizer state.

Every schedule but ``constant`` starts with a linear warm-up from ``init_value`` (0 by
default: the first update has rate 0, as Hugging Face's schedulers) to ``peak_value``
over ``warmup_steps``; then ``warmup_constant`` stays there, ``warmup_linear`` and
``warmup_cosine`` decay to ``end_value`` at ``decay_steps`` (the run's length), and
``wsd`` (warm-up, stable, decay) stays at the peak until the last ``decay_fraction`` of
the run and decays linearly to ``end_value`` over it. The count is that of updates done,
so ``lr(t)`` is the rate of update ``t + 1``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from fdp.errors import require

Schedule = Callable[[int], float]


def constant_schedule(value: float) -> Schedule:
    """The schedule that is ``value`` at every step.

    >>> constant_schedule(0.1)(1000)
    0.1
    """
    _check(value >= 0, "value", ">= 0", value)
    return lambda count: value


def warmup_constant_schedule(peak_value: float, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps``, then ``peak_value``.

    >>> lr = warmup_constant_schedule(1.0, warmup_steps=4)
    >>> lr(0), lr(2), lr(4), lr(1000)
    (0.0, 0.5, 1.0, 1.0)
    """
    _check_values(peak_value=peak_value, init_value=init_value, warmup_steps=warmup_steps)
    warmup = _warmup(peak_value, warmup_steps, init_value)
    return lambda count: warmup(count) if count < warmup_steps else peak_value


def warmup_linear_schedule(
    peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0, init_value: float = 0.0
) -> Schedule:
    """Linear warm-up to ``peak_value``, then a linear decay to ``end_value`` at ``decay_steps`` (and after).

    ``lr(t) = end + (peak - end) * (decay_steps - t) / (decay_steps - warmup_steps)`` after the
    warm-up: Hugging Face's ``get_linear_schedule_with_warmup`` where ``end_value=0``.

    >>> lr = warmup_linear_schedule(1.0, warmup_steps=2, decay_steps=12)
    >>> lr(1), lr(2), lr(7), lr(12), lr(50)
    (0.5, 1.0, 0.5, 0.0, 0.0)
    """
    _check_values(peak_value=peak_value, end_value=end_value, init_value=init_value, warmup_steps=warmup_steps)
    _check(decay_steps >= warmup_steps, "decay_steps", f">= warmup_steps ({warmup_steps})", decay_steps)
    warmup = _warmup(peak_value, warmup_steps, init_value)

    def schedule(count: int) -> float:
        if count < warmup_steps:
            return warmup(count)
        if count >= decay_steps:
            return end_value
        return end_value + (peak_value - end_value) * (decay_steps - count) / (decay_steps - warmup_steps)

    return schedule


def wsd_schedule(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    decay_fraction: float = 0.1,
    end_value: float = 0.0,
    init_value: float = 0.0,
) -> Schedule:
    """Warm-up, stable, decay: linear warm-up, ``peak_value`` until the last ``decay_fraction`` of
    ``decay_steps``, then a linear decay to ``end_value`` at ``decay_steps``.

    The decay starts at ``round(decay_steps * (1 - decay_fraction))`` (never inside the warm-up).
    A run cut short of its decay can be continued from a checkpoint of its stable phase.

    >>> lr = wsd_schedule(1.0, warmup_steps=2, decay_steps=20, decay_fraction=0.2, end_value=0.2)
    >>> lr(1), lr(2), lr(16), round(lr(18), 6), lr(20)
    (0.5, 1.0, 1.0, 0.6, 0.2)
    """
    _check_values(peak_value=peak_value, end_value=end_value, init_value=init_value, warmup_steps=warmup_steps)
    _check(0 <= decay_fraction <= 1, "decay_fraction", "in [0, 1]", decay_fraction)
    _check(decay_steps >= warmup_steps, "decay_steps", f">= warmup_steps ({warmup_steps})", decay_steps)
    stable_until = max(warmup_steps, round(decay_steps * (1.0 - decay_fraction)))
    warmup = _warmup(peak_value, warmup_steps, init_value)

    def schedule(count: int) -> float:
        if count < warmup_steps:
            return warmup(count)
        if count < stable_until:
            return peak_value
        if count >= decay_steps:
            return end_value
        return end_value + (peak_value - end_value) * (decay_steps - count) / (decay_steps - stable_until)

    return schedule


def warmup_cosine_schedule(
    peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0, init_value: float = 0.0
) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    ``lr(t) = init + (peak - init) * t / warmup_steps`` for ``t < warmup_steps``, then
    ``end + (peak - end) * (1 + cos(pi * (t - warmup_steps) / (decay_steps - warmup_steps))) / 2``
    until ``t = decay_steps`` (counted from step 0, warm-up included), and ``end_value`` after.
    With the default ``init_value=0`` the first update (``t = 0``) has learning rate 0.

    >>> lr = warmup_cosine_schedule(1.0, warmup_steps=10, decay_steps=110, end_value=0.1)
    >>> lr(0), lr(5), lr(10), round(lr(60), 6), lr(110), lr(500)
    (0.0, 0.5, 1.0, 0.55, 0.1, 0.1)
    """
    _check_values(peak_value=peak_value, end_value=end_value, init_value=init_value, warmup_steps=warmup_steps)
    _check(decay_steps >= warmup_steps, "decay_steps", f">= warmup_steps ({warmup_steps})", decay_steps)
    warmup = _warmup(peak_value, warmup_steps, init_value)

    def schedule(count: int) -> float:
        if count < warmup_steps:
            return warmup(count)
        if count >= decay_steps:
            return end_value
        progress = (count - warmup_steps) / (decay_steps - warmup_steps)
        return end_value + (peak_value - end_value) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule


def _warmup(peak_value: float, warmup_steps: int, init_value: float) -> Schedule:
    """The rate at ``count < warmup_steps``: linear from ``init_value`` (count 0) towards ``peak_value``."""
    return lambda count: init_value + (peak_value - init_value) * count / warmup_steps


def _check_values(**values: float) -> None:
    for name, value in values.items():
        _check(value >= 0, name, ">= 0", value)


def _check(ok: bool, name: str, bound: str, value: Any) -> None:
    require(ok, name, value, f"a number {bound}")


def _as_schedule(lr: float | Schedule) -> Schedule:
    if callable(lr):
        # A plain float, so the state's ``lr`` stays loadable with weights_only=True.
        return lambda count: float(lr(count))
    _check(lr >= 0, "lr", ">= 0", lr)
    return constant_schedule(float(lr))
