"""A config refused before anything is built or written, each error naming one setting.

The typed schemas (``fdp.run.config``) already refuse unknown keys and wrong types. What a
type cannot say (a range, a combination) is checked by the module that uses the
setting, where its rule is stated once; ``validate`` calls those rules and names the
setting by its config key: a module says ``schedule='x': expected ...``, the run says
``trainer.schedule='x': expected ...``.

>>> from fdp.run.config.compose import compose
>>> validate(compose("trainer.accum_steps=0"))
Traceback (most recent call last):
...
fdp.errors.ConfigError: trainer.accum_steps=0: expected an integer >= 1 or auto (the largest micro-batch that fits)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from fdp.data import check_global_batch, check_micro_batches, check_val_fraction
from fdp.errors import ConfigError, require
from fdp.errors import as_config_key as _as_config_key
from fdp.hooks import build_hook
from fdp.hooks.hierarchical import check_node_size
from fdp.model import remat
from fdp.model.precision import check_matmul_precision, check_precision, check_reduce_dtype
from fdp.model.streams import check_sample_streams, compile_refusal
from fdp.optim import build_optimizer, check_resumed_schedule
from fdp.plan.values import check_cap
from fdp.procs.devices import BACKENDS
from fdp.procs.interrupt import check_requeue_signal
from fdp.procs.launchers import launcher_of
from fdp.run.callbacks.specs import check_callbacks
from fdp.run.checkpoint import format_of, saved_config, verify
from fdp.run.config.keys import check_keys
from fdp.run.config.schema import SCHEMAS
from fdp.run.loop_controls import check_loop_settings
from fdp.run.memory.auto_stage import check_stage_setting
from fdp.run.memory.micro_batch import AUTO, check_accum_setting
from fdp.run.rank_loss import (
    check_one_process,
    check_rank_loss,
    check_rank_loss_in_world,
    check_stage_kept,
    rank_loss_of,
)
from fdp.run.report.loggers import check_loggers
from fdp.run.rundir import RunDir
from fdp.state.replicas import check_sync_buffers
from fdp.step.compiled import check_compile
from fdp.step.outer_spec import check_outer
from fdp.step.reduce import resolve_schedule
from fdp.step.train_step import check_nonfinite
from fdp.targets import locate
from fdp.update.zero import (
    ZERO_STAGES,
    check_hook_across_nodes,
    check_optimizer_for_stage,
    refuses_outer,
)

__all__ = ["validate", "validate_run_dir", "allowed_stages"]


def _require(ok: bool, setting: str, value: Any, what: str) -> None:
    require(ok, setting, value, what, ConfigError)


def _container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _device(world: Any) -> str:
    """The device type the run computes on: the resolved world's, else where ``auto`` will resolve."""
    resolved = {"cpu": "cpu", "gpu": "cuda"}.get(world.accelerator)
    return resolved or ("cuda" if torch.cuda.is_available() else "cpu")


def validate(cfg: Any, run_dir: Any = None) -> None:
    """Refuse a config before anything is built or written; each error names one setting."""
    check_keys(cfg)  # +trainer.x=1 is composed by Hydra, yet nothing would read it
    for group in ("model", "data", "loss"):
        if cfg.get(group) is not None:
            _check_target(group, cfg[group])
    _validate_trainer(cfg)
    _validate_world(cfg)
    _validate_data_and_model(cfg)
    if run_dir is not None:
        validate_run_dir(cfg, run_dir)


def validate_run_dir(cfg: Any, run_dir: Any) -> None:
    """Refuse a run whose directory does not hold what ``cfg`` needs: a run to resume, or none."""
    _validate_run_dir(cfg, RunDir(Path(run_dir)))


def _validate_trainer(cfg: Any) -> None:
    t, device = cfg.trainer, _device(cfg.world)
    _as_config_key("world.on_rank_loss", rank_loss_of, cfg.world)  # refused first, in its own words
    _as_config_key("trainer.accum_steps", check_accum_setting, t.accum_steps)
    for key in ("max_steps", "log_every", "keep_checkpoints"):
        _require(t[key] >= 1, f"trainer.{key}", t[key], "an integer >= 1")
    for key in ("eval_every", "checkpoint_every", "stop_at"):
        _require(t[key] >= 0, f"trainer.{key}", t[key], "an integer >= 0")
    # The run always evaluates at its end: zero batches would average over nothing.
    _require(t.eval_batches >= 1, "trainer.eval_batches", t.eval_batches, "an integer >= 1")
    for key in ("bucket_cap_mb", "first_bucket_cap_mb"):
        _as_config_key(f"trainer.{key}", lambda value, key=key: check_cap(key, value), t[key])
    _as_config_key("trainer.schedule", lambda value: resolve_schedule(value, world_size=1), t.schedule)
    _as_config_key("trainer.nonfinite", check_nonfinite, t.nonfinite)
    _as_config_key("trainer.sync_buffers", check_sync_buffers, t.sync_buffers)
    _as_config_key("trainer.precision", lambda value: check_precision(value, device), t.precision)
    _as_config_key("trainer.matmul_precision", check_matmul_precision, t.matmul_precision)
    _as_config_key("trainer.compile", lambda value: check_compile(value, device), t.compile)
    _as_config_key("trainer.zero_stage", check_stage_setting, t.zero_stage)
    format_of(t, _known_world_size(cfg.world))  # trainer.checkpoint_format and checkpoint_async
    _as_config_key("trainer.sample_streams", check_sample_streams, t.sample_streams)
    _as_config_key("trainer.activation_checkpointing", remat.check_mode, t.activation_checkpointing)
    _as_config_key(
        "trainer.activation_checkpointing_k",
        lambda k: remat.check_k(k, remat.resolved_mode(t.activation_checkpointing, t.activation_checkpointing_policy)),
        t.activation_checkpointing_k,
    )
    hook = _as_config_key("hooks", build_hook, _container(cfg.hooks))
    _as_config_key("trainer.reduce_dtype", lambda value: check_reduce_dtype(value, t.precision, hook), t.reduce_dtype)
    optimizer = _as_config_key("optim", lambda spec: build_optimizer(spec, t.max_steps), _container(cfg.optim))
    _stages_allowed(cfg, hook, optimizer)
    _as_config_key("trainer.loggers", lambda names: check_loggers(names, t.tensorboard), list(t.loggers))
    check_callbacks(_container(t.callbacks))
    check_loop_settings(t)
    _as_config_key("outer", check_outer, _container(cfg.outer))


def allowed_stages(cfg: Any) -> list[int]:
    """The ZeRO stages the run's other settings allow, lowest first: the one ``trainer.zero_stage`` names, or those
    ``auto`` may take (``fdp.run.memory.auto_stage``); the lowest stage's refusal where none is allowed.

    >>> from fdp.run.config.compose import compose
    >>> allowed_stages(compose("trainer.zero_stage=auto", "outer=diloco"))  # a flat world is one replica
    [0]
    """
    t = cfg.trainer
    hook = _as_config_key("hooks", build_hook, _container(cfg.hooks))
    optimizer = _as_config_key("optim", lambda spec: build_optimizer(spec, t.max_steps), _container(cfg.optim))
    return _stages_allowed(cfg, hook, optimizer)


def _stages_allowed(cfg: Any, hook: Any, optimizer: Any) -> list[int]:
    stages = list(ZERO_STAGES) if cfg.trainer.zero_stage == AUTO else [cfg.trainer.zero_stage]
    refusals = [_stage_refusal(cfg, stage, hook, optimizer) for stage in stages]
    allowed = [stage for stage, refusal in zip(stages, refusals) if refusal is None]
    if not allowed:
        raise refusals[0]
    return allowed


def _stage_refusal(cfg: Any, stage: int, hook: Any, optimizer: Any) -> ConfigError | None:
    """Why the other settings refuse ZeRO stage ``stage`` (each rule its owner's), naming the setting; or ``None``."""
    t = cfg.trainer
    try:
        checkpointing = remat.resolved_mode(t.activation_checkpointing, t.activation_checkpointing_policy) != "none"
        not_compiled = compile_refusal(stage, checkpointing)
        if rank_loss_of(cfg.world).sample_streams(t.sample_streams) and not_compiled:
            _require(
                t.compile is not True,
                "trainer.compile",
                t.compile,
                "auto or false with per-sample streams (trainer.sample_streams, on with world.on_rank_loss=shrink): "
                + not_compiled,
            )
        reason = refuses_outer(stage, cfg.world.hierarchical) if cfg.outer.name != "none" else None
        if reason:  # an outer loop syncs replicas: a hybrid world's groups
            _require(
                False,
                "trainer.zero_stage",
                stage,
                f"0 with outer={cfg.outer.name}, or world.hierarchical=true ({reason})",
            )
        if cfg.world.hierarchical and stage:  # hybrid sharding: the chain reduces each rank's slice across nodes
            _as_config_key("hooks", lambda _: check_hook_across_nodes(hook), _container(cfg.hooks))
        _as_config_key("trainer.zero_stage", lambda s: check_optimizer_for_stage(s, optimizer), stage)
        check_stage_kept(cfg.world, stage)
    except ConfigError as error:
        return error
    return None


def _known_world_size(w: Any) -> int | None:
    """The world's size where it is known before the ranks start; ``None`` under a launcher that starts them."""
    try:
        kind = launcher_of(w.launcher)
    except ConfigError:  # refused in its own words by _validate_world
        return None
    return None if kind.starts_ranks else w.nnodes * w.nproc_per_node


def _validate_world(cfg: Any) -> None:
    w, t, d = cfg.world, cfg.trainer, cfg.data
    kind = _as_config_key("world.launcher", launcher_of, w.launcher)
    _require(w.backend in BACKENDS, "world.backend", w.backend, f"one of {BACKENDS}")
    _require(w.nproc_per_node >= 1, "world.nproc_per_node", w.nproc_per_node, "an integer >= 1")
    _require(w.nnodes >= 1, "world.nnodes", w.nnodes, "an integer >= 1")
    _require(w.timeout_s > 0, "world.timeout_s", w.timeout_s, "seconds > 0")
    _require(w.max_restarts >= 0, "world.max_restarts", w.max_restarts, "an integer >= 0")
    _require(w.memory_per_rank_mb >= 0, "world.memory_per_rank_mb", w.memory_per_rank_mb, "MiB >= 0 (0: no limit)")
    _as_config_key("world.requeue_signal", check_requeue_signal, w.requeue_signal)
    check_rank_loss(cfg, kind)
    _require(d.global_batch_size >= 1, "data.global_batch_size", d.global_batch_size, "an integer >= 1")
    if kind.starts_ranks:  # there the world size is known only to the launched processes
        return
    world = w.nnodes * w.nproc_per_node
    check_one_process(w, world)
    per_rank = _as_config_key(
        "data.global_batch_size", lambda size: check_global_batch(size, world), d.global_batch_size
    )
    if t.accum_steps != AUTO:  # auto takes a divisor of each world's share
        _as_config_key("trainer.accum_steps", lambda accum: check_micro_batches(per_rank, accum), t.accum_steps)
    if w.hierarchical:  # under torchrun the world is known only at run time: the worker checks it
        _as_config_key("world.node_size", lambda size: check_node_size(world, size), w.node_size or w.nproc_per_node)
    check_rank_loss_in_world(cfg, world)


def _validate_data_and_model(cfg: Any) -> None:
    d, m = cfg.data, cfg.model
    if "test_fraction" in d:
        _require(0.0 < d.test_fraction < 1.0, "data.test_fraction", d.test_fraction, "a fraction in (0, 1)")
    if "val_fraction" in d:
        _as_config_key("data.val_fraction", check_val_fraction, d.val_fraction)
    if "num_workers" in d:
        _require(d.num_workers >= 0, "data.num_workers", d.num_workers, "an integer >= 0")
    if d.name == "stdlib_text":
        _require(d.block_size >= 1, "data.block_size", d.block_size, "an integer >= 1")
        _require(d.max_chars >= 1, "data.max_chars", d.max_chars, "an integer >= 1")
    text_model, text_data = m.name == "charlm", d.name == "stdlib_text"
    if "custom" not in (m.name, d.name):  # a custom side is checked on the first batch instead
        _require(
            text_model == text_data,
            "data",
            d.name,
            "stdlib_text for model=charlm" if text_model else f"digits for model={m.name}",
        )
    sizes = {"mlp": ("hidden",), "convnet": ("width",), "charlm": ("d_model", "n_layer", "n_head")}.get(m.name, ())
    for key in sizes:
        _require(m[key] >= 1, f"model.{key}", m[key], "an integer >= 1")
    if m.name == "mlp":
        _require(m.depth >= 0, "model.depth", m.depth, "an integer >= 0")
    if text_model:
        _require(m.d_model % m.n_head == 0, "model.n_head", m.n_head, f"a divisor of model.d_model={m.d_model}")
        _require(0.0 <= m.dropout < 1.0, "model.dropout", m.dropout, "a probability in [0, 1)")


def _validate_run_dir(cfg: Any, run_dir: RunDir) -> None:
    source = run_dir.resume_from(cfg.trainer.resume)
    if cfg.trainer.resume is True:
        _require(
            source.exists(),
            "trainer.resume",
            True,
            f"a checkpoint at {source} (set hydra.run.dir to the run to continue)",
        )
    elif source is not None:
        _require(
            source.exists(),
            "trainer.resume",
            cfg.trainer.resume,
            "true, false or the path of a checkpoint (a step_<N>.pt file, or a run directory for its last checkpoint); "
            f"{source} does not exist",
        )
    if source is not None:
        verify(source)  # every file whole and present, before the run writes anything or a worker starts
        _as_config_key(
            "trainer.max_steps",
            lambda _: check_resumed_schedule(saved_config(source), _container(cfg)),
            cfg.trainer.max_steps,
        )
    else:
        _require(
            not run_dir.has_run(),
            "hydra.run.dir",
            str(run_dir.path),
            "a directory without a previous run (or set trainer.resume=true to continue it)",
        )


_KINDS = {
    "model": ("model", "models", "my_pkg.models.Net"),
    "data": ("dataset", "datasets", "my_pkg.data.make"),
    "loss": ("loss", "losses", "my_pkg.losses.loss"),
}


def _check_target(group: str, node: Any) -> None:
    """``<group>.name`` is a registered option and ``<group>._target_`` imports."""
    one, many, example = _KINDS[group]
    known = SCHEMAS[group]
    if node.get("name") not in known:
        raise ConfigError(f"{group}.name={node.get('name')!r}: unknown {one}; known {many}: {', '.join(sorted(known))}")
    if OmegaConf.is_config(node) and OmegaConf.is_missing(node, "_target_"):
        raise ConfigError(
            f"{group}._target_: missing; {group}={node.name} needs the dotted path to a class or function "
            f"(e.g. {group}._target_={example})"
        )
    locate(f"{group}._target_", node.get("_target_"))
