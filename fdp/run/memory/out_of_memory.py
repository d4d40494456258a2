"""What a rank that ran out of memory says: the part of the run it was in, and what to change for it.

>>> from fdp.procs.budget import LateOutOfMemory, MemoryPhase
>>> from fdp.run.config.compose import compose
>>> phase = MemoryPhase()
>>> out_of_memory_message(compose("world.memory_per_rank_mb=500"), 0, 1, phase, MemoryError())[:56]
'rank 0 ran out of memory loading the data (MemoryError);'
"""

from __future__ import annotations

import re

from omegaconf import DictConfig

from fdp.model import remat
from fdp.procs.budget import LateOutOfMemory, MemoryPhase
from fdp.run.checkpoint import format_of
from fdp.run.memory.micro_batch import fixed_accum

__all__ = ["out_of_memory_message"]


def out_of_memory_message(
    cfg: DictConfig, rank: int, world: int, phase: MemoryPhase, error: BaseException, accum: int | None = None
) -> str:
    """Which part of the run ran out (``MemoryPhase``) and what to change for it; ``accum``: the micro-batches
    per step the run was at (``trainer.accum_steps=auto`` decides them; else the setting's)."""
    shown = error  # an error raised while an out-of-memory was handled ("I/O operation on closed file"): that one
    while not isinstance(shown, (MemoryError, RuntimeError, OSError)) and shown.__context__ is not None:
        shown = shown.__context__
    reason = (str(shown).strip().splitlines() or [type(shown).__name__])[0]
    reason = re.sub(r"^\[enforce fail at [^\]]*\]\s*(err == 0\.\s*)?", "", reason)
    tc, budget = cfg.trainer, cfg.world.memory_per_rank_mb
    within = f"world.memory_per_rank_mb={budget:g}" if budget else "this machine's memory"
    accum = tc.accum_steps if accum is None else accum
    micro = max(1, cfg.data.global_batch_size // world // fixed_accum(accum))
    batch = (
        f"{micro} samples: data.global_batch_size={cfg.data.global_batch_size} over {world} ranks and "
        f"trainer.accum_steps={accum}"
    )
    # Recomputing activations in backward (fdp.model.recompute) keeps a step's peak lower, where it is not on yet.
    stage = phase.stage if phase.stage is not None else tc.zero_stage  # trainer.zero_stage=auto: once decided
    # An asynchronous write's, found out where the loop waited for it: the part that ran out is its save.
    name, step = (error.phase, error.step) if isinstance(error, LateOutOfMemory) else (phase.name, phase.step)
    saving = format_of(tc, world)
    on = remat.resolved_mode(tc.activation_checkpointing, tc.activation_checkpointing_policy) != "none"
    remat_hint = "" if on else "trainer.activation_checkpointing=blocks, "
    where, expected = {
        "data": (
            "loading the data",
            "more free memory or a smaller data set (loading it is not counted in world.memory_per_rank_mb)",
        ),
        "build": (
            "building the model and its train state",
            (f"more ranks, a higher trainer.zero_stage (now {stage}; 3 shards the params too) or a smaller model"),
        ),
        "step": (
            f"at step {step}",
            f"a smaller batch per forward (now {batch}), {remat_hint}a higher trainer.zero_stage or a smaller model",
        ),
        "evaluation": (
            f"evaluating after step {step}",
            f"a smaller batch per forward (evaluation takes training's, {batch}) or a smaller model",
        ),
        "save": (f"saving the checkpoint of step {step}", saving.save_hint(stage)),
        "resume": (
            "resuming from its checkpoint",
            "a larger budget, or a checkpoint saved with trainer.checkpoint_format=sharded: rank 0 reads a whole-file "
            "checkpoint and sends all of it to every rank, where each reads its own share of a sharded one",
        ),
    }[name]
    return f"rank {rank} ran out of memory {where} ({reason}); the run does not fit {within}: expected {expected}"
