"""Objects named in a config by a dotted path (``_target_``), built with Hydra's ``instantiate``.

The built-in models and datasets are named the same way (``conf/model/mlp.yaml`` has
``_target_: fdp.model.builtin.MLP``), so a user's own class or function takes the one path the
built-ins take. Besides the settings of its config node, a target is offered arguments
that only the run knows (the model gets ``in_features``, ``num_classes``, ... from the
data); it receives those its signature names and that the config does not set. Every
failure is a ``ConfigError`` of one line naming the setting.

>>> build("model", {"name": "mlp", "_target_": "fdp.model.builtin.MLP", "hidden": 8, "depth": 1},
...       offered={"in_features": 4, "out_features": 3, "vocab_size": 7})
MLP(
  (net): Sequential(
    (0): Linear(in_features=4, out_features=8, bias=True)
    (1): ReLU()
    (2): Linear(in_features=8, out_features=3, bias=True)
  )
)
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Mapping
from typing import Any

from fdp.errors import ConfigError

__all__ = ["build", "classes_setting", "label", "locate"]

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def locate(setting: str, path: Any) -> Any:
    """The object at the dotted ``path`` (``my_pkg.models.Net``); errors name ``setting``.

    >>> locate("model._target_", "fdp.model.builtin.MLP").__name__
    'MLP'
    >>> locate("model._target_", "fdp.model.builtin.ResNet")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
        ...
    fdp.errors.ConfigError: model._target_='fdp.model.builtin.ResNet':
    module fdp.model.builtin has no attribute 'ResNet'
    """
    if not isinstance(path, str) or not _DOTTED.fullmatch(path):
        raise ConfigError(
            f"{setting}={path!r}: expected a dotted path to a class or function, such as my_pkg.models.Net"
        )
    parts = path.split(".")
    module, end = None, 0
    while end < len(parts):  # import the longest prefix that is a module, shortest first
        name = ".".join(parts[: end + 1])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:  # the module exists; something it imports does not
                raise ConfigError(f"{setting}={path!r}: importing {name} failed: {_first_line(error)}") from None
            if module is None:
                raise ConfigError(
                    f"{setting}={path!r}: cannot import it ({_first_line(error)}; is its directory on PYTHONPATH?)"
                ) from None
            break  # the rest are attributes
        except Exception as error:  # a syntax error or a failing statement in the user's module
            raise ConfigError(
                f"{setting}={path!r}: importing {name} failed: {type(error).__name__}: {_first_line(error)}"
            ) from None
        end += 1
    obj = module
    for depth, attr in enumerate(parts[end:], start=end):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            kind = "module" if inspect.ismodule(obj) else type(obj).__name__
            raise ConfigError(
                f"{setting}={path!r}: {kind} {'.'.join(parts[:depth])} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise ConfigError(f"{setting}={path!r}: expected a class or function, got a {type(obj).__name__}")
    return obj


def label(group: str, node: Mapping) -> str:
    """How errors name a config node: ``model=mlp`` for a built-in, ``model._target_='my.Net'`` for a custom one.

    >>> label("model", {"name": "custom", "_target_": "my_pkg.Net"})
    "model._target_='my_pkg.Net'"
    """
    if node.get("name") == "custom":
        return f"{group}._target_={node.get('_target_')!r}"
    return f"{group}={node.get('name')}"


def parameter_names(target: Any) -> set[str]:
    """The keyword arguments ``target`` names in its signature (empty if it has none to inspect)."""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in kinds}


# The arguments by which a model's constructor may set its number of class scores, most specific first.
_CLASS_ARGUMENTS = ("num_classes", "out_features", "num_labels", "vocab_size")


def classes_setting(node: Mapping) -> str:
    """The override that sets the number of class scores of the model ``node`` builds (for messages).

    The first of ``num_classes``, ``out_features``, ``num_labels``, ``vocab_size`` that its
    target names (``num_classes`` if none: torchvision's models take it through ``**kwargs``),
    with Hydra's ``+`` where the node does not have the key yet.

    >>> classes_setting({"name": "mlp", "_target_": "fdp.model.builtin.MLP", "hidden": 8})
    '+model.out_features'
    >>> classes_setting({"name": "custom", "_target_": "torch.nn.Linear", "out_features": 5})
    'model.out_features'
    """
    try:
        accepted = parameter_names(locate("model._target_", node.get("_target_")))
    except ConfigError:
        accepted = set()
    key = next((k for k in _CLASS_ARGUMENTS if k in accepted), _CLASS_ARGUMENTS[0])
    return f"model.{key}" if key in node else f"+model.{key}"


def build(
    group: str, node: Mapping, offered: Mapping[str, Any] | None = None, skip: tuple[str, ...] = ("name",)
) -> Any:
    """Call ``node["_target_"]`` with the node's other settings and the ``offered`` ones its signature names.

    Keys in ``skip`` are settings of fdp, not of the target. A setting of the node wins
    over an offered value of the same name; offered values that are ``None`` (unknown)
    are not passed. A target that rejects its arguments (``TypeError``/``ValueError``)
    is a ``ConfigError`` naming the node; any other exception is a bug and propagates.

    >>> build("model", {"name": "custom", "_target_": "torch.nn.Linear", "bias": False},
    ...       offered={"in_features": 4, "out_features": 2, "num_classes": 2})
    Linear(in_features=4, out_features=2, bias=False)
    >>> build("model", {"name": "custom", "_target_": "torch.nn.Linear", "widht": 3}, offered={"in_features": 4})
    ... # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
        ...
    fdp.errors.ConfigError: model._target_='torch.nn.Linear':
    Linear.__init__() got an unexpected keyword argument 'widht' (called with widht=3, in_features=4)
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    settings = {str(k): v for k, v in node.items() if k not in skip}
    if settings.get("_target_", "???") == "???":  # absent, or Hydra's mark of a value still missing
        raise ConfigError(f"{group}._target_: missing; expected a dotted path to a class or function")
    target = locate(f"{group}._target_", settings["_target_"])
    accepted = parameter_names(target)
    extra = {k: v for k, v in (offered or {}).items() if k in accepted and k not in settings and v is not None}
    try:
        return instantiate(settings, **extra, _convert_="all")
    except InstantiationException as wrapped:
        error = wrapped.__cause__ or wrapped
        if not isinstance(error, (TypeError, ValueError)):
            raise error from None
        called = ", ".join(f"{k}={v!r}" for k, v in {**settings, **extra}.items() if not k.startswith("_"))
        detail = f" (called with {called or 'no arguments'})" if isinstance(error, TypeError) else ""
        raise ConfigError(f"{label(group, node)}: {_first_line(error)}{detail}") from None
