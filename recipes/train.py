"""Train a model from the shell.

    python recipes/train.py                                   # MLP on digits, one process
    python recipes/train.py model=charlm data=stdlib_text optim=adamw trainer.max_steps=300
    python recipes/train.py world=local2 hooks=powersgd hooks.rank=4
    python recipes/train.py -m hooks=allreduce,powersgd       # a sweep, one run directory each

Every setting is in conf/ and fdp/config.py; the logic lives in fdp/trainer.py.
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fdp.checkpoint import CheckpointError
from fdp.config import ConfigError, register_configs
from fdp.trainer import main as train

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        train(cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
