"""On a CUDA GPU: the CPU's training, ranks sharing a GPU, NCCL, resume across devices, host syncs.

Every test here is marked ``gpu`` and skipped without CUDA; run them on a GPU machine
with ``python -m pytest -m gpu``.
"""

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _saved import saved
from torch.utils import _pytree as pytree

import fdp
from fdp.data import global_batch, load_dataset, rank_share
from fdp.hooks import allreduce
from fdp.model.builtin import build_model
from fdp.procs.devices import batch_to_device, to_device
from fdp.run.config.compose import compose
from fdp.run.trainer import run

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["trainer.progress=false", "trainer.log_every=1", "trainer.eval_every=0", "model.hidden=32"]
CHARLM = [
    "trainer.progress=false",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "model=charlm",
    "data=stdlib_text",
    "model.d_model=32",
    "model.n_layer=2",
    "model.n_head=2",
    "data.block_size=32",
    "data.max_chars=50000",
    "data.global_batch_size=8",
    "optim=sgd",
    "optim.lr=0.1",
]


def _params(run_dir: Path) -> dict:
    return saved(run_dir)["params"]


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row and not row.get("summary")]


def _assert_close(a: dict, b: dict, atol: float, rtol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# SGD: a difference in float rounding between devices stays that size (Adam divides it by
# the gradient's own scale, which makes it large wherever a gradient is near zero).
@pytest.mark.parametrize("model", [SMALL, CHARLM], ids=["mlp", "charlm"])
def test_training_on_one_gpu_equals_the_cpu_run(model, tmp_path):
    on_cpu = run(compose(*model, "trainer.max_steps=20", "world.accelerator=cpu"), tmp_path / "cpu")
    on_gpu = run(compose(*model, "trainer.max_steps=20", "world.accelerator=gpu"), tmp_path / "gpu")
    assert (on_cpu["device"], on_gpu["device"]) == ("cpu", "cuda")
    for name, t in _params(tmp_path / "gpu").items():
        assert t.device.type == "cpu", name  # checkpoints hold host tensors
    _assert_close(_params(tmp_path / "gpu"), _params(tmp_path / "cpu"), atol=1e-4, rtol=1e-3)
    assert _losses(tmp_path / "gpu") == pytest.approx(_losses(tmp_path / "cpu"), rel=1e-4, abs=1e-5)


def _on_a_shared_gpu(rank, world, steps):
    assert dist.get_backend() == "gloo"  # backend auto: NCCL refuses two ranks on one GPU
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    data = load_dataset("digits", seed=0)
    torch.manual_seed(0)
    model, params, buffers = fdp.functionalize(
        torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    )
    params, buffers = to_device(params, device), to_device(buffers, device)
    loss_fn = fdp.cross_entropy_loss(model)
    example = batch_to_device(rank_share(global_batch(data, 0, 32, 0), rank, world), device)
    plan = fdp.plan_buckets(
        fdp.planner_loss(loss_fn, buffers), params, example, bucket_cap_mb=0.005, first_bucket_cap_mb=0.005
    )
    assert len(plan) > 1 and {b.device for b in plan.buckets} == {str(device)}
    optimizer = fdp.sgd(0.1, momentum=0.9)
    state = fdp.init_train_state(params, buffers, optimizer, plan, allreduce())
    train_step = fdp.make_train_step(loss_fn, optimizer, plan, allreduce(), fdp.Comm(), schedule="overlap", donate=True)
    for i in range(steps):
        state, _ = train_step(state, batch_to_device(rank_share(global_batch(data, i, 32, 0), rank, world), device))
    leaves = [*state.params.values(), *pytree.tree_flatten(state.opt_state)[0]]
    assert all(t.device == device for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {name: t.cpu() for name, t in state.params.items()}


def test_two_ranks_share_one_gpu_over_gloo_with_cuda_tensors(run_ranks):
    steps = 5
    results = run_ranks(_on_a_shared_gpu, steps, backend="auto", accelerator="gpu", device_ids=(0, 0))
    # Reference: one process, plain torch on the CPU, on the union of the ranks' batches.
    data = load_dataset("digits", seed=0)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for i in range(steps):
        x, y = global_batch(data, i, 32, 0)
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    expected = {name: p.detach() for name, p in reference.named_parameters()}
    for params in results:
        _assert_close(params, expected, atol=1e-5)
    _assert_close(results[0], results[1], atol=0, rtol=0)


def test_nccl_world_of_one_under_torchrun(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        str(ROOT / "recipes" / "train.py"),
        "world=torchrun",
        *SMALL,
        "trainer.max_steps=5",
        f"hydra.run.dir={tmp_path}",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"world 1 on cuda:0 over nccl", done.stdout), done.stdout
    assert re.search(r"^fdp: model=mlp world=1 device=cuda steps=5 ", done.stdout, re.M), done.stdout


@pytest.mark.parametrize("first, then", [("gpu", "cpu"), ("cpu", "gpu")])
def test_resume_moves_between_gpu_and_cpu(first, then, tmp_path):
    common = [*SMALL, "trainer.max_steps=20", "trainer.checkpoint_every=10"]
    run(compose(*common, f"world.accelerator={then}"), tmp_path / "straight")
    run(compose(*common, f"world.accelerator={first}", "trainer.stop_at=10"), tmp_path / "moved")
    summary = run(compose(*common, f"world.accelerator={then}", "trainer.resume=true"), tmp_path / "moved")
    assert summary["steps"] == 20 and summary["device"] == {"gpu": "cuda", "cpu": "cpu"}[then]
    _assert_close(_params(tmp_path / "moved"), _params(tmp_path / "straight"), atol=1e-4, rtol=1e-3)


def test_dropout_on_the_gpu_resumes_where_it_stopped(tmp_path):
    common = [
        *CHARLM,
        "model.dropout=0.2",
        "world.accelerator=gpu",
        "trainer.max_steps=12",
        "trainer.checkpoint_every=6",
    ]
    run(compose(*common), tmp_path / "straight")
    run(compose(*common, "trainer.stop_at=6"), tmp_path / "resumed")
    run(compose(*common, "trainer.resume=true"), tmp_path / "resumed")
    straight, resumed = (saved(tmp_path / d) for d in ("straight", "resumed"))
    # The CUDA generator carried over: after 12 steps it is where the uninterrupted run's is.
    assert straight["ranks"][0]["cuda_rng"].numel() > 0
    assert torch.equal(straight["ranks"][0]["cuda_rng"], resumed["ranks"][0]["cuda_rng"])
    _assert_close(resumed["params"], straight["params"], atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_two_gpu_checkpoint_resumes_on_one(tmp_path):
    common = [*SMALL, "trainer.max_steps=20", "trainer.checkpoint_every=10"]
    run(compose(*common, "world.devices=1"), tmp_path / "straight")
    run(compose(*common, "world.devices=2", "trainer.stop_at=10"), tmp_path / "moved")
    summary = run(compose(*common, "world.devices=1", "trainer.resume=true"), tmp_path / "moved")
    assert summary["steps"] == 20 and summary["world"] == 1
    _assert_close(_params(tmp_path / "moved"), _params(tmp_path / "straight"), atol=1e-4, rtol=1e-3)


def _small_charlm_step(nonfinite: str = "raise", zero_stage: int = 0):
    """A 2-layer char transformer on GPU 0 in several buckets: ``(train_step, state, batch)`` after 3 steps."""
    return _small_charlm(nonfinite, zero_stage)[:3]


def _small_charlm(nonfinite: str = "raise", zero_stage: int = 0):
    """``_small_charlm_step``'s pieces and the bucket plan."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    module = build_model("charlm", vocab_size=64, block_size=32, d_model=64, n_layer=2, n_head=2)
    model, params, buffers = fdp.functionalize(module)
    params, buffers = to_device(params, device), to_device(buffers, device)
    loss_fn = fdp.cross_entropy_loss(model)
    batch = (torch.randint(0, 64, (8, 32), device=device), torch.randint(0, 64, (8, 32), device=device))
    plan = fdp.plan_buckets(
        fdp.planner_loss(loss_fn, buffers), params, batch, bucket_cap_mb=0.1, first_bucket_cap_mb=0.1
    )
    assert len(plan) > 1
    optimizer = fdp.adamw(1e-3)
    if zero_stage:
        state = fdp.update.zero.init_state(params, buffers, optimizer, plan, fdp.Comm(), stage=zero_stage)
    else:
        state = fdp.init_train_state(params, buffers, optimizer, plan)
    train_step = fdp.make_train_step(
        loss_fn, optimizer, plan, donate=True, nonfinite=nonfinite, zero_stage=zero_stage, model=model
    )
    for _ in range(3):  # first steps decide and allocate once
        state, _ = train_step(state, batch)
    torch.cuda.synchronize()
    return train_step, state, batch, plan


def test_zero_stage_three_on_the_gpu_equals_stage_zero():
    """Stage 3's gathers and reduce-scatters on CUDA tensors (a world of one: each bucket gathered and released)."""
    finals = {}
    for stage in (0, 3):
        train_step, state, batch, plan = _small_charlm(zero_stage=stage)
        for _ in range(5):
            state, _ = train_step(state, batch)
        finals[stage] = fdp.update.zero.whole_params(state, plan, fdp.Comm())
    for name, p in finals[0].items():
        torch.testing.assert_close(finals[3][name], p, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_a_train_step_returns_while_the_gpu_still_works_on_it(zero_stage):
    train_step, state, batch = _small_charlm_step(zero_stage=zero_stage)
    # ~0.4 s of matmuls ahead of the step on the same stream: a step that waited for its
    # own work (to read its finiteness verdict) would return after all of it.
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):
        a = a @ a / 8192
    backlog_done = torch.cuda.Event()
    backlog_done.record()
    state, metrics = train_step(state, batch)
    assert not backlog_done.query(), "the step waited for the device"
    train_step.settle()
    assert backlog_done.query() and torch.isfinite(metrics["loss"]).item()


def test_skipping_steps_synchronises_the_host_once_per_step():
    train_step, state, batch = _small_charlm_step(nonfinite="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            state, _ = train_step(state, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # The first warning is torch's notice that the debug mode is a prototype; each sync is one of these.
    syncs = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 1, syncs


def test_a_nonfinite_gradient_on_the_gpu_raises_from_the_next_step_or_settle():
    train_step, state, batch = _small_charlm_step()
    bad = dict(state.params)
    name = next(iter(bad))
    bad[name] = bad[name].clone()
    bad[name].view(-1)[0] = float("nan")
    state, _ = train_step(state._replace(params=bad), batch)  # step 4: its verdict is read later
    with pytest.raises(FloatingPointError, match=r"^non-finite gradient at step 4 in bucket \d+ \("):
        train_step(state, batch)
    train_step, state, batch = _small_charlm_step()
    state, _ = train_step(state._replace(params=bad), batch)
    with pytest.raises(FloatingPointError, match=r"^non-finite gradient at step 4 in bucket"):
        train_step.settle()
