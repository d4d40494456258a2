"""Hooks from config: ``build_hook({"name": "powersgd", "rank": 4})``.

A spec is a mapping with a ``name`` and that hook's settings, or a chain of specs,
``{"chain": [spec, ...]}`` (with ``"name": "chain"`` beside it in ``fdp.run.config.ChainConfig``'s
form). A bare string is a hook with default settings.
``{"name": "custom", "_target_": "my_pkg.hooks.make", ...}`` is a user's own hook: the
factory ``_target_`` names (``fdp.targets``) is called with the other keys and must return
a ``Hook`` (a chain is one); it declares ``shardable`` itself.
Errors are ``ValueError`` naming the setting by its path (``hooks.rank``,
``hooks.chain[1].name``) and listing what is accepted; the hook factories themselves,
called from Python, name their arguments (``rank=0: expected an integer >= 1``).

>>> hook = build_hook(
...     {"chain": [{"name": "fp16_compress"}, {"name": "powersgd", "rank": 4}, {"name": "fp16_decompress"}]}
... )
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from fdp.hooks.allreduce import allreduce
from fdp.hooks.base import Hook, chain
from fdp.hooks.compress import bf16, bf16_compress, bf16_decompress, fp16, fp16_compress, fp16_decompress
from fdp.hooks.int8 import int8
from fdp.hooks.lowbit import lowbit
from fdp.hooks.noop import noop
from fdp.hooks.powersgd import batched_powersgd, powersgd
from fdp.hooks.topk import topk
from fdp.targets import build

__all__ = ["HOOKS", "build_hook"]

HOOKS: dict[str, Callable[..., Hook]] = {
    "allreduce": allreduce,
    "fp16": fp16,
    "bf16": bf16,
    "fp16_compress": fp16_compress,
    "fp16_decompress": fp16_decompress,
    "bf16_compress": bf16_compress,
    "bf16_decompress": bf16_decompress,
    "powersgd": powersgd,
    "batched_powersgd": batched_powersgd,
    "topk": topk,
    "int8": int8,
    "lowbit": lowbit,
    "noop": noop,
}

# Halves of a hook, registered for chains written out hook by hook (conf/hooks/fp16_powersgd.yaml), not hooks a
# run picks alone: they are left out where a refusal lists the hooks to pick instead.
CHAIN_HALVES = ("fp16_compress", "fp16_decompress", "bf16_compress", "bf16_decompress")


def shardable_hooks() -> list[str]:
    """The registered hooks that work on a slice of the reduced bucket (``Hook.shardable``, with their defaults).

    >>> shardable_hooks()[:3]
    ['allreduce', 'fp16', 'bf16']
    """
    return [name for name, factory in HOOKS.items() if name not in CHAIN_HALVES and factory().shardable]


def _known() -> str:
    return ", ".join([*HOOKS, "chain", "custom"])


def build_hook(spec: Any, path: str = "hooks") -> Hook:
    """The hook a spec describes (see the module docstring).

    >>> build_hook({"name": "topk", "ratio": 0.1}).init  # doctest: +ELLIPSIS
    <function topk.<locals>.init at ...>
    """
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{path}={spec!r}: expected a mapping with a 'name' (one of {_known()}) or a 'chain'")
    settings = {str(key): value for key, value in spec.items()}
    if "chain" in settings or settings.get("name") == "chain":
        return _build_chain(settings, path)
    if "name" not in settings:
        raise ValueError(f"{path}.name: missing; expected one of {_known()}")
    if settings["name"] == "custom":
        return _custom(settings, path)
    name = settings.pop("name")
    factory = HOOKS.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ValueError(f"{path}.name={name!r}: unknown hook; known hooks: {_known()}")
    accepted = list(inspect.signature(factory).parameters)
    for key in settings:
        if key not in accepted:
            listed = ", ".join(accepted) if accepted else "none"
            raise ValueError(f"{path}.{key}: not a setting of hook {name!r}; accepted settings: {listed}")
    try:
        return factory(**settings)
    except ValueError as error:
        message = str(error)
        # The factories name their Python arguments ("rank=0: ..."); name the config key instead.
        if message.split("=", 1)[0] in accepted:
            raise ValueError(f"{path}.{message}") from None
        raise


def _custom(settings: dict[str, Any], path: str) -> Hook:
    """The ``Hook`` a user's factory (``<path>._target_``) returns, called with the spec's other keys."""
    if settings.get("_target_", "???") == "???":
        raise ValueError(
            f"{path}._target_: missing; {path}=custom needs the dotted path to a factory returning a Hook "
            f"(e.g. {path}._target_=my_pkg.hooks.make)"
        )
    made = build(path, settings)  # a ConfigError (a ValueError) naming the setting where it does not import or call
    if not isinstance(made, Hook):
        if hasattr(made, "update") and hasattr(made, "init"):
            what = "an optimizer (GradientTransformation)"
        elif inspect.isroutine(made):
            what = f"the function {getattr(made, '__name__', made)!r} (a factory's result is called for)"
        else:
            what = f"a {type(made).__name__}"
        raise ValueError(
            f"{path}._target_={settings.get('_target_')!r}: returned {what}; expected an fdp.hooks.Hook "
            "(init, apply, shardable), such as fdp.hooks.chain(...) or fdp.hooks.stateless(...)"
        )
    return made


def _build_chain(settings: dict[str, Any], path: str) -> Hook:
    for extra in settings:
        if extra not in ("chain", "name"):
            raise ValueError(f"{path}.{extra}: not a setting of a chain; accepted settings: chain, name")
    hooks = settings.get("chain")
    if isinstance(hooks, (str, bytes)) or not isinstance(hooks, Sequence) or not hooks:
        raise ValueError(f"{path}.chain={hooks!r}: expected a non-empty list of hook specs")
    return chain(*(build_hook(hook, f"{path}.chain[{i}]") for i, hook in enumerate(hooks)))
