"""ZeRO stage 3's sharded build (fdp.model.deferred, fdp.update.zero.built): the model is built on ``meta`` and
each rank makes only its slices, and they are bit for bit the params a whole build (stage 0) starts from."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
from torch import nn

from fdp.comm import Comm
from fdp.model.builtin import count_parameters
from fdp.model.deferred import NotDeferrable, record_build
from fdp.model.losses import make_loss_fn
from fdp.procs.budget import limit_memory
from fdp.run.build import build_data, build_module, build_run
from fdp.run.config.compose import compose
from fdp.step.train_step import make_train_step
from fdp.update.zero import whole_params

CHAR = ("model=charlm", "model.d_model=16", "model.n_layer=2", "model.n_head=2")
TEXT = ("data=stdlib_text", "data.block_size=8", "data.max_chars=4000", "data.global_batch_size=8")
HF = ("model=custom", "model._target_=fdp.model.builtin.hf_model")
GPT2 = (*HF, "+model.model_class=transformers.GPT2LMHeadModel", "+model.n_layer=2", "+model.n_embd=16",
        "+model.n_head=2", "+model.n_positions=16")  # fmt: skip
LLAMA = (*HF, "+model.model_class=transformers.LlamaForCausalLM", "+model.num_hidden_layers=2",
         "+model.hidden_size=16", "+model.intermediate_size=32", "+model.num_attention_heads=4",
         "+model.num_key_value_heads=2", "+model.max_position_embeddings=16")  # fmt: skip
IMAGES = ("data=custom", "data._target_=test_sharded_build.images", "data.global_batch_size=8")
RESNET = ("model=custom", "model._target_=torchvision.models.resnet18")
MODELS = {"charlm": (*CHAR, *TEXT), "gpt2": (*GPT2, *TEXT), "llama": (*LLAMA, *TEXT), "resnet18": (*RESNET, *IMAGES)}


def images():
    """Colour images of 10 classes, 16x16: what a torchvision classifier reads."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
    return torch.utils.data.TensorDataset(x, y), None


class FromData(nn.Module):
    """A model that makes its params from data in its constructor: it cannot be built on meta."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.emb = nn.Parameter(torch.from_numpy(np.linspace(-1, 1, vocab_size * 4, dtype=np.float32)).view(-1, 4))
        self.head = nn.Linear(4, vocab_size)

    def forward(self, x):
        return self.head(self.emb[x])


def _start(stage: int, overrides: tuple, comm: Comm) -> tuple[dict, torch.Tensor, bool]:
    """The whole params a run of ``stage`` starts from, its state's generator, whether it holds slices."""
    parts = build_run(compose(*overrides, f"trainer.zero_stage={stage}", "seed=11"), comm)
    rng = parts.state.rng
    whole = whole_params(parts.state, parts.plan, comm)
    return {k: v.clone() for k, v in whole.items()}, rng, list(parts.state.params) != list(whole)


def _stage0_and_stage3(rank: int, world: int, names: tuple) -> dict:
    comm = Comm()
    return {name: (_start(0, MODELS[name], comm), _start(3, MODELS[name], comm)) for name in names}


def _assert_same_start(results: dict) -> None:
    for name, ((params0, rng0, sliced0), (params3, rng3, sliced3)) in results.items():
        assert not sliced0 and sliced3, name
        assert list(params0) and sorted(params0) == sorted(params3), name
        different = [k for k in params0 if not torch.equal(params0[k], params3[k])]
        assert not different, f"{name}: {different[:3]}"
        assert torch.equal(rng0, rng3), f"{name}: the state's generator differs"


def test_stage_3_starts_from_stage_0_s_params_in_one_process(caplog):
    """Char transformer, Hugging Face GPT-2 and Llama from tiny configs, a torchvision ResNet: on the sharded path (no
    line saying it built whole), from exactly stage 0's params."""
    with caplog.at_level(logging.WARNING, logger="fdp"):
        _assert_same_start(_stage0_and_stage3(0, 1, tuple(MODELS)))
    assert "built whole" not in caplog.text


def test_stage_3_starts_from_stage_0_s_params_on_2_ranks(run_ranks):
    for rank_results in run_ranks(_stage0_and_stage3, ("charlm", "llama"), world_size=2):
        _assert_same_start(rank_results)


def test_a_constructor_that_makes_params_from_data_builds_whole_with_one_line_saying_why(caplog):
    with pytest.raises(NotDeferrable, match="made emb on the cpu from data"):
        record_build(lambda: FromData(5))
    overrides = ("model=custom", "model._target_=test_sharded_build.FromData", *TEXT)
    fdp_log = logging.getLogger("fdp")  # a run in this process before may have stopped it propagating to the root
    propagated, fdp_log.propagate = fdp_log.propagate, True
    try:
        with caplog.at_level(logging.WARNING, logger="fdp"):
            params0, _, _ = _start(0, overrides, Comm())
            params3, _, sliced = _start(3, overrides, Comm())
    finally:
        fdp_log.propagate = propagated
    lines = [r.getMessage() for r in caplog.records if "built whole" in r.getMessage()]
    assert lines == [
        "model._target_='test_sharded_build.FromData': built whole on every rank, not on the meta device: "
        "its constructor made emb on the cpu from data, not on the default device"
    ]
    assert sliced and all(torch.equal(params0[k], params3[k]) for k in params0)


# ~19M params (72 MiB in fp32); the largest tensor is an MLP weight of 4 MiB. SGD keeps momentum: one more share.
BIG = ("model=charlm", "model.d_model=512", "model.n_layer=6", "model.n_head=8", *TEXT, "optim=sgd", "seed=11")
MiB = 2**20


def _peak_rss_from_now() -> int:
    """Reset this process's peak resident size to what it holds now (Linux ``clear_refs``); that size in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _start_and_build_peak(rank: int, world: int) -> tuple[dict, dict]:
    """Stage 0's and stage 3's start (a small charlm), then how much this rank's peak resident memory grows while a
    stage-3 build runs under a world.memory_per_rank_mb budget that the whole params exceed (a stage-0 build of this
    model grew it by 230-243 MiB on each of 4 ranks)."""
    comm, out = Comm(), {}
    starts = _stage0_and_stage3(rank, world, ("charlm",))  # also what the first build of a process loads, once
    cfg = compose(*BIG, "trainer.zero_stage=3")
    data = build_data(cfg.data)
    with torch.device("meta"):
        out["whole"] = 4 * count_parameters(build_module(cfg.model, data))  # the model's fp32 params
    out["budget"] = 0.9 * out["whole"]
    start = _peak_rss_from_now()
    limit_memory(out["budget"] / MiB, torch.device("cpu"))  # what world.memory_per_rank_mb sets
    parts = build_run(cfg, comm, data=data)
    out["peak"] = _status("VmHWM") - start
    # The step's buffers, a whole bucket each for the gathered params and the gradients, made under the budget too:
    # each is released before the next is made (all at once they are the whole params twice over).
    before = _status("VmData")
    make_train_step(
        make_loss_fn(parts.model, parts.criterion), parts.optimizer, parts.plan, comm=comm, update=parts.update
    )
    out["step_made"] = _status("VmData") - before
    out["share"] = sum(t.numel() * t.element_size() for t in parts.state.params.values())
    out["largest"] = 4 * max(slot.numel for b in parts.plan.buckets for slot in b.slots)
    return starts, out


def test_on_4_ranks_stage_3_starts_as_stage_0_and_its_build_holds_a_share_and_one_param_in_a_budget_below_the_whole(
    run_ranks,
):
    for starts, peaks in run_ranks(_start_and_build_peak, world_size=4):
        _assert_same_start(starts)
        print({k: f"{v / MiB:.1f} MiB" for k, v in peaks.items()})
        assert peaks["whole"] > peaks["budget"]  # a budget the whole params alone exceed
        assert 4 * peaks["share"] >= peaks["whole"]  # a quarter of the params, padded
        # Its share and the momentum of its share (SGD), one param made, the scratch its draws ran on, and slack.
        assert peaks["peak"] <= 2 * peaks["share"] + 2 * peaks["largest"] + 16 * MiB
        assert peaks["step_made"] <= peaks["largest"]
