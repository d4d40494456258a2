"""fdp: pure-functional data-parallel training on PyTorch.

The pieces, one module each:

* ``functional``: any ``nn.Module`` as ``apply(params, buffers, *inputs)``.
* ``optim``: optax-style optimizers, ``(init, update)`` pairs composed with ``chain``, and their registry.
* ``plan`` / ``buckets``: the static gradient-bucket plan (values, packing, tracing) and its flat buffers.
* ``hooks``: gradient-reduction stages (allreduce, fp16, PowerSGD, top-k) composed with ``hooks.chain``.
* ``comm`` / ``reduce``: collectives as values, and the reduction that hands buckets back as they finish.
* ``_torch``: the one place fdp touches private torch APIs, each with a public fallback.
* ``train``: ``TrainState`` and the pure ``train_step(state, batch) -> (state, metrics)``.
* ``zero``: ZeRO stages 1 and 2, optimizer state (and gradients) sharded over the ranks by bucket slices.
* ``launch`` / ``trainer`` / ``checkpoint``: worlds of processes, the run loop, atomic checkpoints.
"""
from fdp import hooks, zero
from fdp.buckets import allocate, pack, unpack
from fdp.comm import Comm, Pending
from fdp.functional import FunctionalModel, functionalize
from fdp.hooks import GradBucket, Hook
from fdp.launch import WorldLayout, init_distributed, spawn
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
from fdp.plan import Bucket, BucketPlan, ParamSlot, gradient_ready_order, plan_buckets
from fdp.reduce import GradReducer, Reduction, init_hook_states, resolve_schedule
from fdp.train import TrainState, cross_entropy_loss, init_train_state, make_train_step, planner_loss

__all__ = [
    "Bucket", "BucketPlan", "Comm", "FunctionalModel", "GradBucket", "GradReducer", "GradientTransformation",
    "Hook", "ParamSlot", "Pending", "Reduction", "TrainState", "WorldLayout", "adam", "adamw", "allocate",
    "apply_gradients", "apply_updates", "build_optimizer", "chain", "clip_by_global_norm", "constant_schedule", "cross_entropy_loss", "functionalize",
    "gradient_ready_order", "hooks", "init_distributed", "init_hook_states", "init_train_state", "make_train_step",
    "pack", "plan_buckets", "planner_loss", "resolve_schedule", "sgd", "spawn", "supports_inplace", "unpack", "warmup_cosine_schedule",
    "zero",
]
