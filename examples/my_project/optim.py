"""An optimizer of your own: Lion (Chen et al., 2023) as an ``fdp.optim.GradientTransformation``.

``optim=custom optim._target_=my_project.optim.lion +optim.b1=0.95`` calls the factory with
``b1=0.95`` and, since its signature names them, ``lr`` (the schedule of ``optim.lr``,
``optim.lr_schedule``, ...) and ``decay_mask`` (the ``optim.decay_filter`` rule).

>>> opt = lion(lr=0.1, weight_decay=0.0)
>>> params = {"w": torch.tensor([1.0, -1.0])}
>>> updates, state = opt.update({"w": torch.tensor([0.5, -2.0])}, opt.init(params), params)
>>> updates["w"]  # -lr * sign(...)
tensor([-0.1000,  0.1000])
"""

from typing import Callable, NamedTuple

import torch

from fdp.optim import GradientTransformation


class LionState(NamedTuple):
    count: int  # updates done (the schedule's argument)
    lr: float  # the rate of the last update (logged as lr)
    momentum: dict


def lion(
    lr: Callable[[int], float] | float = 1e-4,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    decay_mask: Callable[[str, torch.Tensor], bool] | None = None,
) -> GradientTransformation:
    """Lion: step ``-lr * sign(b1 * m + (1 - b1) * g)``, then ``m <- b2 * m + (1 - b2) * g``; decoupled weight decay."""
    schedule = lr if callable(lr) else (lambda count: lr)
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0 <= value < 1:
            raise ValueError(f"{name}={value!r}: expected a number in [0, 1)")
    decays = decay_mask or (lambda name, param: True)

    def init(params: dict) -> LionState:
        return LionState(0, float(schedule(0)), {k: torch.zeros_like(p) for k, p in params.items()})

    # sum_across: given at ZeRO, where a rank steps its slices; Lion is elementwise and needs no sums.
    def update(grads: dict, state: LionState, params: dict, sum_across=None):
        rate = float(schedule(state.count))
        updates, momentum = {}, {}
        for k, g in grads.items():
            m = state.momentum[k]
            step = -rate * torch.sign(m * b1 + g * (1 - b1))
            if weight_decay and decays(k, params[k]):
                step = step - rate * weight_decay * params[k]
            updates[k], momentum[k] = step, m * b2 + g * (1 - b2)
        return updates, LionState(state.count + 1, rate, momentum)

    return GradientTransformation(init, update, elementwise=True, by_name=decay_mask is not None)
