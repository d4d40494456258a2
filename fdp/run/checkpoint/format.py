"""Which format a world's checkpoints take: the one reading of ``trainer.checkpoint_format`` and
``trainer.checkpoint_async``.

``whole``: rank 0 gathers the state and writes one file while the loop waits
(``fdp.run.checkpoint.whole``); ``sharded``: each rank writes the pieces its update owns, in the
background (``fdp.run.checkpoint.sharded``); ``auto`` (the default): sharded on more than one
rank, whole on one. ``format_of`` reads the settings once, refusing a bad one naming its key, into a
``CheckpointFormat`` that every other part of the run asks (the run's ``Checkpointer``, the memory forecast,
what a save that ran out of memory says); resuming reads either format, whatever this run writes.

>>> from fdp.run.config.compose import compose
>>> format_of(compose().trainer, 4), format_of(compose().trainer, 1)
(CheckpointFormat(name='sharded', asynchronous=True), CheckpointFormat(name='whole', asynchronous=False))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fdp.errors import ConfigError, as_config_key

__all__ = [
    "FORMATS",
    "CheckpointFormat",
    "check_checkpoint_async",
    "check_checkpoint_format",
    "format_of",
    "resolved_format",
]

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


@dataclass(frozen=True)
class CheckpointFormat:
    """How a world writes its checkpoints: ``name`` (``whole`` or ``sharded``; ``auto`` where the world's size is
    known only at run time, under ``torchrun``) and whether the loop goes on while a save is written."""

    name: str
    asynchronous: bool

    @property
    def sharded(self) -> bool:
        """Whether each rank writes its own pieces of the state (else rank 0 writes it whole)."""
        return self.name == "sharded"

    @property
    def keeps_staging(self) -> bool:
        """Whether the copy of its pieces a save makes on each rank stays from the first save to the run's end (an
        asynchronous save's staging buffers, ``fdp.run.checkpoint.staging``), so the steps after a save hold it too."""
        return self.sharded and self.asynchronous

    def save_bytes(self, pieces: int, whole_state: int, rank: int, stage: int) -> int:
        """Bytes a save adds on ``rank`` over what it holds between steps: the copy of its ``pieces`` a sharded save
        makes; a whole-file save, at a stage that shards, gathers the ``whole_state`` on rank 0 (torch writes the
        tensors it holds as they are, and ``last`` names the step file: no copy of it).

        >>> CheckpointFormat("sharded", True).save_bytes(100, 400, rank=1, stage=3)
        100
        >>> whole = CheckpointFormat("whole", False)
        >>> whole.save_bytes(100, 400, rank=0, stage=3), whole.save_bytes(100, 400, rank=0, stage=0)
        (400, 0)
        """
        if self.sharded:
            return pieces
        return whole_state if stage > 0 and not rank else 0

    def save_hint(self, stage: int) -> str:
        """What lets a save that ran out of memory fit, by how the checkpoint is written.

        >>> CheckpointFormat("sharded", False).save_hint(3)
        'a larger budget, or more ranks: each rank writes its own share, copying each piece as it is written'
        """
        if not self.sharded:
            return (
                f"a larger budget, or trainer.checkpoint_format=sharded: rank 0 holds the whole state while it writes "
                f"it (trainer.zero_stage={stage})"
            )
        if self.asynchronous:
            return (
                "a larger budget, or trainer.checkpoint_async=false: an asynchronous save stages a copy of this "
                "rank's state on the CPU while it is written"
            )
        return "a larger budget, or more ranks: each rank writes its own share, copying each piece as it is written"


def format_of(trainer: Any, world_size: int | None) -> CheckpointFormat:
    """The format a world of ``world_size`` ranks writes (``None``: a size known only at run time), from the
    ``trainer`` config's settings; a bad one is a ``ConfigError`` naming its key.

    >>> from fdp.run.config.compose import compose
    >>> format_of(compose("trainer.checkpoint_async=false").trainer, 2)
    CheckpointFormat(name='sharded', asynchronous=False)
    """
    setting = as_config_key("trainer.checkpoint_format", check_checkpoint_format, trainer.checkpoint_format)
    name = resolved_format(setting, world_size)  # under torchrun known only to the ranks: auto left for them
    try:
        asynchronous = as_config_key(
            "trainer.checkpoint_async",
            lambda value: check_checkpoint_async(value, "sharded" if name == "auto" else name),
            trainer.checkpoint_async,
        )
    except ConfigError as error:
        if setting != "auto":
            raise
        raise ConfigError(f"{error} (trainer.checkpoint_format=auto on one process)") from None
    return CheckpointFormat(name, asynchronous)
