import copy

import torch
from torch import nn
from torch.func import grad_and_value

from fdp.model.functional import functionalize


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


def test_grad_and_value_through_vjp_equals_torch_func_s_bit_for_bit():
    """Same grads, loss and aux (BatchNorm's new statistics) as torch.func.grad_and_value."""
    from fdp.model.functional import grad_and_value as vjp_grad_and_value

    torch.manual_seed(0)
    model, params, buffers = functionalize(_Tied())
    tokens, targets = torch.randint(0, 7, (8,)), torch.randint(0, 7, (8,))

    def loss_fn(p, b, batch):
        out, new_buffers = model.apply(p, b, batch[0])
        return nn.functional.cross_entropy(out, batch[1]), (new_buffers, {"max": out.max()})

    grads, (loss, (new_buffers, extra)) = vjp_grad_and_value(loss_fn)(params, buffers, (tokens, targets))
    ref_grads, (ref_loss, (ref_buffers, ref_extra)) = grad_and_value(loss_fn, has_aux=True)(
        params, buffers, (tokens, targets)
    )
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    assert torch.equal(loss, ref_loss) and torch.equal(extra["max"], ref_extra["max"])
    assert all(torch.equal(new_buffers[n], ref_buffers[n]) for n in ref_buffers)
    assert not any(g.requires_grad for g in grads.values()) and not loss.requires_grad


class _Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        if x.sum() > 100:
            raise RuntimeError("forward failed")
        return self.lin(x)


def test_apply_puts_the_module_s_own_tensors_back_even_when_the_forward_raises():
    module = _Fails()
    own = {n: p for n, p in module.named_parameters()}
    model, params, buffers = functionalize(module)
    zeros = {n: torch.zeros_like(p) for n, p in params.items()}
    out, _ = model.apply(zeros, buffers, torch.ones(1, 2))
    assert torch.equal(out, torch.zeros(1, 2))  # ran on the tensors given
    try:
        model.apply(zeros, buffers, torch.full((1, 2), 1000.0))
    except RuntimeError as error:
        assert str(error) == "forward failed"
    assert all(dict(module.named_parameters())[n] is own[n] for n in own)  # the module's own again
    assert all(isinstance(p, nn.Parameter) for p in module.parameters())


def test_apply_takes_names_the_module_does_not_hold_through_functional_call():
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    model, params, buffers = functionalize(module)
    # An extra plain attribute a forward might read: not a registered tensor, so torch's path sets it.
    out, _ = model.apply({**params, "scale": torch.tensor(2.0)}, buffers, torch.ones(1, 3))
    torch.testing.assert_close(out, module(torch.ones(1, 3)), rtol=0, atol=0)
    assert not hasattr(module, "scale")
