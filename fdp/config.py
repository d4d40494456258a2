"""Typed schemas behind the Hydra configs in ``conf/``.

Every YAML file in ``conf/`` extends one of these dataclasses, so an unknown key or a
value of the wrong type fails when the config is composed, with a message naming the
key. Range checks that a type cannot express live in ``validate``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig


# -- model -----------------------------------------------------------------------------
# Every model is built by Hydra's instantiate from its ``_target_``; the trainer adds the
# arguments the data decides (in_features, num_classes, vocab_size, ...) where the target
# takes them (fdp.targets.build). ``custom`` is a user's own class or function: its
# arguments are added on the command line (``+model.width=256``).
@dataclass
class MLPConfig:
    name: str = "mlp"
    _target_: str = "fdp.models.MLP"
    hidden: int = 256
    depth: int = 2


@dataclass
class ConvNetConfig:
    name: str = "convnet"
    _target_: str = "fdp.models.ConvNet"
    width: int = 32


@dataclass
class CharLMConfig:
    name: str = "charlm"
    _target_: str = "fdp.models.CharTransformer"
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    dropout: float = 0.0


@dataclass
class CustomModelConfig:
    name: str = "custom"
    _target_: str = MISSING


# -- data ------------------------------------------------------------------------------
# A built-in target returns an in-memory fdp.data.Dataset; a custom one returns
# (train, test), map-style torch Datasets of (input, target) items read through a DataLoader.
@dataclass
class DigitsConfig:
    name: str = "digits"
    _target_: str = "fdp.data.load_digits"
    global_batch_size: int = 64
    test_fraction: float = 0.2


@dataclass
class StdlibTextConfig:
    name: str = "stdlib_text"
    _target_: str = "fdp.data.load_stdlib_text"
    global_batch_size: int = 32
    block_size: int = 64
    max_chars: int = 1_000_000
    test_fraction: float = 0.1


@dataclass
class CustomDataConfig:
    name: str = "custom"
    _target_: str = MISSING
    global_batch_size: int = 64
    num_workers: int = 0  # DataLoader worker processes per rank (0: load in the training process)


# Settings of fdp, not arguments of a data target.
DATA_SETTINGS = ("name", "global_batch_size", "num_workers")


# -- loss ------------------------------------------------------------------------------
@dataclass
class CrossEntropyConfig:
    name: str = "cross_entropy"
    _target_: str = "fdp.losses.cross_entropy"


@dataclass
class MSEConfig:
    name: str = "mse"
    _target_: str = "fdp.losses.mse"


@dataclass
class CustomLossConfig:
    name: str = "custom"
    _target_: str = MISSING  # a function (outputs, targets) -> scalar


# -- optimizer -------------------------------------------------------------------------
@dataclass
class OptimBase:
    lr: float = 1e-3
    weight_decay: float = 0.0
    lr_schedule: str = "constant"  # constant | warmup_cosine
    warmup_steps: int = 0
    end_lr: float = 0.0  # warmup_cosine: the rate at trainer.max_steps
    clip_norm: Optional[float] = None


@dataclass
class SGDConfig(OptimBase):
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    dampening: float = 0.0
    nesterov: bool = False


@dataclass
class AdamConfig(OptimBase):
    name: str = "adam"
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8


@dataclass
class AdamWConfig(AdamConfig):
    name: str = "adamw"
    weight_decay: float = 0.01


# -- trainer and world -----------------------------------------------------------------
@dataclass
class TrainerConfig:
    max_steps: int = 300  # the length of the run (schedules span it)
    stop_at: int = 0  # end this invocation early at this step, to resume later (0: run to max_steps)
    accum_steps: int = 1
    log_every: int = 10
    eval_every: int = 100  # 0: evaluate only at the end
    eval_batches: int = 20
    checkpoint_every: int = 100  # 0: checkpoint only at the end
    keep_checkpoints: int = 2
    resume: bool = False
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    allow_unused: bool = False
    schedule: str = "auto"  # auto | after | overlap: when bucket reductions start (auto: overlap on more than one process)
    nonfinite: str = "raise"  # raise | skip
    sync_buffers: str = "broadcast"  # broadcast | average | local: buffers (BatchNorm statistics) across ranks
    precision: str = "32-true"  # 32-true | bf16-mixed | 16-mixed | bf16-true (Lightning's names)
    matmul_precision: str = "highest"  # highest | high | medium: torch.set_float32_matmul_precision
    compile: Any = "auto"  # auto | true | false: torch.compile the gradient computation (auto: on a GPU, when the run repays the compile)
    zero_stage: int = 0  # 0 | 1 (shard optimizer state over ranks) | 2 (and reduced gradients)
    trace: bool = False  # write a Chrome trace per rank to <run dir>/trace/ (for short diagnostic runs)
    tensorboard: bool = False  # also write the logged metrics as TensorBoard scalars to <run dir>/tb/ (rank 0)
    progress: bool = True


@dataclass
class WorldConfig:
    name: str = "single"
    launcher: str = "none"  # none | elastic | torchrun | slurm
    nnodes: int = 1
    nproc_per_node: int = 1
    backend: str = "auto"  # auto | gloo | nccl (auto: NCCL when every rank has a GPU of its own)
    accelerator: str = "auto"  # auto | cpu | gpu (auto: the GPUs when there are any)
    devices: Any = "auto"  # auto | N | -1 | "0,2" | [0,2]: see fdp.devices
    timeout_s: float = 300.0
    max_restarts: int = 0
    hierarchical: bool = False  # reduce inside each node, run the hook chain across nodes only, share inside the node
    node_size: int = 0  # processes per node for hierarchical (0: the processes of one launch)


# -- hooks -----------------------------------------------------------------------------
@dataclass
class AllreduceConfig:
    name: str = "allreduce"


@dataclass
class Fp16Config:
    name: str = "fp16"


@dataclass
class Bf16Config:
    name: str = "bf16"


@dataclass
class NoopConfig:
    name: str = "noop"


@dataclass
class PowerSGDConfig:
    name: str = "powersgd"
    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    seed: int = 0
    batch_same_shape: bool = False


@dataclass
class BatchedPowerSGDConfig:
    name: str = "batched_powersgd"
    rank: int = 1
    start_iter: int = 10
    error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    seed: int = 0


@dataclass
class TopKConfig:
    name: str = "topk"
    ratio: float = 0.01
    error_feedback: bool = True
    k: Optional[int] = None  # entries sent per bucket; None: ceil(ratio * numel)


@dataclass
class Int8Config:
    name: str = "int8"
    error_feedback: bool = True


@dataclass
class ChainConfig:
    name: str = "chain"
    stages: List[Any] = field(default_factory=list)


# -- outer loop (fdp.outer) -------------------------------------------------------------
@dataclass
class OuterNoneConfig:
    name: str = "none"


@dataclass
class LocalSGDConfig:
    name: str = "local_sgd"
    sync_every: int = 16  # steps between parameter averages
    start_step: int = 0  # per-step gradient sync up to this step (post-local SGD)
    overlap: int = 0  # inner steps a sync's communication runs behind (applied that many steps late)


@dataclass
class DiLoCoConfig:
    name: str = "diloco"
    sync_every: int = 16
    start_step: int = 0
    lr: float = 0.7  # the outer optimizer: SGD on the averaged pseudo-gradient
    momentum: float = 0.9
    nesterov: bool = True
    overlap: int = 0


# -- the whole run ---------------------------------------------------------------------
@dataclass
class Config:
    model: Any = MISSING
    data: Any = MISSING
    loss: Any = MISSING
    optim: Any = MISSING
    hooks: Any = MISSING
    outer: Any = MISSING
    world: WorldConfig = field(default_factory=WorldConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: int = 0


SCHEMAS = {
    "model": {"mlp": MLPConfig, "convnet": ConvNetConfig, "charlm": CharLMConfig, "custom": CustomModelConfig},
    "data": {"digits": DigitsConfig, "stdlib_text": StdlibTextConfig, "custom": CustomDataConfig},
    "loss": {"cross_entropy": CrossEntropyConfig, "mse": MSEConfig, "custom": CustomLossConfig},
    "optim": {"sgd": SGDConfig, "adam": AdamConfig, "adamw": AdamWConfig},
    "hooks": {
        "allreduce": AllreduceConfig,
        "fp16": Fp16Config,
        "bf16": Bf16Config,
        "noop": NoopConfig,
        "powersgd": PowerSGDConfig,
        "batched_powersgd": BatchedPowerSGDConfig,
        "topk": TopKConfig,
        "int8": Int8Config,
        "chain": ChainConfig,
    },
    "world": {"world": WorldConfig},
    "outer": {"none": OuterNoneConfig, "local_sgd": LocalSGDConfig, "diloco": DiLoCoConfig},
}


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(*overrides: str, config_dir: str | Path = CONF_DIR) -> DictConfig:
    """The run config for ``overrides``, as ``recipes/train.py`` would see it (from Python or a notebook).

    >>> cfg = compose("model=convnet", "trainer.max_steps=50")
    >>> cfg.model.name, cfg.trainer.max_steps
    ('convnet', 50)
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra_compose("config", overrides=list(overrides))


def register_configs() -> None:
    """Register the schemas with Hydra; YAML files extend them as ``<name>_schema``."""
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(group=group, name=f"{name}_schema", node=schema)


# -- checks a type cannot express -------------------------------------------------------
class ConfigError(ValueError):
    """A setting out of range or inconsistent with another; the message names it."""


def _require(ok: bool, setting: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{setting}={value!r}: expected {expected}")


def _checked(key: str, check: Callable[[Any], Any], value: Any) -> None:
    """Run the check of the module that uses a setting; its message names the config key.

    Modules name a setting as their Python argument (``schedule='x': expected ...``); the
    registries already give the group's path (``hooks.rank=0: expected ...``).
    """
    try:
        check(value)
    except ValueError as error:
        message, group, arg = str(error), *key.rpartition(".")[::2]
        if group and message.startswith(arg):
            message = f"{group}.{message}"
        raise ConfigError(message) from None


def validate(cfg: Any, run_dir: Any = None) -> None:
    """Refuse a config before anything is built or written; each error names one setting."""
    from pathlib import Path

    from fdp.hooks.registry import build_hook
    from fdp.devices import BACKENDS
    from fdp.launch import ENV_LAUNCHERS, LAUNCHERS
    from fdp.metrics import check_tensorboard
    from fdp.compiled import check_compile
    from fdp.hooks.hierarchical import check_node_size
    from fdp.optim import build_optimizer
    from fdp.outer import check_outer
    from fdp.plan.values import _check_cap
    from fdp.precision import check_matmul_precision, check_precision
    from fdp.reduce import resolve_schedule
    from fdp.replicas import check_sync_buffers
    from fdp.train import check_nonfinite
    from fdp.zero import check_hooks_for_stage, check_zero_stage

    t, w, d, o, m = cfg.trainer, cfg.world, cfg.data, cfg.optim, cfg.model
    for group in ("model", "data", "loss"):
        if cfg.get(group) is not None:
            _check_target(group, cfg[group])
    for key in ("max_steps", "accum_steps", "log_every", "keep_checkpoints"):
        _require(t[key] >= 1, f"trainer.{key}", t[key], "an integer >= 1")
    for key in ("eval_every", "checkpoint_every", "stop_at"):
        _require(t[key] >= 0, f"trainer.{key}", t[key], "an integer >= 0")
    # The run always evaluates at its end: zero batches would average over nothing.
    _require(t.eval_batches >= 1, "trainer.eval_batches", t.eval_batches, "an integer >= 1")
    # Settings that a module checks where it uses them: the module's rule, under the config's key.
    for key in ("bucket_cap_mb", "first_bucket_cap_mb"):
        _checked(f"trainer.{key}", lambda value, key=key: _check_cap(key, value), t[key])
    _checked("trainer.schedule", lambda value: resolve_schedule(value, world_size=1), t.schedule)
    _checked("trainer.nonfinite", check_nonfinite, t.nonfinite)
    _checked("trainer.sync_buffers", check_sync_buffers, t.sync_buffers)
    _checked("trainer.precision", check_precision, t.precision)
    _checked("trainer.matmul_precision", check_matmul_precision, t.matmul_precision)
    _checked("trainer.compile", check_compile, t.compile)
    _checked("trainer.zero_stage", check_zero_stage, t.zero_stage)
    _checked("trainer.zero_stage", lambda stage: check_hooks_for_stage(stage, _container(cfg.hooks)), t.zero_stage)
    if t.zero_stage:  # combinations whose state does not shard (yet): refused, not silently unsharded
        _require(t.precision != "16-mixed", "trainer.zero_stage", t.zero_stage, "0 with trainer.precision=16-mixed (the loss scale is not sharded)")
        _require(cfg.outer.name == "none", "trainer.zero_stage", t.zero_stage, f"0 with outer={cfg.outer.name} (an outer loop keeps whole optimizer states)")
        _require(not w.hierarchical, "trainer.zero_stage", t.zero_stage, "0 with world.hierarchical=true")
    _checked("optim", lambda spec: build_optimizer(spec, t.max_steps), _container(o))
    _checked("hooks", build_hook, _container(cfg.hooks))
    if t.tensorboard:
        check_tensorboard()
    _checked("outer", check_outer, _container(cfg.outer))
    _require(w.launcher in LAUNCHERS, "world.launcher", w.launcher, f"one of {LAUNCHERS}")
    _require(w.backend in BACKENDS, "world.backend", w.backend, f"one of {BACKENDS}")
    _require(w.nproc_per_node >= 1, "world.nproc_per_node", w.nproc_per_node, "an integer >= 1")
    _require(w.nnodes >= 1, "world.nnodes", w.nnodes, "an integer >= 1")
    _require(w.timeout_s > 0, "world.timeout_s", w.timeout_s, "seconds > 0")
    _require(w.max_restarts >= 0, "world.max_restarts", w.max_restarts, "an integer >= 0")
    _require(d.global_batch_size >= 1, "data.global_batch_size", d.global_batch_size, "an integer >= 1")
    if "test_fraction" in d:
        _require(0.0 < d.test_fraction < 1.0, "data.test_fraction", d.test_fraction, "a fraction in (0, 1)")
    if "num_workers" in d:
        _require(d.num_workers >= 0, "data.num_workers", d.num_workers, "an integer >= 0")
    if d.name == "stdlib_text":
        _require(d.block_size >= 1, "data.block_size", d.block_size, "an integer >= 1")
        _require(d.max_chars >= 1, "data.max_chars", d.max_chars, "an integer >= 1")
    if w.launcher not in ENV_LAUNCHERS:  # there the world size is known only to the launched processes
        world = w.nnodes * w.nproc_per_node
        _require(d.global_batch_size % world == 0, "data.global_batch_size", d.global_batch_size,
                 f"a multiple of the world size {world}")
        per_rank = d.global_batch_size // world
        _require(per_rank % t.accum_steps == 0, "trainer.accum_steps", t.accum_steps,
                 f"a divisor of the per-rank batch {per_rank}")
        if w.hierarchical:  # under torchrun the world is known only at run time: the worker checks it
            _checked("world.node_size", lambda size: check_node_size(world, size), w.node_size or w.nproc_per_node)
    text_model, text_data = m.name == "charlm", d.name == "stdlib_text"
    if "custom" not in (m.name, d.name):  # a custom side is checked on the first batch instead
        _require(text_model == text_data, "data", d.name,
                 "stdlib_text for model=charlm" if text_model else f"digits for model={m.name}")
    sizes = {"mlp": ("hidden",), "convnet": ("width",), "charlm": ("d_model", "n_layer", "n_head")}.get(m.name, ())
    for key in sizes:
        _require(m[key] >= 1, f"model.{key}", m[key], "an integer >= 1")
    if m.name == "mlp":
        _require(m.depth >= 0, "model.depth", m.depth, "an integer >= 0")
    if text_model:
        _require(m.d_model % m.n_head == 0, "model.n_head", m.n_head, f"a divisor of model.d_model={m.d_model}")
        _require(0.0 <= m.dropout < 1.0, "model.dropout", m.dropout, "a probability in [0, 1)")
    if run_dir is not None:
        run_dir = Path(run_dir)
        last = run_dir / "checkpoints" / "last.pt"
        if t.resume:
            _require(last.is_file(), "trainer.resume", True, f"a checkpoint at {last} (set hydra.run.dir to the run to continue)")
            from fdp.checkpoint import check_readable

            check_readable(last)  # a truncated or foreign file fails here, before any worker starts
        else:
            taken = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()
            _require(not taken, "hydra.run.dir", str(run_dir),
                     "a directory without a previous run (or set trainer.resume=true to continue it)")


_KINDS = {
    "model": ("model", "models", "my_pkg.models.Net"),
    "data": ("dataset", "datasets", "my_pkg.data.make"),
    "loss": ("loss", "losses", "my_pkg.losses.loss"),
}


def _check_target(group: str, node: Any) -> None:
    """``<group>.name`` is a registered option and ``<group>._target_`` imports."""
    from omegaconf import OmegaConf

    from fdp.targets import locate

    one, many, example = _KINDS[group]
    known = SCHEMAS[group]
    if node.get("name") not in known:
        raise ConfigError(f"{group}.name={node.get('name')!r}: unknown {one}; known {many}: {', '.join(sorted(known))}")
    if OmegaConf.is_config(node) and OmegaConf.is_missing(node, "_target_"):
        raise ConfigError(f"{group}._target_: missing; {group}={node.name} needs the dotted path to a class or function "
                          f"(e.g. {group}._target_={example})")
    locate(f"{group}._target_", node.get("_target_"))


def _container(node: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
