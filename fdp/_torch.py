"""Every private PyTorch API fdp uses, in one place, each with a public fallback.

fdp leans on a few of torch's underscore APIs for speed (the ``_foreach_*`` multi-tensor
ops, the fused optimizer kernels) or for things torch has no public way to say (leaving
the ``torch.func`` transform from inside a tensor hook). They are looked up here once, at
import; where a torch build lacks one, the fallback is a public path with the same
numbers (a Python loop instead of a ``_foreach`` op) or, where none exists, a flag the
caller checks (``HAS_FUSED_OPTIMIZERS``, ``HAS_DISABLE_FUNCTORCH``). The rest of ``fdp/``
imports from this module and never spells a private torch name itself.

>>> list(foreach.add([torch.ones(2)], [torch.ones(2)], alpha=2.0))
[tensor([3., 3.])]
>>> tree_flatten({"a": torch.zeros(1), "b": (1, 2)})[0]
[tensor([0.]), 1, 2]
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import threading
import warnings
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = [
    "foreach",
    "fused_sgd_",
    "fused_adam_",
    "fused_adamw_",
    "HAS_FUSED_OPTIMIZERS",
    "disable_functorch",
    "HAS_DISABLE_FUNCTORCH",
    "default_store",
    "group_timeout",
    "live_groups",
    "tree_flatten",
    "tree_unflatten",
    "tree_map",
    "tree_paths",
    "TorchDispatchMode",
    "CUSTOM_FUNCTION_CALL",
    "storage_id",
    "storage_alias",
    "release_storage",
    "tensor_slots",
    "swap_into",
    "swap_back",
    "inductor_default_cache_dir",
    "mark_chunk",
    "chunk_of",
    "chunk_load_planner",
    "single_process_dcp",
    "records_without_crc",
]


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


# -- torch.func -----------------------------------------------------------------------------
_DisableFuncTorch = getattr(getattr(torch, "_C", None), "_DisableFuncTorch", None)
HAS_DISABLE_FUNCTORCH = _DisableFuncTorch is not None


def disable_functorch() -> contextlib.AbstractContextManager:
    """A context in which code running inside a ``torch.func`` transform sees plain tensors.

    A tensor hook that starts a bucket's reduction during backward needs it: tensors the
    hook chain creates (and keeps in its state) must not be the transform's wrappers.
    Where torch lacks it, the overlapped schedule is unavailable (``HAS_DISABLE_FUNCTORCH``).
    """
    if _DisableFuncTorch is None:
        raise RuntimeError("this torch build cannot leave a torch.func transform from a hook; use the 'after' schedule")
    return _DisableFuncTorch()


# -- torch.distributed ----------------------------------------------------------------------
def default_store() -> Any | None:
    """The default process group's key-value store, or ``None`` where torch hides it."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def group_timeout(group: Any = None) -> Any | None:
    """The collective timeout (a ``timedelta``) of ``group`` (default: the default group), or ``None``.

    torch has no public getter; a group made with ``new_group`` and no timeout of its own
    gets torch's default (30 minutes on gloo), not its parent's, so fdp passes this on.
    """
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def live_groups() -> list[Any]:
    """Every process group torch knows in this process (the default one included); ``[]`` where it hides them."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}) or {})


# -- pytrees --------------------------------------------------------------------------------
# The private module is the one whose tree specs the checkpoints were written with; the
# public one (torch >= 2.6 on some builds) serves where it is missing.
try:
    from torch.utils import _pytree as _pytree_impl
except ImportError:  # pragma: no cover - a torch without the private module
    from torch.utils import pytree as _pytree_impl  # type: ignore[no-redef]

tree_flatten = _pytree_impl.tree_flatten
tree_unflatten = _pytree_impl.tree_unflatten
tree_map = _pytree_impl.tree_map


def tree_paths(tree: Any) -> list[str]:
    """Each leaf's path in ``tree`` as text (``[1].mu['fc.weight']``), in ``tree_flatten``'s order.

    >>> tree_paths(({"b": 1, "a": 2}, 3))
    ["[0]['b']", "[0]['a']", '[1]']
    """
    return [_pytree_impl.keystr(path) for path, _ in _pytree_impl.tree_flatten_with_path(tree)[0]]


# -- dispatch modes ------------------------------------------------------------------------
# A mode sees every op below autograd (inside a torch.func transform too, on plain tensors):
# ZeRO stage 3 learns from one forward which op reads which bucket's params.
try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - a torch without Python dispatch modes
    TorchDispatchMode = None  # type: ignore[assignment,misc]

# An autograd.Function's call under a torch.func transform, as a function mode sees it (its forward runs inside,
# out of the mode's sight); None where torch has no such operator (the call is then not a function of its own).
try:
    from torch._functorch.autograd_function import custom_function_call as CUSTOM_FUNCTION_CALL
except ImportError:  # pragma: no cover - a torch whose autograd.Function runs torch.func another way
    CUSTOM_FUNCTION_CALL = None


# -- storage ---------------------------------------------------------------------------------
def storage_id(tensor: torch.Tensor) -> int:
    """An id of the storage ``tensor`` views, the same for every view and after the storage is resized.

    >>> flat = torch.zeros(4)
    >>> storage_id(flat[1:]) == storage_id(flat)
    True
    """
    return tensor.untyped_storage()._cdata


def storage_alias(flat: torch.Tensor, offset: int, shape: tuple, strides: tuple) -> torch.Tensor:
    """A tensor on ``flat``'s storage that is not a view of ``flat``.

    A view keeps its base's Python object alive; an alias made with ``Tensor.set_`` only
    shares the storage, so a cache of aliases does not pin the buffers it was made from.

    >>> flat = torch.arange(6.0)
    >>> alias = storage_alias(flat, 2, (2, 2), (2, 1))
    >>> alias.tolist(), alias._base is None
    ([[2.0, 3.0], [4.0, 5.0]], True)
    """
    return torch.empty(0, dtype=flat.dtype, device=flat.device).set_(
        flat.untyped_storage(), flat.storage_offset() + offset, shape, strides
    )


def on_storage(owner: torch.Tensor, dtype: torch.dtype, offset: int, size: tuple, stride: tuple = ()) -> torch.Tensor:
    """A ``dtype`` tensor over the whole storage ``owner`` uses, from ``offset`` (in ``dtype``'s elements): an alias
    made with ``Tensor.set_``, which may read the same bytes as another dtype, unlike a view.

    >>> raw = on_storage(torch.ones(2), torch.uint8, 0, (8,))
    >>> raw.tolist()
    [0, 0, 128, 63, 0, 0, 128, 63]
    """
    return torch.empty(0, dtype=dtype, device=owner.device).set_(owner.untyped_storage(), offset, size, stride)


def preload_compiler() -> None:
    """Import what ``torch.func``'s first gradient imports (dynamo), ahead of a fork that should start with it."""
    importlib.import_module("torch._dynamo")


def release_storage(parameter: torch.nn.Parameter) -> None:
    """Drop a parameter's data, keeping the ``Parameter`` object (so weight ties still resolve).

    >>> p = torch.nn.Parameter(torch.ones(3))
    >>> release_storage(p)
    >>> p.shape
    torch.Size([0])
    """
    with torch.no_grad():
        parameter.set_(parameter.new_empty(0))


# -- a module's tensors ------------------------------------------------------------------------
def tensor_slots(module: torch.nn.Module, names) -> dict[str, tuple[dict, str]] | None:
    """Where each dotted parameter or buffer name of ``names`` lives: ``{name: (owner's dict, key)}``.

    The dicts are the owning submodules' ``_parameters`` / ``_buffers``, so a forward can
    run on other tensors by putting them there (``swap_into``), which is what
    ``torch.func.functional_call`` does, less its per-call name resolution and checks.
    ``None`` when a name is not a registered parameter or buffer.

    >>> slots = tensor_slots(torch.nn.Linear(2, 3), ["weight", "bias"])
    >>> sorted(slots), slots["bias"][1]
    (['bias', 'weight'], 'bias')
    """
    slots = {}
    for name in names:
        owner_name, _, key = name.rpartition(".")
        try:
            owner = module.get_submodule(owner_name)
        except AttributeError:
            return None
        held = owner.__dict__.get("_parameters", {}), owner.__dict__.get("_buffers", {})
        found = next((d for d in held if d.get(key) is not None), None)
        if found is None:
            return None
        slots[name] = (found, key)
    return slots


def swap_into(slots: dict[str, tuple[dict, str]], tensors: dict[str, torch.Tensor]) -> list[tuple[dict, str, Any]]:
    """Put ``tensors`` in their ``slots``; return what was there, for ``swap_back``.

    >>> module = torch.nn.Linear(2, 1)
    >>> slots = tensor_slots(module, ["bias"])
    >>> taken = swap_into(slots, {"bias": torch.zeros(1)})
    >>> module.bias.tolist()
    [0.0]
    >>> swap_back(taken); isinstance(module.bias, torch.nn.Parameter)
    True
    """
    taken = []
    try:
        for name, tensor in tensors.items():
            owner, key = slots[name]
            taken.append((owner, key, owner[key]))
            owner[key] = tensor
    except BaseException:
        swap_back(taken)
        raise
    return taken


def swap_back(taken: list[tuple[dict, str, Any]]) -> None:
    """Undo ``swap_into`` (last in, first out, so a name given twice ends as it began)."""
    for owner, key, tensor in reversed(taken):
        owner[key] = tensor


# -- torch.compile ---------------------------------------------------------------------------
def inductor_default_cache_dir() -> str | None:
    """The cache directory inductor picks when ``TORCHINDUCTOR_CACHE_DIR`` is not set (``None`` if unknown).

    Importing ``torch._dynamo`` already writes that default into the environment, so a
    set variable alone does not say that someone chose it.
    """
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return default_cache_dir()


# -- torch.distributed.checkpoint: a plain tensor as one chunk of a larger logical tensor ---------
_CHUNK_FIELDS = ("global_shape", "global_offsets", "local_offsets", "local_sizes")
# torch >= 2.13 reads these four fields off any tensor (DCP's CheckpointableTensor protocol); older DCP
# knows chunks only through the methods DTensor implements (its _Checkpointable protocol), set below.
DCP_READS_CHUNK_FIELDS = importlib.util.find_spec("torch.distributed.checkpoint.protocol") is not None


def mark_chunk(tensor: torch.Tensor, global_shape: tuple[int, ...], global_offset: tuple[int, ...]) -> torch.Tensor:
    """Mark ``tensor`` (in place; returned) as the chunk at ``global_offset`` of a logical tensor of ``global_shape``.

    DCP then writes it as that chunk and, loading, fills it from whatever chunks overlap it.

    >>> piece = mark_chunk(torch.zeros(3), (6,), (3,))
    >>> chunk_of(piece)
    ((6,), (3,))
    """
    tensor.global_shape, tensor.global_offsets = tuple(global_shape), (tuple(global_offset),)
    tensor.local_offsets, tensor.local_sizes = ((0,) * tensor.dim(),), (tuple(tensor.shape),)
    if not DCP_READS_CHUNK_FIELDS:
        tensor.__create_write_items__ = lambda fqn, obj: [_chunk_write_item(fqn, obj)]
        tensor.__create_chunk_list__ = lambda: [_chunk_metadata(tensor)]
        tensor.__get_tensor_shard__ = lambda index: tensor
    return tensor


def chunk_of(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(global_shape, global_offset)`` of a tensor ``mark_chunk`` marked, else ``None``."""
    if not all(hasattr(tensor, field) for field in _CHUNK_FIELDS):
        return None
    return tuple(tensor.global_shape), tuple(tensor.global_offsets[0])


def _chunk_metadata(tensor: torch.Tensor) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(offsets=torch.Size(tensor.global_offsets[0]), sizes=tensor.size())


def _chunk_write_item(fqn: str, tensor: torch.Tensor) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    chunk = _chunk_metadata(tensor)
    return WriteItem(
        index=MetadataIndex(fqn, chunk.offsets),
        type=WriteItemType.SHARD,  # one of several chunks of fqn, which DCP's global plan merges
        tensor_data=TensorWriteData(
            chunk=chunk, properties=TensorProperties.create_from_tensor(tensor), size=torch.Size(tensor.global_shape)
        ),
    )


def chunk_load_planner() -> Any:
    """The DCP load planner for a state of chunks: DCP's default, or where DCP compares a chunk's own size with
    the saved tensor's (torch < 2.13), one that compares its logical size instead."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    if DCP_READS_CHUNK_FIELDS:
        return DefaultLoadPlanner()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import _create_read_items

    class ChunkLoadPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            requests = []
            for fqn, obj in self.state_dict.items():
                if fqn not in self.metadata.state_dict_metadata:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                saved = self.metadata.state_dict_metadata[fqn]
                shape = (chunk_of(obj) or (tuple(obj.shape), None))[0] if isinstance(obj, torch.Tensor) else None
                if isinstance(saved, TensorStorageMetadata) and shape is not None and tuple(saved.size) != shape:
                    raise ValueError(f"Size mismatch between saved {saved.size} and current: {shape} for {fqn}")
                requests += _create_read_items(fqn, saved, obj)
            return LoadPlan(requests)

    return ChunkLoadPlanner()


# -- DCP's file writer, hashing what it writes ------------------------------------------------------
def digesting_writer(path: Any, new_digest: Callable[[], Any], digests: dict[str, Any]) -> Any:
    """DCP's ``FileSystemWriter`` into directory ``path`` (each file flushed to disk) that feeds every byte of each
    piece file (``*.distcp``) to a ``new_digest()`` (a ``hashlib`` object) as it writes it: once a file is whole,
    ``digests[its name]`` holds its digest, so nothing reads the file back to hash it. A file written other than
    front to back, or a writer with no file system to wrap (another torch), leaves its name out of ``digests``.

    >>> import hashlib, tempfile
    >>> digests = {}
    >>> writer = digesting_writer(tempfile.mkdtemp(), hashlib.sha256, digests)
    >>> with writer.fs.create_stream(writer.path / "__0_0.distcp", "wb") as stream:
    ...     _ = stream.write(b"abc")
    >>> digests["__0_0.distcp"].hexdigest()[:12]
    'ba7816bf8f01'
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    writer = FileSystemWriter(path, sync_files=True)
    if not isinstance(getattr(writer, "fs", None), FileSystem):
        return writer

    class Digesting(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, file: Any, mode: str):
            with super().create_stream(file, mode) as stream:
                if mode != "wb" or not str(file).endswith(".distcp"):
                    yield stream
                    return
                fed = _Digesting(stream, new_digest())
                yield fed
            if fed.whole:
                digests[os.path.basename(str(file))] = fed.digest

    writer.fs = Digesting()
    return writer


class _Digesting:
    """A stream that feeds what is written to it to ``digest`` too; seeking makes the digest no longer whole."""

    def __init__(self, stream: Any, digest: Any):
        self._stream, self.digest, self.whole = stream, digest, True

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self._stream.write(data)

    def seek(self, *args: Any) -> int:
        self.whole = False
        return self._stream.seek(*args)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close: the stream's own
        return getattr(self._stream, name)


# -- torch.save records without their own CRC-32 ----------------------------------------------------
_CRC_SWITCH = threading.Lock()
_crc_off = {"callers": 0, "was": True}  # the callers inside records_without_crc, and torch's switch before the first


@contextlib.contextmanager
def records_without_crc():
    """Inside, ``torch.save`` writes its records without computing their CRC-32 (the field is 0; ``torch.load``
    does not read it): for files whose every byte a checksum of the caller's own covers already, so that writing
    them costs one checksum per byte, not two. torch's switch is process-wide: a ``torch.save`` in another thread
    meanwhile writes no CRC-32 either (fdp writes none then: a run's checkpoints are of one format); it is back as
    it was once the last caller inside has left.

    >>> with records_without_crc():
    ...     torch.serialization.get_crc32_options()
    False
    >>> torch.serialization.get_crc32_options()
    True
    """
    with _CRC_SWITCH:
        if not _crc_off["callers"]:
            _crc_off["was"] = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_off["callers"] += 1
    try:
        yield
    finally:
        with _CRC_SWITCH:
            _crc_off["callers"] -= 1
            if not _crc_off["callers"]:
                torch.serialization.set_crc32_options(_crc_off["was"])


# -- distributed checkpoints in one process ---------------------------------------------------------
@contextlib.contextmanager
def single_process_dcp(alone: bool = True):
    """Around a ``torch.distributed.checkpoint`` save or load that runs without a process group (``alone``:
    ``no_dist=True``, one process): DCP then warns that torch.distributed is disabled, which is what the
    caller asked for, so that note is dropped for this call; any other warning still shows.

    >>> with single_process_dcp():
    ...     warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming ...")
    """
    if not alone:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
