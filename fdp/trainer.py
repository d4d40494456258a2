"""From a config to a trained, logged and checkpointed run, on one process or many.

``run(cfg, run_dir)`` is what ``recipes/train.py`` calls. For a local world it starts
the workers with the elastic launcher; each worker (or the single process) then runs
``train_worker``: build the pieces, check that the ranks agree, and loop.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from fdp import checkpoint, zero
from fdp.comm import Comm
from fdp.config import ConfigError, validate
from fdp.data import Dataset, eval_batches, global_batch, load_dataset, shard
from fdp.functional import FunctionalModel, functionalize
from fdp.hooks import Hook
from fdp.hooks.registry import build_hook
from fdp.launch import (
    Heartbeat,
    RankLostError,
    WorkerFailedError,
    WorldLayout,
    broadcast_from_rank0,
    check_same_plan,
    init_distributed,
    spawn,
    tune_allocator,
)
from fdp.metrics import MetricsLog, StepTimes, progress, summary_line
from fdp.models import build_model, count_parameters
from fdp.optim import GradientTransformation, build_optimizer
from fdp.plan import BucketPlan, plan_buckets
from fdp.trace import NullTimeline, Timeline
from fdp.train import TrainState, cross_entropy_loss, init_train_state, make_train_step, planner_loss

log = logging.getLogger("fdp")


# -- building the pieces from config ------------------------------------------------------
def build_data(cfg: DictConfig) -> Dataset:
    settings = {k: v for k, v in OmegaConf.to_container(cfg).items() if k not in ("name", "global_batch_size")}
    try:
        return load_dataset(cfg.name, seed=0, **settings)
    except ValueError as error:  # e.g. max_chars too small for two splits of block_size + 1
        raise ConfigError(f"data={cfg.name}: {error}") from None


def check_data(cfg: DictConfig, data: Dataset) -> None:
    """The settings ``validate`` cannot check without the data: every rank refuses them alike."""
    gbs = cfg.data.global_batch_size
    if not data.is_text and gbs > data.train_x.shape[0]:
        raise ConfigError(
            f"data.global_batch_size={gbs}: expected at most the {data.train_x.shape[0]} training samples of {data.name}"
        )


def build_module(cfg: DictConfig, data: Dataset) -> torch.nn.Module:
    settings = {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "name"}
    if cfg.name == "mlp":
        return build_model("mlp", in_features=data.train_x[0].numel(), out_features=data.num_classes, **settings)
    if cfg.name == "convnet":
        return build_model("convnet", in_channels=1, num_classes=data.num_classes, **settings)
    return build_model("charlm", vocab_size=data.num_classes, block_size=data.block_size, **settings)


def layout_of(cfg: DictConfig) -> WorldLayout:
    world = cfg.world
    nnodes, nproc = world.nnodes, world.nproc_per_node
    if world.launcher == "torchrun":
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", nproc))
        nnodes = int(os.environ.get("WORLD_SIZE", nproc)) // max(1, nproc)
    return WorldLayout(world.launcher, nnodes, nproc, world.backend, world.timeout_s, world.max_restarts)


# -- evaluation -------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model: FunctionalModel, params, buffers, data: Dataset, max_batches: int, batch_size: int = 256) -> dict:
    """Mean loss and accuracy over (up to ``max_batches`` batches of) the test split."""
    total_loss, correct, count = 0.0, 0, 0
    for x, y in eval_batches(data, batch_size, max_batches):
        logits, _ = model.apply(params, buffers, x, training=False)
        logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        total_loss += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        count += y.numel()
    return {"test_loss": total_loss / count, "test_acc": correct / count}


# -- the run --------------------------------------------------------------------------------
class Run(NamedTuple):
    """Everything a worker builds before step 1."""

    model: FunctionalModel
    data: Dataset
    plan: BucketPlan
    hook: Hook
    optimizer: GradientTransformation
    state: TrainState
    num_params: int


def setup(cfg: DictConfig, comm: Comm) -> Run:
    """Build model, data, plan, hooks, optimizer and the first train state on this rank."""
    data = build_data(cfg.data)
    check_data(cfg, data)
    torch.manual_seed(cfg.seed)
    module = build_module(cfg.model, data)
    num_params = count_parameters(module)
    model, params, buffers = functionalize(module, keep_module_weights=False)  # the state holds the weights
    loss_fn = cross_entropy_loss(model)
    example = shard(global_batch(data, 0, cfg.data.global_batch_size, cfg.seed), comm.rank, comm.world_size)
    example = tuple(t[: max(1, t.shape[0] // cfg.trainer.accum_steps)] for t in example)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers),
        params,
        example,
        bucket_cap_mb=cfg.trainer.bucket_cap_mb,
        first_bucket_cap_mb=cfg.trainer.first_bucket_cap_mb,
        allow_unused=cfg.trainer.allow_unused,
    )
    # Shapes are checked before any broadcast: a broadcast of mismatched shapes would hang.
    check_same_plan(plan, comm)
    params, buffers = broadcast_from_rank0(params, comm), broadcast_from_rank0(buffers, comm)
    hook = build_hook(OmegaConf.to_container(cfg.hooks))
    optimizer = build_optimizer(OmegaConf.to_container(cfg.optim), cfg.trainer.max_steps)
    seed = cfg.seed + comm.rank
    if cfg.trainer.zero_stage:  # the optimizer state is built for this rank's slices only
        state = zero.init_state(params, buffers, optimizer, plan, comm, hook, seed=seed)
    else:
        state = init_train_state(params, buffers, optimizer, plan, hook, seed=seed)
    return Run(model, data, plan, hook, optimizer, state, num_params)


def _save(run_dir: Path, state: TrainState, comm: Comm, cfg: DictConfig, plan: BucketPlan) -> None:
    if cfg.trainer.zero_stage:  # saved whole, so that any world size and stage can resume it
        state = zero.gather_state(state, plan, comm)
    mine = checkpoint.rank_payload(state)
    per_rank = [mine]
    if comm.world_size > 1:
        per_rank = [None] * comm.world_size if comm.rank == 0 else None
        dist.gather_object(mine, per_rank, dst=0)
    if comm.rank == 0:
        payload = checkpoint.state_payload(
            state, per_rank, {"config": OmegaConf.to_yaml(cfg), "plan_fingerprint": plan.fingerprint()}
        )
        checkpoint.save(run_dir / "checkpoints", payload, keep=cfg.trainer.keep_checkpoints)


def _resume(run_dir: Path, run: Run, comm: Comm) -> TrainState:
    path = run_dir / "checkpoints" / checkpoint.LAST
    payload = [checkpoint.load(path) if comm.rank == 0 else None]
    if comm.world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    if payload[0].get("plan_fingerprint") != run.plan.fingerprint():
        raise checkpoint.CheckpointError(f"checkpoint {path} was written with another bucket plan (model or bucket caps changed)")
    sharded = zero.is_sharded(run.state.opt_state, run.plan)
    template = zero.unsharded_template(run.state, run.optimizer) if sharded else run.state
    state = checkpoint.restore(payload[0], template, comm.rank, path)
    return zero.shard_state(state, run.plan, comm) if sharded else state


class Progress:
    """``<run dir>/ranks/rank<N>.txt``: ``pid=<pid> step=<step being computed>``, rewritten each step.

    It tells the launcher which step a rank that died by a signal was on, and an operator
    (or a test) which process is which rank. One ``pwrite`` per step, no fsync.
    """

    def __init__(self, run_dir: Path, rank: int):
        path = self.path(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pid = os.getpid()
        self.step = 0

    @staticmethod
    def path(run_dir: Path, rank: int) -> Path:
        return Path(run_dir) / "ranks" / f"rank{rank}.txt"

    @staticmethod
    def read(run_dir: Path, rank: int) -> dict[str, int]:
        """``{"pid": ..., "step": ...}`` as rank ``rank`` last wrote them (empty if never)."""
        try:
            text = Progress.path(run_dir, rank).read_text()
        except OSError:
            return {}
        return {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", text)}

    def update(self, step: int) -> None:
        # Within one process the line only grows (the step never decreases), so an
        # in-place write never leaves a stale tail.
        self.step = step
        os.pwrite(self._fd, f"pid={self._pid} step={step}\n".encode(), 0)

    def close(self) -> None:
        os.close(self._fd)


def _lost_rank_error(error: RuntimeError, heartbeat: Heartbeat | None, rank: int, step: int) -> RankLostError | None:
    """After a failed collective: a ``RankLostError`` naming the ranks that stopped answering, if any."""
    lost = heartbeat.silent_ranks() if heartbeat is not None else None
    if not lost:
        return None
    # Gloo prefixes its messages with its source location: "[.../pair.cc:537] Read error ...".
    reason = re.sub(r"^\[[^\]]*\]\s*", "", (str(error).strip().splitlines() or [""])[0])
    names = ", ".join(map(str, lost))
    return RankLostError(
        f"rank {names} was lost at step {step}: it stopped answering (killed, hung or unreachable); "
        f"the collective on rank {rank} failed with: {reason}"
    )


def _setup_logging(run_dir: Path, rank: int) -> None:
    handler: logging.Handler
    if rank == 0:
        handler = logging.StreamHandler(sys.stdout)
    else:
        handler = logging.FileHandler(run_dir / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def train_worker(cfg: DictConfig, run_dir: str) -> dict:
    """Train on this rank until ``trainer.max_steps``; return the summary (rank 0's is the one printed)."""
    cfg = OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg
    tune_allocator()
    comm = init_distributed(layout_of(cfg))
    try:
        return _train(cfg, Path(run_dir), comm)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: DictConfig, run_dir: Path, comm: Comm) -> dict:
    rank, world = comm.rank, comm.world_size
    _setup_logging(run_dir, rank)
    tc = cfg.trainer
    if cfg.data.global_batch_size % world:
        raise ConfigError(f"data.global_batch_size={cfg.data.global_batch_size}: expected a multiple of the world size {world}")
    run = setup(cfg, comm)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    has_checkpoint = (run_dir / "checkpoints" / checkpoint.LAST).exists()
    state = _resume(run_dir, run, comm) if tc.resume or (restarted and has_checkpoint) else run.state
    if rank == 0:
        (run_dir / "plan.txt").write_text(f"{run.plan}\nfingerprint: {run.plan.fingerprint()}\n")
        (run_dir / "plan.json").write_text(json.dumps(run.plan.to_dict(), indent=1))
        log.info(
            f"{cfg.model.name}: {run.num_params:,} parameters in {len(run.plan)} buckets "
            f"({run.plan.nbytes / 2**20:.2f} MiB, plan {run.plan.fingerprint()[:12]}, see plan.txt), world {world}"
        )
    timeline = Timeline(rank) if tc.trace else NullTimeline()
    train_step = make_train_step(
        cross_entropy_loss(run.model),
        run.optimizer,
        run.plan,
        run.hook,
        comm,
        accum_steps=tc.accum_steps,
        schedule=tc.schedule,
        nonfinite=tc.nonfinite,
        timeline=timeline,
        donate=True,  # the loop below never looks at a state again once it has the next
        zero_stage=tc.zero_stage,
    )
    metrics_log = MetricsLog(run_dir, resume=state.step > 0) if rank == 0 else None
    times, skipped, last_eval, record = StepTimes(), 0, {}, {}
    gbs = cfg.data.global_batch_size
    t_start = time.perf_counter()
    last_step = min(tc.max_steps, tc.stop_at or tc.max_steps)
    bar = progress(last_step, state.step, enabled=tc.progress and rank == 0)
    tracker = Progress(run_dir, rank)
    heartbeat = Heartbeat(rank, world).start() if world > 1 else None
    try:
        while state.step < last_step:
            tracker.update(state.step + 1)
            batch = shard(global_batch(run.data, state.step, gbs, cfg.seed), rank, world)
            state, m = train_step(state, batch)
            times.add(m)
            skipped += m["skipped"]
            step = state.step
            bar.update(1)
            done = step == last_step
            if step % tc.log_every == 0 or done:
                loss = m["loss"].clone()
                if world > 1:
                    loss = comm.allreduce(loss / world).wait()
                record = {
                    "step": step,
                    "loss": loss.item(),
                    "lr": m["lr"],
                    "samples_per_s": gbs / m["step_s"],
                    "step_ms": 1e3 * m["step_s"],
                    "compute_ms": 1e3 * m["compute_s"],
                    "comm_wait_ms": 1e3 * m["comm_wait_s"],
                    "bytes_sent": m["bytes_sent"],
                    "compression": run.plan.nbytes / m["bytes_sent"] if m["bytes_sent"] else None,
                    "skipped_steps": skipped,
                    "state_mib": m["state_mib"],
                }
                if (tc.eval_every and step % tc.eval_every == 0 or done) and run.data.test_x is not None and rank == 0:
                    last_eval = evaluate(run.model, state.params, state.buffers, run.data, tc.eval_batches)
                    record.update(last_eval)
                bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{record['samples_per_s']:.0f}")
                if metrics_log:
                    metrics_log.write(record)
            if tc.checkpoint_every and step % tc.checkpoint_every == 0 or done:
                _save(run_dir, state, comm, cfg, run.plan)
    except RuntimeError as error:
        lost = _lost_rank_error(error, heartbeat, rank, tracker.step) if world > 1 else None
        if lost is None:
            raise
        raise lost from error
    finally:
        timeline.save(run_dir / "trace" / f"rank{rank}.json")
        if heartbeat is not None:
            heartbeat.stop()
        tracker.close()
    bar.close()
    wall = time.perf_counter() - t_start
    summary = {
        "model": cfg.model.name,
        "world": world,
        "steps": state.step,
        "loss": record.get("loss"),
        **last_eval,
        "wall_s": wall,
        "step_ms": 1e3 * times.median("step_s"),
        "compute_ms": 1e3 * times.median("compute_s"),
        "comm_wait_ms": 1e3 * times.median("comm_wait_s"),
        "bytes_per_step": int(times.median("bytes_sent")) if times.rows else 0,
        "compression": run.plan.nbytes / times.median("bytes_sent") if times.rows and times.median("bytes_sent") else None,
        "samples_per_s": gbs / times.median("step_s"),
        "skipped_steps": skipped,
        "state_mib": record.get("state_mib"),
        "run_dir": str(run_dir),
    }
    if metrics_log:
        metrics_log.write({"summary": True, **summary})
        metrics_log.close()
    return summary


def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Validate ``cfg`` and train it in ``run_dir`` on the world it names; return rank 0's summary."""
    validate(cfg, run_dir)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    layout = layout_of(cfg)
    container = OmegaConf.to_container(cfg, resolve=True)
    if layout.launcher == "elastic":
        try:
            results = spawn(train_worker, (container, str(run_dir)), layout)
        except WorkerFailedError as error:
            if error.signal is None:
                raise  # the worker's own one-line error
            raise RankLostError(_lost_message(Path(run_dir), error)) from error
        summary = results[0]
    else:
        summary = train_worker(cfg, str(run_dir))
    return summary


def _lost_message(run_dir: Path, error: WorkerFailedError) -> str:
    step = Progress.read(run_dir, error.rank).get("step")
    at = f" at step {step}" if step else " before step 1"
    steps = sorted(int(m.group(1)) for p in (run_dir / "checkpoints").glob("step_*.pt") if (m := re.search(r"(\d+)", p.name)))
    resume = (f"the last checkpoint is step {steps[-1]} (continue with trainer.resume=true, or set "
              "world.max_restarts to restart from it automatically)") if steps else "there is no checkpoint yet"
    return f"rank {error.rank} was lost{at}: process {error.pid} was killed by {error.signal}; the other ranks were stopped; {resume}"


def main(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Run and print the one-line summary (what ``recipes/train.py`` does)."""
    summary = run(cfg, run_dir)
    if int(os.environ.get("RANK", 0)) == 0:
        print(summary_line(summary), flush=True)
    return summary
