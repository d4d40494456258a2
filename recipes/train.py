"""Train a model from the shell.

    python recipes/train.py                                   # MLP on digits, one process
    python recipes/train.py model=charlm data=stdlib_text optim=adamw trainer.max_steps=300
    python recipes/train.py world=local2 hooks=powersgd hooks.rank=4
    python recipes/train.py -m hooks=allreduce,powersgd       # a sweep, one run directory each
    PYTHONPATH=. python recipes/train.py model=custom model._target_=my_pkg.models.Net +model.width=256 \
        data=custom data._target_=my_pkg.data.make      # your own model and data (README)

Every setting is in conf/ and fdp/config.py; the logic lives in fdp/trainer.py.
"""
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from fdp.checkpoint import CheckpointError
from fdp.config import register_configs
from fdp.errors import ConfigError
from fdp.launch import RankLostError, RankOutOfMemoryError, WorkerFailedError, launch_rank
from fdp.trainer import main as train
from fdp.validate import validate
from fdp.world import resolve_world

register_configs()

# Failures the run reports in one line: the message says what happened and what to change.
EXPECTED = ("ConfigError", "CheckpointError", "FloatingPointError", "RankLostError", "RankOutOfMemoryError")


def save_hydra_files(cfg: DictConfig, run_dir: str) -> None:
    """What Hydra's ``output_subdir`` would hold, written only once the config is valid.

    A resumed run keeps the files of the invocations before it: each resume writes its
    own ``.hydra/resume-<N>/``.
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
def main(cfg: DictConfig) -> None:
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        validate(resolve_world(cfg), run_dir)  # before anything is written to run_dir
        if launch_rank(cfg.world.launcher) == 0:  # under torchrun and SLURM every rank runs this script
            save_hydra_files(cfg, run_dir)
        train(cfg, run_dir)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except WorkerFailedError as e:
        if e.error_type in ("ConfigError", "CheckpointError"):  # refused by the workers
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        if e.error_type not in EXPECTED and e.traceback:  # a bug: show where
            print(e.traceback, file=sys.stderr, end="")
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except (RankLostError, RankOutOfMemoryError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
