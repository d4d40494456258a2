"""Sharded checkpoints: every rank writes its own share, in ``torch.distributed.checkpoint``'s (DCP's) format.

A checkpoint is a directory ``step_<N>/`` beside the whole-file ``step_<N>.pt`` ones
(``fdp.run.checkpoint.whole``). Its tensors are DCP's: each parameter and each of its optimizer
state's leaves one logical 1-D tensor, each rank writing the pieces it owns
(``fdp.update.pieces``: the stage's update says which, ``Update.checkpoint_pieces``), so DCP's own
tools read it (``dcp_to_torch_save``). Beside them, ``fdp.pt`` (rank 0: step, plan fingerprint,
stage, world size, the parameters' shapes, the config and the loop's state) and
``rank<r>.pt`` (each rank: its hook state, RNG and buffers), all plain values that load with
``weights_only=True``, and ``manifest.json``, the size and SHA-256 of every other file, each
rank's recorded by the rank that wrote it (``fdp.run.checkpoint.integrity`` checks a checkpoint against it
before a run uses it).

Atomic: the ranks write into ``step_<N>.tmp-<token>/``; once DCP has every rank's
pieces (its last collective), rank 0 renames it ``step_<N>/`` and replaces the small file
``last`` that names the newest complete one. A crash or SIGKILL mid-save leaves a
``.tmp-`` directory (removed by the next save) and ``last`` naming the previous checkpoint.

Asynchronous (``trainer.checkpoint_async``): the loop is blocked only while this rank's
pieces are copied to the CPU (pinned memory on a GPU; on the CPU the copy is counted in
``world.memory_per_rank_mb``, the process's data limit); a thread writes them over a
process group of its own while training goes on. The next save, the end of the run and
an interrupt wait for it (``ShardedSaver.wait``).

Loading, each rank asks for the ranges it will own at its own stage and world size and
reads them straight into its state's tensors, from whichever pieces hold them; at stage 1 in
a world that may shrink, its mirror of the next rank's optimizer-state slices
(``TrainState.mirror``) from the same pieces, which are written once.

Under an outer loop (``fdp.step.outer``) the ranks step apart between syncs: each writes its
own params, inner optimizer state and in-flight pseudo-gradient whole, keyed ``rank<r>/...``,
beside the anchor and outer optimizer state they share (``outer...``, in pieces); its
pseudo-gradient's hook state goes in ``rank<r>.pt``. A rank the saving world did not have
starts from rank 0's, as from a whole-file checkpoint (``fdp.run.checkpoint.whole``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fdp._torch import (
    chunk_load_planner,
    digesting_writer,
    records_without_crc,
    single_process_dcp,
    tree_flatten,
    tree_paths,
    tree_unflatten,
)
from fdp.comm import Comm
from fdp.plan import BucketPlan
from fdp.procs.budget import LateOutOfMemory, is_out_of_memory
from fdp.run.checkpoint.atomic import atomic_save, fsync_dir
from fdp.run.checkpoint.files import META, CheckpointError, point_last, prune, read_meta
from fdp.run.checkpoint.integrity import DCP_METADATA, file_entry, write_manifest
from fdp.run.checkpoint.staging import Staging
from fdp.run.checkpoint.whole import agree_on_refusal, hook_state_like, host_leaves
from fdp.state.train_state import TrainState
from fdp.update.base import Update
from fdp.update.pieces import param_shapes, rank_pieces, state_pieces
from fdp.update.zero.layout import slice_range

__all__ = ["ShardedSaver", "load_sharded", "FORMAT"]

log = logging.getLogger("fdp")

FORMAT = "fdp-sharded-1"  # fdp.pt's "format": what this module writes and reads


def _state_tree(state: TrainState) -> dict:
    """The logical tensors every rank holds pieces of. Under an outer loop the params and optimizer state are each
    rank's own (``_own_tree``); the anchor and outer optimizer state are every rank's alike."""
    if state.outer:
        shared = state.outer._replace(hook_state=(), in_flight={})  # the hook state and in-flight sync: per rank
        return {"outer": shared, "loss_scale": state.loss_scale, "buffers": state.buffers}
    return {
        "params": state.params,
        "opt_state": state.opt_state,
        "loss_scale": state.loss_scale,
        "buffers": state.buffers,
    }


def _own_tree(state: TrainState) -> dict:
    """Under an outer loop, what each rank alone holds: its params, optimizer state and in-flight pseudo-gradient
    (``outer.overlap``); else nothing."""
    if not state.outer:
        return {}
    return {"params": state.params, "opt_state": state.opt_state, "outer.in_flight": state.outer.in_flight}


def _own_pieces(state: TrainState, plan: BucketPlan, rank: int, reading: bool = False) -> tuple[dict, dict]:
    """Under an outer loop, what rank ``rank`` alone holds (``_own_tree``), whole
    (``fdp.update.pieces.rank_pieces``)."""
    own = _own_tree(state)
    return rank_pieces(own, plan, rank, reading) if own else ({}, {})


def _mirror_pieces(state: TrainState, plan: BucketPlan, comm: Comm) -> dict:
    """Reading, the pieces a stage-1 state's mirror of the next rank's slices (``TrainState.mirror``, a world that
    may shrink) is filled from: that rank's ranges of the optimizer state's logical tensors (never saved twice)."""
    if not state.mirror:
        return {}
    mirrored, world = (comm.rank + 1) % comm.world_size, comm.world_size
    tensors, _ = state_pieces(
        {"opt_state": state.mirror},
        plan,
        comm.rank,
        world,
        lambda index: slice_range(plan.buckets[index], mirrored, world),
        reading=True,
    )
    return tensors


def _plain_values(plain: dict) -> dict:
    return {k: v for k, v in plain.items() if isinstance(v, (int, float, bool, str, type(None)))}


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


class ShardedSaver:
    """Writes sharded checkpoints of one world (see the module docstring); one write in flight at most.

    Made on every rank at the same point (it makes the writers' process group: a collective, here and not at the
    first save, where a rank that failed before it would leave the others waiting on the group's rendezvous);
    ``save`` and ``wait`` are called by every rank at the same points.

    >>> import tempfile
    >>> from fdp import cross_entropy_loss, functionalize, plan_buckets, planner_loss, sgd
    >>> from fdp.update import zero
    >>> model, params, buffers = functionalize(torch.nn.Linear(4, 3))
    >>> batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    >>> plan = plan_buckets(planner_loss(cross_entropy_loss(model), buffers), params, batch)
    >>> update = zero.update_for(0, sgd(0.1, momentum=0.9), plan, Comm())
    >>> state = update.first_state(params, buffers, None, Comm())
    >>> saver, directory = ShardedSaver(Comm()), tempfile.mkdtemp()
    >>> saver.save(directory, state._replace(step=5), update, plan).name
    'step_00000005'
    >>> saver.wait()  # the write in flight is complete: checkpoints/last names it
    >>> load_sharded(Path(directory) / "step_00000005", update.first_state(params, buffers, None, Comm()), update,
    ...              plan, Comm()).step
    5
    """

    def __init__(self, comm: Comm, asynchronous: bool = True, timeout_s: float = 300.0):
        self.comm, self.asynchronous, self.timeout_s = comm, asynchronous, timeout_s
        self._group = None  # the writers' own process group
        self._thread: threading.Thread | None = None
        self._writing: int | None = None  # the step of the write in flight
        self._error: BaseException | None = None
        # The staging copy, kept from one save to the next: its pages are touched once, not at every save, and
        # where each piece comes from is worked out at the first save (fdp.run.checkpoint.staging).
        self._staging = Staging()
        self._fingerprint: tuple[BucketPlan | None, str] = (None, "")
        self.last_blocked_s = self.last_write_s = 0.0
        self._writers()

    def _writers(self):
        if self.comm.world_size > 1 and self._group is None:
            # Writes overlap training: their collectives go over a gloo group of their own, never the step's.
            self._group = dist.new_group(
                list(range(self.comm.world_size)), backend="gloo", timeout=timedelta(seconds=self.timeout_s)
            )
        return self._group

    def wait(self) -> None:
        """Wait for the write in flight, if any; its failure is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None and is_out_of_memory(
            error
        ):  # the save's out-of-memory line (fdp.run.memory.out_of_memory)
            raise LateOutOfMemory("save", self._writing, "the asynchronous checkpoint write", error) from error
        if error is not None:
            raise CheckpointError(f"the asynchronous checkpoint write failed: {error}") from error

    def abandon(self) -> None:
        """After a lost rank: let the write in flight end (it fails within the writers' group's timeout, at its next
        collective with the lost rank, or completes) and drop it; its temporary directory goes at the next save."""
        if self._thread is not None:
            self._thread.join(self.timeout_s + 5)
            if self._thread.is_alive() or self._error is not None:
                log.warning(f"the checkpoint write in flight was abandoned: {self._error or 'still waiting'}")
        self._thread, self._error = None, None

    def save(
        self,
        directory: str | os.PathLike,
        state: TrainState,
        update: Update,
        plan: BucketPlan,
        keep: int = 2,
        extra: dict | None = None,
    ) -> Path:
        """Save ``state`` as ``directory/step_<N>/``; returns its path (complete once ``wait`` returns)."""
        t0 = time.perf_counter()
        self.wait()
        comm, group = self.comm, self._writers()

        def pieces(trees: list[dict]) -> tuple[dict, list[dict]]:
            tensors, plain = update.checkpoint_pieces(trees[0], comm)
            own, own_plain = rank_pieces(trees[1], plan, comm.rank) if trees[1] else ({}, {})
            return {**tensors, **own}, [plain, own_plain]

        trees = [_state_tree(state), _own_tree(state)]
        if self.asynchronous:  # the loop goes on with the state: the thread writes a copy
            key = (update, plan, comm.rank, comm.world_size)
            tensors, (plain, own_plain) = self._staging.stage(trees, pieces, key)
        else:
            tensors, (plain, own_plain) = pieces(trees)
        if self._fingerprint[0] is not plan:  # the plan is static: its fingerprint is taken once
            self._fingerprint = (plan, plan.on_cpu().fingerprint())
        mine = {
            "hook_state": host_leaves(state.hook_state),
            "rng": state.rng,
            "cuda_rng": state.cuda_rng,
            "buffers": {n: b.detach().cpu().clone() for n, b in state.buffers.items()},
        }
        if state.outer:  # each rank's own: the pseudo-gradient's hook state, its optimizer's step count
            mine.update(
                plain=_plain_values(own_plain),
                outer_hook_state=host_leaves(state.outer.hook_state),
                outer_paths=tree_paths(state.outer),
            )
        meta = {
            "format": FORMAT,
            "step": int(state.step),
            "plan_fingerprint": self._fingerprint[1],
            "stage": update.stage,
            "world_size": comm.world_size,
            "shapes": {name: list(shape) for name, shape in param_shapes(plan).items()},
            "plain": _plain_values(plain),
            "loss_scale_paths": tree_paths(state.loss_scale),
            **(extra or {}),
        }
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        directory, step = Path(directory), int(state.step)
        blocked = time.perf_counter() - t0
        self.last_blocked_s = blocked
        args = (directory, step, tensors, mine, meta, group, keep, blocked, nbytes)
        if self.asynchronous:
            self._writing = step
            self._thread = threading.Thread(target=self._write_caught, args=args, name="fdp-checkpoint", daemon=True)
            self._thread.start()
        else:
            self._write(*args)
        return directory / f"step_{step:08d}"

    def _write_caught(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as error:  # raised by the next wait(), in the loop's thread
            self._error = error

    def _write(
        self,
        directory: Path,
        step: int,
        tensors: dict,
        mine: dict,
        meta: dict,
        group,
        keep: int,
        blocked: float,
        nbytes,
    ) -> None:
        t0 = time.perf_counter()
        rank, world = self.comm.rank, self.comm.world_size
        token = [uuid.uuid4().hex[:8]]
        if group is not None:  # rank 0's; it also holds every rank until rank 0 has published the previous save
            dist.broadcast_object_list(token, src=0, group=group)  # and swept stale temporaries (never this one)
        tmp = directory / f"step_{step:08d}.tmp-{token[0]}"
        tmp.mkdir(parents=True, exist_ok=True)
        atomic_save(mine, tmp / _rank_file(rank))
        if rank == 0:
            atomic_save(meta, tmp / META)
        digests: dict = {}  # each piece file's SHA-256, taken as DCP writes it: no file is read back
        writer = digesting_writer(tmp, hashlib.sha256, digests)
        # That SHA-256 covers every byte of the piece files: their records need no CRC-32 of their own as well.
        with single_process_dcp(group is None), records_without_crc():
            dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=group is None)
        # DCP's last collective gathered every rank's results: every piece is on disk. Each rank records the
        # size and checksum of the files it wrote, rank 0 the whole checkpoint's (fdp.run.checkpoint.integrity).
        files = [tmp / _rank_file(rank), *tmp.glob(f"__{rank}_*.distcp")]
        written = {p.name: file_entry(p, digests.get(p.name)) for p in files}
        gathered = [written]
        if group is not None:
            gathered = [None] * world if rank == 0 else None
            dist.gather_object(written, gathered, dst=0, group=group)
        if rank == 0:
            files = {name: file_entry(tmp / name) for name in (META, DCP_METADATA)}
            for entries in gathered:
                files.update(entries)
            write_manifest(tmp, files)
            _publish(directory, tmp, step, keep)
            self.last_write_s = time.perf_counter() - t0
            log.info(
                f"checkpoint step {step}: the loop blocked {blocked:.3f} s, written in {self.last_write_s:.3f} s "
                f"({nbytes / 2**20:.1f} MiB from rank 0 of {world})"
            )
        else:
            self.last_write_s = time.perf_counter() - t0


def _publish(directory: Path, tmp: Path, step: int, keep: int) -> None:
    """Rank 0: ``tmp`` becomes ``step_<N>/`` and ``last`` names it; older ones beyond ``keep`` and stale
    temporaries (of writes killed mid-way) go."""
    final = directory / f"step_{step:08d}"
    fsync_dir(tmp)  # every rank's files are named in it for good before it is renamed
    if final.exists():  # a resumed run saving a step again
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(directory)
    point_last(directory, final.name)
    prune(directory, keep, final)
    for stale in directory.glob("step_*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def load_sharded(path: str | os.PathLike, like: TrainState, update: Update, plan: BucketPlan, comm: Comm) -> TrainState:
    """This rank's state from the sharded checkpoint ``path``, at ``update``'s stage and ``comm``'s world size.

    ``like`` is a fresh state of this run (the built one): its tensors are filled in place,
    each rank reading only the ranges it owns. A checkpoint of another plan is refused
    with the same ``CheckpointError`` on every rank.
    """
    path = Path(path)
    refused, meta = None, {}
    try:
        meta = read_meta(path)
    except CheckpointError as error:
        refused = str(error)
    if refused is None and meta.get("plan_fingerprint") != plan.on_cpu().fingerprint():
        refused = (
            f"checkpoint {path} was written with another bucket plan (model or bucket caps changed): "
            f"plan {str(meta.get('plan_fingerprint'))[:12]}, this run's {plan.on_cpu().fingerprint()[:12]}"
        )
    saved_world = int(meta.get("world_size", 0))
    if (
        refused is None
        and like.outer
        and update.stage
        and (saved_world, meta.get("stage"))
        != (
            comm.world_size,
            update.stage,
        )
    ):  # each rank's own slices of its replica's params, laid out for the world that wrote them
        refused = (
            f"checkpoint {path} holds an outer loop's own ZeRO slices per rank, written by {saved_world} ranks at "
            f"trainer.zero_stage={meta.get('stage')}: resume it with those, or save with "
            "trainer.checkpoint_format=whole, which resumes on any world and stage"
        )
    agree_on_refusal(refused, comm)
    # Under an outer loop a rank the saving world did not have goes on from rank 0's own params (as a whole-file
    # checkpoint's does: fdp.run.checkpoint.whole).
    source = comm.rank if comm.rank < saved_world else 0
    tensors, _ = update.checkpoint_pieces(_state_tree(like), comm, reading=True)
    tensors.update(_own_pieces(like, plan, source, reading=True)[0])
    try:
        # The mirror reads the same logical tensors as the optimizer state, other ranges: a read of its own.
        for wanted in (tensors, _mirror_pieces(like, plan, comm)):
            if wanted or wanted is tensors:
                with single_process_dcp(comm.world_size == 1):
                    dcp.load(
                        wanted,
                        storage_reader=dcp.FileSystemReader(path),
                        planner=chunk_load_planner(),
                        process_group=comm.group,
                        no_dist=comm.world_size == 1,
                    )
    except Exception as error:  # DCP names the first tensor it could not read
        refused = f"checkpoint {path} does not fit this run's state: {str(error).strip().splitlines()[-1][:300]}"
    mine, own = None, None
    for rank in dict.fromkeys((comm.rank, source) if like.outer else (comm.rank,)):
        rank_path = path / _rank_file(rank)
        if refused is None and rank < saved_world and not rank_path.exists():
            refused = f"checkpoint {rank_path} is missing (the checkpoint was written by {meta['world_size']} ranks)"
        if refused is None and rank_path.exists():
            try:
                loaded = torch.load(rank_path, map_location="cpu", weights_only=True)
            except Exception as error:
                refused = f"checkpoint {rank_path} is unreadable: {type(error).__name__}"
            else:
                mine = loaded if rank == comm.rank else mine
                own = loaded if rank == source else own
    state = like
    if refused is None and mine is not None:  # a rank the saving world did not have starts its hook state fresh
        try:
            hook_state = hook_state_like(like.hook_state, mine["hook_state"], path)
        except CheckpointError as error:
            refused = str(error)
        else:
            cuda_rng = mine.get("cuda_rng")
            on_gpu = cuda_rng is not None and cuda_rng.numel() and like.cuda_rng.numel()
            buffers = {n: mine["buffers"].get(n, b).to(b.device) for n, b in like.buffers.items()}
            state = like._replace(
                hook_state=hook_state, rng=mine["rng"], cuda_rng=cuda_rng if on_gpu else like.cuda_rng, buffers=buffers
            )
    if refused is None and like.outer:
        try:  # the pseudo-gradient's hook state is each rank's own: a rank new to the world starts it fresh
            outer_hook_state = (
                hook_state_like(like.outer.hook_state, mine["outer_hook_state"], path)
                if mine is not None and "outer_hook_state" in mine
                else like.outer.hook_state
            )
        except CheckpointError as error:
            refused = str(error)
    agree_on_refusal(refused, comm)
    plain = {**meta.get("plain", {}), **((own or {}).get("plain", {}))}
    state = state._replace(
        step=int(meta["step"]),
        opt_state=_with_plain(state.opt_state, "opt_state", plain),
        loss_scale=_with_plain(state.loss_scale, "loss_scale", plain),
        mirror=_with_plain(state.mirror, "opt_state", plain),
    )
    if like.outer:
        outer = _with_plain(state.outer._replace(hook_state=()), "outer", plain)
        state = state._replace(outer=outer._replace(hook_state=outer_hook_state))
    return state


def _with_plain(tree: Any, prefix: str, plain: dict) -> Any:
    """``tree`` with its leaves that are not tensors (an optimizer's step count) taken from the checkpoint."""
    leaves, spec = tree_flatten(tree)
    paths = tree_paths(tree)
    return tree_unflatten(
        [leaf if isinstance(leaf, torch.Tensor) else plain.get(prefix + p, leaf) for p, leaf in zip(paths, leaves)],
        spec,
    )
