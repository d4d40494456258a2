"""The private-torch shim: its fallbacks agree with torch's private ops, and nothing else in fdp/ uses them."""

import re
from pathlib import Path

import pytest
import torch

from fdp import _torch

FDP = Path(__file__).resolve().parents[1] / "fdp"

# Private torch names (and private-ish idioms) that only the package fdp/_torch/ may spell.
PRIVATE = re.compile(r"torch\._(?!_)|_get_default_store|utils\._pytree|\.set_\(|\.data\s*=[^=]")


def test_no_module_but_the_shim_touches_private_torch():
    offenders = [
        f"{path.relative_to(FDP.parent)}:{number}: {line.strip()}"
        for path in sorted(FDP.rglob("*.py"))
        if path.relative_to(FDP).parts[0] != "_torch"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line.split("#")[0]) and ">>>" not in line
    ]
    assert not offenders, "\n".join(offenders)


def _lists(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, generator=g) for _ in range(n)]


CASES = {
    "add": (torch.add, lambda: (_lists(0), _lists(1)), {"alpha": 0.5}),
    "mul": (torch.mul, lambda: (_lists(2), 1.5), {}),
    "lerp": (torch.lerp, lambda: (_lists(3), _lists(4), 0.25), {}),
    "sqrt": (torch.sqrt, lambda: ([t.abs() for t in _lists(5)],), {}),
    "add_": (torch.Tensor.add_, lambda: (_lists(6), _lists(7)), {"alpha": 2.0}),
    "addcmul_": (torch.Tensor.addcmul_, lambda: (_lists(8), _lists(9), _lists(10)), {"value": 0.3}),
    "div_": (torch.Tensor.div_, lambda: (_lists(11), 3.0), {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_looped_fallback_gives_torch_s_numbers(name):
    fallback, make_args, kwargs = CASES[name]
    expected_args, fallback_args = make_args(), make_args()
    expected = getattr(_torch.foreach, name)(*expected_args, **kwargs)
    got = _torch.kernels._looped(fallback)(*fallback_args, **kwargs)
    if name.endswith("_"):  # in place: compare what the first list became
        expected, got = expected_args[0], fallback_args[0]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_storage_alias_shares_memory_without_holding_the_buffer():
    flat = torch.zeros(6)
    alias = _torch.storage_alias(flat, 2, (2, 2), (2, 1))
    flat[3] = 7.0
    assert alias[0, 1].item() == 7.0 and alias._base is None
