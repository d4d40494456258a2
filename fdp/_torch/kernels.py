"""torch's multi-tensor ``_foreach_*`` ops and fused optimizer kernels, each with a public fallback or a flag.

>>> list(foreach.add([torch.ones(2)], [torch.ones(2)], alpha=2.0))
[tensor([3., 3.])]
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch


# -- multi-tensor ops ---------------------------------------------------------------------
def _looped(op: Callable) -> Callable:
    """``op`` applied pairwise over lists; a non-list argument is shared by every element."""

    def run(first, *rest, **kwargs):
        n = len(first)
        columns = [r if isinstance(r, (list, tuple)) else [r] * n for r in rest]
        return [op(x, *args, **kwargs) for x, *args in zip(first, *columns)]

    return run


def _multi_tensor(name: str, fallback: Callable) -> Callable:
    # One dispatch for the whole list instead of one per tensor (and torch's fused
    # multi-tensor kernels on CUDA); the loop gives the same numbers, slower.
    return getattr(torch, f"_foreach_{name}", None) or _looped(fallback)


foreach = SimpleNamespace(
    add=_multi_tensor("add", torch.add),
    add_=_multi_tensor("add_", torch.Tensor.add_),
    mul=_multi_tensor("mul", torch.mul),
    mul_=_multi_tensor("mul_", torch.Tensor.mul_),
    div_=_multi_tensor("div_", torch.Tensor.div_),
    lerp=_multi_tensor("lerp", torch.lerp),
    addcmul_=_multi_tensor("addcmul_", torch.Tensor.addcmul_),
    sqrt=_multi_tensor("sqrt", torch.sqrt),
    norm=_multi_tensor("norm", lambda t, ord=2: torch.linalg.vector_norm(t, ord)),
    copy_=_multi_tensor("copy_", torch.Tensor.copy_),
    zero_=_multi_tensor("zero_", torch.Tensor.zero_),
)


# -- fused optimizer kernels (what torch.optim runs with fused=True) ------------------------
fused_sgd_ = getattr(torch, "_fused_sgd_", None)
fused_adam_ = getattr(torch, "_fused_adam_", None)
fused_adamw_ = getattr(torch, "_fused_adamw_", None)
HAS_FUSED_OPTIMIZERS = None not in (fused_sgd_, fused_adam_, fused_adamw_)
