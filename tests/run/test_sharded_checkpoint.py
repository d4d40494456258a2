"""Sharded checkpoints (fdp.run.checkpoint.sharded): written by every rank, read at any stage and world size.

One module-scoped run of 4 gloo ranks at ZeRO stage 3 trains a tiny char transformer
three steps and saves (asynchronously); every test reads that checkpoint another way and
compares with the whole state the saving world gathered (``gather_state``), bit for bit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fdp import adam, functionalize, init_train_state, plan_buckets, planner_loss
from fdp._torch import tree_paths
from fdp.comm import Comm
from fdp.hooks import allreduce
from fdp.model.builtin import CharTransformer
from fdp.model.losses import cross_entropy_loss
from fdp.plan import BucketPlan
from fdp.run import checkpoint
from fdp.run.checkpoint import ShardedSaver, load_sharded, verify, write_consolidated
from fdp.run.checkpoint.consolidate import consolidate
from fdp.run.checkpoint.files import is_sharded, read_meta, sharded_steps
from fdp.run.checkpoint.integrity import MANIFEST
from fdp.run.checkpoint.whole import host_leaves
from fdp.run.config.compose import compose
from fdp.step.train_step import make_train_step
from fdp.update import zero

GLOBAL_BATCH = 8


def _parts(rank, world, d_model=16):
    """The model, this rank's batches (the same global batch on any world) and the plan."""
    torch.manual_seed(0)
    model, params, buffers = functionalize(
        CharTransformer(vocab_size=11, block_size=8, d_model=d_model, n_layer=2, n_head=2)
    )
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(6):
        tokens = torch.randint(0, 11, (GLOBAL_BATCH, 9), generator=g)
        share = GLOBAL_BATCH // world
        tokens = tokens[rank * share : (rank + 1) * share]
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=0.002, first_bucket_cap_mb=0.001
    )
    return model, params, buffers, loss_fn, batches, plan


def _whole(state, plan, comm):
    whole = (
        zero.gather_state(state, plan, comm)
        if comm.world_size > 1 or zero.params_sharded(state.params, plan)
        else state
    )
    return {n: p.clone() for n, p in whole.params.items()}, {
        p: t.clone() if isinstance(t, torch.Tensor) else t
        for p, t in zip(tree_paths(whole.opt_state), host_leaves(whole.opt_state))
    }


def _save_at(rank, world, stage, directory, steps, asynchronous=True, kill_after_save=False):
    """``steps`` steps at ``stage`` then a sharded save: the whole params and optimizer state it should hold."""
    model, params, buffers, loss_fn, batches, plan = _parts(rank, world)
    comm = Comm()
    update = zero.update_for(stage, adam(1e-2), plan, comm, model=model)
    state = update.first_state(params, buffers, allreduce(), comm)
    step = make_train_step(loss_fn, adam(1e-2), plan, comm=comm, donate=False, zero_stage=stage, model=model)
    saver = ShardedSaver(comm, asynchronous=asynchronous, timeout_s=20)
    for batch in batches[:steps]:
        state, _ = step(state, batch)
        if state.step == 2:
            saver.save(directory, state, update, plan)
            saver.wait()
    saver.save(directory, state, update, plan, extra={"config": "seed: 0\n"})
    if kill_after_save and rank == 1:  # the write is in flight on its thread
        os.kill(os.getpid(), signal.SIGKILL)
    saver.wait()
    return _whole(state, plan, comm), plan.to_dict()


def _resume_at(rank, world, stage, directory, more_steps=0):
    model, params, buffers, loss_fn, batches, plan = _parts(rank, world)
    comm = Comm()
    update = zero.update_for(stage, adam(1e-2), plan, comm, model=model)
    like = update.first_state(params, buffers, allreduce(), comm)
    state = load_sharded(checkpoint.resolve(directory), like, update, plan, comm)
    loaded = _whole(state, plan, comm)
    step = make_train_step(loss_fn, adam(1e-2), plan, comm=comm, donate=False, zero_stage=stage, model=model)
    for batch in batches[state.step : state.step + more_steps]:
        state, _ = step(state, batch)
    return state.step, loaded, _whole(state, plan, comm)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of step 3 written by 4 ranks at stage 3: ``(directory, (params, opt_state), plan)``."""
    from fdp import WorldLayout, spawn
    from tests.conftest import COLLECTIVE_TIMEOUT_S, _rank_entry  # noqa: F401 (the shared spawning entry)

    directory = tmp_path_factory.mktemp("sharded")
    layout = WorldLayout("elastic", nproc_per_node=4, backend="gloo", timeout_s=COLLECTIVE_TIMEOUT_S)
    results = spawn(_rank_entry, (_save_at, (3, directory, 3), layout), layout)
    whole, plan = results[0]
    return directory, whole, BucketPlan.from_dict(plan)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def test_the_checkpoint_is_complete_and_self_describing(saved):
    directory, _, plan = saved
    last = checkpoint.last_of(directory)
    assert last.name == "step_00000003" and sharded_steps(directory).keys() == {2, 3}
    assert not list(directory.glob("*.tmp-*"))
    meta = checkpoint.load(last)  # weights_only
    assert (meta["step"], meta["stage"], meta["world_size"]) == (3, 3, 4)
    assert meta["plan_fingerprint"] == plan.fingerprint() and meta["config"] == "seed: 0\n"
    assert sorted(p.name for p in last.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]


def test_the_pieces_are_checksummed_once_by_the_manifest_not_again_by_each_record(saved):
    """Each piece is a ``torch.save`` record inside a ``.distcp`` file; the manifest's SHA-256, taken as the file is
    written, covers every byte of it, so the save spends no second checksum (torch's per-record CRC-32) on them."""
    import io
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    directory, _, _ = saved
    last = checkpoint.last_of(directory)
    crcs = []
    for info in FileSystemReader(last).read_metadata().storage_data.values():
        with open(last / info.relative_path, "rb") as f:
            f.seek(info.offset)
            record = zipfile.ZipFile(io.BytesIO(f.read(info.length)))
        crcs += [entry.CRC for entry in record.infolist()]
    assert crcs and set(crcs) == {0}
    assert torch.serialization.get_crc32_options()


def test_resumes_at_two_ranks_stage_one_bit_for_bit(saved, run_ranks):
    directory, (params, opt_state), _ = saved
    for step, (got_params, got_opt), _ in run_ranks(_resume_at, 1, directory):
        assert step == 3 and _equal(got_params, params) and _equal(got_opt, opt_state)


def test_resumes_in_one_process_at_stage_zero_bit_for_bit(saved):
    directory, (params, opt_state), _ = saved
    step, (got_params, got_opt), _ = _resume_at(0, 1, 0, directory)
    assert step == 3 and _equal(got_params, params) and _equal(got_opt, opt_state)


def test_a_consolidated_file_resumes_bit_for_bit_and_dcp_reads_the_checkpoint(saved, tmp_path):
    directory, (params, opt_state), plan = saved
    written = write_consolidated(directory, tmp_path / "whole.pt")
    model, p0, buffers, _, _, _ = _parts(0, 1)
    state = checkpoint.load_checkpoint(written, init_train_state(p0, buffers, adam(1e-2), plan), plan)
    assert state.step == 3 and _equal({n: state.params[n] for n in params}, params)
    assert _equal(dict(zip(tree_paths(state.opt_state), host_leaves(state.opt_state))), opt_state)
    dcp_to_torch_save(checkpoint.last_of(directory), tmp_path / "dcp.pt")  # DCP's own converter
    flat = torch.load(tmp_path / "dcp.pt", weights_only=True)
    assert all(torch.equal(flat[f"params[{n!r}]"], p.reshape(-1)) for n, p in params.items())
    safetensors = write_consolidated(directory, tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    assert _equal(load_file(safetensors), {n: p.contiguous() for n, p in params.items()})
    cli = subprocess.run(
        [sys.executable, "-m", "fdp.checkpoint", "consolidate", str(directory), "--to", str(tmp_path / "c.pt")],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0 and _equal(
        consolidate(directory)["params"], checkpoint.load(tmp_path / "c.pt")["params"]
    )


def test_another_model_or_a_bad_path_is_refused_in_one_line(saved, tmp_path):
    directory, _, _ = saved
    model, params, buffers, _, batches, plan = _parts(0, 1, d_model=24)
    update = zero.update_for(0, adam(1e-2), plan, Comm(), model=model)
    like = update.first_state(params, buffers, allreduce(), Comm())
    with pytest.raises(checkpoint.CheckpointError, match=r"another bucket plan") as refused:
        load_sharded(checkpoint.last_of(directory), like, update, plan, Comm())
    assert "\n" not in str(refused.value)
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        load_sharded(tmp_path / "nowhere", like, update, plan, Comm())
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="not an fdp checkpoint"):
        load_sharded(tmp_path / "empty", like, update, plan, Comm())


def test_a_checkpoint_saved_without_a_manifest_resumes_and_is_checked_by_its_own_files(saved, tmp_path):
    """As sharded checkpoints were written before manifest.json: DCP's index and the ranks' parts still say
    which files must be there and how long each piece file is."""
    directory, (params, opt_state), _ = saved
    copy = tmp_path / "checkpoints"
    shutil.copytree(directory, copy)
    last = checkpoint.last_of(copy)
    (last / MANIFEST).unlink()
    verify(last)
    step, (got_params, got_opt), _ = _resume_at(0, 1, 0, copy)
    assert step == 3 and _equal(got_params, params) and _equal(got_opt, opt_state)
    piece = last / "__2_0.distcp"
    piece.write_bytes(piece.read_bytes()[:-1])
    with pytest.raises(checkpoint.CheckpointError, match=rf"^checkpoint {piece} is damaged: .* \(truncated\?\)$"):
        verify(last)


def _mirror_at(rank, world, directory):
    """The mirror (the next rank's optimizer-state slices, kept at stage 1 in a world that may shrink) read from the
    sharded checkpoint, and the one the whole-file route makes: the state read whole (stage 0), then sharded."""
    model, params, buffers, _, _, plan = _parts(rank, world)
    comm = Comm()
    mirrored = zero.update_for(1, adam(1e-2), plan, comm, model=model, mirror=True)
    like = mirrored.first_state(params, buffers, allreduce(), comm)
    state = load_sharded(checkpoint.resolve(directory), like, mirrored, plan, comm)
    whole = zero.update_for(0, adam(1e-2), plan, comm, model=model)
    as_whole = load_sharded(
        checkpoint.resolve(directory), whole.first_state(params, buffers, allreduce(), comm), whole, plan, comm
    )
    expected = zero.shard_state(as_whole, plan, comm, stage=1, mirror=True).mirror
    return host_leaves(state.mirror), host_leaves(expected)


def test_a_world_that_may_shrink_reads_its_mirror_of_the_next_ranks_slices(saved, run_ranks):
    """Stage 1 in a world that may shrink keeps the next rank's optimizer-state slices: read from the same logical
    tensors as the optimizer state (never written twice), equal to what the whole-file route builds."""
    directory, _, _ = saved
    for got, expected in run_ranks(_mirror_at, directory):
        assert len(got) == len(expected) and any(isinstance(t, torch.Tensor) and t.abs().sum() > 0 for t in got)
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(got, expected))


def _refusal_at(rank, world, stage, directory):
    try:
        _resume_at(rank, world, stage, directory)
    except checkpoint.CheckpointError as error:
        return str(error)
    return None


def test_a_saving_ranks_missing_part_is_refused_on_every_rank(saved, run_ranks, tmp_path):
    """Without a saving rank's rank<r>.pt its hook state and RNG would start fresh: refused, the same on every rank."""
    directory, _, _ = saved
    copy = tmp_path / "checkpoints"
    shutil.copytree(directory, copy)
    (checkpoint.last_of(copy) / "rank1.pt").unlink()
    expected = f"checkpoint {checkpoint.last_of(copy) / 'rank1.pt'} is missing (the checkpoint was written by 4 ranks)"
    assert run_ranks(_refusal_at, 1, copy) == [expected, expected]


def test_a_rank_killed_mid_asynchronous_save_leaves_the_previous_checkpoint_last(run_ranks, tmp_path):
    """Rank 1 dies while its write of step 4 is in flight: ``last`` still names step 2, which resumes exactly."""
    from fdp.procs.launch import WorkerFailedError

    with pytest.raises((WorkerFailedError, RuntimeError)):
        run_ranks(_save_at, 3, tmp_path, 4, True, True, world_size=2, timeout_s=20)
    assert checkpoint.last_of(tmp_path).name == "step_00000002"
    step, _, (after, _) = run_ranks(_resume_at, 3, tmp_path, 2)[0]
    straight = run_ranks(_save_at, 3, tmp_path / "straight", 4, world_size=2)[0][0][0]
    assert step == 4 and _equal(after, straight)


# -- through the trainer ----------------------------------------------------------------------------
RUN = [
    "model=mlp",
    "model.hidden=32",
    "optim=adam",
    "trainer.progress=false",
    "data.global_batch_size=16",
    "trainer.bucket_cap_mb=0.01",
    "trainer.first_bucket_cap_mb=0.005",
    "trainer.eval_batches=2",
    "trainer.eval_every=0",
    "trainer.max_steps=8",
    "trainer.checkpoint_every=4",
    "trainer.checkpoint_format=sharded",
]


@pytest.mark.timeout(900)  # a four-rank run, a two-rank one and two in one process
def test_four_ranks_at_stage_3_checkpoint_and_two_resume_under_a_memory_cap_like_an_uninterrupted_run(tmp_path):
    """SGD with momentum, asynchronous sharded saves: 4 ranks at stage 3 stopped at step 4, resumed on 2 ranks at
    stage 3 under world.memory_per_rank_mb, end within 1e-5 of one process uninterrupted; then one process at stage 0
    starts from the 4 ranks' step 4. (The issue's params larger than the cap need the sharded build: not here.)"""
    from fdp.run.trainer import run

    one_process = [*RUN, "optim=sgd", "optim.momentum=0.9"]
    sgd = [*one_process, "trainer.zero_stage=3"]
    whole = run(compose(*one_process), tmp_path / "straight")  # uninterrupted, on the union batch
    run(compose(*sgd, "world=local4", "trainer.stop_at=4"), tmp_path / "four")
    step4 = tmp_path / "four" / "checkpoints" / "step_00000004"
    assert read_meta(step4)["world_size"] == 4
    two = run(compose(*sgd, "world=local2", "world.memory_per_rank_mb=1500", "trainer.resume=true"), tmp_path / "four")
    # Evaluated at stage 3 by every rank, each forward gathering its buckets: the figures of the whole params.
    assert two["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-5)
    assert two["test_acc"] == whole["test_acc"]
    straight, resumed = consolidate(tmp_path / "straight"), consolidate(tmp_path / "four")
    assert (
        straight["step"] == resumed["step"] == 8
        and read_meta(checkpoint.last_of(tmp_path / "four" / "checkpoints"))["world_size"] == 2
    )
    assert all(torch.allclose(resumed["params"][n], p, atol=1e-5, rtol=0) for n, p in straight["params"].items())
    logged = "".join(p.read_text() for p in (tmp_path / "four").glob("*.log"))
    assert "checkpoint step 4: the loop blocked" in logged and "written in" in logged
    run(compose(*one_process, f"trainer.resume={step4}"), tmp_path / "one")
    one = consolidate(tmp_path / "one")
    assert one["step"] == 8 and all(
        torch.allclose(one["params"][n], p, atol=1e-5) for n, p in straight["params"].items()
    )


def _consolidated_params(run_dir):
    return (
        consolidate(run_dir)["params"]
        if is_sharded(checkpoint.resolve(run_dir))
        else (checkpoint.load(checkpoint.resolve(run_dir))["params"])
    )


@pytest.mark.timeout(900)  # five two-rank runs and two in one process
def test_a_world_that_may_shrink_checkpoints_sharded_and_resumes_on_two_ranks_and_on_one(tmp_path):
    """Two ranks at stage 1 under world.on_rank_loss=shrink (each mirroring the next rank's slices) stopped at step 4
    in the default format (sharded, on two ranks): resumed on two ranks they end bit for bit as the uninterrupted run;
    resumed in one process, as the same run checkpointed whole and resumed there."""
    from fdp.run.trainer import run

    shrinking = [*RUN[:-1], "world=local2", "world.on_rank_loss=shrink", "trainer.zero_stage=1"]
    run(compose(*shrinking), tmp_path / "straight")
    for fmt in ("auto", "whole"):
        run(compose(*shrinking, f"trainer.checkpoint_format={fmt}", "trainer.stop_at=4"), tmp_path / fmt)
        shutil.copytree(tmp_path / fmt, tmp_path / f"{fmt}_on_one")
    assert is_sharded(checkpoint.resolve(tmp_path / "auto"))
    assert not is_sharded(checkpoint.resolve(tmp_path / "whole"))
    run(compose(*shrinking, "trainer.resume=true"), tmp_path / "auto")
    straight, two = _consolidated_params(tmp_path / "straight"), _consolidated_params(tmp_path / "auto")
    assert _equal(two, straight)
    for fmt in ("auto", "whole"):
        run(compose(*RUN[:-1], "trainer.resume=true"), tmp_path / f"{fmt}_on_one")
    one, one_from_whole = (_consolidated_params(tmp_path / f"{fmt}_on_one") for fmt in ("auto", "whole"))
    assert _equal(one, one_from_whole) and all(torch.allclose(one[n], p, atol=1e-5) for n, p in straight.items())
