"""The shell entry's side of a run: one line for every refusal, interruption and failure.

``main(hydra_main)`` runs a ``@hydra.main`` function so that Hydra's own errors (an
unknown option or key, a value of the wrong type, an override it cannot parse, a run
directory it cannot create) come out as one ``error:`` line naming the key and what was
expected, with exit status 2, instead of Hydra's report and its ``HYDRA_FULL_ERROR``
hint. It does so the way Hydra documents: with ``HYDRA_FULL_ERROR=1`` Hydra re-raises
what it caught, and ``hydra_error_line`` translates it. A user who sets
``HYDRA_FULL_ERROR=1`` themselves gets Hydra's full trace, as Hydra promises.

``run_from_shell(cfg, run_dir, save_config)`` is what the recipe does with a composed
config: start the run as the Python API does (``fdp.run.startup.start_run``: the world
resolved, the config validated once, the run directory owned), write its config files,
train, and end with one line and an exit status: 0 done, 2 refused (nothing left behind) or a callback of
yours failed (``fdp.run.callbacks``; its traceback in ``train.log``), 1 failed, ``128 + signal``
interrupted (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
import re
import signal
import sys
import traceback
import typing
from pathlib import Path
from typing import Any, Callable

from fdp.errors import ConfigError
from fdp.procs.interrupt import StoppedAtOnce, exit_code, requeue_job, stop_signal_names
from fdp.procs.launch import RankLostError, RankOutOfMemoryError, WorkerFailedError
from fdp.procs.launchers import launcher_of
from fdp.run.checkpoint import CheckpointError, last_of
from fdp.run.config.keys import unknown_key_line
from fdp.run.report.metrics import summary_line
from fdp.run.rundir import CHECKPOINTS, run_log, train_log_handler

__all__ = ["hydra_error_line", "main", "run_from_shell"]

REFUSED, FAILED = 2, 1
# Failures the run reports in one line: the message says what happened and what to change.
EXPECTED = (
    "ConfigError",
    "CallbackError",
    "CheckpointError",
    "FloatingPointError",
    "RankLostError",
    "RankOutOfMemoryError",
    "RunDirInUse",
    "RunDoesNotFit",
)
REFUSALS = ("ConfigError", "CheckpointError", "RunDirInUse", "RunDoesNotFit")


# -- Hydra's errors, one line each ------------------------------------------------------------
def _expected_type(schema: Any, key: str) -> str | None:
    """What a dataclass field ``key`` of ``schema`` holds, in words."""
    if not dataclasses.is_dataclass(schema):
        return None
    hints = typing.get_type_hints(schema)
    kind = hints.get(key)
    optional = typing.get_origin(kind) is typing.Union and type(None) in typing.get_args(kind)
    if optional:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind)
    if typing.get_origin(kind) is list:
        words = "a list in brackets"
    if words is None:
        return None
    return f"{words} or null" if optional else words


def _override_of(key: str, argv: list[str]) -> str | None:
    """The command-line override that sets ``key`` (the last one: later ones win)."""
    found = None
    for arg in argv:
        name, eq, _ = arg.lstrip("+~").partition("=")
        if eq and name == key:
            found = arg.lstrip("+~")
    return found


def _unknown_key(cause: Any, override: str | None) -> str:
    full_key = str(getattr(cause, "full_key", "") or "")
    parent, _, key = full_key.rpartition(".")
    schema = getattr(cause, "object_type", None)
    option = getattr(schema, "name", None) if dataclasses.is_dataclass(schema) else None
    return unknown_key_line(parent, key, {parent: {"name": option}} if parent else {}, override or full_key)


def _bad_value(cause: Any, override: str | None) -> str:
    full_key = str(getattr(cause, "full_key", "") or "")
    key = full_key.rpartition(".")[2]
    expected = _expected_type(getattr(cause, "object_type", None), key) or "a value of the key's type"
    setting, _, value = (override or "").partition("=")
    if expected == "a list in brackets" and value and not value.startswith("["):  # loggers=csv: one item, unbracketed
        expected += f" ({setting}=[{value}])"
    return f"{override or full_key}: expected {expected}"


def _missing_option(error: Any) -> str:
    group, _, name = str(getattr(error, "missing_cfg_file", "") or "").rpartition("/")
    options = sorted(o for o in (getattr(error, "options", None) or []) if not o.endswith("_schema"))
    if not group or not options:
        return str(error).strip().splitlines()[0]
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f" (did you mean {group}={close[0]}?)" if close else ""
    return f"{group}={name}: expected one of {', '.join(options)}{hint}"


def _unparsable(argv: list[str], error: BaseException) -> str:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    reason = str(error).strip().splitlines()[0]
    for arg in argv:
        try:
            parser.parse_overrides([arg])
        except Exception:
            return f"{arg}: expected key=value in Hydra's override grammar ({reason})"
    return f"cannot read the overrides: {reason}"


def hydra_error_line(error: BaseException, argv: list[str] | None = None) -> str | None:
    """One line for an error Hydra raised while composing the config or making the run directory
    (``None``: not one of Hydra's; a bug to show in full).

    >>> from fdp.run.config.compose import compose
    >>> try:
    ...     compose("trainer.max_stpes=5")
    ... except Exception as error:
    ...     print(hydra_error_line(error, ["trainer.max_stpes=5"]))  # doctest: +NORMALIZE_WHITESPACE
    trainer.max_stpes=5: unknown key; expected a key of trainer
    (did you mean trainer.max_steps? trainer takes no keys of your own)
    """
    from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    argv = list(sys.argv[1:] if argv is None else argv)
    if isinstance(error, MissingConfigException):
        return _missing_option(error)
    if isinstance(error, OverrideParseException):
        return _unparsable(argv, error)
    cause = error.__cause__
    if isinstance(error, ConfigCompositionException) and cause is not None:
        override = _override_of(str(getattr(cause, "full_key", "")), argv)
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
            return _unknown_key(cause, override)
        if isinstance(cause, ValidationError):
            return _bad_value(cause, override)
    appended = re.search(r"An item is already at '([^']+)'", str(error))
    if appended:  # +key=value for a key the config has
        override = next(
            (a[1:] for a in reversed(argv) if a.startswith("+") and a[1:].partition("=")[0] == appended[1]), appended[1]
        )
        return f"+{override}: expected a new key, but {appended[1]} exists (set it without the +: {override})"
    if isinstance(error, HydraException):
        return str(error).strip().splitlines()[0]
    if isinstance(error, OSError) and _raised_in(error, "run_job"):  # Hydra making the run directory
        key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(argv) else "hydra.run.dir"
        return f"{key}={error.filename}: expected a directory this process can create and write ({error.strerror})"
    return None


def _raised_in(error: BaseException, function: str) -> bool:
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


def main(hydra_main: Callable[[], Any]) -> None:
    """Run a ``@hydra.main`` function, Hydra's own errors turned into one ``error:`` line (exit 2).

    ``--help`` (with any overrides) prints every key of that config, its value and meaning
    (``fdp.run.reference``), in place of Hydra's list of keys without meanings.
    """
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        _print_help([arg for arg in sys.argv[1:] if not arg.startswith("-")])
        return
    if os.environ.get("HYDRA_FULL_ERROR") == "1":  # the user asked for Hydra's full report
        hydra_main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises, rather than printing its report
    try:
        hydra_main()
    except Exception as error:
        line = hydra_error_line(error)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(REFUSED)


def _print_help(overrides: list[str]) -> None:
    from fdp.run.config.compose import compose
    from fdp.run.reference import help_text

    try:
        cfg = compose(*overrides)
    except Exception as error:
        print(f"error: {hydra_error_line(error) or error}", file=sys.stderr, flush=True)
        sys.exit(REFUSED)
    print(help_text(cfg), flush=True)


# -- a run from the shell -----------------------------------------------------------------
def _refused(error: BaseException) -> bool:
    if isinstance(error, WorkerFailedError):
        return error.error_type in REFUSALS
    return isinstance(error, (ConfigError, CheckpointError))


def _callback_failed(error: BaseException) -> bool:
    from fdp.run.callbacks.base import CallbackError

    if isinstance(error, WorkerFailedError):
        return error.error_type == CallbackError.__name__
    return isinstance(error, CallbackError)


def _traceback_of(error: BaseException) -> str:
    if isinstance(error, WorkerFailedError):
        return error.traceback
    return "".join(traceback.format_exception(error))


def _to_train_log(run_dir: Path | None, text: str) -> None:
    """``text`` into ``<run dir>/train.log`` alone (not the terminal)."""
    if run_dir is None or not text:
        return
    handler = train_log_handler(run_dir)
    handler.handle(logging.makeLogRecord({"msg": text.rstrip(), "levelno": logging.ERROR, "levelname": "ERROR"}))
    handler.close()


def _last_checkpoint(run_dir: Path) -> str:
    last = last_of(run_dir / CHECKPOINTS)
    if not last.exists():
        return "no checkpoint yet"
    from fdp.run.checkpoint import load

    return f"the last checkpoint is step {load(last)['step']} ({last})"


def _interrupted_line(summary: dict, run_dir: Path, extra: str = "") -> str:
    return (
        f"fdp: interrupted at step {summary['steps']} by {summary['interrupted']}; checkpoint "
        f"{last_of(run_dir / CHECKPOINTS)}; resume with trainer.resume=true hydra.run.dir={run_dir}{extra}"
    )


def run_from_shell(cfg: Any, run_dir: str | Path, save_config: Callable[[Any, Path], None]) -> int:
    """Start the run (``fdp.run.startup.start_run``), write its config files (``save_config``), train; the exit status.

    Every outcome ends in one line: the summary (stdout), ``error: ...`` (stderr) or
    ``fdp: interrupted ...``. What a started run prints goes to ``<run dir>/train.log`` too;
    a refused run leaves the directory as it found it (and none at all if it was new).
    """
    # Only for a run: translating Hydra's errors does not need them.
    from fdp.model.precision import slow_precision_note
    from fdp.run.startup import owns_run_dir, start_run
    from fdp.run.trainer import run_ranks

    run_dir = Path(run_dir)
    summary: dict = {}
    try:
        kind = launcher_of(cfg.world.launcher)
        owner = owns_run_dir(cfg)  # under torchrun and SLURM every rank runs this; rank 0 owns the directory
        if kind.held_at_start(cfg.world.requeue_signal):  # a signal sent during start-up waits for the loop's handler
            held = stop_signal_names(kind.name, cfg.world.requeue_signal)
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.Signals[name] for name in held])
        with run_log(run_dir if owner else None) as log:
            try:
                with start_run(cfg, run_dir, say=log.warning) as cfg:
                    if owner:
                        save_config(cfg, run_dir)
                        note = slow_precision_note(cfg.trainer.precision, cfg.world.accelerator)
                        if note:
                            log.warning(note)
                    summary = run_ranks(cfg, run_dir)
            except StoppedAtOnce as stop:
                log.error(f"fdp: stopped at once by a second {stop.signame}; {_last_checkpoint(run_dir)}")
                return exit_code(stop.signame)
            except KeyboardInterrupt:  # before the loop took over SIGINT
                log.error(f"fdp: interrupted by SIGINT before the training loop; {_last_checkpoint(run_dir)}")
                return exit_code("SIGINT")
            except Exception as error:
                if _refused(error):
                    raise
                if _callback_failed(error):  # the user's code, not fdp's: one line; where it failed, in train.log
                    _to_train_log(run_dir if owner else None, _traceback_of(error))
                    log.error(f"error: {error}")
                    return REFUSED
                if isinstance(error, WorkerFailedError) and error.error_type not in EXPECTED and error.traceback:
                    print(error.traceback, file=sys.stderr, end="")  # a bug: show where
                if not isinstance(error, (WorkerFailedError, RankLostError, RankOutOfMemoryError, FloatingPointError)):
                    raise
                log.error(f"error: {error}")
                return FAILED
            if summary.get("interrupted"):
                requeued = ""
                if owner and kind.requeues(summary["interrupted"], cfg.world.requeue_signal):
                    requeued = f"; {requeue_job()}"
                log.warning(_interrupted_line(summary, run_dir, requeued))
                return exit_code(summary["interrupted"])
            if owner:
                log.info(summary_line(summary))
            return 0
    except Exception as error:
        if not _refused(error):
            raise
        with contextlib.suppress(OSError):
            run_dir.rmdir()  # the one Hydra made for a run refused before it took it, if empty
        print(f"error: {error}", file=sys.stderr, flush=True)  # refused: nothing was written for it
        return REFUSED
