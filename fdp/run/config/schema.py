"""Typed schemas behind the Hydra configs in ``conf/``.

Every YAML file in ``conf/`` extends one of these dataclasses, so an unknown key or a
value of the wrong type fails when the config is composed, with a message naming the
key. Range checks that a type cannot express live in ``fdp.run.config.validate``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


# -- model -----------------------------------------------------------------------------
# Every model is built by Hydra's instantiate from its ``_target_``; the trainer adds the
# arguments the data decides (in_features, num_classes, vocab_size, ...) where the target
# takes them (fdp.targets.build). ``custom`` is a user's own class or function: its
# arguments are added on the command line (``+model.width=256``).
@dataclass
class MLPConfig:
    name: str = "mlp"
    _target_: str = "fdp.model.builtin.MLP"
    hidden: int = 256  # the width of each hidden layer
    depth: int = 2  # hidden layers


@dataclass
class ConvNetConfig:
    name: str = "convnet"
    _target_: str = "fdp.model.builtin.ConvNet"
    width: int = 32  # channels of the first convolution (the second has twice as many)


@dataclass
class CharLMConfig:
    name: str = "charlm"
    _target_: str = "fdp.model.builtin.CharTransformer"
    d_model: int = 128  # the width of the residual stream
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block (d_model divisible by it)
    dropout: float = 0.0  # dropout rate after attention and the MLP


@dataclass
class CustomModelConfig:
    name: str = "custom"
    _target_: str = MISSING


# -- data ------------------------------------------------------------------------------
# A built-in target returns an in-memory fdp.data.Dataset; a custom one returns
# (train, test), map-style torch Datasets of (input, target) items read through a DataLoader
# (or a dict with a validation split of its own, fdp.data.as_map_data).
@dataclass
class DataShared:
    # The part of the training split held out to validate on (fdp.data.splits): null is 0.1, or the data's own
    # validation split where it has one; 0: none (evaluations during training then score the test split).
    val_fraction: Optional[float] = None


@dataclass
class DigitsConfig(DataShared):
    name: str = "digits"
    _target_: str = "fdp.data.load_digits"
    global_batch_size: int = 64  # samples per step over all ranks and micro-batches
    test_fraction: float = 0.2  # the share of the data held out as the test split


@dataclass
class StdlibTextConfig(DataShared):
    name: str = "stdlib_text"
    _target_: str = "fdp.data.load_stdlib_text"
    global_batch_size: int = 32  # samples per step over all ranks and micro-batches
    block_size: int = 64  # tokens (characters) per sample
    max_chars: int = 1_000_000  # characters read from Python's standard library sources
    test_fraction: float = 0.1  # the share of the text held out as the test split


@dataclass
class CustomDataConfig(DataShared):
    name: str = "custom"
    _target_: str = MISSING
    global_batch_size: int = 64  # samples per step over all ranks and micro-batches
    num_workers: int = 0  # DataLoader worker processes per rank (0: load in the training process)


# Settings of fdp, not arguments of a data target.
DATA_SETTINGS = ("name", "global_batch_size", "num_workers", "val_fraction")


# -- loss ------------------------------------------------------------------------------
@dataclass
class CrossEntropyConfig:
    name: str = "cross_entropy"
    _target_: str = "fdp.model.losses.cross_entropy"


@dataclass
class MSEConfig:
    name: str = "mse"
    _target_: str = "fdp.model.losses.mse"


@dataclass
class CausalLMLossConfig:  # next-token cross-entropy over every counted token of the global batch
    name: str = "causal_lm"
    _target_: str = "fdp.model.losses.TokenCrossEntropy"
    shift: int = 1  # labels are the input ids (Hugging Face's convention): position t predicts t + 1
    ignore_index: int = -100  # targets not counted (padding)
    label_smoothing: float = 0.0  # as torch.nn.functional.cross_entropy's


@dataclass
class MaskedLMLossConfig(CausalLMLossConfig):
    name: str = "masked_lm"
    shift: int = 0  # labels are aligned with the inputs: position t predicts t


@dataclass
class CustomLossConfig:
    name: str = "custom"
    _target_: str = MISSING  # a function (outputs, targets) -> scalar


# -- optimizer -------------------------------------------------------------------------
@dataclass
class OptimShared:  # the settings every optimizer takes (fdp.optim.registry)
    lr: float = 1e-3  # the peak learning rate (the schedule scales it)
    lr_schedule: str = "constant"  # constant | warmup_constant | warmup_linear | warmup_cosine | wsd
    warmup_steps: int = 0  # steps of linear warmup from 0 to lr (warmup_* schedules)
    warmup_ratio: float = 0.0  # where warmup_steps is 0: warm up over this fraction of trainer.max_steps
    end_lr: float = 0.0  # the rate at trainer.max_steps of the decaying schedules
    decay_fraction: float = 0.1  # wsd: the last fraction of the run, over which the rate decays
    decay_filter: Any = "all"  # all | weights (not biases, norms, embeddings) | [names exempt from weight decay]
    clip_norm: Optional[float] = None  # clip the global gradient norm to this (None: off)


@dataclass
class OptimBase(OptimShared):
    weight_decay: float = 0.0  # L2 penalty added to the gradient (decay_filter chooses the params)


@dataclass
class SGDConfig(OptimBase):
    name: str = "sgd"
    lr: float = 0.1  # the peak learning rate (the schedule scales it)
    momentum: float = 0.9  # as torch.optim.SGD's
    dampening: float = 0.0  # as torch.optim.SGD's
    nesterov: bool = False  # Nesterov momentum, as torch.optim.SGD's


@dataclass
class AdamConfig(OptimBase):
    name: str = "adam"
    b1: float = 0.9  # the first moment's decay (torch's betas[0])
    b2: float = 0.999  # the second moment's decay (torch's betas[1])
    eps: float = 1e-8  # added to the second moment's root


@dataclass
class AdamWConfig(AdamConfig):
    name: str = "adamw"
    weight_decay: float = 0.01  # decoupled weight decay, as torch.optim.AdamW's (decay_filter chooses the params)


@dataclass
class CustomOptimConfig(OptimShared):
    name: str = "custom"
    _target_: str = MISSING  # a factory returning an fdp.optim.GradientTransformation


# -- trainer and world -----------------------------------------------------------------
@dataclass
class EarlyStoppingConfig:
    monitor: str = "val_loss"  # a metric of the evaluations (val_loss, val_acc, ema_val_loss, loss...)
    patience: int = 0  # evaluations without improvement before the run stops (0: no early stopping)
    mode: str = "auto"  # auto | min | max (auto: max for an accuracy, min otherwise)
    min_delta: float = 0.0  # the least change that counts as an improvement


@dataclass
class TrainerConfig:
    max_steps: int = 300  # the length of the run (schedules span it)
    max_epochs: int = 0  # end after this many passes over the training data, if sooner than max_steps (0: off)
    max_time: Any = 0  # end (with a checkpoint) after this much training time: seconds or DD:HH:MM:SS (0: off)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    checkpoint_monitor: str = "val_loss"  # the metric of the evaluations the best checkpoints are ranked by
    checkpoint_mode: str = "auto"  # auto | min | max, as early_stopping.mode
    keep_best: int = 0  # keep this many best checkpoints by checkpoint_monitor in checkpoints/best/ (0: none)
    ema_decay: float = 0.0  # a moving average of the params, evaluated as ema_<metric> and checkpointed (0: off)
    stop_at: int = 0  # end this invocation early at this step, to resume later (0: run to max_steps)
    # micro-batches per step (gradients accumulated; the global batch stays) | auto: the largest micro-batch the memory
    # forecast fits in the budget, halved when a step runs out of memory anyway (fdp.run.memory.micro_batch)
    accum_steps: Any = 1
    log_every: int = 10  # steps between lines in train.log and metrics.jsonl (the end is always logged)
    eval_every: int = 100  # 0: evaluate only at the end
    eval_batches: int = 20  # batches of the held-out split per evaluation
    checkpoint_every: int = 100  # 0: checkpoint only at the end
    keep_checkpoints: int = 2  # step checkpoints kept (older ones are pruned; best ones apart)
    # auto (sharded on more than one rank, whole on one) | whole (rank 0 writes one file) | sharded (each rank its
    # share, DCP's format)
    checkpoint_format: str = "auto"
    # auto | true | false: write while training goes on, the loop waiting only to stage (auto: true where sharded)
    checkpoint_async: Any = "auto"
    resume: Any = False  # true: continue hydra.run.dir from its last checkpoint | PATH: start from that checkpoint
    reschedule: bool = False  # resume with another max_steps: stretch the learning-rate schedule over it (else refused)
    bucket_cap_mb: float = 25.0  # the most MiB of gradients one bucket reduces (as DDP's bucket_cap_mb)
    first_bucket_cap_mb: float = 1.0  # the first bucket's cap: small, so its reduction starts early
    allow_unused: bool = False  # params no gradient reaches are allowed (else refused at planning)
    schedule: str = (
        "auto"  # auto | after | overlap: when bucket reductions start (auto: overlap on more than one process)
    )
    nonfinite: str = "raise"  # raise | skip
    sync_buffers: str = "broadcast"  # broadcast | average | local: buffers (BatchNorm statistics) across ranks
    precision: str = "32-true"  # 32-true | bf16-mixed | 16-mixed | bf16-true (Lightning's names)
    reduce_dtype: str = "float32"  # float32 | bfloat16 (bf16-mixed, hooks=allreduce): the dtype gradients average in
    matmul_precision: str = "highest"  # highest | high | medium: torch.set_float32_matmul_precision
    # auto | true | false: torch.compile the gradient computation (auto: on a GPU, when the run repays the compile)
    compile: Any = "auto"
    # 0 | 1 (shard optimizer state over ranks) | 2 (and reduced gradients) | 3 (and params) | auto: the lowest stage
    # whose memory forecast fits the budget (fdp.run.memory.auto_stage)
    zero_stage: Any = 0
    sample_streams: Any = (
        "auto"  # auto | true | false: dropout masks per sample, alike on any world (auto: if it may shrink)
    )
    # none | blocks | every_k: modules whose activations backward recomputes (fdp.model.remat): the repeated blocks, or
    # the classes named in the policy ([Block], which alone turns on blocks); every_k: every k-th of them (null: 2)
    activation_checkpointing: str = "none"
    activation_checkpointing_policy: List[str] = field(default_factory=list)  # module classes to checkpoint
    activation_checkpointing_k: Optional[int] = None  # every_k: checkpoint every k-th module (unset: 2)
    reshard_after_forward: bool = (
        True  # zero_stage=3: release each bucket's params after forward, gather again for backward
    )
    trace: bool = False  # write a Chrome trace per rank to <run dir>/trace/ (for short diagnostic runs)
    tensorboard: bool = False  # the same as "tensorboard" in loggers
    loggers: List[str] = field(default_factory=list)  # tensorboard | csv | mlflow | wandb, beside metrics.jsonl
    # your own code in the loop: [{_target_: my_pkg.callbacks.Log, every: 10}, ...] (fdp.run.callbacks)
    callbacks: List[Any] = field(default_factory=list)
    progress: bool = True  # a progress bar on rank 0's terminal


@dataclass
class WorldConfig:
    name: str = "single"  # the world option chosen (conf/world/)
    launcher: str = "none"  # none | elastic | torchrun | slurm
    nnodes: int = 1  # machines (torchrun's and slurm's)
    nproc_per_node: int = 1  # processes (ranks) per machine
    backend: str = "auto"  # auto | gloo | nccl (auto: NCCL when every rank has a GPU of its own)
    accelerator: str = "auto"  # auto | cpu | gpu (auto: the GPUs when there are any)
    devices: Any = "auto"  # auto | N | -1 | "0,2" | [0,2]: see fdp.procs.devices
    timeout_s: float = 300.0  # the longest a collective may wait for a peer before the rank is lost
    max_restarts: int = 0  # on_rank_loss=restart: restarts of the world from its last checkpoint
    on_rank_loss: str = (
        "restart"  # restart: a lost rank ends the world (max_restarts restarts it) | shrink: the rest go on
    )
    min_ranks: int = 1  # on_rank_loss=shrink: end the run (with a checkpoint) when fewer ranks remain
    max_ranks: int = 0  # on_rank_loss=shrink: the most ranks the world grows back to as ranks join (0: its start size)
    respawn: bool = False  # on_rank_loss=shrink, local worlds: a lost rank's keeper starts it again; it rejoins
    respawn_delay_s: float = 1.0  # respawn: seconds between the world going on without the rank and its new start
    max_respawns: int = 3  # respawn: how many times each rank is started again at most
    memory_per_rank_mb: float = (
        0.0  # what each rank may allocate once started (0: no limit), as a GPU's memory bounds it
    )
    # Reduce inside each node, run the hook chain across nodes only, share inside the node; at a ZeRO stage the state
    # is sharded inside each node and replicated across them (hybrid sharding, fdp.update.zero.hybrid).
    hierarchical: bool = False
    node_size: int = 0  # processes per node for hierarchical (0: the processes of one launch)
    requeue_signal: str = (
        "SIGUSR1"  # world=slurm: stop, checkpoint and requeue the job on it (sbatch --signal=USR1@90); none: off
    )


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
    rank: int = 1  # the rank of each gradient matrix's approximation
    start_iter: int = 10  # steps reduced whole before compression starts
    min_compression_rate: float = 2.0  # a tensor compressed only if this saves that factor
    error_feedback: bool = True  # add what compression lost to the next step's gradient
    warm_start: bool = True  # reuse the last step's Q (else a fresh random one each step)
    orthogonalization_epsilon: float = 0.0  # added in Gram-Schmidt's norms (0: none)
    seed: int = 0  # the first Q's random seed (alike on every rank)
    batch_same_shape: bool = False  # compress the tensors of one shape as one batched matrix


@dataclass
class BatchedPowerSGDConfig:
    name: str = "batched_powersgd"
    rank: int = 1  # the rank of the bucket's square matrix approximation
    start_iter: int = 10  # steps reduced whole before compression starts
    error_feedback: bool = True  # add what compression lost to the next step's gradient
    warm_start: bool = True  # reuse the last step's Q (else a fresh random one each step)
    orthogonalization_epsilon: float = 0.0  # added in Gram-Schmidt's norms (0: none)
    seed: int = 0  # the first Q's random seed (alike on every rank)


@dataclass
class TopKConfig:
    name: str = "topk"
    ratio: float = 0.01  # the share of each bucket's entries sent (where k is None)
    error_feedback: bool = True  # add the entries not sent to the next step's gradient
    k: Optional[int] = None  # entries sent per bucket; None: ceil(ratio * numel)


@dataclass
class Int8Config:
    name: str = "int8"
    error_feedback: bool = True  # add the rounding error to the next step's gradient


@dataclass
class LowBitConfig:
    name: str = "lowbit"
    format: str = "fp4"  # int8, fp8 (e4m3), int4 or fp4 (e2m1)
    block: int = 64  # entries per scale
    error_feedback: bool = True  # add the rounding error to the next step's gradient


@dataclass
class ChainConfig:
    name: str = "chain"
    chain: List[Any] = field(default_factory=list)  # hook configs run in order on each bucket


@dataclass
class CustomHookConfig:
    name: str = "custom"
    _target_: str = MISSING  # a factory returning an fdp.hooks.Hook (a chain is one)


# -- outer loop (fdp.step.outer) -------------------------------------------------------------
@dataclass
class OuterNoneConfig:
    name: str = "none"


@dataclass
class LocalSGDConfig:
    name: str = "local_sgd"
    sync_every: int = 16  # steps between parameter averages
    start_step: int = 0  # per-step gradient sync up to this step (post-local SGD)
    overlap: int = 0  # inner steps a sync's communication runs behind (applied that many steps late)
    fragments: int = 1  # the model synced in this many fragments (runs of buckets), each on its own steps
    fragment_schedule: str = "strided"  # fragments' syncs spread over the period, or sequential: on consecutive steps
    mix: Optional[float] = None  # None: keep the steps since the send; a: a * local + (1 - a) * synced


@dataclass
class DiLoCoConfig(LocalSGDConfig):
    name: str = "diloco"
    lr: float = 0.7  # the outer optimizer: SGD on the averaged pseudo-gradient
    momentum: float = 0.9  # the outer SGD's momentum
    nesterov: bool = True  # the outer SGD's Nesterov momentum


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
    "loss": {
        "cross_entropy": CrossEntropyConfig,
        "mse": MSEConfig,
        "causal_lm": CausalLMLossConfig,
        "masked_lm": MaskedLMLossConfig,
        "custom": CustomLossConfig,
    },
    "optim": {"sgd": SGDConfig, "adam": AdamConfig, "adamw": AdamWConfig, "custom": CustomOptimConfig},
    "hooks": {
        "allreduce": AllreduceConfig,
        "fp16": Fp16Config,
        "bf16": Bf16Config,
        "noop": NoopConfig,
        "powersgd": PowerSGDConfig,
        "batched_powersgd": BatchedPowerSGDConfig,
        "topk": TopKConfig,
        "int8": Int8Config,
        "lowbit": LowBitConfig,
        "chain": ChainConfig,
        "custom": CustomHookConfig,
    },
    "world": {"world": WorldConfig},
    "outer": {"none": OuterNoneConfig, "local_sgd": LocalSGDConfig, "diloco": DiLoCoConfig},
}


@functools.cache
def register_configs() -> None:
    """Register the schemas with Hydra; YAML files extend them as ``<name>_schema``. Once a process: Hydra's
    store is one for the process, and storing again costs a third of a compose."""
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(group=group, name=f"{name}_schema", node=schema)
