"""fdp: pure-functional data-parallel training on PyTorch.

One word per idea:

* **bucket**: parameters packed into one flat buffer whose gradients are reduced together (``plan``).
* **slice**: one rank's equal, zero-padded part of a bucket's flat layout (``update.zero.layout``).
* **share**: one rank's part of the global batch (its samples), or of a state gathered to or read from a checkpoint.
* **stage**: a ZeRO stage (0-3), what the update shards: nothing, optimizer state, gradients, params.
* **hook**: one transform of gradient reduction on a bucket (allreduce, fp16, PowerSGD, ...; ``hooks``); a
  hook chain's parts are hooks too (``stage`` is ZeRO's word alone).
* **chain**: hooks run in order on a bucket (``hooks.chain``), or optimizers composed in order
  (``fdp.chain``, i.e. ``optim.chain``); the package a name comes from says which.
* **update**: reduced buckets to new params and optimizer state, one per ZeRO stage (``update.base``, ``update.zero``).
* **step**: one ``train_step(state, batch) -> (state, metrics)``; ``state.step`` counts them.
* **launcher**: what starts the ranks (``world.launcher``: none, elastic, torchrun, slurm), one class
  each (``procs.launchers``).
* **world**: the ranks training together (its size, layout and process group; ``run.world`` resolves a
  config's on this machine); a world may shrink when a rank is lost, and grow back when one joins.
* **rank**: one process of a world, computing on one device.
* **run**: one training from a config to its summary, in one run directory. The entry chain:
  shell ``main`` (``recipes/train.py``) → ``run.cli.run_from_shell``, or ``run.trainer.run`` from Python;
  both start the run once (``run.startup.start_run``) → ``run.trainer.run_ranks`` → per rank
  ``run.trainer.run_rank`` → its start (``run.startup.start_rank``) and its loop over the steps.
* **status**: a rank's ``RankStatus`` (its pid and the step it is on, ``ranks/rank<N>.txt``); the run's
  directory is a ``RunDir``.

The packages by role, from the ground up (a module imports only modules of its own package
or of packages above it in this list; ``tests/test_imports.py`` holds every import to that):

* ``errors``: ``ConfigError`` and the one wording of every refusal (imports nothing of fdp).
* ``targets``: models, data, losses, optimizers and hooks named in config by ``_target_``.
* ``_torch``: the one place fdp touches private torch APIs, each with a public fallback (one module per area of
  torch it wraps).
* ``comm``: collectives as values (``Comm``, ``Pending``).
* ``trace``: the Chrome-trace ``Timeline`` of a step.
* ``plan``: the static gradient-bucket plan (values, packing, tracing), its flat buffers (``buckets``) and
  the fragments an outer loop syncs in turn (``fragments``).
* ``optim``: optax-style optimizers (``optimizers``), ``(init, update)`` pairs composed with ``chain``
  (``transforms``), learning-rate schedules,
  weight-decay rules, the registry, and the params' moving average (``ema``).
* ``data``: datasets, batches (any pytree of tensors) and their split over ranks and micro-batches, the
  validation split held out of the training split (``splits``).
* ``hooks``: gradient-reduction hooks (allreduce, fp16, PowerSGD, top-k, int8, low-bit codes) composed with
  ``hooks.chain``.
* ``model``: what a model computes: any ``nn.Module`` as a pure function (``functional``), the built-in and
  Hugging Face models (``builtin``), mixed precision (``precision``), per-sample random streams
  (``streams``; as a function mode, ``streams_functions``), activation checkpointing (the modules it takes:
  ``remat``; their forward run again in backward: ``recompute``), losses and the first-batch check (``losses``,
  ``fit``), a model built on ``meta`` and made one tensor at a time with a whole build's values (``deferred``),
  what a forward keeps for backward (``activations``).
* ``procs``: the world of processes: this process's heap (``allocator``), a rank's place in a job (``slurm``,
  ``launchers``: one class per launcher, ``devices``), stop signals (``interrupt``), starting and joining a
  world (``launch``), a rank kept by the process its launcher watches (``keeper``) and a world that goes on
  without a lost rank (``shrink``) and one that a rank joins again at a step boundary (``grow``).
* ``state``: ``TrainState``, the whole training state as one value (``train_state``), what a Python caller
  hands the step (``checks``), one consistent state on every rank (``replicas``), the state a joining rank
  takes from its peers (``heal``).
* ``update``: reduced buckets to new params, each ZeRO stage owning its state's whole life: the interface and
  stage 0 (``base``), stages 1-3 (``zero``).
* ``step``: the pure ``train_step(state, batch) -> (state, metrics)`` (``train_step``): gradients
  (``compiled``), the reduction (``reduce``, ``chains``), finiteness verdicts (``verdicts``), and the outer
  loop of local SGD and (streaming) DiLoCo (``outer``).
* ``run``: from a config to a trained run: schemas, keys and validation (``config``, a package),
  what it reports (``report``: records, ``metrics.jsonl``, loggers), evaluation and the run directory
  (``evaluate``, ``rundir``),
  the world on this machine (``world``), the one start-up (``startup``: the run's, then each rank's up to its first
  step), a run's pieces (``build``), its report, epochs, time limits, early stopping and best checkpoints
  (``loop_controls``), your own code called in the loop (``callbacks``, a package: what one is, from the config, the
  read-only view it is shown, the loop's calls), the loop of one world (``loop``), a rank's run from start to
  summary (``trainer``), what a lost rank does (``rank_loss``: restart, shrink, or shrink and respawn, chosen once),
  its memory (``memory``, a package: what a run will need, forecast from its plan, what fits it,
  ``trainer.accum_steps=auto`` and ``trainer.zero_stage=auto``, and what a rank out of memory says), the shell entry
  (``cli``), its ``--help`` and the docs' pages drawn from the schemas and the checks (``reference``,
  ``compatibility``) and sweeps (``sweep``); checkpoints, whole and sharded, one component with one owner of save,
  resume, wait and prune (``checkpoint``, its ``Checkpointer``; the format a world writes, whole, sharded or auto,
  chosen once; sharded asynchronous ones in DCP's format, their consolidation into one file, and a checkpoint of
  either format checked whole before use).
* ``checkpoint``: the ``python -m fdp.checkpoint consolidate RUN_DIR`` command.
"""

from fdp import hooks
from fdp.comm import Comm, Pending
from fdp.data import MapData, StepSampler, model_inputs
from fdp.errors import ConfigError
from fdp.hooks import GradBucket, Hook, init_hook_states
from fdp.model.builtin import hf_model
from fdp.model.deferred import record_build
from fdp.model.fit import check_first_batch
from fdp.model.functional import FunctionalModel, functionalize
from fdp.model.losses import TokenCrossEntropy, build_loss, cross_entropy_loss, logits_of, make_loss_fn, planner_loss
from fdp.model.precision import LossScale, Precision
from fdp.model.streams import SampleStreams
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
from fdp.optim.ema import Ema, ema
from fdp.plan import Bucket, BucketPlan, ParamSlot, gradient_ready_order, plan_buckets
from fdp.plan.buckets import allocate, lay_out, pack, unpack
from fdp.procs.devices import Placement, batch_to_device, place, resolve_backend, to_device
from fdp.procs.interrupt import StoppedAtOnce, StopSignals
from fdp.procs.keeper import LostRank
from fdp.procs.launch import WorldLayout, broadcast_from_rank0, check_same_plan, init_distributed, spawn
from fdp.procs.launchers import Launcher, launcher_of, register_launcher
from fdp.run.callbacks import Callback, CallbackError, LoopEvent
from fdp.run.checkpoint import CheckpointError, ShardedSaver, load_checkpoint, load_sharded, save_checkpoint
from fdp.run.loop_controls import LoopControls, run_steps
from fdp.run.monitor import Monitor
from fdp.run.report.loggers import CsvLog, MlflowLog
from fdp.run.rundir import RunDirInUse, own_run_dir
from fdp.state.replicas import BUFFER_SYNC, setup_state, sync_buffers
from fdp.state.train_state import TrainState, init_train_state, state_nbytes
from fdp.step.chains import Reduction
from fdp.step.outer import OuterState, init_outer_state, make_outer_step
from fdp.step.outer_spec import OuterSpec, check_outer
from fdp.step.reduce import GradReducer, resolve_schedule
from fdp.step.train_step import StepOptions, TrainStep, make_train_step
from fdp.update import zero

__all__ = [
    "BUFFER_SYNC",
    "CheckpointError",
    "ConfigError",
    "broadcast_from_rank0",
    "check_same_plan",
    "load_checkpoint",
    "save_checkpoint",
    "ShardedSaver",
    "load_sharded",
    "setup_state",
    "sync_buffers",
    "RunDirInUse",
    "StopSignals",
    "StoppedAtOnce",
    "own_run_dir",
    "Bucket",
    "BucketPlan",
    "Comm",
    "FunctionalModel",
    "GradBucket",
    "GradReducer",
    "GradientTransformation",
    "Hook",
    "LossScale",
    "MapData",
    "OuterSpec",
    "OuterState",
    "ParamSlot",
    "Pending",
    "Placement",
    "Precision",
    "Reduction",
    "StepOptions",
    "StepSampler",
    "TrainState",
    "TrainStep",
    "WorldLayout",
    "adam",
    "adamw",
    "allocate",
    "apply_gradients",
    "apply_updates",
    "batch_to_device",
    "build_loss",
    "build_optimizer",
    "chain",
    "check_outer",
    "clip_by_global_norm",
    "constant_schedule",
    "cross_entropy_loss",
    "functionalize",
    "gradient_ready_order",
    "hooks",
    "init_distributed",
    "init_hook_states",
    "init_outer_state",
    "init_train_state",
    "lay_out",
    "make_loss_fn",
    "make_outer_step",
    "make_train_step",
    "pack",
    "place",
    "plan_buckets",
    "planner_loss",
    "resolve_backend",
    "resolve_schedule",
    "sgd",
    "spawn",
    "state_nbytes",
    "supports_inplace",
    "to_device",
    "unpack",
    "warmup_cosine_schedule",
    "zero",
    "TokenCrossEntropy",
    "logits_of",
    "model_inputs",
    "hf_model",
    "check_first_batch",
    "LostRank",
    "SampleStreams",
    "decay_rule",
    "embedding_names",
    "warmup_constant_schedule",
    "warmup_linear_schedule",
    "wsd_schedule",
    "Ema",
    "ema",
    "CsvLog",
    "MlflowLog",
    "LoopControls",
    "Monitor",
    "run_steps",
    "Launcher",
    "launcher_of",
    "register_launcher",
    "record_build",
    "Callback",
    "CallbackError",
    "LoopEvent",
]
