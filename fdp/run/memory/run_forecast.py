"""A run's memory forecast (``fdp.run.memory.forecast``) from its config and pieces: what ``recipes/plan.py`` prints and
saves, and the line a run logs at start.

>>> micro_samples(64, 4, 2)
8
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from fdp.plan import BucketPlan
from fdp.run.checkpoint import format_of
from fdp.run.memory.forecast import Forecast, MiB, forecast
from fdp.run.memory.micro_batch import first_accum, fixed_accum

__all__ = [
    "activations_of",
    "run_forecasts",
    "describe",
    "memory_section",
    "start_line",
    "micro_samples",
    "saves_mid_run",
    "forecast_accum",
]


def micro_samples(global_batch: int, world: int, accum: int) -> int:
    """Samples per forward on a rank.

    >>> micro_samples(64, 4, 2)
    8
    """
    return max(1, math.ceil(global_batch / world / accum))


def saves_mid_run(trainer) -> bool:
    """Whether a run saves before its last step (``trainer.checkpoint_every`` under its length; a run that ends by
    epochs, ``trainer.max_epochs``, may end sooner: counted as saving).

    >>> from fdp.run.config.compose import compose
    >>> saves_mid_run(compose("trainer.max_steps=100").trainer), saves_mid_run(compose("trainer.max_steps=101").trainer)
    (False, True)
    """
    every, steps = trainer.checkpoint_every, trainer.stop_at or trainer.max_steps
    return bool(every) and (every < steps or bool(trainer.max_epochs))


# -- from a run's config and pieces -----------------------------------------------------------
def activations_of(cfg, parts, device: torch.device = torch.device("cpu")) -> Callable[[int], Any]:
    """``at(samples)``: the activations one forward of ``samples`` keeps on a rank, traced on one and two samples of
    the first batch, with ``trainer.activation_checkpointing`` as set (``fdp.model.activations``)."""
    from fdp.data import train_batches
    from fdp.data.batches import head
    from fdp.model import remat
    from fdp.model.activations import traced_pair
    from fdp.model.deferred import meta_wins
    from fdp.model.losses import make_loss_fn, planner_loss
    from fdp.procs.devices import batch_to_device

    tc, plan = cfg.trainer, parts.plan
    modules = remat.from_config(
        tc.activation_checkpointing,
        tc.activation_checkpointing_policy,
        tc.activation_checkpointing_k,
        parts.model.module,
    )
    example = next(train_batches(parts.data, cfg.data.global_batch_size, cfg.seed, 0, 1, 0, 1))
    example = batch_to_device(parts.precision.cast(head(example, 2)), device)
    loss = planner_loss(make_loss_fn(parts.model, parts.criterion), parts.state.buffers)
    params = parts.state.params
    # Slices (stage 3), or params built on meta (fdp.run.build.planned_run): the params stand in on meta, as the
    # planner traces them.
    if set(params) != set(plan.names) or any(p.is_meta for p in params.values()):
        params = {
            s.name: torch.empty(s.shape, dtype=b.torch_dtype, device="meta") for b in plan.buckets for s in b.slots
        }
        with meta_wins(device):
            one, two = traced_pair(loss, params, example, modules)
    else:
        one, two = traced_pair(loss, params, example, modules)
    return lambda samples: one.scaled(two, samples)


def _extra_state_bytes(cfg, plan: BucketPlan) -> int:
    """An outer loop's anchor (and DiLoCo's momentum) and the params' moving average, for the whole params."""
    outer = cfg.outer.get("name", "none")
    copies = {"none": 0, "local_sgd": 1}.get(outer, 2) + (1 if cfg.trainer.ema_decay else 0)
    return copies * plan.nbytes


def _hook_ratio(cfg) -> float:
    """What the hook chain sends against the plan's bytes (half for fp16/bf16 and a bfloat16 reduction)."""
    name = cfg.hooks.get("name", "allreduce")
    if name in ("fp16", "bf16") or cfg.trainer.reduce_dtype == "bfloat16":
        return 0.5
    return {"int8": 0.25}.get(name, 1.0)


def run_forecasts(
    cfg, parts, world: int, fixed_mib: float, activations=None, stages=None, micro=None
) -> list[Forecast]:
    """Every rank's ``Forecast`` of the run ``cfg`` over ``world`` ranks (rank 0, then one for the others, alike),
    at the run's stage or at each of ``stages``; ``activations``: ``activations_of``'s (else traced here);
    ``micro``: samples per forward (else the run's)."""
    from fdp.run.build import stage_of

    micro = micro or micro_samples(cfg.data.global_batch_size, world, fixed_accum(cfg.trainer.accum_steps))
    acts = (activations or activations_of(cfg, parts))(micro)
    gather = parts.precision.gather_dtype
    node_size = (cfg.world.node_size or cfg.world.nproc_per_node) if cfg.world.hierarchical else 0
    saving = format_of(cfg.trainer, world)
    out = []
    for stage in stages if stages is not None else [stage_of(cfg).number]:
        for rank in (0, 1) if world > 1 else (0,):
            out.append(
                forecast(
                    parts.plan,
                    parts.optimizer,
                    parts.hook,
                    acts,
                    stage=stage,
                    world=world,
                    rank=rank,
                    fixed=int(fixed_mib * MiB),
                    extra_state=_extra_state_bytes(cfg, parts.plan),
                    saving=saving,
                    gather_itemsize=gather.itemsize if gather is not None else None,
                    reshard=cfg.trainer.reshard_after_forward,
                    hook_ratio=_hook_ratio(cfg),
                    node_size=node_size,
                    outer=cfg.outer.get("name", "none") != "none",
                    saves_mid_run=saves_mid_run(cfg.trainer),
                    accum=math.ceil(cfg.data.global_batch_size / world / micro),
                )
            )
    return out


# -- what recipes/plan.py prints and saves ----------------------------------------------------
def describe(mine: list[Forecast], stages: list[Forecast], budget_mb: float = 0.0, largest=None) -> str:
    """The forecast as ``recipes/plan.py`` prints it: the parts per rank, the peak and its phase, the bytes sent,
    and the stages table (with a budget: whether each fits, and the largest micro-batch it allows)."""
    names = list(mine[0].parts())
    heads = ["rank 0" if f.rank == 0 else "other ranks" for f in mine]
    width = max(map(len, names)) + 2
    lines = [
        "memory per rank (MiB over what a rank holds once its data is loaded), forecast from the plan:",
        "part".ljust(width) + "".join(h.rjust(14) for h in heads),
    ]
    for name in names:
        lines.append(name.ljust(width) + "".join(f"{f.parts()[name]:14.1f}" for f in mine))
    lines.append("peak".ljust(width) + "".join(f"{f.peak / MiB:8.1f} {f.phase:>5}" for f in mine))
    sent = mine[0].bytes_sent
    lines.append("bytes sent: " + ", ".join(f"{k.replace('_', ' ')} {v / MiB:.2f} MiB" for k, v in sent.items()))
    lines.append("")
    fit = f" | fits {budget_mb:g} MiB | largest micro-batch" if budget_mb else ""
    lines.append(("stage | params | gradients | optimizer | gathers | peak MiB | phase " + fit).rstrip())
    for stage in range(4):
        worst = max((f for f in stages if f.stage == stage), key=lambda f: f.peak)
        t = worst.terms
        row = (
            f"{stage:5d} | {t.params / MiB:6.1f} | {max(t.grads_held, t.grads_step) / MiB:9.1f}"
            f" | {t.optimizer / MiB:9.1f} | {t.gathers / MiB:7.1f} | {worst.peak / MiB:8.1f} | {worst.phase:<6}"
        )
        if budget_mb:
            fits = "yes" if worst.peak <= budget_mb * MiB else "no"
            row += f" | {fits:>{len(f'fits {budget_mb:g} MiB')}} | {largest[stage] if largest else '-'}"
        lines.append(row.rstrip())
    return "\n".join(lines)


def memory_section(mine: list[Forecast], stages: list[Forecast]) -> dict:
    """The ``memory`` section of ``recipes/plan.py``'s JSON: the run's ranks, then every stage's worst rank.

    ``peak_mib`` is per rank: ``ranks`` names rank 0 and, with more ranks, one for the others (all alike)."""
    return {
        "peak_mib": round(max(f.peak for f in mine) / MiB, 2),
        "phase": max(mine, key=lambda f: f.peak).phase,
        "ranks": [f.to_dict() for f in mine],
        "stages": [max((f for f in stages if f.stage == s), key=lambda f: f.peak).to_dict() for s in range(4)],
    }


def start_line(cfg, parts, world: int, fixed_mib: float) -> str:
    """The one line a run logs at start: the forecast's peak per rank and its phase (and whether it fits the budget).

    A forecast that cannot be made (a model the trace cannot run on two samples) says so: it never stops a run."""
    try:
        worst = max(run_forecasts(cfg, parts, world, fixed_mib), key=lambda f: f.peak)
    except Exception as error:  # noqa: BLE001 - the run goes on without a forecast
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"memory forecast: none ({reason})"
    budget = cfg.world.memory_per_rank_mb
    verdict = ""
    if budget:
        verdict = f"; {'fits' if worst.peak <= budget * MiB else 'does not fit'} world.memory_per_rank_mb={budget:g}"
    return (
        f"memory forecast: peak {worst.peak / MiB:.0f} MiB per rank in {worst.phase} at trainer.zero_stage="
        f"{worst.stage} (see recipes/plan.py){verdict}"
    )


def forecast_accum(cfg: Any, parts: Any, world: int, fixed_mib: float, budget: float) -> tuple[int, str]:
    """The fewest micro-batches per step whose forecast peak fits ``budget`` MiB on this rank, and why.

    No budget: the whole share in one forward. A forecast that cannot be made: the same, the steps confirm it."""
    per_rank = cfg.data.global_batch_size // world
    if not budget:
        return 1, "no memory budget (world.memory_per_rank_mb=0 on the CPU)"
    try:
        acts = activations_of(cfg, parts)

        def peak(micro: int) -> int:
            return max(f.peak for f in run_forecasts(cfg, parts, world, fixed_mib, activations=acts, micro=micro))

        accum = first_accum(per_rank, lambda micro: peak(micro) <= budget * MiB)
    except Exception as error:  # noqa: BLE001 - no forecast: the steps decide
        return 1, f"no forecast ({(str(error).strip().splitlines() or [type(error).__name__])[0]})"
    return accum, f"forecast peak {peak(per_rank // accum) / MiB:.0f} MiB of {budget:g} MiB"
