"""``trainer.compile``: the step's gradient computation under ``torch.compile``.

The function fdp differentiates is pure, ``grad_and_value(loss_fn)(params, buffers,
batch) -> (grads, (loss, aux))``, which is what a compiler wants: the whole forward and
backward become one graph (inductor fuses the elementwise work and, under autocast,
the weight casts). It is compiled on the first step (the time is logged once) and reused
after: params, buffers, the batch and the loss scale are graph inputs, so new values of
the same shapes do not recompile.

At ZeRO stage 3 the params are gathered in module hooks and their gradients
reduce-scattered from tensor hooks, collectives and bookkeeping that stay out of any
graph. There the step compiles in regions, as FSDP2 runs are compiled: each of the
model's repeated blocks (``region_modules``) is one compiled region whose params the
gather makes whole at its hooks, outside it (``compiled_regions``), and the gradient is
taken by plain autograd (``fdp.model.functional.autograd_grad_and_value``), since an eager
``torch.func`` transform refuses compiled code. The other way, the whole forward compiled
with the gather's hooks as graph breaks, splits it at every module that holds params (11
breaks and 14 graphs on a 4-block transformer, against one graph shared by the blocks,
and twice the compile time), and in the step its compiled block frames read a bucket the
gather had released (``benchmarks/compile_stage3.py``).

Elsewhere only the ``after`` schedule is compiled. Under ``overlap`` the backward's tensor hooks
start collectives and hook chains from inside the transform, side effects the compiler
cannot put in a graph; a compiled step therefore reduces after backward (one log line
says so).

``trainer.compile=auto`` (the default) compiles where it pays: on a GPU, for a run whose
planned steps save more than the compile costs (``decide_compile``); never on the CPU.
The compiled artifacts live in the run directory (``cache_dir``), so a resumed or
restarted run reads them instead of compiling again, and what a run measured (compile
seconds, step times) is kept there for the next decision (``CompileCosts``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fdp._torch import inductor_default_cache_dir
from fdp.model import remat

log = logging.getLogger("fdp")

SETTINGS = ("auto", True, False)
# What compiling the gradient costs and saves when this run has measured nothing yet.
# On one H100 (precision_cuda.md, the 25M char transformer) the first compile took
# 17-26 s and the compiled step was 0.45-0.89x the uncompiled one: ~11% saved in fp32,
# ~50% with TF32 or bf16. The defaults take the slow compile and the small saving, so
# auto compiles only runs long enough to repay it even then.
KNOWN_COMPILE_S = 25.0
KNOWN_SAVING = 0.11  # of the uncompiled step's time
KNOWN_GPU_STEP_S = 0.035  # the 25M char transformer's fp32 step on an H100, uncompiled
COSTS_FILE = "fdp_compile_costs.json"


def check_compile(compile: Any, device: str = "cpu") -> bool | str:
    """``compile`` (``auto``, ``True`` or ``False``) if it can be honoured; else ``ValueError`` naming it.

    ``True`` needs ``torch.compile`` to build code for ``device``: on CPU inductor
    compiles C++ with the system compiler (``$CXX``, else ``g++``), on CUDA it needs
    triton. ``auto`` is always valid: it compiles only where it can (``decide_compile``).

    >>> check_compile(False), check_compile("auto")
    (False, 'auto')
    """
    if compile not in SETTINGS or isinstance(compile, int) and not isinstance(compile, bool):
        raise ValueError(f"compile={compile!r}: expected auto, true or false")
    if compile is True:
        missing = compiler_missing(device)
        if missing:
            raise ValueError(f"compile=True: {missing}; expected compile=false (or auto)")
    return compile


def compiler_missing(device: str) -> str | None:
    """Why ``torch.compile`` cannot build code for ``device`` here, or ``None`` when it can.

    >>> compiler_missing("meta") is None
    True
    """
    if device == "cpu":
        candidates = [os.environ.get("CXX"), "g++", "clang++", "c++"]
        if not any(c and shutil.which(c) for c in candidates):
            return "torch.compile needs a C++ compiler on CPU (none of $CXX, g++, clang++, c++ found)"
    elif device == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch.compile needs triton on CUDA and it is not installed"
    return None


def compiled_schedule(schedule: str) -> str:
    """The schedule a compiled step runs: ``after`` (overlap's in-backward hooks do not compile).

    >>> compiled_schedule("after")
    'after'
    """
    if schedule == "overlap":
        log.info(
            "trainer.compile: the overlap schedule does not compile (its backward hooks run collectives); "
            "reducing after backward"
        )
        return "after"
    return schedule


def compile_grad(grad_fn: Callable) -> Callable:
    """``grad_fn`` under ``torch.compile``; the first call (which compiles) logs its time once."""
    compiled = torch.compile(grad_fn)
    first = True

    def run(*args):
        nonlocal first
        if not first:
            return compiled(*args)
        t0 = time.perf_counter()
        out = compiled(*args)
        first = False
        log.info(f"trainer.compile: compiled the gradient computation in {time.perf_counter() - t0:.1f} s")
        return out

    return run


def region_modules(module: nn.Module) -> list[nn.Module]:
    """The modules a ZeRO stage-3 step compiles, one region each: the model's repeated blocks (a transformer's
    layers, ``fdp.model.remat.repeated_blocks``), else each module that holds params and has none inside it.

    >>> block = lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> len(region_modules(nn.Sequential(nn.Linear(2, 2), nn.ModuleList([block(), block()]))))
    2
    >>> [type(m).__name__ for m in region_modules(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1)))]
    ['Linear', 'Linear']
    """
    blocks = remat.repeated_blocks(module)
    if blocks:
        return blocks

    def holds(m: nn.Module) -> bool:
        return any(True for _ in m.parameters(recurse=False))

    return [m for m in module.modules() if holds(m) and not any(holds(inner) for inner in list(m.modules())[1:])]


def compiled_regions(loss_fn: Callable, modules: list[nn.Module]) -> Callable:
    """``loss_fn`` whose calls run each of ``modules``' ``forward`` under ``torch.compile``; the rest runs eager.

    The module's hooks stay outside its compiled forward (they run in ``nn.Module.__call__``), which is where
    ZeRO stage 3 gathers and releases params (``ParamGather.hold_by``). The compiled forwards are installed for
    the call alone, as ``fdp.model.recompute.checkpointed`` installs its own, so an evaluation runs the model as it
    is; blocks of one class share their compiled code. The first call, which compiles, logs its time once.

    >>> lin = nn.Linear(3, 1)
    >>> loss = compiled_regions(lambda x: lin(x).sum(), [lin])
    >>> "forward" in vars(lin)
    False
    """
    compiled = [(m, torch.compile(m.forward)) for m in modules]
    first = True

    def run(*args, **kwargs):
        nonlocal first
        t0 = time.perf_counter()
        installed = []
        try:
            for m, forward in compiled:
                installed.append((m, m.__dict__.get("forward")))
                m.forward = forward
            out = loss_fn(*args, **kwargs)
        finally:
            for m, own in reversed(installed):
                if own is None:
                    del m.forward
                else:
                    m.forward = own
        if first:
            first = False
            log.info(
                f"trainer.compile: the first forward, compiling {len(modules)} regions, took "
                f"{time.perf_counter() - t0:.1f} s"
            )
        return out

    return run


class CompileCosts(NamedTuple):
    """What compiling costs and saves: seconds for the first compile, seconds saved per step.

    ``measured`` says where the numbers come from: this run's earlier invocations, or
    the known defaults.
    """

    compile_s: float
    saving_s: float
    measured: bool


def decide_compile(
    setting: Any, device: str, planned_steps: int, costs: CompileCosts, missing: str | None = None
) -> tuple[bool, str]:
    """Whether a run compiles its gradient computation, and why, in a phrase for the log.

    ``setting`` is ``trainer.compile``; ``device`` the params' device type;
    ``planned_steps`` the steps this invocation will take; ``missing`` what keeps
    ``torch.compile`` from building code here (``compiler_missing``). ``auto``
    compiles on a GPU when ``planned_steps`` times the per-step saving exceeds the
    compile time, never on the CPU (the compiled fp32 step was no faster there and the
    C++ build takes minutes, ``precision_cpu.md``).

    >>> known = CompileCosts(25.0, 0.004, measured=False)
    >>> decide_compile("auto", "cuda", 300, known)
    (False, 'auto: 300 steps would save ~1 s, less than the ~25 s compile (known costs)')
    >>> decide_compile("auto", "cuda", 100_000, known)[0], decide_compile("auto", "cpu", 100_000, known)[0]
    (True, False)
    """
    if setting is True or setting is False:
        return setting, f"trainer.compile={str(setting).lower()}"
    if device != "cuda":
        return False, f"auto: not on {device} (compiling pays on a GPU, where the host's time per step shows)"
    if missing:
        return False, f"auto: {missing}"
    saved = planned_steps * costs.saving_s
    source = "measured in this run" if costs.measured else "known costs"
    if saved <= costs.compile_s:
        return (
            False,
            f"auto: {planned_steps} steps would save ~{saved:.0f} s, "
            f"less than the ~{costs.compile_s:.0f} s compile ({source})",
        )
    return (
        True,
        f"auto: {planned_steps} steps save ~{saved:.0f} s, more than the ~{costs.compile_s:.0f} s compile ({source})",
    )


def costs_from(record: dict) -> CompileCosts:
    """The costs a run's record (``read_record``) implies, the known defaults filling what it lacks.

    The saving is the measured uncompiled step time less the compiled one when the run
    has run both ways; from one of them and ``KNOWN_SAVING`` otherwise.

    >>> costs_from({})
    CompileCosts(compile_s=25.0, saving_s=0.00385, measured=False)
    >>> costs_from({"compile_s": 4.0, "step_s": {"eager": 0.02, "compiled": 0.012}})
    CompileCosts(compile_s=4.0, saving_s=0.008, measured=True)
    """
    steps = record.get("step_s", {})
    eager, compiled = steps.get("eager"), steps.get("compiled")
    if eager is not None and compiled is not None:
        saving = max(eager - compiled, 0.0)
    elif eager is not None:
        saving = eager * KNOWN_SAVING
    elif compiled is not None:
        saving = compiled * KNOWN_SAVING / (1.0 - KNOWN_SAVING)
    else:
        saving = KNOWN_GPU_STEP_S * KNOWN_SAVING
    compile_s = record.get("compile_s", KNOWN_COMPILE_S)
    measured = "compile_s" in record or eager is not None or compiled is not None
    return CompileCosts(float(compile_s), round(saving, 9), measured)


def cache_dir(run_dir: str | os.PathLike) -> Path:
    """Where a run keeps its compiled artifacts and what compiling cost it: ``<run dir>/compile_cache``.

    >>> cache_dir("outputs/run1").as_posix()
    'outputs/run1/compile_cache'
    """
    return Path(run_dir) / "compile_cache"


def use_cache_dir(directory: str | os.PathLike, environ: dict = os.environ) -> Path:
    """Point inductor's caches (FX graphs, AOT autograd, kernels) at ``directory``; return the one in use.

    Set before the first compile, the run's later invocations find their graphs there
    (a compile that hits the cache skips code generation and the C++/triton build). A
    ``TORCHINDUCTOR_CACHE_DIR`` the user set is kept; torch's own default (which torch
    writes into the environment when its compiler is imported) is not.

    >>> use_cache_dir("/tmp/run/compile_cache", environ={}).as_posix()
    '/tmp/run/compile_cache'
    >>> use_cache_dir("/tmp/run/compile_cache", environ={"TORCHINDUCTOR_CACHE_DIR": "/mine"}).as_posix()
    '/mine'
    """
    current = environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or current == inductor_default_cache_dir():
        environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(directory).resolve())
    return Path(environ["TORCHINDUCTOR_CACHE_DIR"])


class CompileChoice(NamedTuple):
    """What ``trainer.compile`` decided for one invocation of a run, and on what record."""

    compile: bool
    message: str  # the start-up log line: the setting, the choice and its reason
    record: dict  # what earlier invocations measured (see write_record)


def choose(
    setting: Any,
    run_dir: str | os.PathLike,
    device: str,
    planned_steps: int,
    comm: Any = None,
    blocked: str | None = None,
) -> CompileChoice:
    """``decide_compile`` on the run's record; a run that compiles keeps its artifacts in ``cache_dir(run_dir)``.

    ``blocked`` says why the run's own settings rule compiling out (``auto`` then does not compile).

    With ``comm`` (a ``fdp.comm.Comm`` of more than one rank), every rank takes rank 0's
    choice: ranks that read different records (nodes without a shared run directory) or
    differ in their compilers would otherwise step differently (a compiled step reduces
    ``after`` backward).
    """
    record = read_record(run_dir)
    compile_now, reason = decide_compile(
        setting, device, planned_steps, costs_from(record), blocked or compiler_missing(device)
    )
    if comm is not None and comm.world_size > 1:
        decided = [(compile_now, reason)]
        dist.broadcast_object_list(decided, src=0, group=comm.group)
        compile_now, reason = decided[0]
    if compile_now:
        use_cache_dir(cache_dir(run_dir))
    message = (
        f"trainer.compile={str(setting).lower()}: {'compiling' if compile_now else 'not compiling'} "
        f"the gradient computation ({reason})"
    )
    return CompileChoice(compile_now, message, record)


def read_record(run_dir: str | os.PathLike) -> dict:
    """What earlier invocations of the run measured (``{}`` if nothing, or an unreadable file)."""
    try:
        record = json.loads((cache_dir(run_dir) / COSTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_record(run_dir: str | os.PathLike, choice: CompileChoice, first_step_s: float, step_s: float) -> dict:
    """The run's record with this invocation's median step time and, if it compiled, the compile time.

    The first compiled step holds the compile; what it took beyond a usual step is the
    compile time (with the cache warm, a resumed run measures how little it now costs).
    Written atomically (renamed into place); returns the new record.

    >>> import tempfile
    >>> run_dir = tempfile.mkdtemp()
    >>> _ = write_record(run_dir, CompileChoice(True, "", {}), first_step_s=12.5, step_s=0.5)
    >>> read_record(run_dir)
    {'step_s': {'compiled': 0.5}, 'compile_s': 12.0}
    """
    record = choice.record
    new = {**record, "step_s": {**record.get("step_s", {}), ("compiled" if choice.compile else "eager"): step_s}}
    if choice.compile:
        new["compile_s"] = max(first_step_s - step_s, 0.0)
    path = cache_dir(run_dir) / COSTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(new, indent=1))
    tmp.replace(path)
    return new
