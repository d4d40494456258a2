"""The moving average of the params against torch's own (torch.optim.swa_utils)."""

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from fdp.optim.ema import averaged_as, ema


def test_the_average_follows_torchs_exponential_moving_average_over_training_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    reference.update_parameters(model)  # torch's first update copies; ours starts from the params before step 1
    average = ema(0.9)
    state = average.init(dict(model.named_parameters()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(20):
        x = torch.randn(16, 4)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        state = average.update(state, dict(model.named_parameters()))
        reference.update_parameters(model)
    theirs = dict(reference.module.named_parameters())
    assert state.keys() == theirs.keys()
    assert all(torch.allclose(state[n], theirs[n], atol=1e-6) for n in state)
    assert not all(torch.equal(state[n], p) for n, p in model.named_parameters())


def test_sixteen_bit_params_are_averaged_in_float32_and_evaluated_in_their_own_dtype():
    params = {"w": torch.ones(3, dtype=torch.bfloat16)}
    average = ema(0.999)
    state = average.init(params)
    for _ in range(10):  # each step moves the average by 1e-3: below a bfloat16's resolution near 1
        state = average.update(state, {"w": torch.full((3,), 2.0, dtype=torch.bfloat16)})
    assert state["w"].dtype == torch.float32
    assert abs(state["w"][0].item() - (2 - 0.999**10)) < 1e-6
    assert averaged_as(state, params)["w"].dtype == torch.bfloat16


def test_update_leaves_its_arguments_as_they_were():
    average = ema(0.5)
    params = {"w": torch.zeros(2)}
    state = average.init(params)
    new = average.update(state, {"w": torch.ones(2)})
    assert state["w"].tolist() == [0.0, 0.0] and params["w"].tolist() == [0.0, 0.0] and new["w"].tolist() == [0.5, 0.5]
