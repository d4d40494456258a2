"""Device selection (``world.accelerator``, ``world.devices``, ``world.backend``) with the GPU count faked."""

import os
import re
import sys
from pathlib import Path

import _recipe
import pytest
import torch
from omegaconf import OmegaConf

import fdp.run.world
from fdp.errors import ConfigError
from fdp.procs.devices import (
    Placement,
    batch_to_device,
    parse_devices,
    place,
    probe_gpus,
    resolve_backend,
    rng_scope,
    seeded_cuda_rng,
    use_device,
)
from fdp.run.config.compose import compose

ROOT = Path(__file__).resolve().parents[2]
CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("auto", "auto"),
        (" auto ", "auto"),
        (1, 1),
        (4, 4),
        ("3", 3),
        (-1, -1),
        ("-1", -1),
        ("0,2", (0, 2)),
        (" 1 , 3 ", (1, 3)),
        ("[0,2]", (0, 2)),
        ([0, 2], (0, 2)),
        ((3,), (3,)),
        (OmegaConf.create({"d": [2, 0]}).d, (2, 0)),
    ],
)
def test_every_devices_form_parses(value, expected):
    assert parse_devices(value) == expected


@pytest.mark.parametrize("value", [0, -2, "abc", "", [], [0, 0], [-1], "0,x", True, 1.5])
def test_bad_devices_are_refused_naming_the_setting(value):
    with pytest.raises(ConfigError, match=r"^world\.devices=") as caught:
        parse_devices(value)
    assert "\n" not in str(caught.value)


# -- a machine without GPUs ------------------------------------------------------------------
def test_cpu_machine_keeps_the_world_as_configured():
    assert place("auto", "auto", "none", 1, visible=0) == Placement("cpu", (), 1, "none", "gloo")
    assert place("auto", "auto", "elastic", 2, visible=0) == Placement("cpu", (), 2, "elastic", "gloo")
    assert place("cpu", "auto", "elastic", 4, visible=8) == Placement("cpu", (), 4, "elastic", "gloo")
    assert place("auto", "auto", "elastic", 2, visible=0).device(1) == CPU


def test_cpu_devices_count_processes():
    assert place("cpu", 2, "none", 1, visible=0) == Placement("cpu", (), 2, "elastic", "gloo")
    assert place("cpu", "1", "none", 1, visible=0) == Placement("cpu", (), 1, "none", "gloo")
    assert place("cpu", 2, "elastic", 2, visible=0).nproc_per_node == 2
    with pytest.raises(ConfigError, match=r"^world\.devices=3: expected 2, the number of processes the world"):
        place("cpu", 3, "elastic", 2, visible=0)


@pytest.mark.parametrize("devices", [-1, "0,2", [1]])
def test_gpu_indices_on_the_cpu_are_refused(devices):
    with pytest.raises(
        ConfigError, match=r"^world\.devices=.*: expected auto or a process count >= 1 with world\.accelerator=cpu$"
    ):
        place("cpu", devices, "none", 1, visible=2)
    with pytest.raises(ConfigError, match=r"^world\.devices=.*: expected GPUs, this machine shows no GPU"):
        place("auto", devices, "none", 1, visible=0)


def test_gpu_without_cuda_is_refused():
    with pytest.raises(
        ConfigError, match=r"^world\.accelerator=gpu: expected a CUDA GPU, this machine shows no GPU .*to torch \d"
    ):
        place("gpu", "auto", "none", 1, visible=0)


def test_unknown_accelerator_and_backend_are_refused():
    with pytest.raises(ConfigError, match=r"^world\.accelerator='tpu': expected one of"):
        place("tpu", "auto", "none", 1, visible=0)
    with pytest.raises(ConfigError, match=r"^world\.backend='mpi': expected one of"):
        place("auto", "auto", "none", 1, visible=0, backend="mpi")


# -- GPUs (faked count) ------------------------------------------------------------------
def test_auto_takes_every_visible_gpu_one_process_each():
    p = place("auto", "auto", "none", 1, visible=4)
    assert p == Placement("gpu", (0, 1, 2, 3), 4, "elastic", "nccl")
    assert [p.device(r) for r in range(4)] == [torch.device("cuda", i) for i in range(4)]
    assert place("auto", "auto", "none", 1, visible=1) == Placement("gpu", (0,), 1, "none", "nccl")


def test_a_world_that_fixes_its_processes_takes_that_many_gpus():
    assert place("auto", "auto", "elastic", 2, visible=8) == Placement("gpu", (0, 1), 2, "elastic", "nccl")
    assert place("gpu", "auto", "torchrun", 1, visible=8, local_world_size=4).device_ids == (0, 1, 2, 3)
    assert place("gpu", "auto", "torchrun", 1, visible=8, local_world_size=4).launcher == "torchrun"


def test_counts_minus_one_and_indices_select_gpus():
    assert place("gpu", 2, "none", 1, visible=4) == Placement("gpu", (0, 1), 2, "elastic", "nccl")
    assert place("gpu", -1, "none", 1, visible=3).device_ids == (0, 1, 2)
    assert place("gpu", "0,2", "none", 1, visible=4) == Placement("gpu", (0, 2), 2, "elastic", "nccl")
    assert place("gpu", [3], "none", 1, visible=4) == Placement("gpu", (3,), 1, "none", "nccl")
    assert place("gpu", [2, 0], "elastic", 2, visible=4).device(0) == torch.device("cuda", 2)


def test_more_gpus_than_visible_is_refused_naming_what_the_machine_has(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(
        ConfigError,
        match=r"^world\.devices=4: expected 4 GPUs, this machine shows 2 GPUs \(CUDA_VISIBLE_DEVICES='4,5'\)$",
    ):
        place("gpu", 4, "none", 1, visible=2)
    with pytest.raises(
        ConfigError,
        match=r"^world\.devices=\[0, 2\]: GPU 2 is not visible; this machine shows 2 GPUs .*indices 0\.\.1$",
    ):
        place("gpu", [0, 2], "none", 1, visible=2)
    with pytest.raises(ConfigError, match=r"^world\.devices=auto: expected 2 GPUs, this machine shows 1 GPU"):
        place("gpu", "auto", "elastic", 2, visible=1)  # world=local2 on a one-GPU machine
    with pytest.raises(ConfigError, match=r"^world\.devices=auto: expected 2 GPUs, this machine shows 1 GPU"):
        place("auto", "auto", "torchrun", 1, visible=1, local_world_size=2)


def test_devices_that_disagree_with_the_world_are_refused():
    with pytest.raises(
        ConfigError, match=r"^world\.devices=3: expected 2 GPUs, one for each process the world .* \(got 3;"
    ):
        place("gpu", 3, "elastic", 2, visible=4)
    with pytest.raises(
        ConfigError, match=r"^world\.devices=\[0\]: expected 2 GPUs, one for each process torchrun starts"
    ):
        place("gpu", [0], "torchrun", 1, visible=4, local_world_size=2)


def test_busy_gpus_are_reported_and_passed_over_by_auto():
    probed = []

    def probe(ids):
        probed.append(list(ids))
        return {1: "CUDA error: all CUDA-capable devices are busy or unavailable"}

    p = place("gpu", "auto", "none", 1, visible=4, probe=probe)
    assert p.device_ids == (0, 2, 3) and p.unusable == (
        (1, "CUDA error: all CUDA-capable devices are busy or unavailable"),
    )
    assert probed == [[0, 1, 2, 3]]
    assert place("gpu", 2, "none", 1, visible=4, probe=probe).device_ids == (0, 2)  # the first two that answer
    with pytest.raises(ConfigError, match=r"^world\.devices=\[1, 2\]: GPU 1 is busy or unusable \(CUDA error: all"):
        place("gpu", [1, 2], "none", 1, visible=4, probe=probe)
    with pytest.raises(
        ConfigError, match=r"^world\.devices=4: expected 4 usable GPUs, 3 of the 4 visible are usable \(GPU 1: CUDA"
    ):
        place("gpu", 4, "none", 1, visible=4, probe=probe)
    with pytest.raises(
        ConfigError,
        match=(
            r"^world\.devices=auto: expected 1 usable GPU, 0 of the 2 visible are usable "
            r"\(GPU 0: busy; GPU 1: busy\)$"
        ),
    ):
        place("gpu", "auto", "none", 1, visible=2, probe=lambda ids: {i: "busy" for i in ids})


def test_backend_auto_is_nccl_only_when_every_rank_has_its_own_gpu():
    assert resolve_backend("auto", [CUDA0, CUDA1]) == "nccl"
    assert resolve_backend("auto", [CUDA0]) == "nccl"
    assert resolve_backend("auto", [CUDA0, CUDA0]) == "gloo"  # two ranks on one GPU: NCCL refuses that
    assert resolve_backend("auto", [CPU, CPU]) == "gloo"
    assert resolve_backend("gloo", [CUDA0, CUDA1]) == "gloo"
    assert place("auto", "auto", "elastic", 2, visible=0, backend="auto").backend == "gloo"
    assert place("gpu", "auto", "elastic", 2, visible=2, backend="gloo").backend == "gloo"


def test_nccl_without_a_gpu_per_rank_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"^world\.backend=nccl: expected a GPU of its own for each of the 2 ranks on this node, they have 1 GPU",
    ):
        resolve_backend("nccl", [CUDA0, CUDA0])
    with pytest.raises(ConfigError, match=r"^world\.backend=nccl: expected .* 2 ranks on this node, they have 0 GPUs"):
        place("auto", "auto", "elastic", 2, visible=0, backend="nccl")


# -- the trainer on a faked machine ------------------------------------------------------------
def test_trainer_resolves_the_world_once_for_its_workers(monkeypatch):
    monkeypatch.setattr(fdp.run.world, "visible_gpus", lambda: 2)
    monkeypatch.setattr(fdp.run.world, "probe_gpus", lambda ids: {})
    resolved = fdp.run.world.resolve_world(compose())
    world = resolved.world
    assert (world.accelerator, list(world.devices), world.launcher, world.nproc_per_node, world.backend) == (
        "gpu",
        [0, 1],
        "elastic",
        2,
        "nccl",
    )
    # What a worker makes of the resolved config: the same placement, its own GPU.
    layout = fdp.run.world.layout_of(resolved)
    assert layout.world_size == 2 and layout.device(1) == CUDA1 and layout.backend == "nccl"
    local2 = fdp.run.world.resolve_world(compose("world=local2", "world.accelerator=cpu"))
    assert (local2.world.accelerator, local2.world.launcher, local2.world.nproc_per_node) == ("cpu", "elastic", 2)


def test_probe_reports_gpus_it_cannot_use():
    # The tests see no GPU (conftest), so the probe, run in a child, fails on every index.
    bad = probe_gpus([0, 3])
    assert sorted(bad) == [0, 3] and all(reason and "\n" not in reason for reason in bad.values())
    assert probe_gpus([]) == {}


def test_cpu_helpers_leave_tensors_where_they_are():
    batch = (torch.ones(2), torch.zeros(2, dtype=torch.long))
    assert batch_to_device(batch, CPU) is batch
    assert use_device(CPU) == CPU
    assert seeded_cuda_rng(3, CPU).numel() == 0


def test_rng_scope_runs_on_the_given_state_and_restores_the_process_generator():
    torch.manual_seed(123)
    outside = torch.get_rng_state()
    state = torch.Generator().manual_seed(7).get_state()
    with rng_scope(state, seeded_cuda_rng(7, CPU), CPU) as states:
        drawn = torch.rand(3)
        after, _ = states()
    assert torch.equal(torch.get_rng_state(), outside)
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(7)))
    with rng_scope(after, torch.empty(0), CPU):
        continued = torch.rand(3)
    expected = torch.Generator().manual_seed(7)
    torch.rand(3, generator=expected)
    assert torch.equal(continued, torch.rand(3, generator=expected))


RECIPE_REFUSALS = [
    (["world.accelerator=gpu"], r"^error: world\.accelerator=gpu: expected a CUDA GPU, this machine shows no GPU"),
    (["world.devices=[0,2]"], r"^error: world\.devices=\[0, 2\]: expected GPUs, this machine shows no GPU"),
    (
        ["world=local2", "world.backend=nccl"],
        r"^error: world\.backend=nccl: expected a GPU of its own for each of the 2 ranks",
    ),
]


def test_device_refusals_through_the_recipe_exit_2_with_one_line(tmp_path):
    procs = []
    for i, (overrides, _) in enumerate(RECIPE_REFUSALS):  # concurrently: each is mostly start-up
        command = [
            sys.executable,
            str(ROOT / "recipes" / "train.py"),
            "trainer.progress=false",
            *overrides,
            f"hydra.run.dir={tmp_path / str(i)}",
        ]
        # Forked from the preloaded server (tests/_recipe.py): a refusal before step 1 is mostly the imports.
        procs.append(_recipe.start(command, env=dict(os.environ), cwd=ROOT))
    for (overrides, expected), proc in zip(RECIPE_REFUSALS, procs):
        done = proc.result(timeout=180)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, (overrides, done.stderr)
        assert len(lines) == 1 and re.search(expected, lines[0]), (overrides, lines)
