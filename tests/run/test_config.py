"""Config schemas against the code they configure: every setting a factory takes, with its default."""

import dataclasses
import inspect

import pytest

from fdp.errors import ConfigError
from fdp.hooks import HOOKS
from fdp.optim import OPTIMIZERS, build_optimizer
from fdp.optim.registry import SHARED_SETTINGS
from fdp.run.config import SCHEMAS
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate


def _fields(schema) -> dict:
    return {f.name: f.default for f in dataclasses.fields(schema) if f.name != "name"}


def _signature(factory, leave_out=()) -> dict:
    return {k: p.default for k, p in inspect.signature(factory).parameters.items() if k not in leave_out}


@pytest.mark.parametrize("name", sorted(set(SCHEMAS["hooks"]) - {"chain", "custom"}))
def test_hook_schema_has_every_setting_of_its_factory_with_the_same_default(name):
    assert _fields(SCHEMAS["hooks"][name]) == _signature(HOOKS[name])


@pytest.mark.parametrize("name", sorted(set(SCHEMAS["optim"]) - {"custom"}))
def test_optim_schema_is_the_shared_settings_plus_the_factory_s_own(name):
    fields = _fields(SCHEMAS["optim"][name])
    shared = {k: fields.pop(k) for k in SHARED_SETTINGS}
    assert set(shared) == set(SHARED_SETTINGS)
    own = _signature(OPTIMIZERS[name], leave_out=("lr", "decay_mask"))  # given by the shared settings
    assert set(fields) == set(own)
    # The factory's defaults hold unless the schema deliberately picks another (sgd's momentum).
    differing = {k for k in own if fields[k] != own[k]}
    assert differing <= {"momentum"}, differing


def test_every_registered_optimizer_has_a_schema_and_back():
    assert set(SCHEMAS["optim"]) - {"custom"} == set(OPTIMIZERS)
    assert set(SCHEMAS["hooks"]) - {"chain", "custom"} <= set(HOOKS)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.name=lion"], r"^optim\.name='lion': unknown optimizer; known optimizers: sgd, adam, adamw, custom$"),
        (["optim.momentum=-1"], r"^optim\.momentum=-1\.0: expected a number >= 0$"),
        (["trainer.nonfinite=maybe"], r"^trainer\.nonfinite='maybe': expected raise or skip$"),
    ],
)
def test_a_setting_is_refused_by_the_module_that_uses_it_under_its_config_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides))


def test_the_optimizer_registry_builds_what_the_config_names():
    opt = build_optimizer({"name": "adam", "lr": 0.5, "clip_norm": 1.0}, max_steps=10)
    import torch

    params = {"w": torch.zeros(2)}
    updates, _ = opt.update({"w": torch.tensor([30.0, 40.0])}, opt.init(params), params)
    # Clipped to norm 1, then Adam's first step is -lr * sign(grad).
    assert torch.allclose(updates["w"], torch.tensor([-0.5, -0.5]))


def _schema_of(path, node) -> type:
    """The schema a conf/ YAML file extends: its ``<name>_schema`` default, or the group's field of ``Config``."""
    from fdp.run.config import Config

    group = path.parent.name
    extended = [d for d in node.get("defaults", []) if isinstance(d, str) and d.endswith("_schema")]
    if extended:
        return SCHEMAS[group][extended[0].removesuffix("_schema")]
    return next(f for f in dataclasses.fields(Config) if f.name == group).default_factory


def _restated(path) -> list[str]:
    import yaml

    node = yaml.safe_load(path.read_text()) or {}
    defaults = {
        f.name: f.default for f in dataclasses.fields(_schema_of(path, node)) if f.default is not dataclasses.MISSING
    }
    return [
        f"{path.parent.name}/{path.name}: {key}: {value!r}"
        for key, value in node.items()
        if key != "defaults" and key in defaults and value == defaults[key] and type(value) is type(defaults[key])
    ]


def test_each_conf_file_carries_only_real_overrides_of_its_schema():
    """A default is stated once, in its schema: a YAML value equal to it would be a second statement."""
    from fdp.run.config.compose import CONF_DIR

    files = sorted(p for p in CONF_DIR.glob("*/*.yaml"))
    assert len(files) > 20
    assert [line for path in files for line in _restated(path)] == []


COMPOSED = [
    ("world=local2", "trainer.max_steps=5"),
    ("model=charlm", "data=stdlib_text", "model.d_model=16", "hooks=powersgd", "hooks.rank=2"),
    ("hooks=fp16_powersgd", "hooks.chain=[{name: fp16}]", "trainer.accum_steps=auto"),
    ("world.devices=[0,2]", "trainer.max_time=00:01:00:00", "trainer.resume=/tmp/x/step_3.pt"),
    ("trainer.max_steps=7", "world=local4", "world.hierarchical=true", "trainer.max_steps=9"),
    ("+plan_json=/tmp/plan.json", "trainer.max_steps=3"),  # through Hydra whole
]
REFUSED = [("trainer.max_stepz=3",), ("trainer.max_steps=abc",), ("model=nope",), ("hooks.chain=[{name: fp16}]",)]


@pytest.mark.parametrize("overrides", COMPOSED)
def test_compose_gives_what_hydra_composes_for_the_same_overrides(overrides):
    """``compose`` reuses Hydra's composition of a choice of groups and applies the settings itself: the config,
    its values' types and its struct flag are Hydra's own, and the copy it returns is the caller's."""
    from omegaconf import OmegaConf

    from fdp.run.config.compose import CONF_DIR, _hydra_compose

    ours, hydra = compose(*overrides), _hydra_compose(overrides, str(CONF_DIR))
    assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(hydra)
    assert OmegaConf.is_struct(ours) and type(ours.trainer.max_steps) is type(hydra.trainer.max_steps)
    ours.trainer.max_steps = 12345
    assert compose(*overrides).trainer.max_steps != 12345


@pytest.mark.parametrize("overrides", REFUSED)
def test_compose_refuses_as_hydra_does_in_its_words(overrides):
    from fdp.run.config.compose import CONF_DIR, _hydra_compose

    with pytest.raises(Exception) as ours:
        compose(*overrides)
    with pytest.raises(Exception) as hydra:
        _hydra_compose(overrides, str(CONF_DIR))
    assert (type(ours.value), str(ours.value)) == (type(hydra.value), str(hydra.value))
