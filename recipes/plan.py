"""Print the bucket plan of any configured model, without training it.

    python recipes/plan.py model=charlm data=stdlib_text trainer.bucket_cap_mb=4
    python recipes/plan.py model=convnet +plan_json=plan.json      # also save it as JSON
    python recipes/plan.py world=local4 trainer.zero_stage=3 world.memory_per_rank_mb=500  # will it fit?
    python recipes/plan.py world=local4 trainer.zero_stage=auto world.memory_per_rank_mb=500  # which stage fits?

The plan is built exactly as ``recipes/train.py`` builds it before step 1, for the world
and ZeRO stage the config names. Then the memory forecast (``fdp.run.memory.forecast``): each rank's
memory by part, the peak and its phase, the bytes a step sends, and the same run at stages 0-3
(with ``world.memory_per_rank_mb``: which fit, and the largest micro-batch each allows). Nothing
is written but the JSON asked for (its ``memory`` section holds the forecast; no run directory),
and a mistake ends in one ``error:`` line with exit status 2, as a run does.
"""

import json
import sys

import torch

from fdp._torch import preload_compiler
from fdp.comm import Comm
from fdp.errors import ConfigError
from fdp.procs.allocator import budget_accounting
from fdp.run import build, cli
from fdp.run.build import build_run, display_name
from fdp.run.config.compose import compose
from fdp.run.memory import auto_stage, forecast, run_forecast

JSON = "plan_json"  # this recipe's own setting, not a key of the run's config


def _split(argv: list[str]) -> tuple[list[str], str | None]:
    """The config overrides, and where to save the plan as JSON (``+plan_json=PATH``)."""
    overrides, path = [], None
    for arg in argv:
        key, eq, value = arg.lstrip("+").partition("=")
        if eq and key == JSON:
            path = value
        else:
            overrides.append(arg)
    return overrides, path


def main() -> None:
    from fdp.run.config.validate import validate
    from fdp.run.world import resolve_world

    overrides, json_path = _split(sys.argv[1:])
    cfg = compose(*overrides)  # Hydra's own errors: one line from cli.main
    preload_compiler()  # as a rank does before its budget starts: not part of what the forecast counts
    try:
        cfg = resolve_world(cfg)
        validate(cfg)
        # The heap as a rank's (under a budget, freed blocks handed back), so the fixed part is measured as it does.
        build.tune_allocator_for(cfg)
        if cfg.world.memory_per_rank_mb > 0:
            budget_accounting()
        fixed = forecast.first_use_mib()  # before anything else runs torch's first operations
        before = forecast.resident_mib()
        if cfg.trainer.zero_stage == auto_stage.AUTO:  # the stage the run would take, said as the run says it
            cfg = _auto_stage(cfg, fixed)
        parts = build_run(cfg, Comm())
        fixed += forecast.built_mib(before, parts.state)  # what the build left beyond its state (the model's code)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(cli.REFUSED)
    plan, world = parts.plan, cfg.world.nnodes * cfg.world.nproc_per_node
    params = sum(s.numel for b in plan.buckets for s in b.slots)
    print(
        f"model={display_name(cfg.model)}: {params:,} params in {len(plan)} buckets, for world={cfg.world.name} "
        f"({world} rank{'s' * (world != 1)}) at trainer.zero_stage={cfg.trainer.zero_stage}"
    )
    print(plan)
    print(f"fingerprint: {plan.fingerprint()}")
    activations = run_forecast.activations_of(cfg, parts)
    mine = run_forecast.run_forecasts(cfg, parts, world, fixed, activations)
    stages = run_forecast.run_forecasts(cfg, parts, world, fixed, activations, stages=range(4))
    print()
    print(
        run_forecast.describe(
            mine, stages, cfg.world.memory_per_rank_mb, _largest(cfg, parts, world, fixed, activations)
        )
    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump({**plan.to_dict(), "memory": run_forecast.memory_section(mine, stages)}, f, indent=1)


def _auto_stage(cfg, fixed: float):
    """``cfg`` at the stage ``trainer.zero_stage=auto`` takes under ``world.memory_per_rank_mb`` (0 on the CPU if
    unset: stage 0), with the line the run prints at start."""
    from fdp.run.config.validate import allowed_stages

    allowed, budget = allowed_stages(cfg), cfg.world.memory_per_rank_mb
    world = cfg.world.nnodes * cfg.world.nproc_per_node
    if budget:
        data = build.build_data(cfg.data, cfg.seed)
        before = forecast.resident_mib()
        planned = build.planned_run(cfg, Comm(), torch.device("cpu"), data)
        fixed += forecast.built_mib(before, dict(planned.state.buffers))
        record = auto_stage.decided(cfg, planned, world, allowed, fixed, budget)
    else:
        record = {"stage": allowed[0], "why": "no memory budget: world.memory_per_rank_mb=0 on the CPU"}
    print(f"trainer.zero_stage=auto: stage {record['stage']} ({record['why']})")
    return auto_stage.with_stage(cfg, record["stage"])


def _largest(cfg, parts, world: int, fixed: float, activations) -> dict[int, int] | None:
    """The largest micro-batch each stage fits under ``world.memory_per_rank_mb`` (``None`` without a budget)."""
    budget = cfg.world.memory_per_rank_mb
    if not budget:
        return None

    def fits(stage: int, micro: int) -> bool:
        ranks = run_forecast.run_forecasts(cfg, parts, world, fixed, activations, [stage], micro)
        return max(f.peak for f in ranks) <= budget * forecast.MiB

    most = max(1, cfg.data.global_batch_size // world)
    return {s: forecast.largest_micro_batch(lambda m, s=s: fits(s, m), most) for s in range(4)}


if __name__ == "__main__":
    cli.main(main)  # Hydra's own errors (unknown option or key, bad value) as one `error:` line, exit 2
