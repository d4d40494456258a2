"""Callbacks from the config (``trainer.callbacks=[{_target_: my_pkg.callbacks.Log, every: 10}]``): each spec
checked before anything runs (``check_callbacks``), then built (``build_callbacks``), as models and hooks are
(``fdp.targets``).

>>> build_callbacks([{"_target_": "fdp.run.callbacks.base.Callback"}])  # doctest: +ELLIPSIS
[('fdp.run.callbacks.base.Callback', <fdp.run.callbacks.base.Callback object at ...>)]
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from fdp.errors import ConfigError
from fdp.run.callbacks.base import EVENTS, EXPECTED, not_a_callback
from fdp.targets import build, locate

__all__ = ["build_callbacks", "check_callbacks"]


def _specs(specs: Any, path: str) -> list[dict]:
    if specs is None:
        return []
    if not isinstance(specs, Sequence) or isinstance(specs, str):
        raise ConfigError(
            f"{path}={specs!r}: expected a list of callbacks, such as [{{_target_: my_pkg.callbacks.Log}}]"
        )
    out = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping) or spec.get("_target_", "???") == "???":
            raise ConfigError(
                f"{path}[{i}]={spec!r}: expected a mapping with a _target_ (the dotted path to a callback class "
                "or factory) and its settings, such as {_target_: my_pkg.callbacks.Log, every: 10}"
            )
        out.append({str(k): v for k, v in spec.items()})
    return out


def check_callbacks(specs: Any, path: str = "trainer.callbacks") -> None:
    """Refuse, before anything runs, a callback spec whose ``_target_`` does not import, is not a callback class,
    or does not take its settings; nothing is built.

    >>> check_callbacks([{"_target_": "fdp.run.callbacks.base.Callback", "every": 3}])  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: trainer.callbacks[0]._target_='fdp.run.callbacks.base.Callback':
    does not take every=3 (got an unexpected keyword argument 'every')
    """
    for i, spec in enumerate(_specs(specs, path)):
        setting = f"{path}[{i}]._target_"
        target = locate(setting, spec["_target_"])
        settings = {k: v for k, v in spec.items() if not k.startswith("_")}
        if inspect.isclass(target) and not any(hasattr(target, method) for method in EVENTS.values()):
            raise ConfigError(f"{setting}={spec['_target_']!r}: {EXPECTED}")
        try:
            inspect.signature(target).bind(**settings)
        except TypeError as error:
            given = ", ".join(f"{k}={v!r}" for k, v in settings.items())
            raise ConfigError(f"{setting}={spec['_target_']!r}: does not take {given} ({error})") from None
        except ValueError:  # no signature to inspect (a builtin): the build says
            pass


def build_callbacks(specs: Any, path: str = "trainer.callbacks") -> list[tuple[str, Any]]:
    """The callbacks ``specs`` name, each with its ``_target_`` (how errors name it)."""
    made = []
    for i, spec in enumerate(_specs(specs, path)):
        callback = build(f"{path}[{i}]", {"name": "custom", **spec})
        what = not_a_callback(callback)
        if what is not None:
            raise ConfigError(f"{path}[{i}]._target_={spec['_target_']!r}: returned {what}; {EXPECTED}")
        made.append((str(spec["_target_"]), callback))
    return made
