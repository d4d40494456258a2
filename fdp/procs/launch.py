"""Starting ranks and joining them into a process group, on PyTorch's own launchers.

* ``single``: one process, no process group (a ``Comm`` over a world of one).
* local worlds (``local2``, ``local4``): the recipe starts N workers on this machine
  with PyTorch's elastic launcher, so one command trains on N processes and there is
  one config and one output directory.
* ``torchrun``: each process was started by ``torchrun`` and reads its rank, world size
  and rendezvous from the environment.
* ``slurm``: each process is a task of a SLURM job (``srun``, or Hydra's submitit
  launcher) and reads its place in the job from the job's environment (``fdp.procs.slurm``).

``spawn`` starts the workers of a local world; with ``start_method="fork"`` they are
forked from the calling process, so the function they run may be one defined in a
notebook cell or in ``python -c``.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import socket
import uuid
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from fdp.comm import Comm
from fdp.errors import ConfigError
from fdp.plan import BucketPlan
from fdp.procs.devices import device_of_rank, resolve_backend, use_device
from fdp.procs.interrupt import StoppedAtOnce, relay_to_workers
from fdp.procs.launchers import Launcher, launcher_of

LOOPBACK = "127.0.0.1"
START_METHODS = ("spawn", "fork", "forkserver")
# Errors every rank raises alike (a checkpoint that does not fit: fdp.run.checkpoint): reported without a rank.
AGREED_REFUSALS = ("CheckpointError",)


class WorldLayout(NamedTuple):
    """How many processes run, where, and how they find each other."""

    launcher: str = "none"  # none | elastic | torchrun | slurm
    nnodes: int = 1
    nproc_per_node: int = 1
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0
    max_restarts: int = 0
    accelerator: str = "cpu"  # cpu | gpu (resolved: see fdp.procs.devices.place)
    device_ids: tuple[int, ...] = ()  # gpu: local rank r computes on cuda:device_ids[r]
    start_method: str = "spawn"  # spawn | fork (notebooks, python -c) | forkserver: how spawn starts workers

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def kind(self) -> Launcher:
        """The launcher that starts this world's ranks (``fdp.procs.launchers``)."""
        return launcher_of(self.launcher)

    def device(self, local_rank: int) -> torch.device:
        """The device local rank ``local_rank`` computes on.

        >>> WorldLayout("elastic", nproc_per_node=2, accelerator="gpu", device_ids=(0, 0)).device(1)
        device(type='cuda', index=0)
        """
        return device_of_rank(self.accelerator, self.device_ids, local_rank)


class WorkerFailedError(RuntimeError):
    """A local worker raised or died; the message is one line naming its rank.

    ``rank``, ``pid``, ``exitcode`` and ``signal`` (a name such as ``"SIGKILL"``, or
    ``None`` when the worker raised) describe the first failure the launcher saw;
    ``reason`` is the worker's exception as ``Type: message`` (empty for a signal),
    ``error_type`` that type's name and ``traceback`` the worker's traceback.
    """

    def __init__(self, rank: int, pid: int, exitcode: int, reason: str = "", traceback: str = ""):
        self.rank, self.pid, self.exitcode, self.reason, self.traceback = rank, pid, exitcode, reason, traceback
        self.signal = _signal_name(exitcode)
        named = re.match(r"([A-Za-z_][\w.]*): ", reason.strip())
        self.error_type = named.group(1).rsplit(".", 1)[-1] if named else None
        if self.signal:
            message = f"rank {rank} (pid {pid}) was killed by {self.signal}"
        else:
            # "FloatingPointError: non-finite ..." -> "non-finite ... (rank 0)": the worker's own line.
            text = re.sub(r"^[A-Za-z_][\w.]*: ", "", reason.strip().splitlines()[0]) if reason.strip() else ""
            # A refusal is every rank's, in the same words (fdp.run.checkpoint.load_checkpoint agrees on it): which
            # rank the launcher saw first is chance, so it is not named.
            rank_note = "" if self.error_type in AGREED_REFUSALS else f" (rank {rank})"
            message = f"{text}{rank_note}" if text else f"rank {rank} (pid {pid}) exited with code {exitcode}"
        super().__init__(message)


class RankLostError(RuntimeError):
    """A rank died, hung or became unreachable; the message names it and the step."""


class RankOutOfMemoryError(RuntimeError):
    """A rank could not allocate what the run needs after it saved a checkpoint; the message names it, where,
    the budget and what to change."""


class RunDoesNotFit(ConfigError):
    """A rank ran out of memory before the run saved anything: refused, as a setting is (the message says which)."""


def _signal_name(exitcode: int) -> str | None:
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _loopback_store(timeout_s: float):
    """A rendezvous store server listening on 127.0.0.1 only, and its port.

    ``TCPStore`` binds its server to every interface whatever host it is given, so the
    socket is bound here and handed over (the store closes it). The launcher's own
    store, created with ``multi_tenant=True`` on the same port, reuses this server.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    store = dist.TCPStore(
        LOOPBACK,
        port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return store, port


def spawn(entry: Callable[..., Any], args: tuple, layout: WorldLayout) -> dict[int, Any]:
    """Run ``entry(*args)`` on ``layout.nproc_per_node`` local workers; return each rank's result.

    Everything listens on 127.0.0.1 only: the rendezvous store (a static rendezvous on a
    loopback-bound server that the workers share) and, in ``init_distributed``, gloo. A
    worker that raises or dies makes the whole launch raise ``WorkerFailedError`` (one line
    naming the rank; the launcher has stopped the other workers); with ``max_restarts > 0``
    the group is restarted that many times first.

    ``layout.start_method`` says how the workers start. ``"spawn"`` (the default) starts
    fresh interpreters and pickles ``entry`` and ``args`` into them, so ``entry`` must be
    importable. ``"fork"`` copies this process instead, so ``entry`` may be defined in a
    notebook cell or in ``python -c``; CUDA must not have been initialised here before
    (a forked child cannot use its parent's CUDA context), which is refused with one line.
    Forked workers run torch's CPU ops on one thread (``init_distributed``): OpenMP's pool
    does not survive fork.

    Example (``my_worker`` must be importable, it is pickled into the workers)::

        results = spawn(my_worker, (cfg,), WorldLayout("elastic", nproc_per_node=2))

    and from a notebook, with a function defined in a cell::

        results = spawn(train_cell_fn, (steps,), WorldLayout("elastic", nproc_per_node=2, start_method="fork"))
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_start_method(layout.start_method)
    store, port = _loopback_store(layout.timeout_s)
    quiet = _WorkerFailureFilter()
    for name in _QUIETED:
        logging.getLogger(name).addFilter(quiet)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=layout.nproc_per_node,
        run_id=uuid.uuid4().hex,
        rdzv_backend="static",
        rdzv_endpoint=f"{LOOPBACK}:{port}",
        rdzv_configs={"rank": 0, "timeout": int(layout.timeout_s)},
        max_restarts=layout.max_restarts,
        local_addr=LOOPBACK,
        monitor_interval=0.1,
        start_method=layout.start_method,
    )
    try:
        with relay_to_workers() as relay:  # SIGINT/SIGTERM: passed on to the workers; a second one kills them
            if hasattr(config, "signals_to_handle"):  # torch >= 2.14 sets the agent's signals from its config
                config.signals_to_handle = relay.agent_signals
            try:
                return elastic_launch(config, _worker)(entry, *args)
            except ChildFailedError:
                if relay.stopped_at_once:
                    raise StoppedAtOnce(relay.stopped_at_once) from None
                raise
    except ChildFailedError as error:
        rank, failure = _root_failure(error)
        reason, traceback = _reason(failure)
        raise WorkerFailedError(rank, failure.pid, failure.exitcode, reason, traceback) from error
    finally:
        for name in _QUIETED:
            logging.getLogger(name).removeFilter(quiet)
        del store


# What a rank raises when a peer went away first: an echo of another rank's failure, not its cause.
_PEER_ECHO = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|gloo/transport|Socket Timeout|Operation timed out|"
    r"NCCL communicator was aborted|remote process exited"
)


def _reason(failure: Any) -> tuple[str, str]:
    """A failed worker's exception as ``Type: message`` and its traceback (empty for a signal)."""
    message = failure.message
    if not isinstance(message, dict):
        return "", ""
    return message.get("message", ""), message.get("extraInfo", {}).get("py_callstack", "")


def _root_failure(error: Any) -> tuple[int, Any]:
    """The rank whose failure caused the others': the earliest that is not a broken connection left by a peer.

    A rank that runs out of memory or refuses a setting leaves its process group; a peer in a collective with it
    may report the broken connection a moment before the cause is recorded, and naming that would hide it.
    """
    by_time = sorted(error.failures.items(), key=lambda item: item[1].timestamp)
    causes = [(rank, failure) for rank, failure in by_time if not _PEER_ECHO.search(_reason(failure)[0])]
    return causes[0] if causes else error.get_first_failure()


def _worker(entry: Callable[..., Any], *args: Any) -> Any:
    """A worker of ``spawn``: it starts with SIGINT and SIGTERM blocked (``relay_to_workers``).

    An entry that handles them itself (``handles_stop_signals``, as ``fdp.run.trainer.run_rank``)
    unblocks them once its handlers are in; any other gets them back as they were.
    """
    if not getattr(entry, "handles_stop_signals", False):
        # A forked worker also inherited the launcher's handlers: Python's own defaults instead.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
    return entry(*args)


def check_start_method(method: str) -> None:
    """Refuse a start method ``spawn`` cannot use here, in one line.

    ``fork`` is refused once this process has initialised CUDA.

    >>> check_start_method("spawn")
    >>> check_start_method("threads")
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: start_method='threads': expected one of ('spawn', 'fork', 'forkserver')
    """
    if method not in START_METHODS:
        raise ConfigError(f"start_method={method!r}: expected one of {START_METHODS}")
    # CUDA's context does not survive fork: a child touching it fails or hangs.
    if method == "fork" and torch.cuda.is_initialized():
        raise ConfigError(
            "start_method='fork': CUDA is already initialised in this process and forked workers cannot use it; "
            "start the workers before any CUDA call (restart the kernel), or use start_method='spawn' from a script"
        )


_QUIETED = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


class _WorkerFailureFilter(logging.Filter):
    """Drops the launcher's log of a failed worker's traceback (``WorkerFailedError`` carries
    it) and of the routine stop of the other workers, so a failure reads as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (
            (record.exc_info and message.startswith("failed (exitcode")) or message.startswith("Terminating process")
        )


def init_distributed(layout: WorldLayout) -> Comm:
    """Join this process to the world ``layout`` describes; return its ``Comm``.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``,
    which both the elastic launcher and ``torchrun`` set; under ``slurm`` they are first
    set from the job's environment (``fdp.procs.slurm.job_world``). Every collective of the
    group times out after ``layout.timeout_s`` seconds instead of hanging. On a GPU layout
    the rank's GPU becomes its current device first (NCCL and CUDA tensors made without a
    device go there). ``launcher="none"`` (a world of one, no process group) is refused in a process a launcher
    started as one of several (``WORLD_SIZE > 1``).

    >>> init_distributed(WorldLayout()).world_size
    1
    """
    kind = layout.kind
    os.environ.update(kind.environ(os.environ))
    use_device(layout.device(int(os.environ.get("LOCAL_RANK", 0))))
    if not kind.joins_group:
        refuse_world_of_one(
            "init_distributed(WorldLayout(launcher='none'))",
            "use WorldLayout('elastic', nproc_per_node=N) in workers started by fdp.spawn, or WorldLayout('torchrun') "
            "under torchrun",
        )
        return Comm()
    backend = resolve_backend(layout.backend, [layout.device(r) for r in range(layout.nproc_per_node)])
    if kind.local_only(os.environ):
        # A local world talks over loopback only; gloo (and NCCL's bootstrap) would
        # otherwise listen on the address the hostname resolves to, often the LAN's.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
    if layout.start_method == "fork":
        # OpenMP's thread pool does not survive fork: a forked worker whose parent has run
        # a parallel op hangs in its own first one if it uses more than one thread.
        torch.set_num_threads(1)
    elif layout.accelerator == "cpu":
        # Ranks on one machine share its cores; more threads each only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=layout.timeout_s)
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    expected = int(os.environ.get("WORLD_SIZE", layout.world_size))
    if kind.spawned and expected != layout.world_size:
        raise RuntimeError(f"world has {expected} processes, layout expects {layout.world_size}")
    return Comm()


def launch_rank(launcher: str) -> int:
    """This process's rank before it joins the group (0 unless a launcher started one process per rank).

    >>> launch_rank("none")
    0
    """
    return launcher_of(launcher).rank_before_joining(os.environ)


def launched_world_size() -> int:
    """How many processes the launcher that started this one started (``WORLD_SIZE``; 1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def refuse_world_of_one(what: str, fix: str, error: type[Exception] = RuntimeError) -> None:
    """Refuse to run ``what`` as a world of one in a process started as one of several that never joined them.

    Under a launcher every process would otherwise train alone: no error, no bytes sent,
    ranks drifting apart. ``fix`` says what to do instead.

    >>> refuse_world_of_one("comm", "join the others")  # not launched: a world of one is what was asked for
    """
    launched = launched_world_size()
    if launched > 1 and not dist.is_initialized():
        raise error(f"{what} is a world of one, but this process was started as one of WORLD_SIZE={launched}: {fix}")


def _attempt_store(timeout: datetime.timedelta):
    """This attempt's own key space in the elastic agent's store (``None``: not under such an agent).

    The agent's store outlives the workers, so after a restart (``world.max_restarts``)
    the keys of the dead attempt are still there and gloo's rendezvous reads a dead
    worker's address, failing with "connectFullMesh ... Connect timeout" (pytorch issue
    135712). Every worker of one agent agrees on ``TORCHELASTIC_RESTART_COUNT``.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"fdp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def loopback_interface() -> str:
    """The name of this machine's loopback network interface (``lo`` on Linux)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        try:
            flags = int(open(f"/sys/class/net/{name}/flags").read(), 16)
        except (OSError, ValueError):
            continue
        if flags & 0x8:  # IFF_LOOPBACK
            return name
    return "lo0" if "lo0" in names else "lo"


def check_same_plan(plan: BucketPlan, comm: Comm) -> None:
    """Stop every rank with a named difference if any rank planned other buckets.

    Ranks compare layouts on the host: each rank's buckets are on its own GPU.
    """
    if comm.world_size == 1:
        return
    plans = [None] * comm.world_size
    dist.all_gather_object(plans, plan.on_cpu().to_dict())
    reference = BucketPlan.from_dict(plans[0])
    for rank, other in enumerate(plans[1:], start=1):
        difference = reference.first_difference(BucketPlan.from_dict(other))
        if difference:
            raise RuntimeError(f"bucket plans differ between rank 0 and rank {rank} (different models?): {difference}")


def broadcast_from_rank0(tensors: dict[str, torch.Tensor], comm: Comm) -> dict[str, torch.Tensor]:
    """Rank 0's values for every tensor (new tensors; the inputs are untouched)."""
    if comm.world_size == 1:
        return tensors
    out = {name: t.clone() for name, t in tensors.items()}
    for t in out.values():
        dist.broadcast(t, src=0)
    return out
