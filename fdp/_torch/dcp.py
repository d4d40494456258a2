"""torch.distributed.checkpoint: a plain tensor as one chunk of a larger one, the load planner for such
chunks, a file writer that hashes what it writes, and a save or load in one process."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from typing import Any, Callable

import torch

# -- a plain tensor as one chunk of a larger logical tensor -----------------------------------------
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
