"""Every config key with its default and meaning, read from the schemas: one source for ``--help`` and the docs.

A key's meaning is the comment its schema field carries in ``fdp.run.config.schema`` (on the
field's lines, or on the comment lines just above it), so the reference cannot drift
from the schemas: a field without one fails ``tests/run/test_reference.py``.

>>> doc = next(d for d in key_docs() if d.key == "trainer.eval_every")
>>> doc.default, doc.meaning.startswith("0: evaluate only at the end")
('100', True)
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
from functools import lru_cache
from typing import Any, Iterator, NamedTuple

from omegaconf import MISSING

from fdp.run.config import schema as schemas

__all__ = ["KeyDoc", "key_docs", "field_meanings", "reference_markdown", "help_text"]


_TARGET = "what Hydra builds: a class or function by its import path (fdp.targets)"


class KeyDoc(NamedTuple):
    """One config key: ``group`` option it belongs to (``optim=adamw``, or ``""`` for trainer/world/seed)."""

    option: str
    key: str
    default: str
    meaning: str


@lru_cache(maxsize=None)
def field_meanings(schema: type) -> dict[str, str]:
    """``{field: the comment on its lines or just above it}`` for a dataclass and the classes it extends.

    >>> field_meanings(schemas.LowBitConfig)["block"]
    'entries per scale'
    """
    meanings: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if dataclasses.is_dataclass(cls) and cls.__module__ == schemas.__name__:
            meanings.update(_class_comments(cls))
    return meanings


def _class_comments(cls: type) -> dict[str, str]:
    """The comments of the fields a class body declares itself: on the field's lines, else the lines just above."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        own = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        above, n = [], node.lineno - 1
        while n in comments and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        found[node.target.id] = " ".join(own or above)
    return found


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is MISSING:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(a group of keys)"
    return repr(value) if isinstance(value, str) and value == "" else str(value)


def _schema_docs(schema: type, prefix: str, option: str) -> Iterator[KeyDoc]:
    meanings = field_meanings(schema)
    for f in dataclasses.fields(schema):
        if f.name == "name" and option:
            continue  # the option itself (``optim=adamw``)
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if nested is not None and dataclasses.is_dataclass(nested):
            yield from _schema_docs(nested, f"{prefix}{f.name}.", option)
            continue
        meaning = meanings.get(f.name) or (_TARGET if f.name == "_target_" else "")
        yield KeyDoc(option, f"{prefix}{f.name}", _default(f), meaning)


def key_docs() -> list[KeyDoc]:
    """Every key of every config group option, trainer and world, in the schemas' order."""
    docs = list(_schema_docs(schemas.TrainerConfig, "trainer.", ""))
    docs += _schema_docs(schemas.WorldConfig, "world.", "")
    for group, options in schemas.SCHEMAS.items():
        if group == "world":
            continue
        for option, schema in options.items():
            docs += _schema_docs(schema, f"{group}.", f"{group}={option}")
    return docs


def reference_markdown() -> str:
    """The config reference page: a table per group (and option), key, default, meaning."""
    lines = [
        "# Config reference",
        "",
        "Generated from `fdp/run/config/schema.py` by `fdp.run.reference`: do not edit.",
        "",
    ]
    section = None
    for doc in key_docs():
        title = doc.option or doc.key.split(".")[0]
        if title != section:
            section = title
            lines += ["", f"## `{title}`", "", "| key | default | meaning |", "|---|---|---|"]
        meaning = doc.meaning.replace("|", "\\|")
        lines.append(f"| `{doc.key}` | `{doc.default}` | {meaning} |")
    return "\n".join(lines) + "\n"


def help_text(cfg: Any) -> str:
    """What ``python recipes/train.py --help [overrides]`` prints: every key of the composed config, its value and
    its one-line meaning."""
    chosen = {group: cfg[group].name for group in schemas.SCHEMAS if group != "world"}
    docs = [d for d in key_docs() if not d.option or d.option == f"{d.key.split('.')[0]}={chosen[d.key.split('.')[0]]}"]
    groups = ", ".join(f"{g}={'|'.join(options)}" for g, options in schemas.SCHEMAS.items() if g != "world")
    lines = [
        "usage: python recipes/train.py [group=option ...] [key=value ...] [-m for a sweep]",
        f"groups: {groups}",
        "keys (with this command's values):",
    ]
    width = max(len(d.key) for d in docs)
    for doc in docs:
        value = _value_at(cfg, doc.key)
        lines.append(f"  {doc.key:<{width}} = {value!s:<10} {doc.meaning}".rstrip())
    return "\n".join(lines)


def _value_at(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        try:
            node = node[part]
        except Exception:
            return "?"
    return node
