import copy

import torch
from torch import nn
from torch.func import grad_and_value

from fdp.functional import functionalize


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.norm(self.frozen(self.emb(tokens))))


def test_params_hold_trainable_tensors_once_and_buffers_separately():
    module = _Tied()
    model, params, buffers = functionalize(module)
    assert set(params) == {"emb.weight", "norm.weight", "norm.bias"}
    assert set(model.frozen) == {"frozen.weight", "frozen.bias"}
    assert set(buffers) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}


def test_apply_matches_the_module_and_returns_new_buffers_without_mutation():
    torch.manual_seed(0)
    module = _Tied()
    model, params, buffers = functionalize(module)
    before = {k: v.clone() for k, v in buffers.items()}
    tokens = torch.randint(0, 7, (8,))
    out, new_buffers = model.apply(params, buffers, tokens)
    reference = module(tokens)  # the eager module updates its own running stats
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    for name in buffers:
        assert torch.equal(buffers[name], before[name]), name
        torch.testing.assert_close(new_buffers[name], dict(module.named_buffers())[name], rtol=0, atol=0)
    assert int(new_buffers["norm.num_batches_tracked"]) == 1


def test_grads_form_a_tree_like_params_and_match_eager_backward():
    torch.manual_seed(0)
    module = _Tied()
    model, params, buffers = functionalize(module)
    tokens, targets = torch.randint(0, 7, (8,)), torch.randint(0, 7, (8,))

    def loss_fn(p):
        out, new_buffers = model.apply(p, buffers, tokens)
        return nn.functional.cross_entropy(out, targets), new_buffers

    grads, (loss, _) = grad_and_value(loss_fn, has_aux=True)(params)
    assert set(grads) == set(params)
    nn.functional.cross_entropy(module(tokens), targets).backward()
    eager = dict(module.named_parameters())
    for name, g in grads.items():
        torch.testing.assert_close(g, eager[name].grad, rtol=1e-6, atol=1e-7)
    assert module.frozen.weight.grad is None


def test_apply_puts_every_submodule_in_the_mode_asked_for():
    module = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 2)))
    module[1][0].eval()  # a submodule out of step with its parents
    model, params, buffers = functionalize(module)
    x = torch.ones(16, 4)
    model.apply(params, buffers, x)
    assert all(m.training for m in module.modules())
    model.apply(params, buffers, x, training=False)
    assert not any(m.training for m in module.modules())
    model.apply(params, buffers, x)
    assert all(m.training for m in module.modules())


def test_tied_weights_follow_the_one_tensor_given_for_them():
    torch.manual_seed(0)
    reference = _Tied().eval()
    model, params, buffers = functionalize(copy.deepcopy(reference), keep_module_weights=False)
    assert model.ties == (("head.weight", "emb.weight"),)
    moved = {**params, "emb.weight": params["emb.weight"] * 2}
    with torch.no_grad():
        reference.emb.weight.mul_(2)  # the head is the same tensor
    tokens = torch.randint(0, 7, (8,))
    out, _ = model.apply(moved, buffers, tokens, training=False)
    torch.testing.assert_close(out, reference(tokens), rtol=0, atol=0)
