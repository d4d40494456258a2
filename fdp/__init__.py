"""fdp: pure-functional data-parallel training on PyTorch.

The pieces, one module each:

* ``functional``: any ``nn.Module`` as ``apply(params, buffers, *inputs)``.
* ``optim``: optax-style optimizers, ``(init, update)`` pairs composed with ``chain``.
* ``plan`` / ``buckets``: the static gradient-bucket plan and its flat buffers.
* ``hooks``: gradient-reduction stages (allreduce, fp16, PowerSGD, top-k) composed with ``hooks.chain``.
* ``comm`` / ``reduce``: collectives as values, and the runtime that keeps buckets in flight.
* ``train``: ``TrainState`` and the pure ``train_step(state, batch) -> (state, metrics)``.
* ``targets`` / ``losses``: models, data and losses named in config by ``_target_``.
* ``launch`` / ``trainer`` / ``checkpoint``: worlds of processes, the run loop, atomic checkpoints.
"""
from fdp import hooks
from fdp.buckets import allocate, pack, unpack
from fdp.comm import Comm, Pending
from fdp.functional import FunctionalModel, functionalize
from fdp.hooks import GradBucket, Hook
from fdp.data import MapData, StepSampler
from fdp.launch import WorldLayout, init_distributed, spawn
from fdp.losses import build_loss, make_loss_fn
from fdp.optim import (
    GradientTransformation,
    adam,
    adamw,
    apply_gradients,
    apply_updates,
    chain,
    clip_by_global_norm,
    constant_schedule,
    sgd,
    supports_inplace,
    warmup_cosine_schedule,
)
from fdp.plan import Bucket, BucketPlan, ParamSlot, gradient_ready_order, plan_buckets
from fdp.reduce import GradReducer, Reduction, init_hook_states
from fdp.train import TrainState, cross_entropy_loss, init_train_state, make_train_step, planner_loss

__all__ = [
    "Bucket", "BucketPlan", "Comm", "FunctionalModel", "GradBucket", "GradReducer", "GradientTransformation",
    "Hook", "MapData", "ParamSlot", "Pending", "Reduction", "StepSampler", "TrainState", "WorldLayout", "adam", "adamw", "allocate",
    "apply_gradients", "apply_updates", "build_loss", "chain", "clip_by_global_norm", "constant_schedule", "cross_entropy_loss", "functionalize",
    "gradient_ready_order", "hooks", "init_distributed", "init_hook_states", "init_train_state", "make_loss_fn", "make_train_step",
    "pack", "plan_buckets", "planner_loss", "sgd", "spawn", "supports_inplace", "unpack", "warmup_cosine_schedule",
]
