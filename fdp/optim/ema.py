"""An exponential moving average of the params, as an optax-like ``(init, update)`` pair.

``ema(decay)`` keeps ``average = decay * average + (1 - decay) * params`` after every
step (``trainer.ema_decay``). The params it follows are the same on every rank of a data-
parallel world and for any world size, so the average is too (under an outer loop the run
follows the anchor, the params every rank agreed on at the last sync: ``fdp.run.loop_controls``).
Under ZeRO stage 3 each rank averages its own slices, which together are the average of the whole params
(``fdp.update.zero``). Params kept in 16 bits are averaged in float32: a decay of 0.999 moves the
average by less than a bfloat16's resolution per step. The trainer evaluates the average
beside the params (``ema_test_loss``...) and checkpoints it whole (``fdp.run.loop_controls``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from fdp._torch import foreach
from fdp.errors import require

__all__ = ["Ema", "averaged_as", "check_ema_decay", "ema"]

Params = dict[str, torch.Tensor]
_WIDENED = (torch.float16, torch.bfloat16)


class Ema(NamedTuple):
    """``init(params) -> average`` and ``update(average, params) -> average``; neither changes its arguments."""

    init: Callable[[Params], Params]
    update: Callable[[Params, Params], Params]


def check_ema_decay(value: float) -> float:
    """``ema_decay``: 0 (no average) or a fraction in (0, 1).

    >>> check_ema_decay(0.999)
    0.999
    >>> check_ema_decay(1.0)
    Traceback (most recent call last):
    ...
    ValueError: ema_decay=1.0: expected 0 (off) or a decay in (0, 1), e.g. 0.999
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1
    require(ok, "ema_decay", value, "0 (off) or a decay in (0, 1), e.g. 0.999")
    return float(value)


def ema(decay: float) -> Ema:
    """The moving average with ``decay`` (the weight of the old average at each step).

    >>> average = ema(0.5)
    >>> state = average.init({"w": torch.zeros(2)})
    >>> average.update(state, {"w": torch.ones(2)})["w"].tolist()
    [0.5, 0.5]
    """
    check_ema_decay(decay)

    def init(params: Params) -> Params:
        return {name: _widened(p).clone() for name, p in params.items()}

    def update(average: Params, params: Params) -> Params:
        names = list(average)
        new = foreach.lerp([average[n] for n in names], [_widened(params[n]) for n in names], 1.0 - decay)
        return dict(zip(names, new))

    return Ema(init, update)


def averaged_as(average: Params, params: Params) -> Params:
    """The average in the dtype of ``params`` (what the model runs on), on their devices.

    >>> averaged_as({"w": torch.ones(1)}, {"w": torch.zeros(1, dtype=torch.bfloat16)})["w"].dtype
    torch.bfloat16
    """
    return {name: average[name].to(device=p.device, dtype=p.dtype) for name, p in params.items()}


def _widened(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float() if t.dtype in _WIDENED else t.detach()
