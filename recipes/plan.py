"""Print the bucket plan of any configured model, without training it.

    python recipes/plan.py model=charlm data=stdlib_text trainer.bucket_cap_mb=4
    python recipes/plan.py model=convnet +plan_json=plan.json      # also save it as JSON

The plan is built exactly as ``recipes/train.py`` builds it before step 1, for the world
and ZeRO stage the config names. Nothing is written but the JSON asked for (no run
directory), and a mistake ends in one ``error:`` line with exit status 2, as a run does.
"""

import json
import sys

from fdp.comm import Comm
from fdp.errors import ConfigError
from fdp.run import cli
from fdp.run.build import build_run, display_name
from fdp.run.config import compose

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
    from fdp.run.validate import validate
    from fdp.run.world import resolve_world

    overrides, json_path = _split(sys.argv[1:])
    cfg = compose(*overrides)  # Hydra's own errors: one line from cli.main
    try:
        cfg = resolve_world(cfg)
        validate(cfg)
        plan = build_run(cfg, Comm()).plan
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(cli.REFUSED)
    world = cfg.world.nnodes * cfg.world.nproc_per_node
    params = sum(s.numel for b in plan.buckets for s in b.slots)
    print(
        f"model={display_name(cfg.model)}: {params:,} params in {len(plan)} buckets, for world={cfg.world.name} "
        f"({world} rank{'s' * (world != 1)}) at trainer.zero_stage={cfg.trainer.zero_stage}"
    )
    print(plan)
    print(f"fingerprint: {plan.fingerprint()}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(plan.to_dict(), f, indent=1)


if __name__ == "__main__":
    cli.main(main)  # Hydra's own errors (unknown option or key, bad value) as one `error:` line, exit 2
