"""Activation checkpointing (fdp.model.remat, fdp.model.recompute): the same numbers as without it, the forward
run again, refusals."""

import pytest
import torch
from torch import nn

from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
from fdp.comm import Comm
from fdp.errors import ConfigError
from fdp.model import recompute, remat
from fdp.model.builtin import CharTransformer, ConvNet
from fdp.model.functional import functionalize, grad_and_value
from fdp.model.streams import SampleStreams
from fdp.optim import adam
from fdp.plan import plan_buckets
from fdp.update import zero
from fdp.update.zero.gather import ParamGather

STEPS = 4


def _char_transformer(dropout=0.2):
    torch.manual_seed(0)
    return CharTransformer(vocab_size=11, block_size=8, d_model=16, n_layer=3, n_head=2, dropout=dropout)


def _tokens(count, seed=1):
    tokens = torch.randint(0, 11, (count, 9), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _counting(modules):
    """Count the calls of ``modules`` (inside a checkpointed block, they run in the forward and again in backward)."""
    calls = [0]
    for m in modules:
        m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(
    "per_sample,autocast",
    [(False, False), (True, False), (False, True)],
    ids=["generator", "per_sample_streams", "bf16_autocast"],
)
def test_gradients_equal_bit_for_bit_with_dropout_and_the_forward_runs_again(per_sample, autocast):
    module = _char_transformer()
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    batch = _tokens(4)
    blocks = remat.select(module, "blocks")
    calls = _counting([b.attn for b in blocks])

    def gradients(fn):
        if per_sample:
            streams = SampleStreams(seed=3)
            streams.begin(step=1, first=0, sizes=[4])
            fn = streams.wrap(fn)
        torch.manual_seed(5)
        # Under bf16 autocast attention with dropout takes another kernel where no gradient is recorded:
        # the checkpointed forward must run as its recomputation does.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            grads, (loss, _) = grad_and_value(fn)(params, buffers, batch)
        return grads, loss, torch.rand(3)  # the generator after the step: the recomputation leaves it as it was

    plain = gradients(loss_fn)
    assert calls[0] == len(blocks) == 3
    checkpointed = gradients(recompute.checkpointed(loss_fn, blocks))
    assert calls[0] == 3 + 2 * 3  # each block's forward, then once more in backward
    assert torch.equal(plain[1], checkpointed[1]) and torch.equal(plain[2], checkpointed[2])
    for name in plain[0]:
        assert torch.equal(plain[0][name], checkpointed[0][name]), name
    # Dropout drew: without the replayed random state the recomputed masks would differ.
    torch.manual_seed(6)
    _, (other, _) = grad_and_value(loss_fn)(params, buffers, batch)
    assert not torch.equal(other, plain[1]) or per_sample


def test_a_hugging_face_gpt2_checkpoints_its_blocks_bit_for_bit():
    from fdp.model.builtin import hf_model

    torch.manual_seed(0)  # GPT-2's configs drop out 0.1 (attention, residuals, embeddings)
    module = hf_model("transformers.GPT2LMHeadModel", vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    batch = _tokens(2)
    blocks = remat.select(module, "blocks")
    assert [type(b).__name__ for b in blocks] == ["GPT2Block", "GPT2Block"]
    results = []
    for fn in (loss_fn, recompute.checkpointed(loss_fn, blocks)):
        torch.manual_seed(3)
        results.append(grad_and_value(fn)(params, buffers, batch))
    (plain, (loss, _)), (checkpointed, (loss_ck, _)) = results
    assert torch.equal(loss, loss_ck)
    assert all(torch.equal(plain[name], checkpointed[name]) for name in plain)


def test_buffers_update_once_and_the_module_is_itself_again_after_the_call():
    module = ConvNet(width=4)
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    batch = (torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(6) % 10)
    grads, (_, (new_buffers, _)) = grad_and_value(loss_fn)(params, buffers, batch)
    wrapped = recompute.checkpointed(loss_fn, remat.select(module, "blocks", policy=[nn.Sequential]))
    grads_ck, (_, (new_buffers_ck, _)) = grad_and_value(wrapped)(params, buffers, batch)
    for name in grads:
        assert torch.equal(grads[name], grads_ck[name]), name
    for name in new_buffers:  # BatchNorm's statistics (num_batches_tracked too) moved once
        assert torch.equal(new_buffers[name], new_buffers_ck[name]), name
    assert "forward" not in module.features.__dict__


def test_select_modes_and_refusals():
    module = _char_transformer()
    blocks = list(module.blocks)
    assert remat.select(module, "blocks") == blocks
    assert remat.select(module, "every_k", every=2) == blocks[::2]
    assert remat.select(module, "none") == []
    assert remat.select(module, "blocks", policy=["_Block", "Linear"]) == blocks + [module.head]  # nested Linears once
    assert remat.modules_of("blocks", functionalize(module)[0]) == blocks
    with pytest.raises(ConfigError) as error:
        remat.from_config("blocks", ["Block"], None, module)
    assert str(error.value) == (
        "trainer.activation_checkpointing_policy=['Block']: expected the model's classes (none is Block; it has "
        "CharTransformer, Dropout, Embedding, GELU, LayerNorm, Linear, Sequential, _Block, _CausalSelfAttention)"
    )
    with pytest.raises(ValueError, match=r"^checkpoint_modules=\['Conv2d'\]: expected the model's classes \(none is"):
        model, params, buffers = functionalize(module)
        loss_fn = cross_entropy_loss(model)
        plan = plan_buckets(planner_loss(loss_fn, buffers), params, _tokens(2))
        make_train_step(loss_fn, adam(1e-3), plan, model=model, checkpoint_modules=["Conv2d"])
    with pytest.raises(ValueError, match=r"^checkpoint_modules='blocks': expected modules, or model= to find them in"):
        make_train_step(loss_fn, adam(1e-3), plan, checkpoint_modules="blocks")
    with pytest.raises(ValueError, match=r"^activation_checkpointing='all': expected none, blocks or every_k$"):
        remat.select(module, "all")
    with pytest.raises(ValueError, match=r"^activation_checkpointing_policy=\[\]: expected the classes of the modules"):
        remat.select(nn.Linear(2, 2), "blocks", setting="activation_checkpointing_policy")


def test_the_config_settings_are_checked_before_anything_runs():
    from fdp.run.config.compose import compose as cfg
    from fdp.run.config.validate import validate

    with pytest.raises(ConfigError, match=r"^trainer.activation_checkpointing=.all.: expected none, blocks or every_k"):
        validate(cfg("trainer.activation_checkpointing=all"))
    with pytest.raises(ConfigError, match=r"^trainer.activation_checkpointing_k=0: expected an integer >= 1$"):
        validate(cfg("trainer.activation_checkpointing=every_k", "trainer.activation_checkpointing_k=0"))
    validate(
        cfg(
            "model=charlm",
            "data=stdlib_text",
            "trainer.activation_checkpointing=every_k",
            "trainer.activation_checkpointing_policy=[_Block]",
        )
    )


def _train(rank, world, stage, checkpoint, sample_seed, accum):
    module = _char_transformer()
    model, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(model)
    batches = [tuple(t[rank * 4 : (rank + 1) * 4] for t in _tokens(4 * world, seed)) for seed in range(STEPS)]
    plan = plan_buckets(
        planner_loss(loss_fn, buffers), params, batches[0], bucket_cap_mb=0.01, first_bucket_cap_mb=0.002
    )
    comm = Comm()
    step = make_train_step(
        loss_fn,
        adam(1e-2),
        plan,
        comm=comm,
        zero_stage=stage,
        model=model,
        donate=True,
        accum_steps=accum,
        sample_seed=sample_seed,
        checkpoint_modules="blocks" if checkpoint else (),
    )
    if stage:
        state = zero.init_state(params, buffers, adam(1e-2), plan, comm, stage=stage, seed=7)
    else:
        state = init_train_state(params, buffers, adam(1e-2), plan, seed=7)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"].item())
    return losses, {n: p.clone() for n, p in zero.whole_params(state, plan, comm).items()}


def _with_and_without(rank, world):
    # At stage 3 the recomputation gathers the block's buckets again, off the forward's recorded schedule: a
    # forward seen to leave that schedule would gather every bucket and keep them whole to the end of the step.
    schedules = []
    stop = ParamGather.stop
    ParamGather.stop = lambda self: (schedules.append(self._on_schedule), stop(self))[1]
    out = {}
    for stage, sample_seed, accum in ((0, None, 1), (3, None, 2), (0, 11, 2), (3, 11, 1)):
        plain, checkpointed = (_train(rank, world, stage, c, sample_seed, accum) for c in (False, True))
        differ = [n for n in plain[1] if not torch.equal(plain[1][n], checkpointed[1][n])]
        out[(stage, sample_seed, accum)] = (plain[0] == checkpointed[0], differ)
    return out, schedules


def test_two_ranks_train_bit_for_bit_alike_with_and_without_checkpointing_at_stages_0_and_3(run_ranks):
    for result, schedules in run_ranks(_with_and_without):
        assert schedules and all(schedules)
        for variant, (same_losses, differ) in result.items():
            assert same_losses and differ == [], (variant, differ)
