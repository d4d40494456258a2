"""From a config to a trained, logged and checkpointed run, on one process or many.

``run(cfg, run_dir)`` is what ``recipes/train.py`` calls. For a local world it starts
the workers with the elastic launcher; each worker (or the single process) then runs
``train_worker``: build the pieces, check that the ranks agree, and loop.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from fdp import checkpoint, compiled, zero
from fdp.build import Run, display_name, setup
from fdp.comm import Comm
from fdp.config import ConfigError, validate
from fdp.data import (
    Dataset,
    MapData,
    eval_batches,
    has_test_split,
    train_batches,
)
from fdp.devices import (
    Placement,
    batch_to_device,
    device_of,
    place,
    probe_gpus,
    visible_gpus,
)
from fdp.functional import FunctionalModel
from fdp.launch import (
    ENV_LAUNCHERS,
    Heartbeat,
    RankLostError,
    WorkerFailedError,
    WorldLayout,
    init_distributed,
    spawn,
    tune_allocator,
)
from fdp.losses import Criterion, batch_metrics, cross_entropy, make_loss_fn
from fdp.metrics import MetricsLog, StepTimes, progress, summary_line
from fdp.outer import check_outer, make_outer_step
from fdp.plan import BucketPlan
from fdp.precision import Precision, set_matmul_precision
from fdp.slurm import job_world
from fdp.trace import NullTimeline, Timeline
from fdp.train import TrainState, make_train_step

log = logging.getLogger("fdp")


def placement_of(cfg: DictConfig, probe=None) -> Placement:
    """Where this node's ranks compute (``world.accelerator``, ``world.devices``, ``world.backend``)."""
    world = cfg.world
    local = None
    if world.launcher == "torchrun":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world.nproc_per_node))
    elif world.launcher == "slurm":
        local = job_world(os.environ).local_world_size
    return place(
        world.accelerator, world.devices, world.launcher, world.nproc_per_node, world.backend,
        visible=visible_gpus(), probe=probe, local_world_size=local,
    )


def layout_of(cfg: DictConfig) -> WorldLayout:
    world = cfg.world
    placement = placement_of(cfg)
    nnodes, nproc = world.nnodes, placement.nproc_per_node
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world.launcher == "none" and launched > 1:
        raise ConfigError(f"world={world.name}: this process was started as one of WORLD_SIZE={launched}; expected world=torchrun")
    if world.launcher == "torchrun":
        nnodes = int(os.environ.get("WORLD_SIZE", nproc)) // max(1, nproc)
    elif world.launcher == "slurm":
        job = job_world(os.environ)
        nproc, nnodes = job.local_world_size, job.world_size // job.local_world_size
    return WorldLayout(
        placement.launcher, nnodes, nproc, placement.backend, world.timeout_s, world.max_restarts,
        placement.accelerator, placement.device_ids,
    )


def resolve_world(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``world`` naming the devices, processes and backend this machine gives it.

    Resolved once, before any worker starts, so every worker reads the same answer (and
    the GPUs are probed once); the workers' own ``layout_of`` then only re-checks it.
    Busy or unusable GPUs that ``world.devices=auto`` passed over are reported on stderr.
    """
    under_torchrun = cfg.world.launcher in ENV_LAUNCHERS
    # Under torchrun or SLURM each process is a rank; it checks its own GPU when it takes it.
    placement = placement_of(cfg, probe=None if under_torchrun else probe_gpus)
    for index, reason in placement.unusable:
        print(f"fdp: GPU {index} is busy or unusable and is left out: {reason}", file=sys.stderr, flush=True)
    resolved = copy.deepcopy(cfg)  # keeps the schema: the values below are type-checked
    resolved.world.accelerator = placement.accelerator
    resolved.world.backend = placement.backend
    if not under_torchrun:
        resolved.world.launcher = placement.launcher
        resolved.world.nproc_per_node = placement.nproc_per_node
    resolved.world.devices = list(placement.device_ids) if placement.accelerator == "gpu" else "auto"
    return resolved


# -- evaluation -------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(
    model: FunctionalModel, params, buffers, data: Dataset | MapData, max_batches: int, batch_size: int = 256,
    criterion: Criterion = cross_entropy, num_workers: int = 0, precision: Precision = Precision(),
) -> dict:
    """Mean loss over (up to ``max_batches`` batches of) the test split, and accuracy where it applies.

    Accuracy applies to class scores ``(..., classes)`` for integer targets ``(...)``. Runs on
    the params' device, in ``precision`` (scored in float32).
    """
    device = device_of(params)
    total_loss, count, correct, scored = 0.0, 0, 0, 0
    for batch in eval_batches(data, batch_size, max_batches, num_workers=num_workers):
        x, y = batch_to_device(batch, device)
        with precision.autocast(device.type):
            outputs, _ = model.apply(params, buffers, precision.cast(x), training=False)
        if isinstance(outputs, torch.Tensor) and outputs.is_floating_point():
            outputs = outputs.float()
        loss, weight, hits, n = batch_metrics(criterion, outputs, y)
        total_loss, count, correct, scored = total_loss + loss, count + weight, correct + hits, scored + n
    metrics = {"test_loss": total_loss / count}
    if scored:
        metrics["test_acc"] = correct / scored
    return metrics


# -- the run --------------------------------------------------------------------------------
def _save(run_dir: Path, state: TrainState, comm: Comm, cfg: DictConfig, plan: BucketPlan) -> None:
    if cfg.trainer.zero_stage:  # saved whole, so that any world size and stage can resume it
        state = zero.gather_state(state, plan, comm)
    extra = {"config": OmegaConf.to_yaml(cfg)}
    checkpoint.save_checkpoint(run_dir / "checkpoints", state, plan, comm, keep=cfg.trainer.keep_checkpoints, extra=extra)


def _resume(run_dir: Path, run: Run, comm: Comm) -> TrainState:
    sharded = zero.is_sharded(run.state.opt_state, run.plan)
    template = zero.unsharded_template(run.state, run.optimizer) if sharded else run.state
    state = checkpoint.load_checkpoint(run_dir / "checkpoints" / checkpoint.LAST, template, run.plan, comm)
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
    layout = layout_of(cfg)
    comm = init_distributed(layout)
    try:
        return _train(cfg, Path(run_dir), comm, layout.device(int(os.environ.get("LOCAL_RANK", 0))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: DictConfig, run_dir: Path, comm: Comm, device: torch.device) -> dict:
    rank, world = comm.rank, comm.world_size
    _setup_logging(run_dir, rank)
    tc = cfg.trainer
    set_matmul_precision(tc.matmul_precision)  # process-wide: set once, before anything runs
    if cfg.data.global_batch_size % world:
        raise ConfigError(f"data.global_batch_size={cfg.data.global_batch_size}: expected a multiple of the world size {world}")
    run = setup(cfg, comm, device)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    has_checkpoint = (run_dir / "checkpoints" / checkpoint.LAST).exists()
    state = _resume(run_dir, run, comm) if tc.resume or (restarted and has_checkpoint) else run.state
    if rank == 0:
        (run_dir / "plan.txt").write_text(f"{run.plan}\nfingerprint: {run.plan.fingerprint()}\n")
        (run_dir / "plan.json").write_text(json.dumps(run.plan.to_dict(), indent=1))
        log.info(
            f"{display_name(cfg.model)}: {run.num_params:,} parameters in {len(run.plan)} buckets "
            f"({run.plan.nbytes / 2**20:.2f} MiB, plan {run.plan.fingerprint()[:12]}, see plan.txt), world {world} on {device}"
            + (f" over {dist.get_backend()}" if dist.is_initialized() else "")
        )
    timeline = Timeline(rank) if tc.trace else NullTimeline()
    outer = check_outer(OmegaConf.to_container(cfg.outer))
    last_step = min(tc.max_steps, tc.stop_at or tc.max_steps)
    choice = compiled.choose(tc.compile, run_dir, device.type, last_step - state.step, comm)
    if rank == 0:
        log.info(choice.message)
    options = dict(
        accum_steps=tc.accum_steps, schedule=tc.schedule, nonfinite=tc.nonfinite, timeline=timeline,
        donate=True,  # the loop below never looks at a state again once it has the next
        sync_buffers=tc.sync_buffers, precision=run.precision, compile=choice.compile,
        zero_stage=tc.zero_stage,
    )
    loss_fn = make_loss_fn(run.model, run.criterion)
    if outer.name == "none":
        train_step = make_train_step(loss_fn, run.optimizer, run.plan, run.hook, comm, **options)
    else:
        train_step = make_outer_step(loss_fn, run.optimizer, run.plan, outer, run.hook, comm, **options)
    metrics_log = MetricsLog(run_dir, resume=state.step > 0, tensorboard=tc.tensorboard) if rank == 0 else None
    times, skipped, last_eval, record = StepTimes(), 0, {}, {}
    gbs = cfg.data.global_batch_size
    t_start = time.perf_counter()
    bar = progress(last_step, state.step, enabled=tc.progress and rank == 0)
    tracker = Progress(run_dir, rank)
    heartbeat = Heartbeat(rank, world).start() if world > 1 else None
    num_workers = cfg.data.get("num_workers", 0)
    on_gpu = any(p.is_cuda for p in state.params.values())
    batches = train_batches(run.data, gbs, cfg.seed, rank, world, state.step, last_step, num_workers, pin_memory=on_gpu)
    try:
        while state.step < last_step:
            tracker.update(state.step + 1)
            batch = batch_to_device(next(batches), device)
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
                if "loss_scale" in m:
                    record["loss_scale"] = m["loss_scale"].item()
                if (tc.eval_every and step % tc.eval_every == 0 or done) and has_test_split(run.data) and rank == 0:
                    last_eval = evaluate(run.model, state.params, state.buffers, run.data, tc.eval_batches,
                                         criterion=run.criterion, num_workers=num_workers, precision=run.precision)
                    record.update(last_eval)
                bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{record['samples_per_s']:.0f}")
                if metrics_log:
                    metrics_log.write(record)
            if tc.checkpoint_every and step % tc.checkpoint_every == 0 or done:
                train_step.settle()  # no checkpoint of a step whose gradients were not finite
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
    if rank == 0 and times.rows:  # what this invocation measured, for the next one's trainer.compile=auto
        compiled.write_record(run_dir, choice, times.rows[0]["step_s"], times.median("step_s"))
    summary = {
        "model": display_name(cfg.model),
        "world": world,
        "device": device.type,
        "steps": state.step,
        "loss": record.get("loss"),
        **last_eval,
        "wall_s": wall,
        "step_ms": 1e3 * times.median("step_s"),
        "compute_ms": 1e3 * times.median("compute_s"),
        "comm_wait_ms": 1e3 * times.median("comm_wait_s"),
        "bytes_per_step": int(times.median("bytes_sent")) if times.rows else 0,
        # Under an outer loop most steps send nothing: the mean is what a sync every H steps costs.
        "mean_bytes_per_step": int(sum(r["bytes_sent"] for r in times.rows) / len(times.rows)) if times.rows else 0,
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
    cfg = resolve_world(cfg)
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
