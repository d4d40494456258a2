"""Optimizers from config: ``build_optimizer({"name": "adamw", "lr": 3e-4, ...}, max_steps)``.

One registry for the ``optim`` config group. A spec names an optimizer of ``OPTIMIZERS``
and gives its settings (the factory's own keyword arguments) plus the settings every
optimizer shares: ``lr``, ``lr_schedule`` (one of ``LR_SCHEDULES``, with ``warmup_steps`` or ``warmup_ratio``,
``end_lr`` and, for ``wsd``, ``decay_fraction``; ``fdp.optim.schedules``), ``decay_filter``
(which params weight decay applies to; ``fdp.optim.decay``) and ``clip_norm`` (clip by
global norm first; ``None`` for off). Errors are ``ValueError`` naming the setting by its
path (``optim.lr``).

``name: custom`` is a user's own optimizer: ``_target_`` names a factory that returns a
``GradientTransformation`` (``fdp.targets``); its other keys are the factory's keyword
arguments, and it is offered ``lr`` (the schedule the shared settings make) and
``decay_mask`` (the ``decay_filter`` rule) where its signature names them. Clipping wraps
it as it wraps the built-ins.

>>> opt = build_optimizer({"name": "sgd", "lr": 0.1, "momentum": 0.9}, max_steps=100)
>>> opt.elementwise
True
>>> build_optimizer({"name": "lion"}, max_steps=100)
Traceback (most recent call last):
ValueError: optim.name='lion': unknown optimizer; known optimizers: sgd, adam, adamw, custom
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Callable, Mapping

import torch

from fdp.errors import ConfigError, require
from fdp.optim.decay import decay_rule
from fdp.optim.optimizers import adam, adamw, sgd
from fdp.optim.schedules import (
    Schedule,
    constant_schedule,
    warmup_constant_schedule,
    warmup_cosine_schedule,
    warmup_linear_schedule,
    wsd_schedule,
)
from fdp.optim.transforms import GradientTransformation, chain, clip_by_global_norm
from fdp.targets import build, locate, parameter_names

OPTIMIZERS: dict[str, Callable[..., GradientTransformation]] = {"sgd": sgd, "adam": adam, "adamw": adamw}
# The schedules by name, from (lr, warmup_steps, max_steps, end_lr, decay_fraction).
LR_SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "constant": lambda lr, warmup, steps, end, fraction: constant_schedule(lr),
    "warmup_constant": lambda lr, warmup, steps, end, fraction: warmup_constant_schedule(lr, warmup),
    "warmup_linear": lambda lr, warmup, steps, end, fraction: warmup_linear_schedule(lr, warmup, steps, end),
    "warmup_cosine": lambda lr, warmup, steps, end, fraction: warmup_cosine_schedule(lr, warmup, steps, end),
    "wsd": lambda lr, warmup, steps, end, fraction: wsd_schedule(lr, warmup, steps, fraction, end),
}
# The schedules whose rates depend on the run's length (trainer.max_steps).
SPANNING = ("warmup_linear", "warmup_cosine", "wsd")
SHARED_SETTINGS = {
    "lr": 1e-3,
    "lr_schedule": "constant",
    "warmup_steps": 0,
    "warmup_ratio": 0.0,
    "end_lr": 0.0,
    "decay_fraction": 0.1,
    "decay_filter": "all",
    "clip_norm": None,
}
# What a custom optimizer's factory is offered where its signature names it.
_OFFERED = ("lr", "decay_mask")


def warmup_length(warmup_steps: int, warmup_ratio: float, max_steps: int) -> int:
    """The warm-up's steps: ``warmup_steps`` where set, else ``warmup_ratio`` of the run (a preset for any length).

    >>> warmup_length(0, 0.1, 300), warmup_length(0, 0.1, 20), warmup_length(5, 0.1, 20)
    (30, 2, 5)
    """
    return warmup_steps or round(warmup_ratio * max_steps)


def build_optimizer(
    spec: Mapping[str, Any], max_steps: int, path: str = "optim", embeddings: Iterable[str] = ()
) -> GradientTransformation:
    """The optimizer ``spec`` describes, with its learning-rate schedule, weight-decay rule and clipping.

    ``max_steps`` is the run's length, over which the decaying schedules decay;
    ``embeddings`` the names of the model's embedding params (``fdp.optim.embedding_names``),
    which ``decay_filter=weights`` exempts from weight decay.
    """
    settings = {**SHARED_SETTINGS, **{str(k): v for k, v in spec.items()}}
    name = settings.pop("name", None)
    if name not in OPTIMIZERS and name != "custom":
        known = ", ".join([*OPTIMIZERS, "custom"])
        raise ValueError(f"{path}.name={name!r}: unknown optimizer; known optimizers: {known}")
    lr, lr_schedule, warmup_steps, warmup_ratio, end_lr, decay_fraction, decay_filter, clip_norm = (
        settings.pop(k) for k in SHARED_SETTINGS
    )
    require(lr > 0, f"{path}.lr", lr, "a learning rate > 0")
    require(lr_schedule in LR_SCHEDULES, f"{path}.lr_schedule", lr_schedule, " or ".join(LR_SCHEDULES))
    require(
        0 <= warmup_steps <= max_steps,
        f"{path}.warmup_steps",
        warmup_steps,
        f"between 0 and trainer.max_steps={max_steps} (the schedule must not end before warm-up; "
        f"{path}.warmup_ratio scales it to the run)",
    )
    require(0 <= warmup_ratio < 1, f"{path}.warmup_ratio", warmup_ratio, "a fraction of trainer.max_steps in [0, 1)")
    require(end_lr >= 0, f"{path}.end_lr", end_lr, "a learning rate >= 0")
    require(0 <= decay_fraction <= 1, f"{path}.decay_fraction", decay_fraction, "a fraction of the run in [0, 1]")
    require(clip_norm is None or clip_norm > 0, f"{path}.clip_norm", clip_norm, "null (off) or > 0")
    try:
        mask = decay_rule(decay_filter, embeddings)
    except ValueError as error:  # "decay_filter='x': expected ..."
        raise ValueError(f"{path}.{error}") from None
    warmup = warmup_length(warmup_steps, warmup_ratio, max_steps)
    schedule = LR_SCHEDULES[lr_schedule](lr, warmup, max_steps, end_lr, decay_fraction)
    if name == "custom":
        optimizer = _custom(settings, schedule, mask, path)
    else:
        optimizer = _builtin(name, settings, schedule, mask, path)
    return chain(clip_by_global_norm(clip_norm), optimizer) if clip_norm else optimizer


def _builtin(name: str, settings: dict, schedule: Schedule, mask: Any, path: str) -> GradientTransformation:
    factory = OPTIMIZERS[name]
    accepted = [p for p in inspect.signature(factory).parameters if p not in _OFFERED]
    for key in settings:
        if key not in accepted:
            raise ValueError(
                f"{path}.{key}: not a setting of optimizer {name!r}; accepted settings: "
                f"{', '.join([*SHARED_SETTINGS, *accepted])}"
            )
    try:
        return factory(schedule, **settings, decay_mask=mask)
    except ValueError as error:  # "momentum=-1: expected a number >= 0"
        raise ValueError(f"{path}.{error}") from None


def _custom(settings: dict, schedule: Schedule, mask: Any, path: str) -> GradientTransformation:
    """The ``GradientTransformation`` a user's factory (``optim._target_``) returns, offered the rate and the rule."""
    target = settings.get("_target_", "???")
    if target == "???":
        raise ValueError(
            f"{path}._target_: missing; {path}=custom needs the dotted path to a factory returning a "
            f"GradientTransformation (e.g. {path}._target_=my_pkg.optim.make)"
        )
    try:
        factory = locate(f"{path}._target_", target)
        if isinstance(factory, type) and issubclass(factory, torch.optim.Optimizer):
            raise ConfigError(
                f"{path}._target_={target!r}: a torch.optim optimizer, which steps tensors in place; "
                "expected a factory returning an fdp.optim.GradientTransformation (pure init and update)"
            )
        accepted = parameter_names(factory)
        if mask is not None and "decay_mask" not in accepted:
            raise ConfigError(
                f"{path}.decay_filter: {target} takes no decay_mask argument; expected all, "
                "or a factory with a decay_mask parameter"
            )
        made = build(path, {"name": "custom", **settings}, offered={"lr": schedule, "decay_mask": mask})
    except ConfigError as error:
        raise ValueError(str(error)) from None
    if not isinstance(made, GradientTransformation):
        raise ValueError(
            f"{path}._target_={target!r}: returned {_a(made)}; expected a GradientTransformation "
            "(init, update), such as fdp.optim.adamw(...) or fdp.optim.chain(...)"
        )
    return made


def _a(value: Any) -> str:
    what = "a reduction hook (fdp.hooks.Hook)" if hasattr(value, "apply") and hasattr(value, "init") else None
    return what or f"a {type(value).__name__}"


def check_resumed_schedule(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """Refuse a resumed run whose ``trainer.max_steps`` would silently re-span the learning-rate schedule.

    ``warmup_cosine`` decays over ``trainer.max_steps``: resuming with another length
    would move every later rate (a jump at the resumed step) unless asked for with
    ``trainer.reschedule=true``. ``saved`` and ``current`` are run configs as dicts
    (``saved`` ``None``: a checkpoint that does not say, accepted).

    >>> run = lambda steps, schedule="warmup_cosine", **trainer: {"trainer": {"max_steps": steps, **trainer},
    ...                                                          "optim": {"lr_schedule": schedule}}
    >>> check_resumed_schedule(run(100), run(200))  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ValueError: trainer.max_steps=200: the checkpoint's learning-rate schedule (optim.lr_schedule=warmup_cosine)
    spans trainer.max_steps=100; expected 100, or trainer.reschedule=true to stretch it over 200 steps
    (the rate jumps where the run resumes)
    >>> check_resumed_schedule(run(100, "constant"), run(200, "constant"))  # nothing depends on the length
    >>> check_resumed_schedule(run(100), run(200, reschedule=True))
    """
    if saved is None or current["trainer"].get("reschedule", False):
        return
    before, after = saved.get("trainer", {}).get("max_steps"), current["trainer"]["max_steps"]
    schedule = saved.get("optim", {}).get("lr_schedule", "constant")
    # Only the length changed implicitly: a schedule changed on the command line is what was asked for.
    if before is None or before == after or schedule not in SPANNING or current["optim"].get("lr_schedule") != schedule:
        return
    raise ValueError(
        f"trainer.max_steps={after}: the checkpoint's learning-rate schedule (optim.lr_schedule={schedule}) spans "
        f"trainer.max_steps={before}; expected {before}, or trainer.reschedule=true to stretch it over {after} steps "
        "(the rate jumps where the run resumes)"
    )
