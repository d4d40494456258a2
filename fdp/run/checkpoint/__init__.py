"""A run's checkpoints, whole and sharded: one component, one owner of save, resume, wait and prune.

The run asks ``Checkpointer`` (``checkpointer``) for everything: save a state in the run's format, wait for a
write in flight, drop one after a lost rank, keep the best; ``resume`` reads a checkpoint of either format into a
built state. Its modules, by role:

* ``format``: which format a world writes (``trainer.checkpoint_format``: whole, sharded or auto, and
  ``trainer.checkpoint_async``), read once into a ``CheckpointFormat``;
* ``atomic``: files that readers see whole or not at all;
* ``files``: a checkpoints directory of either format: the checkpoints' names, the newest (``last``), each
  format's description read, the newest kept (``prune``) and the best (``keep_best``);
* ``whole``: the whole state in one file, gathered to rank 0 (``save_checkpoint``, ``load_checkpoint``);
* ``integrity``: a checkpoint of either format checked whole before use (``verify``);
* ``staging``: the buffers an asynchronous save copies a rank's pieces to, planned at its first save;
* ``sharded``: each rank's pieces in DCP's format, written in the background (``ShardedSaver``, ``load_sharded``);
* ``consolidate``: a sharded checkpoint as one whole-file one (``python -m fdp.checkpoint consolidate``), and
  either format read as that one payload (``whole_payload``);
* ``checkpointer``: the owner (``Checkpointer``, ``resume``), the one place a run's format is branched on.

Each module imports only modules listed before it, and none imports another module of ``fdp.run``.
"""

from fdp.run.checkpoint.checkpointer import Checkpointer, resume
from fdp.run.checkpoint.consolidate import whole_payload, write_consolidated
from fdp.run.checkpoint.files import (
    BEST,
    CHECKPOINTS,
    CheckpointError,
    last_of,
    load,
    resolve,
    saved_config,
    saved_steps,
)
from fdp.run.checkpoint.format import FORMATS, CheckpointFormat, format_of
from fdp.run.checkpoint.integrity import verify
from fdp.run.checkpoint.sharded import ShardedSaver, load_sharded
from fdp.run.checkpoint.whole import load_checkpoint, save_checkpoint

__all__ = [
    "BEST",
    "CHECKPOINTS",
    "FORMATS",
    "CheckpointError",
    "CheckpointFormat",
    "Checkpointer",
    "ShardedSaver",
    "format_of",
    "last_of",
    "load",
    "load_checkpoint",
    "load_sharded",
    "resolve",
    "resume",
    "save_checkpoint",
    "saved_config",
    "saved_steps",
    "verify",
    "whole_payload",
    "write_consolidated",
]
