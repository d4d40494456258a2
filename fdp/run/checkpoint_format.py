"""How a run's checkpoints are written: the one owner of ``trainer.checkpoint_format`` and ``checkpoint_async``.

``whole``: rank 0 gathers the state and writes one file while the loop waits
(``fdp.run.checkpoint``); ``sharded``: each rank writes the pieces its update owns, in the
background (``fdp.run.sharded_checkpoint``); ``auto`` (the default): sharded on more than one
rank, whole on one. The rest of the run asks this module which one a world writes
(``resolved_format``) and for its writer (``saver_for``); resuming reads either, whatever
this run writes (``fdp.run.checkpoint.resolve``).

>>> resolved_format("auto", 4), check_checkpoint_async("auto", "sharded")
('sharded', True)
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from fdp.comm import Comm
from fdp.errors import ConfigError
from fdp.run.sharded_checkpoint import ShardedSaver

__all__ = ["FORMATS", "check_checkpoint_format", "resolved_format", "check_checkpoint_async", "saver_for"]

FORMATS = ("auto", "whole", "sharded")


def check_checkpoint_format(value: Any) -> str:
    """``trainer.checkpoint_format``: ``auto`` (``resolved_format``), ``whole`` (one file, rank 0 writes) or
    ``sharded`` (each rank its share).

    >>> check_checkpoint_format("sharded")
    'sharded'
    >>> check_checkpoint_format("dcp")
    Traceback (most recent call last):
    ...
    ValueError: trainer.checkpoint_format='dcp': expected auto, whole or sharded
    """
    if value not in FORMATS:
        raise ValueError(f"trainer.checkpoint_format={value!r}: expected auto, whole or sharded")
    return value


def resolved_format(value: str, world_size: int | None) -> str:
    """The format a run of ``world_size`` ranks writes: ``auto`` is ``sharded`` on more than one rank (no rank
    holds the whole state, and the loop waits only for a copy) and ``whole`` on one (one file, nothing to split);
    ``None``: a world size known only at run time (under ``torchrun``), ``auto`` left as is.

    >>> [resolved_format("auto", 4), resolved_format("auto", 1), resolved_format("whole", 4)]
    ['sharded', 'whole', 'whole']
    >>> resolved_format("auto", None)
    'auto'
    """
    if value != "auto" or world_size is None:
        return value
    return "sharded" if world_size > 1 else "whole"


def check_checkpoint_async(value: Any, checkpoint_format: str = "sharded") -> bool:
    """``trainer.checkpoint_async``: ``auto`` (asynchronous where the format is ``sharded``), ``true`` or ``false``.

    Only sharded saves are written while training goes on; a whole-file save is written by
    rank 0 while the loop waits, so ``true`` with it would promise what does not happen.

    >>> check_checkpoint_async("auto", "sharded"), check_checkpoint_async("auto", "whole")
    (True, False)
    >>> check_checkpoint_async(True, "whole")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: trainer.checkpoint_async=true: expected auto or false with trainer.checkpoint_format=whole (rank 0
    writes a whole-file save while the loop waits; trainer.checkpoint_format=sharded writes in the background)
    """
    if value not in ("auto", True, False):
        raise ValueError(f"trainer.checkpoint_async={value!r}: expected auto, true or false")
    if value is True and checkpoint_format != "sharded":
        raise ValueError(
            f"trainer.checkpoint_async=true: expected auto or false with trainer.checkpoint_format={checkpoint_format} "
            "(rank 0 writes a whole-file save while the loop waits; trainer.checkpoint_format=sharded writes in the "
            "background)"
        )
    return value is True or value == "auto" and checkpoint_format == "sharded"


def saver_for(cfg: DictConfig, comm: Comm, launched: int) -> ShardedSaver | None:
    """The writer of the run's sharded checkpoints on the world of ``comm``, or ``None`` where the run's format
    (``trainer.checkpoint_format``, ``auto`` resolved at the size of the world it ``launched`` with: a world that
    shrinks keeps its format) is whole."""
    tc = cfg.trainer
    if resolved_format(tc.checkpoint_format, launched) != "sharded":
        try:  # under torchrun the size is known only now: true on one process is refused here
            check_checkpoint_async(tc.checkpoint_async, "whole")
        except ValueError as error:
            raise ConfigError(f"{error} (trainer.checkpoint_format=auto on one process)") from None
        return None
    return ShardedSaver(comm, check_checkpoint_async(tc.checkpoint_async), cfg.world.timeout_s)
