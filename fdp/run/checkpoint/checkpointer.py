"""The one owner of a run's checkpoints: save in the run's format, resume from either, wait, keep the newest and
the best.

``Checkpointer`` is made for each world a run trains in (at start, and again when the world shrinks or grows):
it reads the format once (``fdp.run.checkpoint.format``: whole, or sharded and perhaps asynchronous, as the world
the run was launched with says, so a world that shrinks keeps its format) and holds the writer of a sharded
world. The loop asks it to ``save`` (the run's config rides along), ``wait`` for a write in flight before
anything that needs it complete (a callback told of it, the best ones, a world that changes, the run's end),
``abandon`` one that needs a lost rank, and ``keep_best``. ``resume`` reads a checkpoint of either format into
the state a run built, whatever format this run writes. Nothing outside this package branches on the format
(``tests/run/test_checkpointer.py``).

>>> import tempfile, torch
>>> from fdp import cross_entropy_loss, functionalize, plan_buckets, planner_loss, sgd
>>> from fdp.run.config.compose import compose
>>> from fdp.update import zero
>>> model, params, buffers = functionalize(torch.nn.Linear(4, 3))
>>> batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
>>> plan = plan_buckets(planner_loss(cross_entropy_loss(model), buffers), params, batch)
>>> update = zero.update_for(0, sgd(0.1), plan, Comm())
>>> state = update.first_state(params, buffers, None, Comm())
>>> checkpoints, directory = Checkpointer(compose("trainer.checkpoint_format=sharded"), Comm()), tempfile.mkdtemp()
>>> checkpoints.save(directory, state._replace(step=5), update, plan).name
'step_00000005'
>>> checkpoints.wait()  # the write in flight is complete
>>> resume(directory, state, update, plan, Comm()).step
5
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fdp.comm import Comm
from fdp.plan import BucketPlan
from fdp.run.checkpoint import files
from fdp.run.checkpoint.files import is_sharded, resolve
from fdp.run.checkpoint.format import CheckpointFormat, format_of
from fdp.run.checkpoint.sharded import ShardedSaver, load_sharded
from fdp.run.checkpoint.whole import load_checkpoint, save_checkpoint
from fdp.state.train_state import TrainState
from fdp.update.base import Update

__all__ = ["Checkpointer", "resume"]


class Checkpointer:
    """A run's checkpoints in the world of ``comm`` (see the module docstring); ``launched``: the size of the world
    the run started with (by default ``comm``'s), which chooses an ``auto`` format; ``asynchronous=False``: every
    save complete before ``save`` returns, whatever ``trainer.checkpoint_async`` says (the last save of a run).

    Made on every rank at the same point, and its ``save``, ``wait`` and ``keep_best`` called by every rank at the
    same points: a sharded world's writer makes a process group of its own here (a collective).
    """

    def __init__(self, cfg: Any, comm: Comm, launched: int | None = None, asynchronous: bool | None = None):
        tc = cfg.trainer
        # Under torchrun the world's size is known only now: checkpoint_async=true on one process is refused here.
        self.format: CheckpointFormat = format_of(tc, comm.world_size if launched is None else launched)
        self.comm, self.keep = comm, tc.keep_checkpoints
        # Written with every save, by rank 0 alone (the metadata of a sharded one, the file of a whole one); a
        # run's config does not change in it.
        self._config = OmegaConf.to_yaml(cfg) if comm.rank == 0 else None
        wanted = self.format.asynchronous if asynchronous is None else asynchronous
        self._writer = ShardedSaver(comm, wanted, cfg.world.timeout_s) if self.format.sharded else None

    def save(
        self,
        directory: str | os.PathLike,
        state: TrainState,
        update: Update,
        plan: BucketPlan,
        extra: dict | None = None,
    ) -> Path | None:
        """Checkpoint ``state`` in ``directory``, keeping the newest ``trainer.keep_checkpoints``: sharded, each rank
        writing the pieces its ``update`` owns (perhaps still being written: ``wait``), or whole, gathered to rank 0
        (``update`` converts it, so that any world size and stage resumes it). ``extra`` rides along, with the run's
        config. The path written (a whole-file save's on rank 0 alone; ``None`` on the others)."""
        extra = {"config": self._config, **(extra or {})}
        if self._writer is not None:
            return self._writer.save(directory, state, update, plan, self.keep, extra)
        whole = update.to_checkpoint(state, self.comm)
        return save_checkpoint(directory, whole, plan, self.comm, keep=self.keep, extra=extra)

    def wait(self) -> None:
        """Wait for the write in flight, if any (a sharded, asynchronous one); its failure is raised here."""
        if self._writer is not None:
            self._writer.wait()

    def abandon(self) -> None:
        """After a lost rank: drop the write in flight, which needs it (its temporary directory goes at the next
        save), before the world's groups end."""
        if self._writer is not None:
            self._writer.abandon()

    def keep_best(self, directory: str | os.PathLike, written: Path | None, step: int, best: dict[int, str] | None):
        """Keep ``written``, the checkpoint of ``step``, among the best where ``best`` (step -> name: the best ones
        ranked so far; ``None``: the run keeps none) ranks it, once its writes are complete; those ranked out go
        (rank 0: ``fdp.run.checkpoint.files.keep_best``)."""
        if best is None:
            return
        if step in best:
            self.wait()
        if self.comm.rank == 0:
            files.keep_best(directory, written, step, best)


def resume(
    source: str | os.PathLike, like: TrainState, update: Update, plan: BucketPlan, comm: Comm | None = None
) -> TrainState:
    """This rank's state from the checkpoint at ``source`` (a checkpoint, or a run or checkpoints directory: its
    last), whichever format wrote it, at ``update``'s stage and ``comm``'s world size; ``like``: the state this run
    built (``fdp.run.build``). Call on every rank; a checkpoint that does not fit is refused with the same
    ``CheckpointError`` on every rank."""
    comm, source = comm or Comm(), resolve(source)
    if is_sharded(source):  # each rank reads the ranges its update owns, into the built state
        return load_sharded(source, like, update, plan, comm)
    template = update.checkpoint_template(like)
    return update.from_checkpoint(load_checkpoint(source, template, plan, comm), comm)
