"""Whole-file checkpoints: the whole train state in one file ``step_<N>.pt``, written by rank 0.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, so
``torch.load(path, weights_only=True)`` reads it without unpickling any code. Its
``params`` entry maps parameter names to tensors. Structured state (optimizer and hook
NamedTuples) is stored as flat lists of leaves and rebuilt against the live state's
structure, which also checks that the run being resumed is the same kind of run. The
optimizer state's leaves are stored with their paths (``[1].mu['fc.weight']``) and
matched by path, so a state whose parameters come in another order (a ZeRO stage 3 run
keeps them in plan order) restores into any other.

Tensors are saved on the CPU and restored onto the devices of the live state, so a run
on GPUs resumes on the CPU and the reverse, and on another number of GPUs.

Files are written atomically (``fdp.run.checkpoint.atomic``), so a crash mid-write leaves the previous
checkpoint intact. Each save writes the state once: ``last``, a small file replaced atomically
after the step file is whole, names the newest (as a sharded run's does: ``fdp.run.checkpoint.files``).

``save_checkpoint`` and ``load_checkpoint`` are the whole of it for a ``TrainState`` on
any number of ranks (a run saves and resumes through ``fdp.run.checkpoint.checkpointer``): every rank's share
is gathered to rank 0, which writes; on loading rank 0 reads and every rank takes its own share. What
differs between ranks is stored per rank: the hook state (error feedback), the RNG, and
buffers where a rank's differ from rank 0's (``sync_buffers="local"``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fdp._torch import tree_flatten, tree_paths, tree_unflatten
from fdp.comm import Comm
from fdp.plan import BucketPlan
from fdp.run.checkpoint.atomic import atomic_save, fsync_dir
from fdp.run.checkpoint.files import LAST, CheckpointError, load, point_last, prune, resolve
from fdp.state.train_state import TrainState


def _on_host(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _like(value: Any, template: Any) -> Any:
    """``value`` on the device of ``template`` (when both are tensors)."""
    if isinstance(value, torch.Tensor) and isinstance(template, torch.Tensor):
        return value.to(template.device)
    return value


def host_leaves(tree: Any) -> list:
    """The leaves of ``tree`` in order, tensors on the CPU: how a checkpoint stores a state's trees.

    >>> host_leaves({"m": torch.ones(2), "count": 3})
    [tensor([1., 1.]), 3]
    """
    return [_on_host(leaf) for leaf in tree_flatten(tree)[0]]


def rebuild_like(template: Any, leaves: list, what: str, path: Path, paths: list[str] | None = None) -> Any:
    """``template``'s tree made of saved ``leaves`` (matched by ``paths`` where given), on its devices; a
    ``CheckpointError`` naming ``what`` and ``path`` when they do not fit.

    >>> rebuild_like({"m": torch.zeros(2)}, [torch.ones(2)], "optimizer state", Path("x"))
    {'m': tensor([1., 1.])}
    """
    template_leaves, spec = tree_flatten(template)
    if spec.num_leaves != len(leaves):
        raise CheckpointError(
            f"checkpoint {path}: {what} has {len(leaves)} entries, this run expects {spec.num_leaves} "
            "(different optimizer, hooks or bucket plan?)"
        )
    if paths is not None:  # matched by path, whatever order the saving run kept its parameters in
        by_path = dict(zip(paths, leaves))
        wanted = tree_paths(template)
        missing = [p for p in wanted if p not in by_path]
        if missing:
            raise CheckpointError(
                f"checkpoint {path}: {what} has no entry {missing[0]} (different optimizer or model?)"
            )
        leaves = [by_path[p] for p in wanted]
    return tree_unflatten([_like(v, t) for v, t in zip(leaves, template_leaves)], spec)


def hook_state_like(template: Any, leaves: list, path: Path) -> Any:
    """The saved hook state ``leaves`` as ``template``'s tree (``rebuild_like``), or ``template`` itself (a fresh state)
    where a saved tensor's shape differs: error feedback kept for another layout of the buckets (a hybrid world's
    slices, ``fdp.update.zero.hybrid``, against a flat world's buckets) starts again, as a rank new to the world does.

    >>> hook_state_like((torch.zeros(2),), [torch.ones(3)], Path("x"))
    (tensor([0., 0.]),)
    """
    fresh = tree_flatten(template)[0]
    if len(fresh) == len(leaves) and any(
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape
        for a, b in zip(fresh, leaves)
    ):
        return template
    return rebuild_like(template, leaves, "hook state", path)


def state_payload(state: TrainState, per_rank: list[dict], extra: dict | None = None) -> dict:
    """The dict saved for ``state``, every tensor on the CPU; ``per_rank`` holds each rank's ``rank_payload``."""
    return {
        "step": state.step,
        "params": {name: _on_host(t) for name, t in state.params.items()},
        "buffers": {name: _on_host(t) for name, t in state.buffers.items()},
        "opt_state": host_leaves(state.opt_state),
        "opt_state_paths": tree_paths(state.opt_state),
        "loss_scale": host_leaves(state.loss_scale),  # decided after the reduction: the same on every rank
        "ranks": per_rank,
        **(extra or {}),
    }


def rank_payload(state: TrainState) -> dict:
    """What may differ between ranks and is saved for each: hook state (error feedback), RNGs, buffers.

    ``save_checkpoint`` keeps only the buffers that differ from rank 0's. Under an outer
    loop (``fdp.step.outer``) ranks step apart between syncs, so each rank's params and
    optimizer state are saved too, with its outer state.
    """
    mine = {
        "hook_state": host_leaves(state.hook_state),
        "rng": state.rng,
        "cuda_rng": state.cuda_rng,
        "buffers": {name: _on_host(b) for name, b in state.buffers.items()},
    }
    if state.outer:
        mine.update(
            params={name: _on_host(p) for name, p in state.params.items()},
            opt_state=host_leaves(state.opt_state),
            opt_state_paths=tree_paths(state.opt_state),
            outer=host_leaves(state.outer),
        )
    return mine


def _differing_buffers(per_rank: list[dict], reference: dict) -> list[dict]:
    # Buffers equal to rank 0's (all of them unless sync_buffers="local") are stored once.
    return [
        {
            **mine,
            "buffers": {n: b for n, b in mine.get("buffers", {}).items() if not torch.equal(b, _on_host(reference[n]))},
        }
        for mine in per_rank
    ]


def restore(payload: dict, template: TrainState, rank: int, path: str | os.PathLike = "checkpoint") -> TrainState:
    """Rebuild the ``TrainState`` of ``rank`` from ``payload``, shaped like ``template`` and on its devices.

    The CUDA generator state carries over only from a GPU run to a GPU run; otherwise
    the template's (seeded) one is kept.
    """
    path = Path(path)
    ranks = payload["ranks"]
    missing = sorted(set(template.params) ^ set(payload["params"]))
    if missing:
        raise CheckpointError(f"checkpoint {path}: parameters differ from this model's: {missing[:5]}")
    # A world larger than the one that saved: the new ranks start their hook state and RNG fresh.
    mine = ranks[rank] if rank < len(ranks) else {"hook_state": host_leaves(template.hook_state), "rng": template.rng}
    if rank >= len(ranks) and template.outer:
        mine.update(_outer_place(ranks[0], template, len(ranks), path))
    saved_cuda_rng = mine.get("cuda_rng")
    both_on_gpu = saved_cuda_rng is not None and saved_cuda_rng.numel() and template.cuda_rng.numel()
    own_buffers = mine.get("buffers", {})
    # Under an outer loop each rank saved its own params and optimizer state (with their paths).
    source = mine if "opt_state" in mine else payload
    shared = {
        "params": mine.get("params", payload["params"]),
        "opt_state": source["opt_state"],
        "opt_state_paths": source.get("opt_state_paths"),
    }
    return TrainState(
        step=int(payload["step"]),
        params={name: _like(shared["params"][name], t) for name, t in template.params.items()},
        buffers={
            name: _like(own_buffers.get(name, payload["buffers"][name]), t) for name, t in template.buffers.items()
        },
        opt_state=rebuild_like(
            template.opt_state, shared["opt_state"], "optimizer state", path, shared["opt_state_paths"]
        ),
        hook_state=hook_state_like(template.hook_state, mine["hook_state"], path),
        rng=mine["rng"],
        cuda_rng=saved_cuda_rng if both_on_gpu else template.cuda_rng,
        loss_scale=rebuild_like(template.loss_scale, payload.get("loss_scale", []), "loss scale", path),
        outer=rebuild_like(template.outer, mine.get("outer", []), "outer state (outer loop)", path),
    )


def _outer_place(first: dict, template: TrainState, saved_world: int, path: Path) -> dict:
    """Under an outer loop, what a rank the saving world did not have takes from rank 0: its params, optimizer
    state and outer state (the anchor and outer moments are every rank's alike), its own pseudo-gradient hook
    state fresh, as a rank that joins starts it. At a sync step every rank's params are the anchor, so this is
    exact there; between syncs the new rank goes on from rank 0's inner steps.

    A sync in flight (``outer.overlap``) is the saving ranks' own pseudo-gradient: refused, in one line."""
    if len(first["outer"]) != len(host_leaves(template.outer)):
        raise CheckpointError(
            f"checkpoint {path} was saved by {saved_world} ranks with an outer sync in flight (outer.overlap); "
            "expected a checkpoint between syncs to resume on more ranks"
        )
    outer = rebuild_like(template.outer, first["outer"], "outer state (outer loop)", path)
    return {
        "params": first["params"],
        "opt_state": first["opt_state"],
        "opt_state_paths": first.get("opt_state_paths"),
        "outer": host_leaves(outer._replace(hook_state=template.outer.hook_state)),
    }


def save(directory: str | os.PathLike, payload: dict, keep: int = 2) -> Path:
    """Save ``payload`` as ``step_<N>.pt`` in ``directory`` and make ``last`` name it; keep the newest ``keep``
    step files.

    The state is written once: ``last`` is a small file naming the step file (``last_of``), not a
    copy nor a link, so no file aliases another (a tool that rewrites a step file in place changes
    that one alone). A ``last.pt`` copy of a run saved before goes: ``last`` names the newest now.

    >>> import tempfile
    >>> directory = Path(tempfile.mkdtemp())
    >>> save(directory, {"step": 7, "params": {}}).name, (directory / "last").read_text().strip()
    ('step_00000007.pt', 'step_00000007.pt')
    """
    directory = Path(directory)
    path = atomic_save(payload, directory / f"step_{int(payload['step']):08d}.pt")
    point_last(directory, path.name)
    (directory / LAST).unlink(missing_ok=True)
    fsync_dir(directory)
    prune(directory, keep, path)
    # Temporaries of a writer that was killed mid-save (only one process saves, and it is done).
    for stale in [*directory.glob(".step_*.tmp"), *directory.glob(f".{LAST}.*")]:
        stale.unlink(missing_ok=True)
    return path


def save_checkpoint(
    directory: str | os.PathLike,
    state: TrainState,
    plan: BucketPlan,
    comm: Comm | None = None,
    keep: int = 2,
    extra: dict | None = None,
) -> Path | None:
    """Save ``state`` of every rank as ``step_<N>.pt`` in ``directory``, named by ``last``; call on every rank.

    Rank 0 writes (atomically; the newest ``keep`` step files are kept) and returns the
    path; other ranks return ``None``. The file records ``plan``'s fingerprint, which
    ``load_checkpoint`` checks, and any ``extra`` entries (plain values: the file loads
    with ``weights_only=True``).

    >>> import tempfile
    >>> from fdp import functionalize, plan_buckets, planner_loss, cross_entropy_loss, sgd, init_train_state
    >>> model, params, buffers = functionalize(torch.nn.Linear(4, 3))
    >>> batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    >>> plan = plan_buckets(planner_loss(cross_entropy_loss(model), buffers), params, batch)
    >>> state = init_train_state(params, buffers, sgd(0.1), plan)
    >>> directory = tempfile.mkdtemp()
    >>> save_checkpoint(directory, state, plan).name
    'step_00000000.pt'
    >>> load_checkpoint(directory, state, plan).step
    0
    """
    comm = comm or Comm()
    mine = rank_payload(state)
    per_rank = [mine]
    if comm.world_size > 1:
        per_rank = [None] * comm.world_size if comm.rank == 0 else None
        dist.gather_object(mine, per_rank, dst=0, group=comm.group)
    if comm.rank != 0:
        return None
    payload = state_payload(
        state,
        _differing_buffers(per_rank, state.buffers),
        {**(extra or {}), "plan_fingerprint": plan.on_cpu().fingerprint()},
    )
    return save(directory, payload, keep=keep)


def load_checkpoint(
    path: str | os.PathLike, like: TrainState, plan: BucketPlan, comm: Comm | None = None
) -> TrainState:
    """This rank's ``TrainState`` from a checkpoint ``save_checkpoint`` wrote; call on every rank.

    ``path`` is a checkpoint file or a directory (the one its ``last`` names: ``resolve``). ``like`` is a state
    of the same run (from ``init_train_state`` or ``fdp.setup_state``): it gives the
    structure of the optimizer and hook states. Rank 0 reads the file with
    ``weights_only=True`` and sends it to the others; a file written with another
    bucket plan than ``plan`` (another model, dtype or bucket caps), or a state that does
    not fit ``like`` on any rank, is refused with the same ``CheckpointError`` on every rank.
    """
    comm = comm or Comm()
    path = resolve(path)
    payload: list = [None]
    if comm.rank == 0:
        try:
            payload = [load(path)]
        except CheckpointError as error:
            payload = [{"refused": str(error)}]
    if comm.world_size > 1:
        dist.broadcast_object_list(payload, src=0, group=comm.group)
    refused, state = payload[0].get("refused"), None
    if refused is None and payload[0].get("plan_fingerprint") != plan.on_cpu().fingerprint():
        refused = f"checkpoint {path} was written with another bucket plan (model or bucket caps changed)"
    if refused is None:
        try:
            state = restore(payload[0], like, comm.rank, path)
        except CheckpointError as error:
            refused = str(error)
    agree_on_refusal(refused, comm)
    return state


def agree_on_refusal(refused: str | None, comm: Comm) -> None:
    """Raise ``CheckpointError`` on every rank if any rank refused, in the same words (a collective).

    No rank goes on into collectives that a refusing one has left, and which rank reports it does not matter.

    >>> agree_on_refusal(None, Comm())
    """
    if comm.world_size > 1:
        seen: list = [None] * comm.world_size
        dist.all_gather_object(seen, refused, group=comm.group)
        refused = next((r for r in seen if r is not None), None)
    if refused is not None:
        raise CheckpointError(refused)
