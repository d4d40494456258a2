import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad_and_value

from fdp.model.builtin import MLP, CharTransformer, ConvNet, build_model, count_parameters
from fdp.model.functional import functionalize

torch.set_num_threads(1)

VOCAB, BLOCK = 13, 8


def tiny_charlm(**kwargs) -> CharTransformer:
    cfg = dict(vocab_size=VOCAB, block_size=BLOCK, d_model=16, n_layer=2, n_head=2)
    return CharTransformer(**{**cfg, **kwargs})


def test_mlp_shapes_and_flatten():
    torch.manual_seed(0)
    model = MLP(64, 32, 2, 10)
    assert model(torch.randn(5, 64)).shape == (5, 10)
    images = torch.randn(5, 1, 8, 8)
    assert torch.equal(model(images), model(images.reshape(5, 64)))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 3  # depth hidden layers + head


def test_mlp_depth_zero_is_a_linear_model():
    assert count_parameters(MLP(64, 32, 0, 10)) == 64 * 10 + 10


def test_convnet_shapes_and_batchnorm():
    torch.manual_seed(0)
    model = ConvNet(width=8)
    assert model(torch.randn(4, 1, 8, 8)).shape == (4, 10)
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert ConvNet(in_channels=3, num_classes=5, width=4)(torch.randn(2, 3, 8, 8)).shape == (2, 5)


def test_charlm_shapes_and_shorter_sequences():
    torch.manual_seed(0)
    model = tiny_charlm()
    assert model(torch.randint(0, VOCAB, (3, BLOCK))).shape == (3, BLOCK, VOCAB)
    assert model(torch.randint(0, VOCAB, (3, BLOCK - 3))).shape == (3, BLOCK - 3, VOCAB)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randint(0, VOCAB, (1, BLOCK + 1)))


def test_charlm_is_causal():
    torch.manual_seed(0)
    model = tiny_charlm().eval()
    idx = torch.randint(0, VOCAB, (2, BLOCK))
    changed = idx.clone()
    t = 5
    changed[:, t] = (changed[:, t] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert not torch.allclose(a[:, t:], b[:, t:])  # the change is visible from position t on


def test_tied_weights_appear_once():
    tied, untied = tiny_charlm(), tiny_charlm(tie_weights=False)
    assert tied.head.weight is tied.tok_emb.weight
    tied_names = [name for name, _ in tied.named_parameters()]
    assert "tok_emb.weight" in tied_names and "head.weight" not in tied_names
    assert "head.weight" in [name for name, _ in untied.named_parameters()]
    assert count_parameters(untied) - count_parameters(tied) == VOCAB * 16


def test_weights_follow_the_callers_seed():
    torch.manual_seed(123)
    a = tiny_charlm()
    torch.manual_seed(123)
    b = tiny_charlm()
    c = tiny_charlm()  # no reseed: different weights, so nothing seeds internally
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(b.tok_emb.weight, c.tok_emb.weight)


def test_count_parameters_mlp():
    # 64*256+256 + 256*256+256 + 256*10+10
    assert count_parameters(MLP(64, 256, 2, 10)) == 85002


def _train(module, inputs, targets, lr, steps=30):
    """SGD through torch.func.grad_and_value over the functional model; returns losses."""
    model, params, buffers = functionalize(module)

    def loss_fn(params, buffers):
        logits, new_buffers = model.apply(params, buffers, inputs, training=True)
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten()), new_buffers

    step = grad_and_value(loss_fn, has_aux=True)
    losses = []
    for _ in range(steps):
        grads, (loss, buffers) = step(params, buffers)
        assert grads.keys() == params.keys()
        params = {k: p - lr * grads[k] for k, p in params.items()}
        losses.append(loss.item())
    return losses, params, buffers


@pytest.mark.parametrize(
    "name,kwargs,make_batch,lr",
    [
        (
            "mlp",
            dict(in_features=64, hidden=32, depth=2, out_features=10),
            lambda g: (torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)),
            0.3,
        ),
        (
            "convnet",
            dict(width=8),
            lambda g: (torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)),
            0.1,
        ),
        (
            "charlm",
            dict(vocab_size=VOCAB, block_size=BLOCK, d_model=16, n_layer=2, n_head=2),
            lambda g: (
                torch.randint(0, VOCAB, (4, BLOCK), generator=g),
                torch.randint(0, VOCAB, (4, BLOCK), generator=g),
            ),
            0.5,
        ),
    ],
)
def test_trains_under_torch_func(name, kwargs, make_batch, lr):
    torch.manual_seed(0)
    module = build_model(name, **kwargs)
    x, y = make_batch(torch.Generator().manual_seed(1))
    losses, params, buffers = _train(module, x, y, lr)
    assert losses[-1] < 0.7 * losses[0], losses
    # The module's own weights are untouched: training happened on the functional copies.
    assert not torch.equal(params[next(iter(params))], dict(module.named_parameters())[next(iter(params))])
    if name == "convnet":
        assert int(buffers["features.1.num_batches_tracked"]) == 30


def test_charlm_dropout_trains_and_eval_is_deterministic():
    torch.manual_seed(0)
    module = tiny_charlm(dropout=0.1)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, VOCAB, (4, BLOCK), generator=g)
    losses, params, buffers = _train(module, x, torch.roll(x, -1, dims=1), lr=0.5)
    assert losses[-1] < losses[0]
    model, _, _ = functionalize(module)
    out1, _ = model.apply(params, buffers, x, training=False)
    out2, _ = model.apply(params, buffers, x, training=False)
    assert torch.equal(out1, out2)


def test_build_model_errors():
    with pytest.raises(ValueError, match="known models: charlm, convnet, mlp"):
        build_model("resnet")
    with pytest.raises(TypeError):
        build_model("mlp", in_features=4)
    with pytest.raises(ValueError, match="expected a divisor of d_model"):
        build_model("charlm", vocab_size=5, block_size=4, d_model=10, n_layer=1, n_head=3)
