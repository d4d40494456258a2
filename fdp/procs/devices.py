"""Which device each rank computes on: ``world.accelerator`` and ``world.devices``.

The settings read as Lightning's do:

* ``world.accelerator``: ``auto`` (the GPUs when this machine has any, else the CPU),
  ``cpu`` or ``gpu``.
* ``world.devices``: ``auto``; a count ``N``; ``-1`` (every visible GPU); GPU indices as
  ``"0,2"`` or ``[0,2]``. Indices count the GPUs CUDA shows this process, so they
  honour ``CUDA_VISIBLE_DEVICES``. On the CPU, ``N`` is the number of processes.

One process per GPU. With ``devices=auto`` a world that fixes its process count
(``world=local2``, or the processes ``torchrun`` started on this node) takes that many
GPUs; ``world=single`` takes every visible GPU. The selection functions here are pure:
they take the number of visible GPUs and a probe, so they run (and are tested) anywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from fdp._torch import tree_map
from fdp.data.batches import as_batch
from fdp.errors import ConfigError
from fdp.procs.launchers import launcher_of

ACCELERATORS = ("auto", "cpu", "gpu")
BACKENDS = ("auto", "gloo", "nccl")

# ``probe(ids) -> {id: reason}`` for the GPUs among ``ids`` that cannot be used.
Probe = Callable[[Sequence[int]], Mapping[int, str]]


class Placement(NamedTuple):
    """Where a world's ranks on this node compute, and over which backend they talk.

    ``device_ids[r]`` is local rank ``r``'s GPU (empty on the CPU); ``unusable`` lists the
    GPUs a ``devices=auto`` selection passed over, each with the probe's reason.
    """

    accelerator: str  # cpu | gpu
    device_ids: tuple[int, ...]
    nproc_per_node: int
    launcher: str
    backend: str  # gloo | nccl
    unusable: tuple[tuple[int, str], ...] = ()

    def device(self, local_rank: int) -> torch.device:
        """The device of local rank ``local_rank``.

        >>> Placement("gpu", (0, 2), 2, "elastic", "nccl").device(1)
        device(type='cuda', index=2)
        """
        return device_of_rank(self.accelerator, self.device_ids, local_rank)


def device_of_rank(accelerator: str, device_ids: Sequence[int], local_rank: int) -> torch.device:
    """``cuda:<device_ids[local_rank]>`` on the GPU, else the CPU.

    >>> device_of_rank("cpu", (), 3)
    device(type='cpu')
    """
    if accelerator != "gpu":
        return torch.device("cpu")
    return torch.device("cuda", device_ids[local_rank])


def parse_devices(value: Any) -> str | int | tuple[int, ...]:
    """``world.devices`` as ``"auto"``, a count (``-1``: all) or a tuple of GPU indices.

    >>> parse_devices("auto"), parse_devices(2), parse_devices("-1"), parse_devices("0,2"), parse_devices([1])
    ('auto', 2, -1, (0, 2), (1,))
    """
    expected = 'auto, a count >= 1, -1 (every GPU), or GPU indices such as "0,2" or [0,2]'
    shown = list(value) if isinstance(value, (list, tuple)) or _is_sequence(value) else value
    if isinstance(value, str):
        text = value.strip()
        if text == "auto":
            return "auto"
        if "," in text or text.startswith("["):
            value = [part for part in text.strip("[]").split(",") if part.strip()]
        else:
            try:
                value = int(text)
            except ValueError:
                raise ConfigError(f"world.devices={shown!r}: expected {expected}") from None
    if isinstance(value, bool):
        raise ConfigError(f"world.devices={shown!r}: expected {expected}")
    if isinstance(value, int):
        if value == -1 or value >= 1:
            return value
        raise ConfigError(f"world.devices={shown!r}: expected {expected}")
    if isinstance(value, (list, tuple)) or _is_sequence(value):
        try:
            ids = tuple(int(str(v).strip()) for v in value)
        except ValueError:
            raise ConfigError(f"world.devices={shown!r}: expected {expected}") from None
        if not ids or min(ids) < 0:
            raise ConfigError(f"world.devices={shown!r}: expected {expected}")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"world.devices={shown!r}: expected each GPU once (one process per GPU)")
        return ids
    raise ConfigError(f"world.devices={shown!r}: expected {expected}")


def _is_sequence(value: Any) -> bool:
    from omegaconf import ListConfig

    return isinstance(value, ListConfig)


def _visible_text(visible: int) -> str:
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = "no GPU" if visible == 0 else f"{visible} GPU{'s' if visible > 1 else ''}"
    return f"this machine shows {gpus}" + (f" (CUDA_VISIBLE_DEVICES={mask!r})" if mask is not None else "")


def place(
    accelerator: str,
    devices: Any,
    launcher: str,
    nproc_per_node: int,
    backend: str = "auto",
    visible: int = 0,
    probe: Probe | None = None,
    local_world_size: int | None = None,
) -> Placement:
    """Resolve ``world.accelerator``, ``world.devices`` and ``world.backend`` for this node.

    ``visible`` is the number of GPUs CUDA shows; ``probe`` (optional) reports the busy or
    unusable ones among the candidates. ``local_world_size`` is the number of processes
    ``torchrun`` started on this node. Anything that cannot be had raises ``ConfigError``
    naming the setting, what was asked and what this machine has.

    >>> place("auto", "auto", "none", 1, visible=0)
    Placement(accelerator='cpu', device_ids=(), nproc_per_node=1, launcher='none', backend='gloo', unusable=())
    >>> place("auto", "auto", "none", 1, visible=2).device_ids
    (0, 1)
    >>> place("gpu", "auto", "elastic", 2, visible=4)[1:5]
    ((0, 1), 2, 'elastic', 'nccl')
    """
    if accelerator not in ACCELERATORS:
        raise ConfigError(f"world.accelerator={accelerator!r}: expected one of {ACCELERATORS}")
    if backend not in BACKENDS:
        raise ConfigError(f"world.backend={backend!r}: expected one of {BACKENDS}")
    wanted = parse_devices(devices)
    kind = launcher_of(launcher)
    # Processes the world itself fixes; None: as many as the devices give (world=single).
    fixed = kind.fixed_processes(nproc_per_node, local_world_size)
    if accelerator == "gpu" and visible == 0:
        raise ConfigError(
            f"world.accelerator=gpu: expected a CUDA GPU, {_visible_text(0)} to torch {torch.__version__}"
        )
    if accelerator == "cpu" or (accelerator == "auto" and visible == 0):
        if isinstance(wanted, tuple) or wanted == -1:
            if accelerator == "cpu":
                raise ConfigError(
                    f"world.devices={_shown(devices)}: expected auto or a process count >= 1 with world.accelerator=cpu"
                )
            raise ConfigError(f"world.devices={_shown(devices)}: expected GPUs, {_visible_text(visible)}")
        procs = fixed or nproc_per_node
        if wanted != "auto":
            if fixed is not None and wanted != fixed:
                raise ConfigError(
                    f"world.devices={wanted}: expected {fixed}, the number of processes {kind.starter} starts"
                )
            procs = wanted
        cpu_devices = [torch.device("cpu")] * procs
        return Placement("cpu", (), procs, kind.for_processes(procs).name, resolve_backend(backend, cpu_devices))
    ids, unusable = _select_gpus(wanted, devices, fixed, visible, probe)
    if fixed is not None and len(ids) != fixed:
        raise ConfigError(
            f"world.devices={_shown(devices)}: expected {fixed} GPUs, one for each process {kind.starter} "
            f"starts (got {len(ids)}; {_visible_text(visible)})"
        )
    procs = len(ids)
    gpu_devices = [torch.device("cuda", i) for i in ids]
    return Placement("gpu", ids, procs, kind.for_processes(procs).name, resolve_backend(backend, gpu_devices), unusable)


def _shown(devices: Any) -> str:
    return str(list(devices)) if isinstance(devices, (list, tuple)) or _is_sequence(devices) else str(devices)


def _select_gpus(wanted, devices, fixed: int | None, visible: int, probe: Probe | None):
    """The GPU indices for ``wanted`` and the passed-over ``(index, reason)`` pairs."""
    if isinstance(wanted, tuple):
        missing = [i for i in wanted if i >= visible]
        if missing:
            raise ConfigError(
                f"world.devices={_shown(devices)}: GPU {missing[0]} is not visible; {_visible_text(visible)}, "
                f"indices 0..{visible - 1}"
            )
        bad = dict(probe(wanted)) if probe else {}
        if bad:
            index, reason = next(iter(sorted(bad.items())))
            raise ConfigError(f"world.devices={_shown(devices)}: GPU {index} is busy or unusable ({reason})")
        return wanted, ()
    count = {"auto": fixed or visible, -1: visible}.get(wanted, wanted)
    if count > visible:
        raise ConfigError(f"world.devices={_shown(devices)}: expected {count} GPUs, {_visible_text(visible)}")
    # As Lightning's find_usable_cuda_devices: the first `count` GPUs that answer.
    bad = dict(probe(range(visible))) if probe else {}
    usable = [i for i in range(visible) if i not in bad]
    unusable = tuple(sorted(bad.items()))
    if wanted == -1 or (wanted == "auto" and fixed is None):
        count = len(usable)
    if len(usable) < count or count == 0:
        busy = "; ".join(f"GPU {i}: {reason}" for i, reason in unusable)
        raise ConfigError(
            f"world.devices={_shown(devices)}: expected {max(count, 1)} usable GPU{'s' if count > 1 else ''}, "
            f"{len(usable)} of the {visible} visible are usable ({busy})"
        )
    return tuple(usable[:count]), unusable


def resolve_backend(backend: str, devices: Sequence[torch.device]) -> str:
    """The process-group backend for ranks on ``devices`` (this node's ranks, in order).

    ``auto`` is NCCL only when every rank has a GPU of its own, else gloo; ``nccl``
    without a GPU per rank is refused.

    >>> cuda = torch.device("cuda", 0)
    >>> resolve_backend("auto", [cuda, torch.device("cuda", 1)]), resolve_backend("auto", [cuda, cuda])
    ('nccl', 'gloo')
    """
    if backend not in BACKENDS:
        raise ConfigError(f"world.backend={backend!r}: expected one of {BACKENDS}")
    gpus = {d.index for d in devices if d.type == "cuda"}
    own_gpu = bool(devices) and all(d.type == "cuda" for d in devices) and len(gpus) == len(devices)
    if backend == "nccl" and not own_gpu:
        ranks, have = len(devices), len(gpus)
        raise ConfigError(
            f"world.backend=nccl: expected a GPU of its own for each of the {ranks} rank{'s' if ranks != 1 else ''} "
            f"on this node, they have {have} GPU{'s' if have != 1 else ''} (use world.backend=gloo or auto)"
        )
    if backend == "auto":
        return "nccl" if own_gpu else "gloo"
    return backend


# -- this machine ---------------------------------------------------------------------------
def visible_gpus() -> int:
    """How many GPUs CUDA shows this process (0 without CUDA); creates no CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_PROBE_SCRIPT = """
import json, sys, torch
bad = {}
for i in map(int, sys.argv[1:]):
    try:
        torch.ones(1, device=f"cuda:{i}").add_(1)
        torch.cuda.synchronize(i)
    except Exception as e:
        bad[i] = (str(e).strip().splitlines() or [type(e).__name__])[0]
print(json.dumps(bad))
"""


def probe_gpus(ids: Sequence[int]) -> dict[int, str]:
    """GPUs among ``ids`` where a tiny tensor cannot be made, each with the reason.

    The allocations run in a child process: in this one they would leave a CUDA context
    on every GPU probed (hundreds of MiB each, and an exclusive-mode GPU taken) for the
    whole run.
    """
    ids = list(ids)
    if not ids:
        return {}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE_SCRIPT, *map(str, ids)], capture_output=True, text=True, timeout=300
        )
        lines = done.stdout.strip().splitlines()
        return (
            {int(k): v for k, v in json.loads(lines[-1]).items()}
            if done.returncode == 0 and lines
            else {i: f"probe failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}" for i in ids}
        )
    except subprocess.TimeoutExpired:
        return {i: "probe timed out after 300 s" for i in ids}


def use_device(device: torch.device) -> torch.device:
    """Make ``device`` this process's current device; a GPU that fails a tiny allocation is refused.

    >>> use_device(torch.device("cpu"))
    device(type='cpu')
    """
    if device.type != "cuda":
        return device
    try:
        torch.cuda.set_device(device)
        torch.ones(1, device=device).add_(1)
    except Exception as error:  # busy (exclusive mode), out of memory, or a broken device
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"world.devices: GPU {device.index} is busy or unusable ({reason})") from None
    return device


# -- tensors on the device ------------------------------------------------------------------
def to_device(tensors: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A dict of the same tensors on ``device`` (the same objects where they are there already).

    >>> to_device({"w": torch.ones(2)}, torch.device("cpu"))["w"].device
    device(type='cpu')
    """
    return {name: t.to(device) for name, t in tensors.items()}


def batch_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (any pytree of tensors) on ``device``: staged in pinned host memory, copied without blocking the host.

    The copy is queued on the device's stream, so the host goes on to queue the step that
    reads it; on the CPU the batch is returned as it is.

    >>> batch_to_device((torch.ones(2),), torch.device("cpu"))[0].device
    device(type='cpu')
    """
    if device.type != "cuda":
        return batch
    return tree_map(
        lambda t: t.pin_memory().to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, as_batch(batch)
    )


def device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    """The device of the first tensor (the CPU for none).

    >>> device_of({"w": torch.ones(1)}), device_of({})
    (device(type='cpu'), device(type='cpu'))
    """
    return next((t.device for t in tensors.values()), torch.device("cpu"))


# -- the CUDA generator in the train state ---------------------------------------------------
_NO_CUDA_RNG = torch.empty(0, dtype=torch.uint8)


def seeded_cuda_rng(seed: int, device: torch.device) -> torch.Tensor:
    """The state of a CUDA generator seeded with ``seed`` on ``device`` (empty off CUDA).

    >>> seeded_cuda_rng(0, torch.device("cpu")).numel()
    0
    """
    if device.type != "cuda":
        return _NO_CUDA_RNG
    return torch.Generator(device=device).manual_seed(seed).get_state()


@contextlib.contextmanager
def rng_scope(rng: torch.Tensor, cuda_rng: torch.Tensor, device: torch.device) -> Iterator[Callable[[], tuple]]:
    """Run the body on the generator states ``rng`` (CPU) and ``cuda_rng`` (``device``'s).

    Yields ``states()``, which returns both states as they are when it is called (call it
    at the end of the body); the process's own generators are restored on exit. An empty
    ``cuda_rng`` (a state from a CPU run) leaves the CUDA generator as it is seeded.

    >>> seeded = torch.Generator().manual_seed(1).get_state()
    >>> with rng_scope(seeded, torch.empty(0), torch.device("cpu")) as states:
    ...     a = torch.rand(1)
    ...     rng, cuda_rng = states()
    >>> with rng_scope(seeded, cuda_rng, torch.device("cpu")):
    ...     b = torch.rand(1)
    >>> torch.equal(a, b), torch.equal(rng, seeded)
    (True, False)
    """
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.set_rng_state(rng)
        if cuda and cuda_rng.numel():
            torch.cuda.set_rng_state(cuda_rng, device)
        yield lambda: (torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else cuda_rng)
