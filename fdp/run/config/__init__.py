"""A run's configuration: the typed schemas behind ``conf/`` (``schema``), the keys a command line may set, with
their one-line meanings (``keys``), the config for a list of overrides from Python (``compose``), and every
setting's range and the refused pairs, checked before anything runs (``validate``).

>>> from fdp.run.config.compose import compose
>>> compose("trainer.max_steps=3").trainer.max_steps
3
"""

from fdp.run.config.schema import (
    DATA_SETTINGS,
    SCHEMAS,
    Config,
    DiLoCoConfig,
    EarlyStoppingConfig,
    LocalSGDConfig,
    TrainerConfig,
    WorldConfig,
    register_configs,
)

__all__ = [
    "Config",
    "TrainerConfig",
    "WorldConfig",
    "EarlyStoppingConfig",
    "LocalSGDConfig",
    "DiLoCoConfig",
    "SCHEMAS",
    "DATA_SETTINGS",
    "register_configs",
]
