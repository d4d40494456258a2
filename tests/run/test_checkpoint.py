"""Atomic checkpoints, clear errors for bad files, and exact resume."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fdp._torch import tree_flatten, tree_map
from fdp.errors import ConfigError
from fdp.model.builtin import MLP
from fdp.optim import warmup_cosine_schedule
from fdp.run import checkpoint
from fdp.run.checkpoint.atomic import atomic_save
from fdp.run.checkpoint.files import LAST, POINTER
from fdp.run.checkpoint.whole import _differing_buffers, rank_payload, restore, save, state_payload
from fdp.run.config import register_configs
from fdp.run.config.compose import compose
from fdp.run.trainer import run

register_configs()


def make_cfg(*overrides):
    return compose("trainer.progress=false", *overrides)


def test_atomic_save_replaces_whole_files(tmp_path):
    path = tmp_path / "c.pt"
    atomic_save({"step": 1, "params": {"w": torch.ones(3)}}, path)
    atomic_save({"step": 2, "params": {"w": torch.zeros(3)}}, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 2 and torch.equal(loaded["params"]["w"], torch.zeros(3))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary left behind


def test_killed_writer_leaves_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "c.pt"
    atomic_save({"step": 1, "params": {"w": torch.ones(3)}}, path)
    # A writer killed in the middle of torch.save: the big payload is being written when SIGKILL lands.
    script = (
        "import os, signal, threading, torch, sys\n"
        "from fdp.run.checkpoint.atomic import atomic_save\n"
        "threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()\n"
        f"atomic_save({{'step': 2, 'params': {{'w': torch.randn(60_000_000)}}}}, {str(path)!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9
    loaded = checkpoint.load(path)
    assert loaded["step"] == 1 and torch.equal(loaded["params"]["w"], torch.ones(3))


def test_truncated_and_foreign_files_give_one_line_errors(tmp_path):
    good = tmp_path / "good.pt"
    atomic_save({"step": 3, "params": {"w": torch.ones(1000)}}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:500])
    with pytest.raises(checkpoint.CheckpointError, match="truncated.pt"):
        checkpoint.load(truncated)
    foreign = tmp_path / "foreign.pt"
    torch.save([1, 2, 3], foreign)
    with pytest.raises(checkpoint.CheckpointError, match="not an fdp checkpoint"):
        checkpoint.load(foreign)
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        checkpoint.load(tmp_path / "missing.pt")


def test_checkpoint_loads_with_weights_only_and_names_params(tmp_path):
    cfg = make_cfg("trainer.max_steps=4", "trainer.checkpoint_every=2", "model.hidden=16")
    run(cfg, tmp_path)
    payload = torch.load(checkpoint.last_of(tmp_path / "checkpoints"), weights_only=True)
    assert payload["step"] == 4
    expected = {name: p.shape for name, p in MLP(64, 16, 2, 10).named_parameters()}
    assert {name: t.shape for name, t in payload["params"].items()} == expected
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "last",
        "step_00000002.pt",
        "step_00000004.pt",
    ]


def test_resume_is_bit_identical_with_adam_and_a_schedule(tmp_path):
    common = [
        "optim=adamw",
        "optim.warmup_steps=5",
        "model.hidden=32",
        "trainer.checkpoint_every=10",
        "trainer.eval_every=0",
    ]
    straight = tmp_path / "straight"
    run(make_cfg(*common, "trainer.max_steps=20"), straight)
    stopped = tmp_path / "stopped"
    run(make_cfg(*common, "trainer.max_steps=20", "trainer.stop_at=10"), stopped)
    # Another length would re-span the warm-up + cosine schedule: refused unless asked for.
    stretched = tmp_path / "stretched"
    shutil.copytree(stopped, stretched)
    with pytest.raises(ConfigError) as refused:
        run(make_cfg(*common, "trainer.max_steps=40", "trainer.resume=true"), stretched)
    assert str(refused.value) == (
        "trainer.max_steps=40: the checkpoint's learning-rate schedule (optim.lr_schedule=warmup_cosine) spans "
        "trainer.max_steps=20; expected 20, or trainer.reschedule=true to stretch it over 40 steps (the rate jumps "
        "where the run resumes)"
    )
    run(
        make_cfg(
            *common, "trainer.max_steps=40", "trainer.resume=true", "trainer.reschedule=true", "trainer.log_every=1"
        ),
        stretched,
    )
    lr_11 = [
        json.loads(line)["lr"]
        for line in (stretched / "metrics.jsonl").read_text().splitlines()
        if '"step": 11,' in line
    ]
    assert lr_11 == [
        pytest.approx(warmup_cosine_schedule(3e-4, 5, 40)(10))
    ]  # the 40-step schedule's rate for update 11
    run(make_cfg(*common, "trainer.max_steps=20", "trainer.resume=true"), stopped)
    a = torch.load(checkpoint.last_of(straight / "checkpoints"), weights_only=True)
    b = torch.load(checkpoint.last_of(stopped / "checkpoints"), weights_only=True)
    assert a["step"] == b["step"] == 20
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    for x, y in zip(a["opt_state"], b["opt_state"]):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_each_save_writes_the_state_once_and_last_names_the_newest(tmp_path):
    """``last`` names the newest step file: N saves keeping K hold K copies of the state on disk, not K + 1; a
    step file rewritten in place changes that file alone; a run saved before (``last.pt``, a copy or a hard
    link) loads, and its next save removes the old copy."""
    for step in range(1, 5):
        save(tmp_path, {"step": step, "params": {"w": torch.full((250_000,), float(step))}}, keep=2)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["last", "step_00000003.pt", "step_00000004.pt"], files
    one = (tmp_path / "step_00000004.pt").stat().st_size
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) < 2 * one + 64  # 2 copies and a name
    assert checkpoint.resolve(tmp_path) == tmp_path / "step_00000004.pt"
    with open(tmp_path / "step_00000004.pt", "r+b") as f:  # in place, as torch.save(obj, path) opens it
        torch.save({"step": 99, "params": {}}, f)
    assert checkpoint.load(tmp_path / "step_00000003.pt")["step"] == 3
    for old_last in (shutil.copyfile, os.link):
        old = tmp_path / old_last.__name__
        atomic_save({"step": 5, "params": {"w": torch.ones(3)}}, old / "step_00000005.pt")
        old_last(old / "step_00000005.pt", old / LAST)
        assert checkpoint.resolve(old) == old / LAST and checkpoint.load(checkpoint.resolve(old))["step"] == 5
        save(old, {"step": 6, "params": {"w": torch.zeros(3)}})
        assert sorted(p.name for p in old.iterdir()) == ["last", "step_00000005.pt", "step_00000006.pt"]
        assert checkpoint.load(checkpoint.resolve(old))["step"] == 6
        assert (
            checkpoint.load(old / "step_00000005.pt")["step"] == 5 and (old / "step_00000005.pt").stat().st_nlink == 1
        )


def test_a_run_saved_with_a_last_pt_copy_resumes_exactly(tmp_path):
    """A run directory as runs saved it before ``last`` (its step files and ``last.pt``, a copy of the newest)
    resumes with ``trainer.resume=true`` and from ``trainer.resume=PATH``, bit-identical to a run straight on; a
    whole-file run's checkpoints hold the state once per step file."""
    common = ["model.hidden=16", "trainer.checkpoint_every=3", "trainer.eval_every=0", "trainer.keep_checkpoints=2"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run(make_cfg(*common, "trainer.max_steps=9"), straight)
    run(make_cfg(*common, "trainer.max_steps=9", "trainer.stop_at=6"), stopped)
    checkpoints = stopped / "checkpoints"
    sizes = [p.stat().st_size for p in checkpoints.glob("step_*.pt")]
    assert len(sizes) == 2 and sum(p.stat().st_size for p in checkpoints.iterdir()) < sum(sizes) + 64
    (checkpoints / POINTER).unlink()
    shutil.copyfile(checkpoints / "step_00000006.pt", checkpoints / LAST)  # as saved before
    branch = tmp_path / "branch"
    run(make_cfg(*common, "trainer.max_steps=9", f"trainer.resume={stopped}"), branch)
    run(make_cfg(*common, "trainer.max_steps=9", "trainer.resume=true"), stopped)
    assert not (checkpoints / LAST).exists()  # the new save's last names the newest
    a = torch.load(checkpoint.last_of(straight / "checkpoints"), weights_only=True)
    for other in (stopped, branch):
        b = torch.load(checkpoint.last_of(other / "checkpoints"), weights_only=True)
        assert a["step"] == b["step"] == 9
        assert all(torch.equal(a["params"][name], b["params"][name]) for name in a["params"]), other


def test_resume_from_a_chosen_checkpoint_file_starts_there_and_says_so(tmp_path, capsys):
    """trainer.resume=PATH (Lightning's ckpt_path): another run's step file starts a new run directory at that
    step, and it ends bit-identical to the run the file came from; a missing file is refused in one line."""
    common = ["model.hidden=16", "trainer.checkpoint_every=3", "trainer.eval_every=0", "trainer.max_steps=6"]
    straight = tmp_path / "straight"
    run(make_cfg(*common), straight)
    chosen = straight / "checkpoints" / "step_00000003.pt"
    capsys.readouterr()
    run(make_cfg(*common, f"trainer.resume={chosen}"), tmp_path / "branch")
    assert f"resumed from step 3 ({chosen})" in capsys.readouterr().out
    a, b = (
        torch.load(checkpoint.last_of(d / "checkpoints"), weights_only=True) for d in (straight, tmp_path / "branch")
    )
    assert a["step"] == b["step"] == 6
    assert all(torch.equal(a["params"][name], b["params"][name]) for name in a["params"])
    run(make_cfg(*common, "trainer.max_steps=6", f"trainer.resume={straight}"), tmp_path / "from_dir")  # its last
    assert "resumed from step 6" in capsys.readouterr().out
    missing = tmp_path / "nope" / "step_00000003.pt"
    with pytest.raises(ConfigError) as refused:
        run(make_cfg(*common, f"trainer.resume={missing}"), tmp_path / "refused")
    assert str(refused.value) == (
        f"trainer.resume='{missing}': expected true, false or the path of a checkpoint (a step_<N>.pt file, or a run "
        f"directory for its last checkpoint); {missing} does not exist"
    )
    assert not (tmp_path / "refused").exists()


def _tensors(tree):
    from torch.utils import _pytree as pytree

    return [leaf for leaf in pytree.tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _powersgd_state():
    import fdp
    from fdp.hooks import powersgd

    model, params, buffers = fdp.functionalize(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    )
    loss_fn = fdp.cross_entropy_loss(model)
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    plan = fdp.plan_buckets(fdp.planner_loss(loss_fn, buffers), params, batch)
    hook, optimizer = powersgd(rank=2, start_iter=0), fdp.adam(1e-2)
    state = fdp.init_train_state(params, buffers, optimizer, plan, hook, seed=3)
    state, _ = fdp.make_train_step(loss_fn, optimizer, plan, hook)(state, batch)
    return state


def test_checkpoint_tensors_are_on_the_cpu_and_restore_follows_the_template_device():
    state = _powersgd_state()
    # As save_checkpoint builds it: buffers equal to rank 0's are stored once.
    payload = state_payload(state, _differing_buffers([rank_payload(state)], state.buffers))
    saved = _tensors(payload)
    assert len(saved) == len(_tensors(state))  # every tensor of the state, the generator states included
    assert {t.device.type for t in saved} == {"cpu"}
    # Onto a template on another device (meta, as a GPU would be): every tensor lands there.
    from torch.utils import _pytree as pytree

    on_meta = pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, state)
    restored = restore(payload, on_meta._replace(rng=state.rng, cuda_rng=state.cuda_rng), 0)
    for field in ("params", "buffers", "opt_state", "hook_state"):
        got, want = _tensors(getattr(restored, field)), _tensors(getattr(state, field))
        assert got and all(t.device.type == "meta" for t in got), field
        assert [t.shape for t in got] == [t.shape for t in want], field
    # Onto a CPU template: the very values.
    back = restore(payload, state, 0)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(back), _tensors(state)))


# ----------------------------------------------------------------------------- the Python API, on two ranks


def _bn_dropout_module():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3)
    )


def _rank_batch(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=gen) * (1 + rank) + rank, torch.randint(0, 3, (8,), generator=gen)


def _same_tree(a, b) -> bool:
    from torch.utils import _pytree as pytree

    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    return sa == sb and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else type(x) is type(y) and x == y for x, y in zip(la, lb)
    )


def _save_and_resume(rank, world, directory):
    """Train 2 steps, save, train 2 more; load the checkpoint into a fresh state and train the same 2."""
    import fdp
    from fdp.comm import Comm
    from fdp.hooks import int8

    comm = Comm()
    model, params, buffers = fdp.functionalize(_bn_dropout_module())
    loss_fn = fdp.cross_entropy_loss(model)
    plan = fdp.plan_buckets(
        fdp.planner_loss(loss_fn, buffers),
        params,
        _rank_batch(rank, 0),
        bucket_cap_mb=0.0002,
        first_bucket_cap_mb=0.0002,
    )
    hook, optimizer = int8(), fdp.adamw(1e-2)
    fresh = fdp.setup_state(params, buffers, optimizer, plan, hook, comm, seed=0)
    step = fdp.make_train_step(loss_fn, optimizer, plan, hook, comm, sync_buffers="local")
    state = fresh
    for i in range(2):
        state, _ = step(state, _rank_batch(rank, i))
    written = fdp.save_checkpoint(directory, state, plan, comm)
    saved = state
    for i in range(2, 4):
        state, _ = step(state, _rank_batch(rank, i))
    resumed = fdp.load_checkpoint(directory, fresh, plan, comm)
    restored = _same_tree(tuple(resumed), tuple(saved))
    for i in range(2, 4):
        resumed, _ = step(resumed, _rank_batch(rank, i))
    other = fdp.plan_buckets(fdp.planner_loss(loss_fn, buffers), params, _rank_batch(rank, 0))
    try:
        fdp.load_checkpoint(directory, fresh, other, comm)
        refused = None
    except fdp.CheckpointError as error:
        refused = str(error)
    return {
        "written": str(written) if written else None,
        "restored": restored,
        "resumed": _same_tree(tuple(resumed), tuple(state)),
        "refused": refused,
        "error": saved.hook_state[0][0].error,
    }


def test_save_and_load_checkpoint_keep_every_ranks_share_and_resume_bit_identically(run_ranks, tmp_path):
    """Per-rank int8 error feedback, dropout RNG and local BatchNorm statistics survive a
    save and load on 2 ranks: the restored state is the saved one, and training on from it
    equals training straight on, on both ranks."""
    results = run_ranks(_save_and_resume, str(tmp_path))
    assert results[0]["written"] == str(tmp_path / "step_00000002.pt") and results[1]["written"] is None
    for rank, result in enumerate(results):
        assert result["restored"], f"rank {rank}: the loaded state differs from the saved one"
        assert result["resumed"], f"rank {rank}: training on from the checkpoint differs"
        assert (
            result["refused"]
            == f"checkpoint {tmp_path / 'step_00000002.pt'} was written with another bucket plan (model or bucket caps "
            "changed)"
        )
    assert not torch.equal(results[0]["error"], results[1]["error"])  # per-rank state, really
    payload = torch.load(tmp_path / "step_00000002.pt", weights_only=True)
    assert payload["step"] == 2 and len(payload["ranks"]) == 2
    assert payload["ranks"][0]["buffers"] == {}  # rank 0's are the shared entry
    assert {"1.running_mean", "1.running_var"} <= set(payload["ranks"][1]["buffers"])  # rank 1's own statistics
    assert "num_batches_tracked" not in " ".join(payload["ranks"][1]["buffers"])  # equal on both: stored once


def _outer_rank_state(seed: int, in_flight: bool = False):
    """A local-SGD state with an int8 outer hook (error feedback); params, anchor and hook state made from ``seed``."""
    from fdp import functionalize, init_train_state, plan_buckets, planner_loss, sgd
    from fdp.hooks import lowbit
    from fdp.model.losses import cross_entropy_loss
    from fdp.step.outer import init_outer_state
    from fdp.step.outer_spec import OuterSpec

    torch.manual_seed(0)
    model, params, buffers = functionalize(torch.nn.Linear(4, 3))
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    plan = plan_buckets(planner_loss(cross_entropy_loss(model), buffers), params, batch)
    state = init_train_state(params, buffers, sgd(0.1), plan)
    spec = OuterSpec("local_sgd", 4, 0, 1.0, 0.0, False, 1 if in_flight else 0, 1, "strided", None)
    outer = init_outer_state(spec, state.params, plan, lowbit("int8"))
    g = torch.Generator().manual_seed(seed)
    noisy = lambda tree: {n: torch.randn(t.shape, generator=g) for n, t in tree.items()}  # noqa: E731
    made = outer._replace(anchor=noisy(outer.anchor), syncs=seed)
    if in_flight:
        made = made._replace(in_flight=noisy(state.params))
    made = made._replace(hook_state=tree_map(lambda t: t + seed, made.hook_state))
    return state._replace(params=noisy(state.params), outer=made), state._replace(outer=outer)


def test_a_larger_world_resumes_an_outer_loop_with_rank_zeros_place_and_fresh_hook_state():
    """Saved by 2 ranks under local SGD, read by rank 2 of 3: rank 0's params, anchor and sync count, its own
    pseudo-gradient hook state fresh; a checkpoint with a sync in flight is refused in one line."""
    rank0, template = _outer_rank_state(1)
    rank1, _ = _outer_rank_state(2)
    payload = state_payload(rank0, [rank_payload(rank0), rank_payload(rank1)])
    new = restore(payload, template, rank=2)
    assert all(torch.equal(new.params[n], p) for n, p in rank0.params.items())
    assert all(torch.equal(new.outer.anchor[n], a) for n, a in rank0.outer.anchor.items())
    assert new.outer.syncs == rank0.outer.syncs == 1
    fresh, _ = tree_flatten(template.outer.hook_state)
    got, _ = tree_flatten(new.outer.hook_state)
    assert fresh and all(torch.equal(a, b) for a, b in zip(got, fresh))
    assert restore(payload, template, rank=1).outer.syncs == 2  # a saved rank keeps its own
    flying, _ = _outer_rank_state(3, in_flight=True)
    payload = state_payload(flying, [rank_payload(flying)] * 2)
    with pytest.raises(checkpoint.CheckpointError, match="outer sync in flight .* expected a checkpoint between syncs"):
        restore(payload, template, rank=2)
