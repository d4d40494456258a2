"""Which params weight decay applies to: ``optim.decay_filter`` as a rule on names and kinds.

* ``all``: every param (``torch.optim``'s behaviour with one param group);
* ``weights``: the weights of layers, as language-model recipes decay: not biases and
  norms' scales (params of fewer than two dimensions) nor embeddings (the params of
  ``nn.Embedding`` modules, tied ones included, named by ``embedding_names``);
* a list of ``fnmatch`` patterns (``["*.bias", "*norm*"]``): params whose names match one
  are exempt, every other param decays.

The rule is a ``DecayMask``, ``(name, param) -> bool``, handed to ``sgd``, ``adam`` or
``adamw`` as ``decay_mask``; the exempt params are then stepped as a second
``torch.optim`` param group with ``weight_decay=0`` would be. At ZeRO stages, which step
flat slices of buckets, each slice's runs of decayed elements are derived from the plan
once (``fdp.update.zero.decay``).

>>> import torch
>>> rule = decay_rule("weights", embeddings={"tok.weight"})
>>> rule("fc.weight", torch.zeros(3, 2)), rule("fc.bias", torch.zeros(3)), rule("tok.weight", torch.zeros(9, 2))
(True, False, False)
>>> decay_rule(["*.bias"])("fc.bias", torch.zeros(3)), decay_rule("all") is None
(False, True)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from torch import nn

from fdp.errors import require
from fdp.optim.transforms import DecayMask

__all__ = ["DECAY_FILTERS", "check_decay_filter", "decay_rule", "embedding_names"]

DECAY_FILTERS = ("all", "weights")


def decay_rule(decay_filter: str | Sequence[str], embeddings: Iterable[str] = ()) -> DecayMask | None:
    """The ``decay_mask`` of ``decay_filter`` (see the module docstring); ``None`` for ``all``.

    ``embeddings``: the names of the embedding params (``embedding_names(module)``), which ``weights`` exempts.
    """
    if isinstance(decay_filter, str):
        require(
            decay_filter in DECAY_FILTERS,
            "decay_filter",
            decay_filter,
            f"{' or '.join(DECAY_FILTERS)}, or a list of name patterns exempt from weight decay ([*.bias, *norm*])",
        )
        if decay_filter == "all":
            return None
        exempt = frozenset(embeddings)
        return lambda name, param: param.ndim >= 2 and name not in exempt
    patterns = list(decay_filter) if isinstance(decay_filter, Sequence) else None
    require(
        bool(patterns) and all(isinstance(p, str) and p for p in patterns),
        "decay_filter",
        decay_filter,
        f"{' or '.join(DECAY_FILTERS)}, or a non-empty list of name patterns ([*.bias, *norm*])",
    )
    return lambda name, param: not any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def check_decay_filter(decay_filter: str | Sequence[str], names: Iterable[str]) -> None:
    """Refuse a list of patterns of which one matches none of the params ``names``: it would exempt nothing.

    >>> check_decay_filter(["*.bias"], ["fc.weight", "fc.bias"])
    >>> check_decay_filter(["*.bias", "norm*"], ["fc.weight", "fc.bias"])  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: decay_filter=['*.bias', 'norm*']: expected patterns that each match a param's name
    (norm* matches none of fc.weight, fc.bias)
    """
    if isinstance(decay_filter, str):
        return
    names = list(names)
    for pattern in decay_filter:
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} params)" if len(names) > 8 else "")
        require(
            any(fnmatch.fnmatchcase(name, pattern) for name in names),
            "decay_filter",
            list(decay_filter),
            f"patterns that each match a param's name ({pattern} matches none of {shown})",
        )


def embedding_names(module: nn.Module) -> frozenset[str]:
    """The names (as ``module.named_parameters()`` gives them) of the params of its ``nn.Embedding`` modules.

    A head tied to an embedding is the same tensor, so it is named whichever way it comes first.

    >>> embedding_names(nn.Sequential(nn.Embedding(5, 2), nn.Linear(2, 5)))
    frozenset({'0.weight'})
    """
    ids = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    return frozenset(name for name, p in module.named_parameters() if id(p) in ids)
