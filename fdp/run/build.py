"""From a config to the pieces of a run on this rank: data, model, loss, plan, hooks, optimizer, first state.

``build_run(cfg, comm, device)`` is what each worker calls before step 1 (``fdp.run.startup.start_rank``;
``fdp.run.trainer`` then loops). Every piece is built from its config group: ``_target_`` nodes through
``fdp.targets``, hooks and optimizers through their registries.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf

from fdp.comm import Comm
from fdp.data import (
    SPLITS,
    Dataset,
    MapData,
    as_map_data,
    has_split,
    hold_out,
    model_arguments,
    num_train_samples,
    targets_shifted,
    train_batches,
)
from fdp.data.batches import batch_size, head, model_inputs
from fdp.errors import ConfigError
from fdp.hooks import Hook
from fdp.hooks.hierarchical import check_node_size, hierarchical, node_comms
from fdp.hooks.lowbit import check_block
from fdp.hooks.registry import build_hook
from fdp.model import remat
from fdp.model.builtin import count_parameters
from fdp.model.deferred import NotDeferrable, meta_wins, record_build
from fdp.model.fit import Names, check_first_batch, untransformable
from fdp.model.functional import FunctionalModel, functionalize
from fdp.model.losses import Criterion, build_loss, cross_entropy, make_loss_fn, planner_loss, scores_accuracy
from fdp.model.precision import Precision, check_precision
from fdp.optim import GradientTransformation, build_optimizer, embedding_names
from fdp.optim.decay import check_decay_filter
from fdp.plan import BucketPlan, plan_buckets
from fdp.plan.fragments import split_fragments
from fdp.procs.allocator import tune_allocator
from fdp.procs.devices import batch_to_device, to_device
from fdp.run.config import DATA_SETTINGS
from fdp.run.evaluate import metric_names
from fdp.run.loop_controls import run_steps
from fdp.run.memory.micro_batch import AUTO
from fdp.run.rank_loss import rank_loss_of
from fdp.state.train_state import TrainState
from fdp.step.outer import init_outer_state
from fdp.step.outer_spec import check_outer
from fdp.targets import build, classes_setting, label
from fdp.update import zero
from fdp.update.base import Update

log = logging.getLogger("fdp")


# -- building the pieces from config ------------------------------------------------------
def build_data(cfg: DictConfig, seed: int = 0) -> Dataset | MapData:
    """The data ``data._target_`` returns: an in-memory ``Dataset`` (built-ins) or ``(train, test)`` torch Datasets,
    with its validation split (``data.val_fraction`` of the training split held out by ``seed``, or its own)."""
    node = OmegaConf.to_container(cfg, resolve=True)
    # e.g. max_chars too small for two splits of block_size + 1: "data=stdlib_text: max_chars=..."
    returned = build("data", node, skip=DATA_SETTINGS)
    if not isinstance(returned, Dataset):
        try:
            returned = as_map_data(str(cfg.get("_target_")), returned)
        except ValueError as error:
            raise ConfigError(f"{label('data', node)}: {error}") from None
    try:
        return hold_out(returned, cfg.get("val_fraction"), seed, cfg.global_batch_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_data(cfg: DictConfig, data: Dataset | MapData) -> None:
    """The settings ``validate`` cannot check without the data: every rank refuses them alike."""
    gbs = cfg.data.global_batch_size
    n = num_train_samples(data)
    if not (isinstance(data, Dataset) and data.is_text) and gbs > n:
        raise ConfigError(
            f"data.global_batch_size={gbs}: expected at most the {n} training samples of {display_name(cfg.data)}"
        )


def check_plan_settings(cfg: DictConfig, plan: BucketPlan, names: list[str]) -> None:
    """The settings ``validate`` cannot check without the bucket plan and the params' ``names``: every rank
    refuses them alike, before the first state is made (the run directory is then rolled back).

    >>> from fdp.plan import pack_into_buckets
    >>> from fdp.run.config.compose import compose
    >>> plan = pack_into_buckets([("w", (3,), "float32", "cpu")])
    >>> check_plan_settings(compose("hooks=lowbit", "hooks.block=8"), plan, ["w"])
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: hooks.block=8: expected at most 3, the entries of the plan's largest bucket (a larger \
block pads every bucket with zeros that are sent too; a smaller trainer.bucket_cap_mb makes smaller buckets)
    """
    if cfg.outer.name != "none":
        try:
            split_fragments(plan, cfg.outer.fragments)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    largest = max(bucket.numel for bucket in plan.buckets)
    spec = OmegaConf.to_container(cfg.hooks, resolve=True)
    hooks = [(f"hooks.chain[{i}]", h) for i, h in enumerate(spec.get("chain") or [])] or [("hooks", spec)]
    for path, hook in hooks:
        if isinstance(hook, dict) and hook.get("name") == "lowbit":
            try:
                check_block(hook.get("block", 64), largest)
            except ValueError as error:
                raise ConfigError(f"{path}.{error}") from None
    try:
        check_decay_filter(cfg.optim.get("decay_filter", "all"), names)
    except ValueError as error:
        raise ConfigError(f"optim.{error}") from None


def build_module(cfg: DictConfig, data: Dataset | MapData) -> torch.nn.Module:
    """The model ``model._target_`` names, given what the data decides where its signature asks for it."""
    module = build("model", OmegaConf.to_container(cfg, resolve=True), offered=model_arguments(data))
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"{label('model', cfg)}: returned a {type(module).__name__}; expected a torch.nn.Module")
    if next(module.parameters(), None) is None:  # nothing to train: refused here, not deep in the planner
        raise ConfigError(
            f"{label('model', cfg)}: built a module without parameters ({type(module).__name__}); "
            "expected a model with parameters to train"
        )
    return module


def display_name(node: DictConfig) -> str:
    """A built-in's name, or the dotted path of a custom target (for logs and summaries)."""
    return str(node.get("_target_")) if node.name == "custom" else node.name


def check_fit(
    cfg: DictConfig, model: FunctionalModel, criterion: Criterion, params, buffers, batch, data: Dataset | MapData
) -> tuple[str, ...]:
    """Run the model and the loss on the first batch: a model/data/loss that do not fit is refused before step 1.
    Returns the metrics the run's evaluations during training will report (``fdp.run.evaluate.metric_names``)."""
    node = OmegaConf.to_container(cfg.model, resolve=True)
    names = Names(label("model", cfg.model), label("data", cfg.data), label("loss", cfg.loss), classes_setting(node))
    outputs = check_first_batch(
        model, criterion, params, buffers, batch, names, model_arguments(data)["num_classes"], targets_shifted(data)
    )
    watched = next((split for split in SPLITS if has_split(data, split)), "test")  # what evaluations score
    return metric_names(scores_accuracy(criterion, outputs, model_inputs(batch)[2]), watched)


class RunParts(NamedTuple):
    """Everything a worker builds before step 1."""

    model: FunctionalModel
    data: Dataset | MapData
    plan: BucketPlan
    hook: Hook
    optimizer: GradientTransformation
    state: TrainState
    num_params: int
    criterion: Criterion = cross_entropy
    precision: Precision = Precision()
    update: Update | None = None  # the ZeRO stage's update (fdp.update.zero.update_for): the state's whole life
    metrics: tuple[str, ...] = ("test_loss",)  # what an evaluation reports (fdp.run.evaluate.metric_names)


def build_run(
    cfg: DictConfig,
    comm: Comm,
    device: torch.device = torch.device("cpu"),
    data: Dataset | MapData | None = None,
    alone: bool = False,
) -> RunParts:
    """Build model, data, plan, hooks, optimizer and the first train state on this rank, on ``device``.

    The weights are made on the CPU from the seed (the same on any device) and moved;
    the plan then records the device from the params, and hook and optimizer state are
    made where the buckets and params are. ``data``: the run's data set, when already loaded. ``alone``: a rank
    that joins a running world builds alone, without ``world.hierarchical``'s groups (``regrouped`` makes them
    once it is in the world).
    A stage that shards the params builds the model on ``meta`` and makes each rank's slices
    alone (``_built_on_meta``), with the values of a whole build.
    """
    stage = stage_of(cfg)
    data = build_data(cfg.data, cfg.seed) if data is None else data
    check_data(cfg, data)
    precision = check_precision(cfg.trainer.precision, device.type, cfg.trainer.reduce_dtype)
    criterion = build_loss(OmegaConf.to_container(cfg.loss, resolve=True))
    pieces = _built_on_meta(cfg, data, device, precision, criterion, comm) if stage.shards_params else None
    if pieces is None:
        pieces = _built_whole(cfg, data, device, precision, criterion, comm)
    model, params, buffers, plan, embeddings, num_params, make, metrics = pieces
    check_plan_settings(cfg, plan, list(params))
    tc = cfg.trainer  # a policy naming no class of the model: refused here, before the run announces itself
    remat.from_config(
        tc.activation_checkpointing, tc.activation_checkpointing_policy, tc.activation_checkpointing_k, model.module
    )
    hook = build_hook(OmegaConf.to_container(cfg.hooks))
    # world.hierarchical: a sharded state splits over each node and is replicated across them (hybrid sharding);
    # a replicated one reduces inside each node first and runs the hook chain across them.
    groups = None
    if cfg.world.hierarchical and not alone:
        node_size = _node_size(cfg, comm)
        if stage.shards_optimizer:
            groups = zero.shard_groups(node_size, comm.watch)
        else:  # trainer.reduce_dtype applies on the leg across nodes (each node's float32 sum sent in it), as at
            # ZeRO stages (fdp.update.zero.hybrid): the step then reduces in no other dtype of its own
            hook = hierarchical(
                precision.reducing(hook), node_comms(node_size, watch=comm.watch), comm.world_size // node_size
            )
            precision = precision._replace(reduce_dtype="float32")
    # The schedule spans the run: max_steps, or fewer where trainer.max_epochs ends it sooner.
    steps = run_steps(cfg.trainer.max_steps, cfg.trainer.max_epochs, data, cfg.data.global_batch_size)
    optimizer = build_optimizer(OmegaConf.to_container(cfg.optim), steps, embeddings=embeddings)
    # A world that may shrink keeps, where the state is sharded, the next rank's slices too (fdp.run.rank_loss).
    mirror = rank_loss_of(cfg.world).mirrors(stage.shards_optimizer, cfg.world.hierarchical)
    update = zero.update_for(
        stage.number,
        optimizer,
        plan,
        comm,
        model=model,
        reshard_after_forward=cfg.trainer.reshard_after_forward,
        mirror=mirror,
        gather_dtype=precision.gather_dtype,
        groups=groups,
    )
    if make is not None:  # params made slice by slice: no rank holds them whole
        state = update.first_state_made(make, buffers, hook, comm, seed=cfg.seed, precision=precision)
    else:
        state = update.first_state(params, buffers, hook, comm, seed=cfg.seed, precision=precision)
    outer = check_outer(OmegaConf.to_container(cfg.outer))
    if outer.name != "none":  # the anchor of what each rank syncs: its params, or its group's slices of them
        replica = update.replica()
        state = state._replace(outer=init_outer_state(outer, replica.pieces(state.params), replica.plan, hook))
    return RunParts(model, data, plan, hook, optimizer, state, num_params, criterion, precision, update, metrics)


def planned_run(cfg: DictConfig, comm: Comm, device: torch.device, data: Dataset | MapData) -> RunParts:
    """What a memory forecast of the run reads (``fdp.run.memory.run_forecast``), without its train state: the model
    built on ``meta`` where it can be (else whole), its plan, hook and optimizer; ``state`` holds the params as built
    and the buffers, no optimizer or hook state (``trainer.zero_stage=auto`` decides the stage from it before the
    run is built at that stage: ``fdp.run.memory.auto_stage``)."""
    precision = check_precision(cfg.trainer.precision, device.type, cfg.trainer.reduce_dtype)
    criterion = build_loss(OmegaConf.to_container(cfg.loss, resolve=True))
    pieces = _built_on_meta(cfg, data, device, precision, criterion, comm, quiet=True)
    if pieces is None:
        pieces = _built_whole(cfg, data, device, precision, criterion, comm)
    steps = run_steps(cfg.trainer.max_steps, cfg.trainer.max_epochs, data, cfg.data.global_batch_size)
    optimizer = build_optimizer(OmegaConf.to_container(cfg.optim), steps, embeddings=pieces.embeddings)
    state = TrainState(0, pieces.params, pieces.buffers, (), (), torch.empty(0))
    hook = build_hook(OmegaConf.to_container(cfg.hooks))
    return RunParts(pieces.model, data, pieces.plan, hook, optimizer, state, pieces.num_params, criterion, precision)


class _ModelPieces(NamedTuple):
    """The model and its plan; ``make(name)`` makes a param that ``params`` hold on ``meta`` only (else ``None``)."""

    model: FunctionalModel
    params: dict
    buffers: dict
    plan: BucketPlan
    embeddings: Any
    num_params: int
    make: Callable[[str], torch.Tensor] | None = None
    metrics: tuple[str, ...] = ("test_loss",)  # what the run's evaluations report (check_fit)


def _built_whole(
    cfg: DictConfig, data, device: torch.device, precision: Precision, criterion: Criterion, comm: Comm
) -> _ModelPieces:
    """The whole model on every rank, its params on ``device``, checked on the first batch and planned."""
    torch.manual_seed(cfg.seed)
    module = build_module(cfg.model, data)
    num_params = count_parameters(module)
    embeddings = embedding_names(module)  # for optim.decay_filter=weights; the module gives up its weights next
    model, params, buffers = functionalize(module, keep_module_weights=False)  # the state holds the weights
    params, buffers = to_device(params, device), to_device(buffers, device)
    params, buffers = precision.cast(params), precision.cast(buffers)  # bf16-true: the plan's buckets follow
    plan, metrics = _checked_plan(cfg, data, model, params, buffers, precision, criterion, comm, device)
    return _ModelPieces(model, params, buffers, plan, embeddings, num_params, metrics=metrics)


def _built_on_meta(
    cfg: DictConfig, data, device: torch.device, precision: Precision, criterion: Criterion, comm: Comm, quiet=False
) -> _ModelPieces | None:
    """The model built on ``meta`` and each param made only when this rank's slices need it
    (``fdp.model.deferred``), or ``None``, with one line saying why, where the model cannot be:
    a constructor that reads values or makes its params from data, a forward the meta device cannot run."""
    torch.manual_seed(cfg.seed)
    try:
        deferred = record_build(lambda: build_module(cfg.model, data))
    except NotDeferrable as error:
        return None if quiet else _whole_instead(cfg, comm, str(error))
    module = deferred.module
    num_params = count_parameters(module)
    embeddings = embedding_names(module)
    make_param = deferred.materializer(dict(module.named_parameters()))  # before functionalize releases them
    model, params, buffers = functionalize(module, keep_module_weights=False)
    try:
        params, buffers = precision.cast(params), precision.cast(buffers)
        plan, metrics = _checked_plan(cfg, data, model, params, buffers, precision, criterion, comm, device)
    except Exception as error:  # the whole build gives the real verdict: a misfit is refused there, in its words
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return None if quiet else _whole_instead(cfg, comm, f"its forward cannot run on the meta device ({reason})")
    deferred.materialize_rest()  # buffers, frozen params and tensor attributes: whole on every rank (small)
    buffers = to_device(precision.cast({n: b.detach().clone() for n, b in module.named_buffers()}), device)
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    model = FunctionalModel(module, frozen)

    def make(name: str) -> torch.Tensor:
        return precision.cast({name: make_param(name)})[name].to(device)

    return _ModelPieces(model, params, buffers, plan, embeddings, num_params, make, metrics)


def _whole_instead(cfg: DictConfig, comm: Comm, reason: str) -> None:
    """The one line saying why a stage that shards the params builds the whole model on every rank."""
    if comm.rank == 0:
        log.warning("%s: built whole on every rank, not on the meta device: %s", label("model", cfg.model), reason)


def _checked_plan(
    cfg: DictConfig, data, model: FunctionalModel, params, buffers, precision: Precision, criterion, comm, device
) -> tuple[BucketPlan, tuple[str, ...]]:
    """The model run on the first batch (``check_fit``: the metrics its evaluations report) and its bucket plan,
    traced on ``meta`` where the params are."""
    loss_fn = make_loss_fn(model, criterion)
    example = next(train_batches(data, cfg.data.global_batch_size, cfg.seed, comm.rank, comm.world_size, 0, 1))
    # One micro-batch; under trainer.accum_steps=auto two samples (it is decided once the run is built).
    micro = 2 if cfg.trainer.accum_steps == AUTO else max(1, batch_size(example) // cfg.trainer.accum_steps)
    example = batch_to_device(precision.cast(head(example, micro)), device)
    # Params that stand in on meta (a build that makes them later): the model runs on them and the real batch, what
    # mixes the two on meta (fdp.model.deferred.meta_wins), so the batch's own values stay real where it reads them.
    on_meta = any(p.is_meta for p in params.values())
    with meta_wins(device) if on_meta else contextlib.nullcontext():
        metrics = check_fit(cfg, model, criterion, params, buffers, example, data)
        try:  # the first gradient of the run: what torch.func cannot run in the model fails here
            plan = plan_buckets(
                planner_loss(loss_fn, buffers),
                params,
                head(example, 2),  # the order is any batch's; two samples keep BatchNorm's training mode
                bucket_cap_mb=cfg.trainer.bucket_cap_mb,
                first_bucket_cap_mb=cfg.trainer.first_bucket_cap_mb,
                allow_unused=cfg.trainer.allow_unused,
                trace="real" if on_meta else "auto",  # the meta device's trace would put the batch on meta too
                device=device if on_meta else None,
            )
        except RuntimeError as error:
            refusal = untransformable(error, label("model", cfg.model))
            if refusal is None:
                raise
            raise refusal from None
    return plan, metrics


def stage_of(cfg: DictConfig) -> zero.Stage:
    """What the run's ZeRO stage shards (``fdp.update.base.Stage``): the one place a run reads its stage."""
    return zero.stage_rules(cfg.trainer.zero_stage)


def tune_allocator_for(cfg: DictConfig) -> None:
    """This process's heap tuned for the run's stage (``fdp.procs.allocator``): first thing in a worker, before anything
    is allocated (a stage that gathers its params keeps large blocks out of the heap). ``trainer.zero_stage=auto`` is
    decided later: stage 0's without a budget (what it takes then), else stage 3's, which maps large blocks as the
    budget's accounting asks (``fdp.procs.allocator.budget_accounting``; stage 0's serves every block from the heap,
    where a build that the run is decided on leaves its freed blocks to be split, and the budget fills sooner)."""
    auto = cfg.trainer.zero_stage == AUTO
    sharded = bool(cfg.world.memory_per_rank_mb) if auto else stage_of(cfg).shards_params
    tune_allocator(sharded_params=sharded, bucket_bytes=int(cfg.trainer.bucket_cap_mb * 2**20))


def node_size_of(cfg: DictConfig) -> int:
    """The ranks of a node under ``world.hierarchical``: ``world.node_size``, or one launch's; 1 without it (a
    world that shrinks loses whole nodes: ``fdp.procs.shrink.whole_groups``)."""
    if not cfg.world.hierarchical:
        return 1
    return cfg.world.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world.nproc_per_node))


def regrouped(cfg: DictConfig, parts: RunParts, comm: Comm) -> RunParts:
    """``parts`` for the world of ``comm`` after it lost or gained whole nodes (``world.hierarchical``; a
    collective): the hook across its nodes (stage 0), or the update over its groups (hybrid sharding). One node
    left is a world of one group. Without ``world.hierarchical``, ``parts`` as they are."""
    if not cfg.world.hierarchical:
        return parts
    node_size = node_size_of(cfg)
    hook = build_hook(OmegaConf.to_container(cfg.hooks))
    if not parts.update.rules.shards_optimizer:
        nodes = check_node_size(comm.world_size, node_size, least=1)
        return parts._replace(hook=hierarchical(hook, node_comms(node_size, 1, comm.watch), nodes))
    update = zero.update_for(
        parts.update.stage,
        parts.optimizer,
        parts.plan,
        comm,
        model=parts.model,
        reshard_after_forward=cfg.trainer.reshard_after_forward,
        gather_dtype=parts.precision.gather_dtype,
        groups=zero.shard_groups(node_size, comm.watch, least=1),
    )
    return parts._replace(update=update)


def _node_size(cfg: DictConfig, comm: Comm) -> int:
    """The processes of a node (``world.hierarchical``): ``world.node_size``, or one launch's; refused unless it
    splits the world into two or more nodes."""
    node_size = node_size_of(cfg)
    try:
        check_node_size(comm.world_size, node_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return node_size
