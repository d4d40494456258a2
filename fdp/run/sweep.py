"""A Hydra sweep (``recipes/train.py -m ...``) checked whole before its first job, run to its end, and summed up.

``SweepTable`` is the Hydra callback that ``conf/config.yaml`` names. Before any job
runs, it composes and validates every job's config: a sweep with a job that would be
refused is refused whole, in one line naming the job (exit 2), rather than after the
jobs before it have trained. A job that fails once started (a model that does not fit
its data) ends in its one line and the sweep goes on with the next. The sweep ends with
a table of its jobs (status, final loss, test metrics, time, run directory) and the
worst exit status of its jobs. Each job's row is also written to ``<sweep dir>/.fdp-jobs/<num>.json``
by the process that ran it: a launcher that runs jobs in processes of their own (``submitit_local``,
SLURM) calls ``on_job_end`` there, and the sweep's own process reads the rows back for its table.

>>> print(sweep_table([Job(0, "hooks=allreduce", 0, 1.5, "multirun/x/0", {"loss": 0.25, "test_acc": 0.9})]))
job | overrides       | status | loss   | test_loss | test_acc | time_s | run dir
----+-----------------+--------+--------+-----------+----------+--------+-------------
0   | hooks=allreduce | done   | 0.2500 | -         | 0.9000   | 1.5    | multirun/x/0
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

__all__ = ["Job", "SweepTable", "sweep_table", "sweep_jobs"]

_STATUS = {0: "done", 1: "failed", 2: "refused"}
_METRICS = ("loss", "test_loss", "test_acc")


class Job(NamedTuple):
    """One job of a sweep, once it ended."""

    num: int
    overrides: str
    status: int  # the exit status the job would have had alone (fdp.run.cli)
    seconds: float
    run_dir: str
    summary: dict


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """Every job's overrides, as Hydra's basic sweeper expands the command line's (``a=1,2 b=x,y``: four jobs)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def _varying(jobs: list[list[str]]) -> list[list[str]]:
    """Each job's overrides that tell it apart: those common to every job are left out."""
    common = set.intersection(*map(set, jobs)) if len(jobs) > 1 else set()
    return [[word for word in job if word not in common] for job in jobs]


JOB_ROWS = ".fdp-jobs"  # <sweep dir>/.fdp-jobs/<num>.json: a job's row, written by the process that ran it


def _written(rows: Path) -> list[Job]:
    """The rows the jobs' processes wrote under ``rows`` (none where the directory is missing)."""
    jobs = []
    for path in sorted(rows.glob("*.json")) if rows.is_dir() else ():
        try:
            jobs.append(Job(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # a row cut short: the job is left out of the table rather than the table lost
    return jobs


def _summary(run_dir: Path) -> dict:
    """The summary record a finished run wrote last in its ``metrics.jsonl`` (empty if none)."""
    try:
        last = (run_dir / "metrics.jsonl").read_text().strip().splitlines()[-1]
        record = json.loads(last)
    except (OSError, IndexError, ValueError):
        return {}
    return record if record.get("summary") else {}


def sweep_table(jobs: list[Job]) -> str:
    """The sweep's jobs as a table: one row each."""
    header = ("job", "overrides", "status", *_METRICS, "time_s", "run dir")

    def number(value: Any) -> str:
        return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"

    rows = [
        (
            str(j.num),
            j.overrides or "-",
            _STATUS.get(j.status, f"exit {j.status}"),
            *(number(j.summary.get(k)) for k in _METRICS),
            f"{j.seconds:.1f}",
            j.run_dir,
        )
        for j in jobs
    ]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


class SweepTable(Callback):
    """Hydra callback: every job checked before the first runs; a table and the worst exit status at the end."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.started = 0.0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra

        from fdp.errors import ConfigError
        from fdp.procs.launchers import launcher_of
        from fdp.run.cli import REFUSED, hydra_error_line
        from fdp.run.config.validate import validate
        from fdp.run.world import resolve_world

        loader = GlobalHydra.instance().config_loader()
        jobs = sweep_jobs(config)
        for num, overrides in enumerate(jobs):
            try:
                job = loader.load_sweep_config(config, list(overrides))
                with open_dict(job):
                    del job["hydra"]
                if launcher_of(job.world.launcher).starts_ranks:
                    continue  # its world exists only inside the job (torchrun, SLURM): checked there as it starts
                validate(resolve_world(job))
            except ConfigError as error:
                line = str(error)
            except Exception as error:
                line = hydra_error_line(error, list(overrides))
                if line is None:
                    raise
            else:
                continue
            which = " ".join(_varying(jobs)[num])
            print(
                f"error: sweep job {num} ({which}): {line}; no job of the {len(jobs)} was run",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(REFUSED)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.monotonic()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        from fdp.run.cli import FAILED

        if config.hydra.mode != RunMode.MULTIRUN:  # a single run has no table (nor a job number)
            return

        run_dir = Path(config.hydra.runtime.output_dir)
        status = job_return._return_value if job_return.status == JobStatus.COMPLETED else FAILED
        status = status if isinstance(status, int) else 0
        overrides = " ".join(OmegaConf.to_container(config.hydra.overrides.task))
        shown = str(run_dir) if run_dir.is_dir() else "-"  # a refused job leaves none
        job = Job(config.hydra.job.num, overrides, status, time.monotonic() - self.started, shown, _summary(run_dir))
        self.jobs.append(job)
        # Where the sweep's process finds it when the launcher ran this job in a process of its own.
        rows = run_dir.parents[len(Path(str(config.hydra.sweep.subdir)).parts) - 1] / JOB_ROWS
        try:
            rows.mkdir(parents=True, exist_ok=True)
            (rows / f"{job.num}.json").write_text(json.dumps(job._asdict()))
        except OSError:  # the table of this process still has it
            pass

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        ended = {job.num: job for job in _written(Path(str(config.hydra.sweep.dir)) / JOB_ROWS)}
        ended.update({job.num: job for job in self.jobs})  # those this process ran
        ran = [ended[num] for num in sorted(ended)]
        if not ran:
            return
        varying = _varying([j.overrides.split() for j in ran])
        jobs = [j._replace(overrides=" ".join(words)) for j, words in zip(ran, varying)]
        print(sweep_table(jobs), flush=True)
        worst = max((j.status for j in ran), key=lambda s: (s != 0, s))
        if worst:
            raise SystemExit(worst)
