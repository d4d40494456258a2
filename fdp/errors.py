"""The error a refused setting raises, and the one wording of every refusal.

This module imports nothing of fdp, so any module may use it: a rule is stated where the
code that needs it lives, and ``fdp.run.config.validate`` calls those rules for a config without any
of them importing the config layer.

Every refusal reads ``<setting>=<value>: expected <what>``. A module names a setting as
its Python argument (``rank=0: expected an integer >= 1``); ``fdp.run.config.validate`` names it by
its config key (``hooks.rank=0: ...``).

>>> expected("trainer.max_steps", 0, "an integer >= 1")
'trainer.max_steps=0: expected an integer >= 1'
>>> check_int("rank", 0, low=1)
Traceback (most recent call last):
...
ValueError: rank=0: expected an integer >= 1
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

__all__ = [
    "ConfigError",
    "as_config_key",
    "expected",
    "require",
    "one_of",
    "check_choice",
    "check_bool",
    "check_int",
    "check_real",
]


class ConfigError(ValueError):
    """A setting out of range or inconsistent with another; the message names it."""


def expected(setting: str, value: Any, what: str) -> str:
    """The message of a refused setting: ``setting=value: expected what``.

    Strings are quoted so that an empty or padded value shows.

    >>> expected("schedule", "later", "auto, after or overlap")
    "schedule='later': expected auto, after or overlap"
    """
    return f"{setting}={value!r}: expected {what}"


def require(ok: bool, setting: str, value: Any, what: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error(expected(setting, value, what))`` unless ``ok``.

    >>> require(3 >= 1, "accum_steps", 3, "an integer >= 1")
    """
    if not ok:
        raise error(expected(setting, value, what))


def as_config_key(key: str, check: Callable[[Any], Any], value: Any) -> Any:
    """Run the check of the module that uses a setting, a refusal naming its config key (a ``ConfigError``).

    Modules name a setting as their Python argument (``schedule='x': expected ...``); the
    registries already give the group's path (``hooks.rank=0: expected ...``).

    >>> as_config_key("trainer.rank", lambda value: check_int("rank", value, low=1), 0)
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: trainer.rank=0: expected an integer >= 1
    """
    try:
        return check(value)
    except ValueError as error:
        message, group, arg = str(error), *key.rpartition(".")[::2]
        if group and message.startswith(arg):
            message = f"{group}.{message}"
        raise ConfigError(message) from None


def one_of(choices: Any) -> str:
    """The choices of a setting as a refusal lists them, from the tuple that states them.

    >>> one_of(("auto", "after", "overlap")), one_of((0, 1))
    ('auto, after or overlap', '0 or 1')
    """
    names = [str(choice) for choice in choices]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check_choice(setting: str, value: Any, choices: Any) -> Any:
    """``value`` if it is one of ``choices`` (a bool is not the integer it equals); refused naming them all.

    >>> check_choice("nonfinite", "ignore", ("raise", "skip"))
    Traceback (most recent call last):
    ...
    ValueError: nonfinite='ignore': expected raise or skip
    """
    ok = not isinstance(value, bool) or any(isinstance(choice, bool) for choice in choices)
    require(ok and value in choices, setting, value, one_of(choices))
    return value


def check_bool(setting: str, value: Any) -> bool:
    """``value`` if it is a boolean (numpy's too); refused otherwise (``1`` is not ``True`` here).

    >>> check_bool("error_feedback", "yes")
    Traceback (most recent call last):
    ...
    ValueError: error_feedback='yes': expected true or false
    """
    ok = isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy.bool_ without importing numpy
    require(ok, setting, value, "true or false")
    return bool(value)


def check_int(setting: str, value: Any, low: int, high: int | None = None) -> int:
    """``value`` if it is an integer (not a bool) in ``[low, high]``.

    >>> check_int("k", 5, low=1, high=4)
    Traceback (most recent call last):
    ...
    ValueError: k=5: expected an integer in [1, 4]
    """
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    ok = ok and value >= low and (high is None or value <= high)
    require(ok, setting, value, f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]")
    return int(value)


def check_real(
    setting: str, value: Any, low: float, high: float | None = None, low_open: bool = False, what: str | None = None
) -> float:
    """``value`` if it is a finite real number (not a bool) above ``low`` (and at most ``high``).

    ``what`` words the expectation where the bounds alone say it less well.

    >>> check_real("ratio", 0.0, low=0.0, high=1.0, low_open=True)
    Traceback (most recent call last):
    ...
    ValueError: ratio=0.0: expected a number in (0.0, 1.0]
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value <= high)
    if what is None and high is None:
        what = f"a number {'>' if low_open else '>='} {low}"
    elif what is None:
        what = f"a number in {'(' if low_open else '['}{low}, {high}]"
    require(ok, setting, value, what)
    return float(value)
