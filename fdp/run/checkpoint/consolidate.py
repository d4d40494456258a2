"""A sharded checkpoint as one whole-file one: for inference, sharing, or a run that wants one file.

``consolidate(path)`` reads every piece of a sharded checkpoint (``fdp.run.checkpoint.sharded``)
in one process, without a process group, and gives the payload ``fdp.run.checkpoint.whole.save`` writes:
params and optimizer state whole, by parameter name (stage 0's structure, which any stage
and world size resumes), each rank's hook state and RNG. ``write_consolidated`` writes it
as a ``.pt`` file (``weights_only`` loadable, a valid ``trainer.resume=PATH``) or, for a
``.safetensors`` path, the params alone (a Hugging Face model's names are its own:
``fdp.model.builtin.hf_model``). The command is ``python -m fdp.checkpoint consolidate``.
``whole_payload(path)`` reads a checkpoint of either format as that one payload.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fdp._torch import single_process_dcp
from fdp.run.checkpoint.atomic import atomic_bytes, atomic_save
from fdp.run.checkpoint.files import CheckpointError, is_sharded, load, read_meta, resolve
from fdp.run.checkpoint.integrity import verify

__all__ = ["consolidate", "whole_payload", "write_consolidated"]

SUFFIXES = (".pt", ".safetensors")  # what write_consolidated writes
_DESCRIPTION = ("format", "shapes", "plain", "loss_scale_paths", "stage", "world_size")


def _name(key: str, prefix: str) -> str:
    """``params['fc.weight']`` -> ``fc.weight``."""
    return ast.literal_eval(key[len(prefix) + 1 : -1])


def consolidate(path: str | os.PathLike) -> dict:
    """The whole-file payload of the sharded checkpoint ``path`` (a ``step_<N>/`` directory, or a run or
    checkpoints directory for its last); it holds the whole model in this process."""
    path = resolve(Path(path))
    meta = read_meta(path)
    reader = dcp.FileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    whole = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in stored.items()
        if isinstance(md, TensorStorageMetadata)
    }
    with single_process_dcp():
        dcp.load(whole, storage_reader=reader, no_dist=True)
    shapes = {name: tuple(shape) for name, shape in meta["shapes"].items()}

    def shaped(key: str, value: torch.Tensor) -> torch.Tensor:
        name = next((n for n in shapes if key.endswith(f"[{n!r}]")), None)
        return (
            value.view(shapes[name])
            if name is not None and value.numel() == torch.Size(shapes[name]).numel()
            else value
        )

    plain = meta.get("plain", {})
    buffers = {_name(k, "buffers"): v for k, v in whole.items() if k.startswith("buffers[")}
    loss_scale = [whole.get(f"loss_scale{p}", plain.get(f"loss_scale{p}")) for p in meta.get("loss_scale_paths", [])]
    ranks = []
    for rank in range(int(meta["world_size"])):
        mine = torch.load(path / f"rank{rank}.pt", map_location="cpu", weights_only=True)
        mine["buffers"] = {
            n: b for n, b in mine.get("buffers", {}).items() if not torch.equal(b, buffers.get(n, b + 1))
        }
        if "outer_paths" in mine:  # an outer loop's: each rank's own params, optimizer state and outer state
            own = {**plain, **mine.pop("plain", {})}
            params, opt = _params_and_opt(whole, own, f"rank{rank}/", shaped)
            outer = _outer_leaves(whole, own, mine.pop("outer_paths"), mine.pop("outer_hook_state"), rank, shaped)
            mine.update(params=params, opt_state=list(opt.values()), opt_state_paths=list(opt), outer=outer)
        ranks.append(mine)
    # The model's params and optimizer state: every rank's alike, or under an outer loop rank 0's (as a whole file's).
    params, opt = (
        (ranks[0]["params"], dict(zip(ranks[0]["opt_state_paths"], ranks[0]["opt_state"])))
        if ranks and "outer" in ranks[0]
        else _params_and_opt(whole, plain, "", shaped)
    )
    return {
        **{k: v for k, v in meta.items() if k not in _DESCRIPTION},
        "params": params,
        "buffers": buffers,
        "opt_state": list(opt.values()),
        "opt_state_paths": list(opt),
        "loss_scale": loss_scale,
        "ranks": ranks,
        "consolidated_from": str(path),
    }


def whole_payload(path: str | os.PathLike) -> dict:
    """The whole-file payload of the checkpoint ``path`` names (a run or checkpoints directory: its last), whichever
    format wrote it: read as written (whole), or consolidated from its pieces (sharded).

    >>> whole_payload("/nonexistent/step_00000001.pt")
    Traceback (most recent call last):
    ...
    fdp.run.checkpoint.files.CheckpointError: checkpoint /nonexistent/step_00000001.pt does not exist
    """
    found = resolve(path)
    return consolidate(found) if is_sharded(found) else load(found)


def _params_and_opt(whole: dict, plain: dict, prefix: str, shaped) -> tuple[dict, dict]:
    """The params by name and the optimizer state by path stored under ``prefix`` (``rank<r>/`` for one rank's)."""
    params = {
        _name(k[len(prefix) :], "params"): shaped(k, v) for k, v in whole.items() if k.startswith(prefix + "params[")
    }
    opt = {k[len(prefix + "opt_state") :]: shaped(k, v) for k, v in whole.items() if k.startswith(prefix + "opt_state")}
    opt.update({k[len("opt_state") :]: v for k, v in plain.items() if k.startswith("opt_state")})
    return params, opt


def _outer_leaves(whole: dict, plain: dict, paths: list, hook_state: list, rank: int, shaped) -> list:
    """One rank's outer-loop state as a whole file's leaves (``fdp.run.checkpoint.whole.rank_payload``), in its
    ``paths``' order: the anchor and outer optimizer state every rank's alike, the in-flight pseudo-gradient and
    the hook state its own."""
    hooks, leaves = iter(hook_state), []
    for path in paths:
        if path.startswith(".hook_state"):
            leaves.append(next(hooks))
        elif path.startswith(".in_flight"):
            key = f"rank{rank}/outer.in_flight" + path[len(".in_flight") :]
            leaves.append(shaped(key, whole[key]))
        else:
            key = "outer" + path
            leaves.append(shaped(key, whole[key]) if key in whole else plain.get(key))
    return leaves


def write_consolidated(path: str | os.PathLike, to: str | os.PathLike | None = None) -> Path:
    """Consolidate ``path`` into ``to`` (default: ``<checkpoint>.pt`` beside it); ``.safetensors``: the params alone.

    Refused in one ``CheckpointError`` before anything is written: a checkpoint that is not a whole sharded
    one (``fdp.run.checkpoint.integrity``), a target that exists, has another suffix or cannot be written.
    """
    source = resolve(Path(path))
    if not source.exists():
        raise CheckpointError(f"checkpoint {source} does not exist")
    if not source.is_dir():
        raise CheckpointError(f"checkpoint {source} is not a sharded checkpoint (a step_<N> directory): nothing to do")
    to = Path(to) if to is not None else source.with_name(source.name + ".pt")
    _check_target(to)
    verify(source)
    payload = consolidate(source)
    try:
        if to.suffix == ".safetensors":
            from safetensors.torch import save

            params = {n: p.contiguous() for n, p in payload["params"].items()}
            return atomic_bytes(save(params, metadata={"step": str(payload["step"])}), to)
        return atomic_save(payload, to)
    except OSError as error:  # the disk filled up, or the directory went away: the temporary is gone too
        raise CheckpointError(f"cannot write {to}: {error.strerror or error}") from None


def _check_target(to: Path) -> None:
    """A new ``.pt`` or ``.safetensors`` file in a directory this process can write."""
    if to.suffix not in SUFFIXES:
        raise CheckpointError(f"cannot write {to}: expected a file ending in {' or '.join(SUFFIXES)}")
    if to.exists() or to.is_symlink():
        raise CheckpointError(f"cannot write {to}: it exists (remove it, or choose another file with --to)")
    if not to.parent.is_dir():
        raise CheckpointError(f"cannot write {to}: its directory {to.parent} does not exist")
    if not os.access(to.parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {to}: its directory {to.parent} is not writable")
