"""Learning-rate schedules: functions from the update count to a rate, evaluated in the optimizer state."""
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
    for name, value in (("peak_value", peak_value), ("end_value", end_value), ("init_value", init_value),
                        ("warmup_steps", warmup_steps)):
        _check(value >= 0, name, ">= 0", value)
    _check(decay_steps >= warmup_steps, "decay_steps", f">= warmup_steps ({warmup_steps})", decay_steps)

    def schedule(count: int) -> float:
        if count < warmup_steps:
            return init_value + (peak_value - init_value) * count / warmup_steps
        if count >= decay_steps:
            return end_value
        progress = (count - warmup_steps) / (decay_steps - warmup_steps)
        return end_value + (peak_value - end_value) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule


def _check(ok: bool, name: str, bound: str, value: Any) -> None:
    require(ok, name, value, f"a number {bound}")


def _as_schedule(lr: float | Schedule) -> Schedule:
    if callable(lr):
        # A plain float, so the state's ``lr`` stays loadable with weights_only=True.
        return lambda count: float(lr(count))
    _check(lr >= 0, "lr", ">= 0", lr)
    return constant_schedule(float(lr))
