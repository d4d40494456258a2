"""``trainer.zero_stage=auto``: the lowest ZeRO stage whose memory forecast fits the budget.

Each rank decides before the run's pieces are built for good, at start and on every resume (another machine may
have another budget), as ``trainer.accum_steps=auto`` decides its micro-batch (``fdp.run.memory.micro_batch``):

* the budget is ``world.memory_per_rank_mb``, or on a GPU its free memory (``fdp.run.memory.micro_batch.budget_mib``);
  without one (0 on the CPU) the stage is 0;
* the candidates are the stages the run's other settings allow (``fdp.run.config.validate.allowed_stages``: an
  outer loop on a flat world, an optimizer a shard cannot step, a world that shrinks, ... rule some out), lowest
  first;
* the forecast (``fdp.run.memory.run_forecast.run_forecasts``) of every candidate is read from the run's plan, built on
  ``meta`` where the model can be (``fdp.run.build.planned_run``: no train state is made), and the run is then
  built once, at the stage chosen;
* the stage is the lowest candidate whose peak fits at the requested micro-batch (``trainer.accum_steps``'s).
  Under ``trainer.accum_steps=auto`` too (auto x auto), that micro-batch is the largest that setting may take,
  the whole share in one forward; where no stage fits it, the largest divisor of the share some stage fits, at the
  lowest stage that fits it: the stage never costs a smaller micro-batch than another stage would allow, and
  ``accum_steps=auto`` then decides the micro-batch at that stage;
* every rank takes the highest stage any rank chose (a rank's budget may be smaller); where no stage fits on some
  rank, the run is refused before it trains (``RunDoesNotFit``: the setting, the budget and the smallest peak).

A rank that joins a running world (``world.respawn``) takes the stage the world runs at, from its store. A stage
that differs from the checkpoint's resumes it: a whole checkpoint is resharded for any stage, a sharded one is read
range by range into any stage's pieces (``fdp.run.checkpoint.sharded``); an outer loop's own ZeRO slices are the
one layout read only at the stage and world that wrote them: a resume that decides another stage there is refused
in one line naming them (set ``trainer.zero_stage`` to it, or save with ``trainer.checkpoint_format=whole``).

>>> lowest_fitting(lambda stage, micro: {0: 900, 1: 700, 2: 600, 3: 400}[stage] * micro / 8, [0, 1, 2, 3], [8], 650)
(2, 8)
>>> lowest_fitting(lambda stage, micro: (4 - stage) * 100 * micro, [0, 1, 2, 3], [4, 2, 1], 250)  # auto x auto
(3, 2)
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from fdp.comm import Comm
from fdp.errors import require
from fdp.procs.allocator import release_free_memory
from fdp.procs.launch import RunDoesNotFit
from fdp.procs.shrink import shrink_store
from fdp.run.build import RunParts, build_run, planned_run
from fdp.run.memory.forecast import MiB, built_mib
from fdp.run.memory.micro_batch import AUTO, accum_options, budget_mib, fixed_accum
from fdp.run.memory.run_forecast import activations_of, run_forecasts
from fdp.run.rejoin import Joining
from fdp.update.zero import ZERO_STAGES

__all__ = ["AUTO", "check_stage_setting", "lowest_fitting", "with_stage", "built_at_stage", "decided", "STORE_KEY"]

log = logging.getLogger("fdp")
STORE_KEY = "zero_stage_auto"  # where the world keeps its stage for a rank that joins it (fdp.procs.shrink's store)


def check_stage_setting(value: Any) -> int | str:
    """``trainer.zero_stage``: 0, 1, 2, 3, or ``auto`` (the lowest that fits the memory budget).

    >>> check_stage_setting("auto"), check_stage_setting(2)
    ('auto', 2)
    >>> check_stage_setting(4)
    Traceback (most recent call last):
    ...
    ValueError: zero_stage=4: expected 0, 1, 2, 3 or auto (the lowest stage whose memory forecast fits the budget)
    """
    whole = isinstance(value, int) and not isinstance(value, bool) and value in ZERO_STAGES
    require(
        whole or value == AUTO,
        "zero_stage",
        value,
        "0, 1, 2, 3 or auto (the lowest stage whose memory forecast fits the budget)",
    )
    return value


def lowest_fitting(
    peak: Callable[[int, int], float], stages: list[int], micro_batches: list[int], budget: float
) -> tuple[int, int] | None:
    """``(stage, micro)``: for each micro-batch of ``micro_batches`` (largest first), the lowest of ``stages`` whose
    ``peak(stage, micro)`` fits ``budget``; the first micro-batch any stage fits decides. ``None``: none fits.

    >>> lowest_fitting(lambda stage, micro: 10 * micro, [0, 3], [4], 30) is None
    True
    """
    for micro in micro_batches:
        for stage in stages:
            if peak(stage, micro) <= budget:
                return stage, micro
    return None


def with_stage(cfg: DictConfig, stage: int) -> DictConfig:
    """``cfg`` with ``trainer.zero_stage`` set to ``stage`` (a copy; ``cfg`` is left as it is).

    >>> from fdp.run.config.compose import compose
    >>> with_stage(compose("trainer.zero_stage=auto"), 2).trainer.zero_stage
    2
    """
    out = OmegaConf.create(OmegaConf.to_container(cfg))
    out.trainer.zero_stage = stage
    return out


def built_at_stage(
    cfg: DictConfig,
    comm: Comm,
    device: torch.device,
    data: Any,
    world: Any,
    allowed: list[int],
    fixed_mib: float,
    base_mib: float,
) -> tuple[DictConfig, RunParts, dict | None]:
    """The run's config at its stage, its pieces built there, and ``trainer.zero_stage=auto``'s record (``None``
    for a stage the config names). ``allowed``: the stages the other settings allow, lowest first; ``fixed_mib``,
    ``base_mib``: what a rank adds whatever the model, and what it held before the build (the forecast's zero);
    ``world``: a world that may shrink and grow (its store keeps the stage for a rank that joins later), a rank
    joining one (``fdp.run.rejoin.Joining``: it builds alone, at the world's stage), or ``None``."""
    alone = isinstance(world, Joining)
    if cfg.trainer.zero_stage != AUTO:
        return cfg, build_run(cfg, comm, device, data, alone=alone), None
    began = time.perf_counter()
    if alone:  # a rank joining a running world takes the world's stage
        stage = int(shrink_store(cfg.world.timeout_s).get(STORE_KEY))
        return with_stage(cfg, stage), build_run(with_stage(cfg, stage), comm, device, data, alone=True), None
    budget = budget_mib(cfg, device, base_mib)
    if not budget:
        why = "no memory budget: world.memory_per_rank_mb=0 on the CPU"
        record = {"stage": allowed[0], "why": why}
        parts = build_run(with_stage(cfg, allowed[0]), comm, device, data)
    else:
        planned = planned_run(cfg, comm, device, data)
        fixed = fixed_mib + built_mib(base_mib + fixed_mib, dict(planned.state.buffers))
        record = decided(cfg, planned, comm.world_size, allowed, fixed, budget, comm)
        planned = None  # freed before the run is built
        gc.collect()
        release_free_memory()
        parts = build_run(with_stage(cfg, record["stage"]), comm, device, data)
    record["seconds"] = round(time.perf_counter() - began, 3)
    if getattr(world, "store", None) is not None and comm.rank == 0:
        world.store.set(STORE_KEY, str(record["stage"]))
    if comm.rank == 0:
        log.info(f"trainer.zero_stage=auto: stage {record['stage']} ({record['why']})")
    return with_stage(cfg, record["stage"]), parts, record


def decided(
    cfg: DictConfig, parts: RunParts, world: int, allowed: list[int], fixed: float, budget: float, comm=None
) -> dict:
    """The stage of ``allowed`` a run over ``world`` ranks takes under ``budget`` MiB, forecast from ``parts`` (a
    ``planned_run``) with ``fixed`` MiB a rank adds whatever the model, and why; every rank of ``comm`` (a
    collective) takes the highest any chose. ``RunDoesNotFit`` where none fits (on some rank)."""
    per_rank = cfg.data.global_batch_size // world
    asked = cfg.trainer.accum_steps
    micros = [per_rank // a for a in accum_options(per_rank)] if asked == AUTO else [per_rank // fixed_accum(asked)]
    acts = activations_of(cfg, parts)
    peaks: dict[tuple[int, int], float] = {}

    def peak(stage: int, micro: int) -> float:
        if (stage, micro) not in peaks:
            ranks = run_forecasts(cfg, parts, world, fixed, acts, stages=[stage], micro=micro)
            peaks[stage, micro] = max(f.peak for f in ranks) / MiB
        return peaks[stage, micro]

    found = lowest_fitting(peak, allowed, micros, budget)
    mine = found[0] if found else len(ZERO_STAGES)  # past the last stage: none fits
    agreed = torch.tensor([mine], dtype=torch.int64)
    if comm is not None and comm.world_size > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=comm.group)
    stage = int(agreed[0])
    setting = "world.memory_per_rank_mb" if cfg.world.memory_per_rank_mb else "the GPU's free memory"
    of = f"of budget {budget:g} MiB ({setting})"
    if stage == len(ZERO_STAGES):
        if found is None:
            smallest = min(allowed, key=lambda s: peak(s, micros[-1]))
            raise RunDoesNotFit(
                f"trainer.zero_stage=auto: no stage fits the budget of {budget:g} MiB per rank ({setting}) at "
                f"{micros[-1]} samples per forward: the "
                f"smallest forecast peak is {peak(smallest, micros[-1]):.0f} MiB (stage {smallest}); expected a larger "
                "budget, more ranks, a smaller micro-batch, trainer.activation_checkpointing or a smaller model"
            )
        raise RunDoesNotFit("trainer.zero_stage=auto: no stage fits another rank's budget (its error says which)")
    micro = found[1]  # a higher stage another rank needs fits this rank's micro-batch too
    lower = [s for s in allowed if s < stage]
    why = f"forecast peak {peak(stage, micro):.0f} MiB per rank {of}"
    if micro != micros[0]:
        why += f" at {micro} samples per forward"
    if lower:
        why += f"; stage {lower[-1]} needs {peak(lower[-1], micro):.0f}"
    return {"stage": stage, "peak_mib": round(peak(stage, micro), 1), "budget_mib": round(budget, 1), "why": why}
