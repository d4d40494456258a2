"""What a run reports while it trains: a record per logged step, evaluations, the bar and the summary.

``Report`` turns each step's metrics (``fdp.step.train_step``) into the records ``metrics.jsonl``
holds (rank 0 writes them; every rank computes the same world-mean loss), evaluates when
due, and sums the run up at its end. Evaluations during training score the validation split
(``val_*``; the test split where the data has none), so what selects a model (early stopping, the
best checkpoints) never sees the test split; the test split is scored once, at the run's end
(``test_*``, in the last record and the summary).
"""

from __future__ import annotations

import time

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from fdp.comm import Comm
from fdp.data import SPLITS, has_split
from fdp.optim.ema import averaged_as
from fdp.run.build import RunParts, display_name
from fdp.run.evaluate import evaluate
from fdp.run.memory.micro_batch import fixed_accum
from fdp.run.report.loggers import check_loggers, open_loggers
from fdp.run.report.metrics import MetricsLog, StepTimes, progress
from fdp.run.rundir import RunDir
from fdp.state.train_state import TrainState

__all__ = ["Report", "evaluated_names"]

AVERAGE = "ema_"  # the moving average's evaluation, beside the params': ema_val_loss


def evaluated_names(evaluation: tuple[str, ...], average: bool) -> tuple[str, ...]:
    """The metrics an evaluating step adds to its record: the evaluation's (``fdp.run.evaluate.metric_names``),
    and with a moving average of the params (``trainer.ema_decay``) the same of the average.

    >>> evaluated_names(("test_loss",), average=True)
    ('test_loss', 'ema_test_loss')
    """
    return (*evaluation, *(f"{AVERAGE}{name}" for name in evaluation if average))


class Report:
    """The metrics of one rank's run (see the module docstring)."""

    peak = None  # this rank's fdp.procs.allocator.PeakMemory since the budget began: the summary's peak_mib

    def __init__(
        self,
        cfg: DictConfig,
        run_dir: RunDir,
        parts: RunParts,
        comm: Comm,
        first_step: int,
        last_step: int,
        stage_choice: dict | None = None,
    ):
        self.cfg, self.run_dir, self.parts, self.comm = cfg, run_dir, parts, comm
        self.last_step = last_step
        is_rank0 = comm.rank == 0
        self.log = self._open_log(resume=first_step > 0) if is_rank0 else None
        self.bar = progress(last_step, first_step, enabled=cfg.trainer.progress and is_rank0)
        self.times, self.skipped, self.last_eval, self.record = StepTimes(), 0, {}, {}
        # The split the evaluations during training score, and whether the test split waits for the end.
        self.watched = next((split for split in SPLITS if has_split(parts.data, split)), None)
        self.tests_at_end = self.watched == "val" and has_split(parts.data, "test")
        self.tested_at: int | None = None  # the step the test split was scored at the end of
        self.started = time.perf_counter()
        self.shrinks: list[dict] = []  # each time the world went on without a lost rank (fdp.procs.shrink)
        self.accum = fixed_accum(cfg.trainer.accum_steps)  # micro-batches per step (trainer.accum_steps=auto decides)
        self.micro_batches: list[dict] = []  # each micro-batch trainer.accum_steps=auto chose
        self.grows: list[dict] = []  # each time ranks joined it (fdp.procs.grow)
        self.stage_choice = stage_choice  # the stage trainer.zero_stage=auto chose (fdp.run.memory.auto_stage)
        if self.log and stage_choice:
            self.log.write({"zero_stage": True, "step": first_step, **stage_choice})

    def shrunk(self, comm: Comm, record: dict) -> None:
        """The world went on without a lost rank from step ``record["step"]``: note it (a line of
        ``metrics.jsonl``, and the summary); the new world's rank 0 writes the records from here on."""
        self.comm = comm
        if comm.rank == 0 and self.log is None:
            self.log = self._open_log(resume=True)
        self.shrinks.append(record)
        if self.log:
            self.log.write({"shrink": True, **record})

    def micro_batch(self, record: dict, accum: int) -> None:
        """``trainer.accum_steps=auto`` chose a micro-batch from step ``record["step"] + 1``: note it (a line of
        ``metrics.jsonl``, and the summary); ``accum``: the micro-batches per step now."""
        self.accum = accum
        self.micro_batches.append(record)
        if self.log:
            self.log.write({"micro_batch": True, **record})

    def grown(self, comm: Comm, record: dict) -> None:
        """Ranks joined the world at step ``record["step"]``: note it (``metrics.jsonl`` and the summary)."""
        self.comm = comm
        self.grows.append(record)
        if self.log:
            self.log.write({"grow": True, **record})

    def _open_log(self, resume: bool) -> MetricsLog:
        tc = self.cfg.trainer
        names = check_loggers(tc.loggers, tc.tensorboard)
        settings = OmegaConf.to_container(self.cfg, resolve=True)
        return MetricsLog(
            self.run_dir.path, resume=resume, loggers=open_loggers(names, self.run_dir.path, resume, settings)
        )

    def step(
        self, state: TrainState, metrics: dict, stopping: bool = False, average: dict | None = None
    ) -> dict | None:
        """Count a step; on a logged one (every ``log_every``-th, the last, ``stopping`` early included) or
        one that evaluates (every ``eval_every``-th and the last, whatever ``log_every`` is; not on a run
        stopping early: it should stop at once), write its record, with the evaluation's metrics.

        ``average``: the params' moving average (``fdp.optim.ema``), evaluated too (``ema_val_loss``...).
        The last step (not stopping early) scores the test split too.
        Returns the record of a step that evaluated, rank 0's on every rank, else ``None``.
        """
        tc, number = self.cfg.trainer, state.step
        self.times.add(metrics)
        self.skipped += metrics["skipped"]
        self.bar.update(1)
        done = number == self.last_step
        logged = number % tc.log_every == 0 or done or stopping
        # Each setting counts its own steps: an evaluation is due every eval_every steps, logged or not.
        evaluates = self.watched is not None and (
            tc.eval_every and number % tc.eval_every == 0 or done and not stopping
        )
        if not logged and not evaluates:
            return
        self.record = self._record(number, metrics)
        if evaluates:
            tested = self.tests_at_end and done and not stopping
            evaluation = self._scores(state, (self.watched, "test") if tested else (self.watched,), average)
            self.tested_at = number if tested else self.tested_at
            if self.comm.rank == 0:
                self.last_eval = evaluation
                self.record.update(self.last_eval)
            evaluated = self._from_rank0(self.record)
        else:
            evaluated = None
        self.bar.set_postfix(loss=f"{self.record['loss']:.4f}", samples_s=f"{self.record['samples_per_s']:.0f}")
        if self.log:
            self.log.write(self.record)
        return evaluated

    def _from_rank0(self, record: dict) -> dict:
        """Rank 0's record on every rank: what it evaluated, for decisions every rank must make alike."""
        if self.comm.world_size == 1:
            return dict(record)
        box = [record if self.comm.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.comm.group, group_src=0)
        return box[0]

    def _record(self, number: int, m: dict) -> dict:
        loss, world = m["loss"].clone(), self.comm.world_size
        if world > 1:
            loss = self.comm.allreduce(loss / world).wait()
        gbs = self.cfg.data.global_batch_size
        record = {
            "step": number,
            "loss": loss.item(),
            "lr": m["lr"],
            "grad_norm": m["grad_norm"].item(),
            "samples_per_s": gbs / m["step_s"],
            "step_ms": 1e3 * m["step_s"],
            "compute_ms": 1e3 * m["compute_s"],
            "comm_wait_ms": 1e3 * m["comm_wait_s"],
            "data_wait_ms": 1e3 * m["data_wait_s"],
            "bytes_sent": m["bytes_sent"],
            "compression": self.parts.plan.nbytes / m["bytes_sent"] if m["bytes_sent"] else None,
            "skipped_steps": self.skipped,
            "state_mib": m["state_mib"],
        }
        if "loss_scale" in m:
            record["loss_scale"] = m["loss_scale"].item()
        return record

    def _scores(self, state: TrainState, splits: tuple, average: dict | None) -> dict | None:
        """The metrics of the params (and of their moving ``average``, ``ema_*``) on ``splits``: rank 0's figures;
        the ranks that evaluate with it are the update's to say (ZeRO stage 3: all of them), ``None`` on the others."""
        scores: dict | None = {}
        for split in splits:
            figures = self._evaluate(state, state.params, split)
            if average is not None:
                on_average = self._evaluate(state, averaged_as(average, state.params), split)
                figures = figures and {**figures, **{f"{AVERAGE}{k}": v for k, v in on_average.items()}}
            scores = None if figures is None or scores is None else {**scores, **figures}
        return scores

    def tested(self, state: TrainState, average: dict | None = None) -> None:
        """Score the test split once at the end of a run that stopped before its last step (early stopping,
        ``max_time``), where the last step's record did not: a record of its own, and the summary's figures."""
        if not self.tests_at_end or self.tested_at == state.step or not self.times.rows:  # scored, or no step run
            return
        evaluation = self._scores(state, ("test",), average)
        self.tested_at = state.step
        if self.comm.rank == 0 and evaluation:
            self.last_eval = {**self.last_eval, **evaluation}
            if self.log:
                self.log.write({"step": state.step, **evaluation})

    def _evaluate(self, state: TrainState, params, split: str) -> dict | None:
        """The metrics of ``params`` (this rank's, as the state holds them) on ``split``, on a rank that evaluates."""
        parts, tc = self.parts, self.cfg.trainer
        # In pieces no larger than what one forward of training takes: what trains within a memory budget evaluates.
        micro = max(1, self.cfg.data.global_batch_size // self.comm.world_size // self.accum)
        with parts.update.evaluating(params, self.comm) as evaluated:
            if evaluated is None:
                return None
            read, wrap, together = evaluated
            return evaluate(
                parts.model,
                read,
                state.buffers,
                parts.data,
                tc.eval_batches,
                criterion=parts.criterion,
                num_workers=self.cfg.data.get("num_workers", 0),
                precision=parts.precision,
                fits=micro,
                wrap=wrap,
                together=together,
                split=split,
            )

    def summary(
        self, state: TrainState, device: str, interrupted: str | None = None, stopped: str | None = None
    ) -> dict:
        """The run in one record (the ``fdp: ...`` line rank 0 prints), also written to ``metrics.jsonl``;
        ``interrupted``: the signal that stopped it early; ``stopped``: the setting that ended it before
        its last step (``max_time``, ``early_stopping``: ``fdp.run.loop_controls``)."""
        self.bar.close()
        times, gbs = self.times, self.cfg.data.global_batch_size
        rows = times.rows
        sent = times.median("bytes_sent") if rows else 0
        summary = {
            "model": display_name(self.cfg.model),
            "world": self.comm.world_size,
            "device": device,
            "steps": state.step,
            "loss": self.record.get("loss"),
            **self.last_eval,
            "wall_s": time.perf_counter() - self.started,
            "step_ms": 1e3 * times.median("step_s"),
            "compute_ms": 1e3 * times.median("compute_s"),
            "comm_wait_ms": 1e3 * times.median("comm_wait_s"),
            "data_wait_ms": 1e3 * times.mean("data_wait_s"),  # every step's: a loader's start-up stall counts
            "bytes_per_step": int(sent),
            # Under an outer loop most steps send nothing: the mean is what a sync every H steps costs.
            "mean_bytes_per_step": int(sum(r["bytes_sent"] for r in rows) / len(rows)) if rows else 0,
            "compression": self.parts.plan.nbytes / sent if sent else None,
            "samples_per_s": gbs / times.median("step_s"),
            "skipped_steps": self.skipped,
            "state_mib": self.record.get("state_mib"),
            **({"peak_mib": round(self.peak.mib(), 1)} if self.peak else {}),
            "run_dir": str(self.run_dir.path),
            **({"shrinks": self.shrinks} if self.shrinks else {}),
            **({"grows": self.grows} if self.grows else {}),
            **({"micro_batches": self.micro_batches} if self.micro_batches else {}),
            **({"zero_stage": self.stage_choice} if self.stage_choice else {}),
            **({"interrupted": interrupted} if interrupted else {}),
            **({"stopped": stopped} if stopped else {}),
        }
        if self.log:
            self.log.write({"summary": True, **summary})
            self.log.close()
        return summary
