"""Every private PyTorch API fdp uses, in one place, each with a public fallback.

fdp leans on a few of torch's underscore APIs for speed (the ``_foreach_*`` multi-tensor
ops, the fused optimizer kernels) or for things torch has no public way to say (leaving
the ``torch.func`` transform from inside a tensor hook). They are looked up here once, at
import; where a torch build lacks one, the fallback is a public path with the same
numbers (a Python loop instead of a ``_foreach`` op) or, where none exists, a flag the
caller checks (``HAS_FUSED_OPTIMIZERS``, ``HAS_DISABLE_FUNCTORCH``). The rest of ``fdp/``
imports from this package and never spells a private torch name itself
(``tests/test_torch_shim.py`` holds it to that).

One module per area of torch it wraps: the multi-tensor ops and fused optimizer kernels
(``kernels``), ``torch.func`` and dispatch modes (``dispatch``), process groups
(``distributed``), pytrees (``trees``), storages (``storage``), a module's parameter and
buffer dicts (``slots``), ``torch.compile`` (``compiler``), ``torch.distributed.checkpoint``
(``dcp``) and ``torch.save``'s records (``serialization``). Callers import every name from
``fdp._torch`` itself.

>>> list(foreach.add([torch.ones(2)], [torch.ones(2)], alpha=2.0))
[tensor([3., 3.])]
>>> tree_flatten({"a": torch.zeros(1), "b": (1, 2)})[0]
[tensor([0.]), 1, 2]
"""

from __future__ import annotations

import torch  # noqa: F401 - the examples above use it

from fdp._torch.compiler import inductor_default_cache_dir, preload_compiler
from fdp._torch.dcp import (
    DCP_READS_CHUNK_FIELDS,
    chunk_load_planner,
    chunk_of,
    digesting_writer,
    mark_chunk,
    single_process_dcp,
)
from fdp._torch.dispatch import CUSTOM_FUNCTION_CALL, HAS_DISABLE_FUNCTORCH, TorchDispatchMode, disable_functorch
from fdp._torch.distributed import default_store, group_timeout, live_groups
from fdp._torch.kernels import HAS_FUSED_OPTIMIZERS, foreach, fused_adam_, fused_adamw_, fused_sgd_
from fdp._torch.serialization import records_without_crc
from fdp._torch.slots import swap_back, swap_into, tensor_slots
from fdp._torch.storage import on_storage, release_storage, storage_alias, storage_id
from fdp._torch.trees import tree_flatten, tree_map, tree_paths, tree_unflatten

__all__ = [
    "foreach",
    "fused_sgd_",
    "fused_adam_",
    "fused_adamw_",
    "HAS_FUSED_OPTIMIZERS",
    "disable_functorch",
    "HAS_DISABLE_FUNCTORCH",
    "TorchDispatchMode",
    "CUSTOM_FUNCTION_CALL",
    "default_store",
    "group_timeout",
    "live_groups",
    "tree_flatten",
    "tree_unflatten",
    "tree_map",
    "tree_paths",
    "storage_id",
    "storage_alias",
    "on_storage",
    "release_storage",
    "tensor_slots",
    "swap_into",
    "swap_back",
    "preload_compiler",
    "inductor_default_cache_dir",
    "DCP_READS_CHUNK_FIELDS",
    "mark_chunk",
    "chunk_of",
    "chunk_load_planner",
    "digesting_writer",
    "single_process_dcp",
    "records_without_crc",
]
