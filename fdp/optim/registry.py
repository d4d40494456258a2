"""Optimizers from config: ``build_optimizer({"name": "adamw", "lr": 3e-4, ...}, max_steps)``.

One registry for the ``optim`` config group. A spec names an optimizer of ``OPTIMIZERS``
and gives its settings (the factory's own keyword arguments) plus the settings every
optimizer shares: ``lr``, ``lr_schedule`` (``constant`` or ``warmup_cosine`` with
``warmup_steps``, or ``warmup_ratio`` of the run's steps where ``warmup_steps`` is 0, and
``end_lr``) and ``clip_norm`` (clip by global norm first; ``None``
for off). Errors are ``ValueError`` naming the setting by its path (``optim.lr``).

>>> opt = build_optimizer({"name": "sgd", "lr": 0.1, "momentum": 0.9}, max_steps=100)
>>> opt.elementwise
True
>>> build_optimizer({"name": "lion"}, max_steps=100)
Traceback (most recent call last):
ValueError: optim.name='lion': unknown optimizer; known optimizers: sgd, adam, adamw
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from fdp.errors import require
from fdp.optim.schedules import constant_schedule, warmup_cosine_schedule
from fdp.optim.transforms import GradientTransformation, adam, adamw, chain, clip_by_global_norm, sgd

OPTIMIZERS: dict[str, Callable[..., GradientTransformation]] = {"sgd": sgd, "adam": adam, "adamw": adamw}
LR_SCHEDULES = ("constant", "warmup_cosine")
SHARED_SETTINGS = {"lr": 1e-3, "lr_schedule": "constant", "warmup_steps": 0, "warmup_ratio": 0.0, "end_lr": 0.0,
                   "clip_norm": None}


def warmup_length(warmup_steps: int, warmup_ratio: float, max_steps: int) -> int:
    """The warm-up's steps: ``warmup_steps`` where set, else ``warmup_ratio`` of the run (a preset for any length).

    >>> warmup_length(0, 0.1, 300), warmup_length(0, 0.1, 20), warmup_length(5, 0.1, 20)
    (30, 2, 5)
    """
    return warmup_steps or round(warmup_ratio * max_steps)


def build_optimizer(spec: Mapping[str, Any], max_steps: int, path: str = "optim") -> GradientTransformation:
    """The optimizer ``spec`` describes, with its learning-rate schedule and clipping.

    ``max_steps`` is the run's length, over which ``warmup_cosine`` decays.
    """
    settings = {**SHARED_SETTINGS, **{str(k): v for k, v in spec.items()}}
    name = settings.pop("name", None)
    if name not in OPTIMIZERS:
        raise ValueError(f"{path}.name={name!r}: unknown optimizer; known optimizers: {', '.join(OPTIMIZERS)}")
    lr, lr_schedule, warmup_steps, warmup_ratio, end_lr, clip_norm = (settings.pop(k) for k in SHARED_SETTINGS)
    require(lr > 0, f"{path}.lr", lr, "a learning rate > 0")
    require(lr_schedule in LR_SCHEDULES, f"{path}.lr_schedule", lr_schedule, " or ".join(LR_SCHEDULES))
    require(0 <= warmup_steps <= max_steps, f"{path}.warmup_steps", warmup_steps,
             f"between 0 and trainer.max_steps={max_steps} (the schedule must not end before warm-up; "
             f"{path}.warmup_ratio scales it to the run)")
    require(0 <= warmup_ratio < 1, f"{path}.warmup_ratio", warmup_ratio, "a fraction of trainer.max_steps in [0, 1)")
    require(clip_norm is None or clip_norm > 0, f"{path}.clip_norm", clip_norm, "null (off) or > 0")
    factory = OPTIMIZERS[name]
    accepted = [p for p in inspect.signature(factory).parameters if p != "lr"]
    for key in settings:
        if key not in accepted:
            raise ValueError(f"{path}.{key}: not a setting of optimizer {name!r}; accepted settings: "
                             f"{', '.join([*SHARED_SETTINGS, *accepted])}")
    if lr_schedule == "warmup_cosine":
        schedule = warmup_cosine_schedule(lr, warmup_length(warmup_steps, warmup_ratio, max_steps), max_steps, end_lr)
    else:
        schedule = constant_schedule(lr)
    try:
        optimizer = factory(schedule, **settings)
    except ValueError as error:  # "momentum=-1: expected a number >= 0"
        raise ValueError(f"{path}.{error}") from None
    return chain(clip_by_global_norm(clip_norm), optimizer) if clip_norm else optimizer


def check_resumed_schedule(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """Refuse a resumed run whose ``trainer.max_steps`` would silently re-span the learning-rate schedule.

    ``warmup_cosine`` decays over ``trainer.max_steps``: resuming with another length
    would move every later rate (a jump at the resumed step) unless asked for with
    ``trainer.reschedule=true``. ``saved`` and ``current`` are run configs as dicts
    (``saved`` ``None``: a checkpoint that does not say, accepted).

    >>> run = lambda steps, schedule="warmup_cosine", **trainer: {"trainer": {"max_steps": steps, **trainer},
    ...                                                          "optim": {"lr_schedule": schedule}}
    >>> check_resumed_schedule(run(100), run(200))
    Traceback (most recent call last):
    ValueError: trainer.max_steps=200: the checkpoint's learning-rate schedule (optim.lr_schedule=warmup_cosine) spans trainer.max_steps=100; expected 100, or trainer.reschedule=true to stretch it over 200 steps (the rate jumps where the run resumes)
    >>> check_resumed_schedule(run(100, "constant"), run(200, "constant"))  # nothing depends on the length
    >>> check_resumed_schedule(run(100), run(200, reschedule=True))
    """
    if saved is None or current["trainer"].get("reschedule", False):
        return
    before, after = saved.get("trainer", {}).get("max_steps"), current["trainer"]["max_steps"]
    schedule = saved.get("optim", {}).get("lr_schedule", "constant")
    # Only the length changed implicitly: a schedule changed on the command line is what was asked for.
    if before is None or before == after or schedule == "constant" or current["optim"].get("lr_schedule") != schedule:
        return
    raise ValueError(
        f"trainer.max_steps={after}: the checkpoint's learning-rate schedule (optim.lr_schedule={schedule}) spans "
        f"trainer.max_steps={before}; expected {before}, or trainer.reschedule=true to stretch it over {after} steps "
        "(the rate jumps where the run resumes)"
    )
