"""Print the bucket plan of any configured model, without training it.

    python recipes/plan.py model=charlm data=stdlib_text trainer.bucket_cap_mb=4
    python recipes/plan.py model=convnet +plan_json=plan.json      # also save it as JSON

The plan is built exactly as ``recipes/train.py`` builds it before step 1.
"""
import json

import hydra
from omegaconf import DictConfig

from fdp.config import register_configs
from fdp.build import build_run
from fdp.comm import Comm

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    plan = build_run(cfg, Comm()).plan
    print(plan)
    print(f"fingerprint: {plan.fingerprint()}")
    if cfg.get("plan_json"):
        with open(cfg.plan_json, "w") as f:
            json.dump(plan.to_dict(), f, indent=1)


if __name__ == "__main__":
    main()
