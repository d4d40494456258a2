"""Train a model from the shell.

    python recipes/train.py                                   # MLP on digits, one process
    python recipes/train.py model=charlm data=stdlib_text optim=adamw trainer.max_steps=300
    python recipes/train.py world=local2 hooks=powersgd hooks.rank=4
    python recipes/train.py -m hooks=allreduce,powersgd       # a sweep, one run directory each
    PYTHONPATH=. python recipes/train.py model=custom model._target_=my_pkg.models.Net +model.width=256 \
        data=custom data._target_=my_pkg.data.make      # your own model and data (docs/guide/your-own.md)

Every setting is in conf/ and fdp/run/config/schema.py; the logic lives in fdp/run/trainer.py, and how a run
ends (one line, an exit status) in fdp/run/cli.py.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fdp.run import cli
from fdp.run.config import register_configs

register_configs()


def save_hydra_files(cfg: DictConfig, run_dir: str | Path) -> None:
    """What Hydra's ``output_subdir`` would hold, written only once the config is valid.

    A resumed run keeps the files of the invocations before it: each resume writes its
    own ``.hydra/resume-<N>/`` (and a refused one removes its own again: ``fdp.run.rundir``).
    """
    hydra_cfg = HydraConfig.get()
    out = Path(run_dir) / ".hydra"
    n = 0
    while (out / "config.yaml").exists():
        n += 1
        out = Path(run_dir) / ".hydra" / f"resume-{n}"
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), out / "hydra.yaml")
    OmegaConf.save(hydra_cfg.overrides.task, out / "overrides.yaml")


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> int:
    hydra_cfg = HydraConfig.get()
    status = cli.run_from_shell(cfg, hydra_cfg.runtime.output_dir, save_hydra_files)
    # A sweep goes on after a job that failed (fdp.run.sweep sums them up and ends with the worst status),
    # but not after a stop signal: Ctrl-C stops the sweep.
    if status and (hydra_cfg.mode != RunMode.MULTIRUN or status >= 128):
        sys.exit(status)
    return status


if __name__ == "__main__":
    cli.main(main)  # Hydra's own errors (unknown option or key, bad value) as one `error:` line, exit 2
