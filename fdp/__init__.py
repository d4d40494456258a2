"""fdp: pure-functional data-parallel training on PyTorch.

One word per idea:

* **bucket**: parameters packed into one flat buffer whose gradients are reduced together (``plan``).
* **slice**: one rank's equal, zero-padded part of a bucket's flat layout (``zero.layout``).
* **share**: one rank's part of the global batch (its samples), or of a state gathered to or read from a checkpoint.
* **stage**: a ZeRO stage (0-3), what the update shards: nothing, optimizer state, gradients, params.
* **hook**: one stage of gradient reduction on a bucket (allreduce, fp16, PowerSGD, ...; ``hooks``).
* **chain**: hooks run in order on a bucket (``hooks.chain``), or optimizers composed in order
  (``fdp.chain``, i.e. ``optim.chain``); the package a name comes from says which.
* **update**: reduced buckets to new params and optimizer state, one per ZeRO stage (``update``, ``zero``).
* **step**: one ``train_step(state, batch) -> (state, metrics)``; ``state.step`` counts them.
* **launcher**: what starts the ranks (``world.launcher``: none, elastic, torchrun, slurm), one class
  each (``launchers``).
* **world**: the ranks training together (its size, layout and process group; ``world`` resolves a
  config's on this machine); a world may shrink when a rank is lost.
* **rank**: one process of a world, computing on one device.
* **run**: one training from a config to its summary, in one run directory. The entry chain:
  shell ``main`` (``recipes/train.py``) → ``cli.run_from_shell``, or ``trainer.run`` from Python;
  both start the run once (``startup.start_run``) → ``trainer.run_ranks`` → per rank
  ``trainer.run_rank`` → its loop over the steps.
* **status**: a rank's ``RankStatus`` (its pid and the step it is on, ``ranks/rank<N>.txt``); the run's
  directory is a ``RunDir``.

The modules, one concept each, from the ground up (a module imports only modules above
it in this list; ``tests/test_imports.py`` holds every import to that):

* ``errors``: ``ConfigError`` and the one wording of every refusal (imports nothing of fdp).
* ``targets``: models, data, losses, optimizers and hooks named in config by ``_target_``.
* ``allocator``: this process's memory (glibc's heap tuned for pure steps, free memory handed back).
* ``_torch``: the one place fdp touches private torch APIs, each with a public fallback.
* ``plan`` / ``buckets``: the static gradient-bucket plan (values, packing, tracing, fragments), its flat buffers, params laid out by it.
* ``comm``: collectives as values (``Comm``, ``Pending``).
* ``trace``: the Chrome-trace ``Timeline`` of a step.
* ``streams``: each sample's own random stream (dropout masks that do not depend on the rank or the world size).
* ``precision``: autocast, bf16 weights and the dynamic loss scale (``LossScale``) of mixed precision.
* ``optim``: optax-style optimizers, ``(init, update)`` pairs composed with ``chain``, their learning-rate
  schedules and weight-decay rules, and their registry.
* ``ema``: an exponential moving average of the params as an ``(init, update)`` pair.
* ``functional``: any ``nn.Module`` as ``apply(params, buffers, *inputs, **named_inputs)``.
* ``remat``: activation checkpointing under ``torch.func`` (chosen modules' activations recomputed in backward).
* ``models`` / ``data``: the built-in models and Hugging Face ones from their configs (``hf_model``); datasets,
  batches (any pytree of tensors) and their split over ranks and micro-batches.
* ``hooks``: gradient-reduction stages (allreduce, fp16, PowerSGD, top-k, int8, low-bit codes) composed with ``hooks.chain``.
* ``slurm`` / ``launchers`` / ``devices`` / ``interrupt`` / ``launch``: a rank's place in a job; what started
  the ranks, one class per launcher (``Launcher``, ``register_launcher``); which device it computes on;
  stopping every rank at one step on SIGINT, SIGTERM or SLURM's warning signal; starting and joining a world
  of processes on torch's launchers.
* ``keeper`` / ``shrink``: a rank kept by the process its launcher watches, so it can be lost alone; a world that
  goes on without a lost rank, in place (``world.on_rank_loss=shrink``).
* ``losses`` / ``fit``: loss functions, reading model outputs, token means over the global batch; the first-batch check.
* ``chains``: one step's bucket hook chains in flight, handed back in plan order as they finish (``Reduction``).
* ``compiled`` / ``reduce``: the gradient computation (under ``torch.compile`` when asked, and
  ``trainer.compile=auto``'s choice) and the reduction that starts each bucket's chain as its gradient is packed.
* ``checks``: what a Python caller hands the train step, checked with errors naming the argument.
* ``state``: ``TrainState``, the whole training state as one value.
* ``verdicts``: each step's finiteness verdict, read without stalling the device.
* ``replicas``: one consistent state on every rank (``setup_state``, ``sync_buffers``).
* ``update``: reduced buckets to new params: the one interface of every ZeRO stage, and stage 0.
* ``zero``: ZeRO stages 1, 2 and 3 on that interface (layout, state conversion, the sharded updates, gathering).
* ``step``: the pure ``train_step(state, batch) -> (state, metrics)``.
* ``outer``: local SGD and (streaming) DiLoCo, an outer loop that syncs every few steps across slow links.
* ``checkpoint``: atomic checkpoints of every rank (``save_checkpoint``, ``load_checkpoint``).
* ``loop_controls``: when a loop ends before ``max_steps`` (epochs, time, early stopping), its best checkpoints,
  its moving average.
* ``metrics`` / ``loggers`` / ``evaluate`` / ``rundir``: what a run writes (and to TensorBoard, CSV, MLflow),
  its test metrics, its directory's files, its one owner and its ``train.log``.
* ``config`` / ``keys`` / ``validate``: typed config schemas; the keys each node takes (keys of one's own only
  where they reach one's own objects); a config refused before anything runs.
* ``world`` / ``startup`` / ``build`` / ``report`` / ``trainer``: a config's world on this machine, a run's
  one start-up (world resolved, config validated once, directory owned), its pieces, what it reports, and
  the run loop.
* ``cli`` / ``sweep``: the shell entry's one-line endings (Hydra's errors, refusals, interruptions, exit statuses);
  a Hydra sweep checked whole before its first job, run to its end and summed up in a table.
"""
from fdp import hooks, zero
from fdp.buckets import allocate, lay_out, pack, unpack
from fdp.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fdp.comm import Comm, Pending
from fdp.data import MapData, StepSampler, model_inputs
from fdp.ema import Ema, ema
from fdp.devices import Placement, batch_to_device, place, resolve_backend, to_device
from fdp.errors import ConfigError
from fdp.fit import check_first_batch
from fdp.functional import FunctionalModel, functionalize
from fdp.hooks import GradBucket, Hook, init_hook_states
from fdp.interrupt import StopSignals, StoppedAtOnce
from fdp.keeper import LostRank
from fdp.launch import WorldLayout, broadcast_from_rank0, check_same_plan, init_distributed, spawn
from fdp.loggers import CsvLog, MlflowLog
from fdp.loop_controls import LoopControls, Monitor, run_steps
from fdp.launchers import Launcher, launcher_of, register_launcher
from fdp.losses import TokenCrossEntropy, build_loss, cross_entropy_loss, logits_of, make_loss_fn, planner_loss
from fdp.models import hf_model
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
    decay_rule,
    embedding_names,
    sgd,
    supports_inplace,
    warmup_constant_schedule,
    warmup_cosine_schedule,
    warmup_linear_schedule,
    wsd_schedule,
)
from fdp.outer import OuterSpec, OuterState, check_outer, init_outer_state, make_outer_step
from fdp.plan import Bucket, BucketPlan, ParamSlot, gradient_ready_order, plan_buckets
from fdp.precision import LossScale, Precision
from fdp.chains import Reduction
from fdp.reduce import GradReducer, resolve_schedule
from fdp.replicas import BUFFER_SYNC, setup_state, sync_buffers
from fdp.rundir import RunDirInUse, own_run_dir
from fdp.state import TrainState, init_train_state, state_nbytes
from fdp.step import StepOptions, TrainStep, make_train_step
from fdp.streams import SampleStreams

__all__ = [
    "BUFFER_SYNC", "CheckpointError", "ConfigError", "broadcast_from_rank0", "check_same_plan", "load_checkpoint",
    "save_checkpoint", "setup_state", "sync_buffers", "RunDirInUse", "StopSignals", "StoppedAtOnce", "own_run_dir",
    "Bucket", "BucketPlan", "Comm", "FunctionalModel", "GradBucket", "GradReducer", "GradientTransformation",
    "Hook", "LossScale", "MapData", "OuterSpec", "OuterState", "ParamSlot", "Pending", "Placement", "Precision",
    "Reduction", "StepOptions", "StepSampler", "TrainState", "TrainStep", "WorldLayout", "adam", "adamw", "allocate",
    "apply_gradients", "apply_updates", "batch_to_device", "build_loss", "build_optimizer", "chain", "check_outer",
    "clip_by_global_norm", "constant_schedule", "cross_entropy_loss", "functionalize", "gradient_ready_order", "hooks",
    "init_distributed", "init_hook_states", "init_outer_state", "init_train_state", "lay_out", "make_loss_fn",
    "make_outer_step",
    "make_train_step", "pack", "place", "plan_buckets", "planner_loss", "resolve_backend", "resolve_schedule", "sgd",
    "spawn", "state_nbytes", "supports_inplace", "to_device", "unpack", "warmup_cosine_schedule",
    "zero",
    "TokenCrossEntropy", "logits_of", "model_inputs", "hf_model", "check_first_batch", "LostRank", "SampleStreams",
    "decay_rule", "embedding_names", "warmup_constant_schedule", "warmup_linear_schedule", "wsd_schedule",
    "Ema", "ema", "CsvLog", "MlflowLog", "LoopControls", "Monitor", "run_steps",
    "Launcher", "launcher_of", "register_launcher",
]
