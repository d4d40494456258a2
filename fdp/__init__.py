"""fdp: pure-functional data-parallel training on PyTorch.

The pieces, one module each:

* ``functional``: any ``nn.Module`` as ``apply(params, buffers, *inputs)``.
* ``optim``: optax-style optimizers, ``(init, update)`` pairs composed with ``chain``, and their registry.
* ``plan`` / ``buckets``: the static gradient-bucket plan (values, packing, tracing), its flat buffers, params laid out by it.
* ``hooks``: gradient-reduction stages (allreduce, fp16, PowerSGD, top-k) composed with ``hooks.chain``.
* ``comm`` / ``reduce``: collectives as values, and the reduction that hands buckets back as they finish.
* ``_torch``: the one place fdp touches private torch APIs, each with a public fallback.
* ``precision``: autocast, bf16 weights and the dynamic loss scale (``LossScale``) of mixed precision.
* ``compiled``: the gradient computation under ``torch.compile``; ``trainer.compile=auto``'s choice and cache.
* ``train``: ``TrainState`` and the pure ``train_step(state, batch) -> (state, metrics)``.
* ``devices``: which device each rank computes on (``world.accelerator``, ``world.devices``).
* ``targets`` / ``losses``: models, data and losses named in config by ``_target_``.
* ``launch`` / ``replicas``: worlds of processes; one consistent state on every rank (``setup_state``, ``sync_buffers``).
* ``checks``: what a Python caller hands the train step, checked with errors naming the argument.
* ``trainer`` / ``checkpoint``: the run loop; atomic checkpoints of every rank (``save_checkpoint``, ``load_checkpoint``).
* ``outer``: local SGD and DiLoCo, an outer loop that syncs every few steps across slow links.
* ``zero``: ZeRO stages 1 and 2, optimizer state (and gradients) sharded over the ranks by bucket slices.
"""
from fdp import hooks, zero
from fdp.buckets import allocate, lay_out, pack, unpack
from fdp.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fdp.comm import Comm, Pending
from fdp.devices import Placement, batch_to_device, place, resolve_backend, to_device
from fdp.functional import FunctionalModel, functionalize
from fdp.hooks import GradBucket, Hook
from fdp.data import MapData, StepSampler
from fdp.launch import WorldLayout, broadcast_from_rank0, check_same_plan, init_distributed, spawn
from fdp.losses import build_loss, make_loss_fn
from fdp.optim import (
    GradientTransformation,
    adam,
    adamw,
    apply_gradients,
    apply_updates,
    build_optimizer,
    chain,
    clip_by_global_norm,
    constant_schedule,
    sgd,
    supports_inplace,
    warmup_cosine_schedule,
)
from fdp.outer import OuterSpec, OuterState, check_outer, init_outer_state, make_outer_step
from fdp.plan import Bucket, BucketPlan, ParamSlot, gradient_ready_order, plan_buckets
from fdp.precision import LossScale, Precision
from fdp.reduce import GradReducer, Reduction, init_hook_states, resolve_schedule
from fdp.replicas import BUFFER_SYNC, setup_state, sync_buffers
from fdp.train import TrainState, cross_entropy_loss, init_train_state, make_train_step, planner_loss

__all__ = [
    "BUFFER_SYNC", "CheckpointError", "broadcast_from_rank0", "check_same_plan", "load_checkpoint", "save_checkpoint",
    "setup_state", "sync_buffers",
    "Bucket", "BucketPlan", "Comm", "FunctionalModel", "GradBucket", "GradReducer", "GradientTransformation",
    "Hook", "LossScale", "MapData", "OuterSpec", "OuterState", "ParamSlot", "Pending", "Placement", "Precision",
    "Reduction", "StepSampler", "TrainState", "WorldLayout", "adam", "adamw", "allocate", "apply_gradients",
    "apply_updates", "batch_to_device", "build_loss", "build_optimizer", "chain", "check_outer", "clip_by_global_norm",
    "constant_schedule", "cross_entropy_loss", "functionalize", "gradient_ready_order", "hooks", "init_distributed",
    "init_hook_states", "init_outer_state", "init_train_state", "lay_out", "make_loss_fn", "make_outer_step", "make_train_step",
    "pack", "place", "plan_buckets", "planner_loss", "resolve_backend", "resolve_schedule", "sgd", "spawn",
    "supports_inplace", "to_device", "unpack", "warmup_cosine_schedule",
    "zero",
]
