"""Activation checkpointing's choice: the modules a run checkpoints, from its settings, and the settings' checks.

``trainer.activation_checkpointing`` (``none``, ``blocks`` or ``every_k``, with ``_policy`` and
``_k``) and ``make_train_step(checkpoint_modules=...)`` choose modules of the model; how a chosen
module keeps only its inputs and runs again in backward is ``fdp.model.recompute``.

* ``select(module, mode, policy, every)``: the modules a run checkpoints (``blocks``: the
  transformer's repeated blocks or the classes ``policy`` names; ``every_k``: every
  ``every``-th of them).
* ``from_config`` (the config's settings, refused as a ``ConfigError``) and ``modules_of`` (what
  a Python caller gives ``make_train_step``): ``select`` for each.

>>> import torch.nn as nn
>>> net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
>>> [type(m).__name__ for m in select(net, "blocks", policy=["Linear"])]
['Linear', 'Linear']
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from fdp.errors import ConfigError, check_int, require

__all__ = [
    "MODES",
    "check_k",
    "check_mode",
    "from_config",
    "modules_of",
    "repeated_blocks",
    "resolved_mode",
    "select",
]

MODES = ("none", "blocks", "every_k")
DEFAULT_K = 2  # every_k: every second block


def check_mode(mode: Any) -> str:
    """``activation_checkpointing``: ``none``, ``blocks`` or ``every_k``; else a ``ValueError`` naming it.

    >>> check_mode("all")
    Traceback (most recent call last):
    ...
    ValueError: activation_checkpointing='all': expected none, blocks or every_k
    """
    require(mode in MODES, "activation_checkpointing", mode, "none, blocks or every_k")
    return mode


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module`` held in a ``ModuleList`` or ``Sequential`` beside others of their class.

    These are a transformer's layers (GPT-2's ``GPT2Block``s in ``transformer.h``, the
    char transformer's blocks), the unit activation checkpointing saves the most per
    recomputation; the outermost such list wins.

    >>> layer = lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([layer(), layer()]))
    >>> [type(m).__name__ for m in repeated_blocks(net)]
    ['Sequential', 'Sequential']
    """
    found: list[nn.Module] = []
    inside: set[int] = set()
    for holder in module.modules():
        if id(holder) in inside or not isinstance(holder, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(holder.children())
        counts: dict[type, int] = {}
        for child in children:
            counts[type(child)] = counts.get(type(child), 0) + 1
        repeated = [c for c in children if counts[type(c)] >= 2 and any(True for _ in c.parameters())]
        # A list of parameterless modules (activations) or of single layers in a Sequential is no block stack.
        repeated = [c for c in repeated if any(True for _ in c.children())]
        if repeated:
            found += repeated
            inside |= {id(m) for c in repeated for m in c.modules()}
    return found


def _class_names(module: nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in module.modules()})


def _matches(m: nn.Module, policy: Iterable[Any]) -> bool:
    for entry in policy:
        if isinstance(entry, type) and isinstance(m, entry):
            return True
        if isinstance(entry, str) and entry in (type(m).__name__, f"{type(m).__module__}.{type(m).__qualname__}"):
            return True
        if isinstance(entry, nn.Module) and entry is m:
            return True
    return False


def select(
    module: nn.Module,
    mode: str = "blocks",
    policy: Iterable[Any] = (),
    every: int = 2,
    setting: str = "checkpoint_modules",
) -> list[nn.Module]:
    """The modules of ``module`` a run checkpoints, outermost first, in module order.

    ``mode`` is ``none`` (no module), ``blocks`` (the modules of the classes ``policy``
    names, by class, class name or qualified name, or given as modules; with no policy,
    ``repeated_blocks``), or ``every_k`` (every ``every``-th of those, from the first:
    less memory saved, less recomputed). A module inside another selected one is left
    out (the outer recomputation covers it). A policy entry that matches no module is
    refused, naming ``setting`` and the classes the model has.

    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(4)])
    >>> len(select(net, "blocks")), len(select(net, "every_k", every=3))
    (4, 2)
    >>> select(net, "blocks", policy=["B"])
    Traceback (most recent call last):
    ...
    ValueError: checkpoint_modules=['B']: expected the model's classes (none is B; it has Linear, ReLU, Sequential)
    """
    check_mode(mode)
    every = check_int("every", every, low=1)
    if mode == "none":
        return []
    policy = list(policy)
    if not policy:
        chosen = repeated_blocks(module)
        require(bool(chosen), setting, policy, "the classes of the modules to checkpoint (the model repeats no block)")
    else:
        for entry in policy:
            found = any(_matches(m, [entry]) for m in module.modules())
            name = entry.__name__ if isinstance(entry, type) else entry
            require(
                found,
                setting,
                [e.__name__ if isinstance(e, type) else e for e in policy],
                f"the model's classes (none is {name}; it has {', '.join(_class_names(module))})",
            )
        chosen, inside = [], set()
        for m in module.modules():
            if id(m) not in inside and m is not module and _matches(m, policy):
                chosen.append(m)
                inside |= {id(sub) for sub in m.modules()}
    return chosen[::every] if mode == "every_k" else chosen


def modules_of(spec: Any, model: Any = None) -> list[nn.Module]:
    """The modules ``make_train_step(checkpoint_modules=spec, model=model)`` checkpoints.

    ``spec`` is a module, a list of modules, ``"blocks"`` (the model's repeated
    blocks), or classes and class names (the model's modules of those classes);
    ``model`` an ``fdp.FunctionalModel`` or ``nn.Module``, needed unless ``spec`` holds modules.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    >>> len(modules_of(nn.Linear, net)), modules_of([net[0]]) == [net[0]]
    (2, True)
    >>> modules_of("Linear")
    Traceback (most recent call last):
    ...
    ValueError: checkpoint_modules='Linear': expected modules, or model= to find them in (the loss's FunctionalModel)
    """
    entries = [spec] if isinstance(spec, (str, type, nn.Module)) else list(spec)
    if entries and all(isinstance(e, nn.Module) for e in entries):
        return entries
    module = getattr(model, "module", model)
    require(
        isinstance(module, nn.Module),
        "checkpoint_modules",
        spec,
        "modules, or model= to find them in (the loss's FunctionalModel)",
    )
    if entries == ["blocks"]:
        return select(module, "blocks")
    return select(module, "blocks", policy=entries)


def from_config(mode: str, policy: Iterable[str], k: int | None, module: nn.Module) -> list[nn.Module]:
    """The modules ``trainer.activation_checkpointing`` (with ``_policy`` and ``_k``) choose in ``module``.

    The mode and ``k`` are checked with the rest of the config (``check_mode``,
    ``check_k``); a policy alone turns on ``blocks`` (``resolved_mode``); a policy naming no
    class of the model is refused here, where the model is known, with a ``ConfigError`` that names the setting.

    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(4)])
    >>> len(from_config("every_k", [], None, net)), len(from_config("none", ["Linear"], None, net))
    (2, 4)
    """
    mode = resolved_mode(mode, policy)
    try:
        return select(module, mode, list(policy), check_k(k, mode), setting="trainer.activation_checkpointing_policy")
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_k(k: Any, mode: str = "every_k") -> int:
    """``activation_checkpointing_k``: checkpoint every k-th block under ``every_k`` (an integer >= 1; ``None``: 2).

    It picks among the blocks only under ``every_k``: set with another mode it would do nothing.

    >>> check_k(None), check_k(3)
    (2, 3)
    >>> check_k(0)
    Traceback (most recent call last):
    ...
    ValueError: activation_checkpointing_k=0: expected an integer >= 1
    >>> check_k(3, "blocks")
    Traceback (most recent call last):
    ...
    ValueError: activation_checkpointing_k=3: expected it unset with trainer.activation_checkpointing=blocks (k picks \
every k-th block under every_k)
    """
    if k is None:
        return DEFAULT_K
    require(
        mode == "every_k",
        "activation_checkpointing_k",
        k,
        f"it unset with trainer.activation_checkpointing={mode} (k picks every k-th block under every_k)",
    )
    return check_int("activation_checkpointing_k", k, low=1)


def resolved_mode(mode: str, policy: Iterable[Any] = ()) -> str:
    """The mode a run checkpoints with: a policy with the mode ``none`` turns on ``blocks``, as Lightning's
    ``activation_checkpointing_policy`` turns checkpointing on.

    >>> resolved_mode("none", ["Block"]), resolved_mode("none"), resolved_mode("every_k", ["Block"])
    ('blocks', 'none', 'every_k')
    """
    return "blocks" if mode == "none" and list(policy) else mode
