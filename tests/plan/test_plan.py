"""The static bucket plan: packing rules (property-tested), tracing against real models.

Expected values come from elsewhere than the code under test: gradient-ready orders from
a plain ``loss.backward()`` with hooks written here (the planner uses ``torch.func.grad``),
packing from hand computation or from the defining properties of the greedy rule.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paths import pythonpath_first
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fdp.model.functional import functionalize
from fdp.plan import Bucket, BucketPlan, ParamSlot, gradient_ready_order, pack_into_buckets, plan_buckets

torch.set_num_threads(1)

MiB = 2**20
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODEL_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- helpers


def observed_order(loss_fn, params, batch) -> list[str]:
    """Gradient-ready order seen by a plain autograd backward, independent of fdp.plan."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    seen: list[str] = []
    for k, v in leaves.items():
        v.register_hook(lambda g, k=k: seen.append(k))
    out = loss_fn(leaves, batch)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return seen


def model_loss(model, buffers):
    def loss_fn(p, batch):
        x, y = batch
        out, _ = model.apply(p, buffers, x)
        return nn.functional.mse_loss(out, y)

    return loss_fn


def spec_list(n: int, numel: int, dtype="float32", device="cpu"):
    return [(f"p{i}", (numel,), dtype, device) for i in range(n)]


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
dtypes = st.sampled_from(["float32", "float16", "bfloat16", "float64"])
devices = st.sampled_from(["cpu", "meta"])


@st.composite
def spec_orders(draw, max_size=25):
    n = draw(st.integers(1, max_size))
    return [(f"layer{i}.w", draw(shapes), draw(dtypes), draw(devices)) for i in range(n)]


caps_bytes = st.integers(1, 600)


def nbytes(spec) -> int:
    return math.prod(spec[1]) * ITEMSIZE[spec[2]]


# ----------------------------------------------------------------------------- packing properties


def check_greedy_packing(plan: BucketPlan, order, unused, first_cap_b: float, cap_b: float) -> None:
    """Assert the properties that define the packing rule (they determine it uniquely)."""
    specs = {s[0]: s for s in list(order) + list(unused)}
    position = {s[0]: i for i, s in enumerate(order)}
    # Every parameter exactly once.
    names = [s.name for b in plan.buckets for s in b.slots]
    assert sorted(names) == sorted(specs)
    assert len(names) == len(set(names))
    used_buckets = [b for b in plan.buckets if not b.unused]
    unused_buckets = [b for b in plan.buckets if b.unused]
    assert plan.buckets == tuple(used_buckets + unused_buckets)  # unused buckets come last
    assert {n for b in unused_buckets for n in b.names} == {s[0] for s in unused}
    for i, b in enumerate(plan.buckets):
        assert b.index == i
        offset = 0
        for slot in b.slots:
            name, shape, dtype, device = specs[slot.name]
            # Single dtype/device per bucket, shape kept, tensor never split.
            assert (b.dtype, b.device) == (dtype, device)
            assert slot.shape == shape and slot.numel == math.prod(shape)
            assert slot.offset == offset
            offset += slot.numel
        assert b.numel == offset
        assert b.nbytes == sum(nbytes(specs[n]) for n in b.names)
    # Buckets ordered by the gradient-ready position of their last tensor.
    lasts = [position[b.names[-1]] for b in used_buckets]
    assert lasts == sorted(lasts)
    for part, first_cap, rest_cap in ((order, first_cap_b, cap_b), (unused, cap_b, cap_b)):
        part_names = {s[0] for s in part}
        for group in {(s[2], s[3]) for s in part}:
            seq = [s[0] for s in part if (s[2], s[3]) == group]
            gb = [b for b in plan.buckets if (b.dtype, b.device) == group and set(b.names) <= part_names]
            # The group's buckets, read in index order, are exactly its tensors in order.
            assert [n for b in gb for n in b.names] == seq
            for k, b in enumerate(gb):
                cap = first_cap if k == 0 else rest_cap
                assert b.nbytes <= cap or len(b.slots) == 1, (k, b, cap)
                if k + 1 < len(gb):
                    # Closed only because the next tensor would have pushed it over.
                    assert b.nbytes + nbytes(specs[gb[k + 1].names[0]]) > cap


@SETTINGS
@given(order=spec_orders(), first=caps_bytes, cap=caps_bytes, n_unused=st.integers(0, 4))
def test_packing_properties(order, first, cap, n_unused):
    unused = [(f"idle{i}.w", (i + 1, 3), "float32" if i % 2 else "float16", "cpu") for i in range(n_unused)]
    plan = pack_into_buckets(order, bucket_cap_mb=cap / MiB, first_bucket_cap_mb=first / MiB, unused=unused)
    check_greedy_packing(plan, order, unused, first, cap)
    assert len(plan) == len(plan.buckets)
    assert plan.nbytes == sum(nbytes(s) for s in order + unused)
    for b in plan.buckets:
        for s in b.slots:
            assert plan.slot(s.name) == (b.index, s)


def test_packing_hand_computed():
    # float32 sizes in bytes: a=8, b=8, c=12, d=40, e=4; first cap 16 B, then 20 B.
    order = [
        ("a", (2,), "float32", "cpu"),
        ("b", (2,), "float32", "cpu"),
        ("c", (3,), "float32", "cpu"),
        ("d", (10,), "float32", "cpu"),
        ("e", (1,), "float32", "cpu"),
    ]
    plan = pack_into_buckets(order, bucket_cap_mb=20 / MiB, first_bucket_cap_mb=16 / MiB)
    # a+b = 16 fits the first cap; c opens a 20 B bucket; d (40 B) alone, over the cap; e alone after it.
    assert [b.names for b in plan.buckets] == [("a", "b"), ("c",), ("d",), ("e",)]
    assert [b.numel for b in plan.buckets] == [4, 3, 10, 1]
    assert plan.buckets[0].slots == (ParamSlot("a", (2,), 0, 2), ParamSlot("b", (2,), 2, 2))


def test_packing_interleaved_dtypes_hand_computed():
    # One open bucket per dtype; a bucket's index is set by when its last tensor is ready.
    order = [
        ("h1", (4,), "float16", "cpu"),
        ("f1", (4,), "float32", "cpu"),
        ("f2", (4,), "float32", "cpu"),
        ("h2", (4,), "float16", "cpu"),
        ("f3", (2,), "float32", "cpu"),
    ]
    # f32 first cap 16 B: f1 alone (16 B), then f2+f3 = 24 B <= 32 B. f16: h1+h2 = 16 B <= 16 B.
    plan = pack_into_buckets(order, bucket_cap_mb=32 / MiB, first_bucket_cap_mb=16 / MiB)
    assert [(b.dtype, b.names) for b in plan.buckets] == [
        ("float32", ("f1",)),  # last tensor ready at position 1
        ("float16", ("h1", "h2")),  # position 3
        ("float32", ("f2", "f3")),  # position 4
    ]


def test_packing_unused_go_last_hand_computed():
    order = [("a", (4,), "float32", "cpu")]
    unused = [("u1", (3,), "float32", "cpu"), ("u2", (3,), "float32", "cpu"), ("u3", (3,), "float16", "cpu")]
    plan = pack_into_buckets(order, bucket_cap_mb=12 / MiB, first_bucket_cap_mb=100 / MiB, unused=unused)
    # Unused tensors are capped at bucket_cap_mb: u1 (12 B) fills one, u2 the next; u3 is
    # float16, a group of its own, whose last (only) tensor comes after u2.
    assert [(b.names, b.unused) for b in plan.buckets] == [
        (("a",), False),
        (("u1",), True),
        (("u2",), True),
        (("u3",), True),
    ]


@pytest.mark.parametrize(
    "kw,name",
    [
        ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
        ({"first_bucket_cap_mb": -1.0}, "first_bucket_cap_mb"),
        ({"bucket_cap_mb": float("nan")}, "bucket_cap_mb"),
    ],
)
def test_caps_must_be_positive(kw, name):
    with pytest.raises(ValueError, match=rf"{name}.*expected a size in MiB > 0"):
        pack_into_buckets(spec_list(2, 4), **kw)
    params = {"w": torch.randn(2)}
    with pytest.raises(ValueError, match=rf"{name}.*expected a size in MiB > 0"):
        plan_buckets(lambda p, x: p["w"].sum(), params, None, **kw)


def test_empty_and_duplicate_inputs_rejected():
    with pytest.raises(ValueError, match="empty"):
        pack_into_buckets([])
    with pytest.raises(ValueError, match="empty"):
        plan_buckets(lambda p, x: x.sum(), {}, torch.ones(1))
    with pytest.raises(ValueError, match="more than once"):
        pack_into_buckets([("a", (1,), "float32", "cpu")], unused=[("a", (1,), "float32", "cpu")])
    with pytest.raises(ValueError, match="unknown dtype"):
        pack_into_buckets([("a", (1,), "float33", "cpu")])


# ----------------------------------------------------------------------------- serialisation, fingerprint, diff


@SETTINGS
@given(order=spec_orders(), first=caps_bytes, cap=caps_bytes)
def test_json_round_trip(order, first, cap):
    plan = pack_into_buckets(order, cap / MiB, first / MiB, unused=[("idle", (2, 2), "bfloat16", "cpu")])
    again = BucketPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and hash(again) == hash(plan)
    assert again.fingerprint() == plan.fingerprint()
    assert again.first_difference(plan) is None


def test_equal_caps_given_as_int_or_float_are_equal_plans():
    a = pack_into_buckets(spec_list(3, 4), bucket_cap_mb=25, first_bucket_cap_mb=1)
    b = pack_into_buckets(spec_list(3, 4), bucket_cap_mb=25.0, first_bucket_cap_mb=1.0)
    assert a == b and a.fingerprint() == b.fingerprint()


def test_from_dict_rejects_inconsistent_layouts():
    d = pack_into_buckets(spec_list(3, 4)).to_dict()
    bad = json.loads(json.dumps(d))
    bad["buckets"][0]["slots"][1]["offset"] = 3  # overlaps the first slot
    with pytest.raises(ValueError, match="offset"):
        BucketPlan.from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["format"] = "something else"
    with pytest.raises(ValueError, match="fdp.BucketPlan"):
        BucketPlan.from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["buckets"][0]["slots"][0]["shape"] = [5]
    with pytest.raises(ValueError, match="numel"):
        BucketPlan.from_dict(bad)


_FIXED_ORDER = [
    ("emb.weight", (100, 16), "float32", "cpu"),
    ("fc.bias", (10,), "float32", "cpu"),
    ("fc.weight", (10, 16), "float32", "cpu"),
    ("norm.weight", (16,), "bfloat16", "cpu"),
]


def test_fingerprint_is_stable_across_processes():
    plan = pack_into_buckets(_FIXED_ORDER, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001)
    code = (
        "from fdp.plan import pack_into_buckets\n"
        f"print(pack_into_buckets({_FIXED_ORDER!r}, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001).fingerprint())"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath_first(REPO), "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == plan.fingerprint()
    assert len(plan.fingerprint()) == 64 and int(plan.fingerprint(), 16) >= 0


def _changed(i, field, value):
    order = [list(s) for s in _FIXED_ORDER]
    order[i][field] = value
    return [tuple(s) for s in order]


@pytest.mark.parametrize(
    "other,expected",
    [
        (dict(order=_changed(2, 0, "fc.weight2")), "parameter 2: 'fc.weight' vs 'fc.weight2'"),
        (dict(order=_changed(2, 1, (10, 15))), "parameter 2: 'fc.weight' shape (10, 16) vs (10, 15)"),
        (dict(order=_changed(3, 2, "float16")), "parameter 3: 'norm.weight' dtype bfloat16 vs float16"),
        (dict(order=_changed(1, 3, "meta")), "parameter 1: 'fc.bias' device cpu vs meta"),
        (dict(order=[_FIXED_ORDER[i] for i in (0, 2, 1, 3)]), "parameter 1: 'fc.bias' vs 'fc.weight'"),
        (dict(cap=0.005), "bucket_cap_mb 0.004 vs 0.005"),
        (dict(first=0.002), "first_bucket_cap_mb 0.001 vs 0.002"),
        (dict(order=_FIXED_ORDER[:3]), "4 parameters vs 3; parameter 3: 'norm.weight' is in only this plan"),
        (dict(unused=True), "parameter 3: 'norm.weight' used vs unused"),
    ],
)
def test_fingerprint_and_first_difference_see_every_change(other, expected):
    base = pack_into_buckets(_FIXED_ORDER, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001)
    order = other.get("order", _FIXED_ORDER)
    unused = ()
    if other.get("unused"):
        order, unused = order[:3], order[3:]
    changed = pack_into_buckets(order, other.get("cap", 0.004), other.get("first", 0.001), unused=unused)
    assert changed != base
    assert changed.fingerprint() != base.fingerprint()
    assert base.first_difference(changed) == expected


def test_first_difference_names_a_moved_bucket_boundary():
    # Same parameters, same order, caps equal: only the boundary differs (built by hand).
    slots = [ParamSlot("a", (2,), 0, 2), ParamSlot("b", (2,), 2, 2)]
    one = BucketPlan((Bucket(0, "float32", "cpu", tuple(slots), 4),), 1.0, 1.0)
    two = BucketPlan(
        (Bucket(0, "float32", "cpu", (slots[0],), 2), Bucket(1, "float32", "cpu", (ParamSlot("b", (2,), 0, 2),), 2)),
        1.0,
        1.0,
    )
    assert one.first_difference(two) == "parameter 1: 'b' bucket 0 vs 1"
    assert one.fingerprint() != two.fingerprint()


def test_str_has_a_row_per_bucket_and_a_total():
    plan = pack_into_buckets(
        _FIXED_ORDER, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001, unused=[("idle.w", (3,), "float32", "cpu")]
    )
    text = str(plan)
    lines = text.splitlines()
    assert lines[0].startswith("buckets in backward order")
    assert [c.strip() for c in lines[1].split("|")] == [
        "bucket",
        "dtype",
        "device",
        "params",
        "MiB",
        "tensors",
        "first param",
        "last param",
    ]
    for b in plan.buckets:
        row = [ln for ln in lines if ln.split("|")[0].strip() == (f"{b.index} (unused)" if b.unused else str(b.index))]
        assert len(row) == 1, (b, text)
        cells = [c.strip() for c in row[0].split("|")]
        assert cells[1:3] == [b.dtype, b.device]
        assert cells[3] == f"{sum(s.numel for s in b.slots):,}"
        assert cells[5] == str(len(b.slots))
        assert cells[6:] == [b.names[0], b.names[-1]]
    total = sum(s.numel for b in plan.buckets for s in b.slots)
    assert lines[-1].startswith(f"total: {len(plan)} buckets, 5 tensors, {total:,} params")


# ----------------------------------------------------------------------------- tracing real models


class Branchy(nn.Module):
    """A Linear trunk feeding two heads whose outputs are summed (a fork in the graph)."""

    def __init__(self, widths: list[int], head_width: int, out: int, bias: bool):
        super().__init__()
        layers = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b, bias=bias), nn.Tanh()]
        self.trunk = nn.Sequential(*layers)
        self.left = nn.Sequential(nn.Linear(widths[-1], head_width), nn.ReLU(), nn.Linear(head_width, out))
        self.right = nn.Linear(widths[-1], out, bias=bias)

    def forward(self, x):
        h = self.trunk(x)
        return self.left(h) + 0.5 * self.right(h)


@MODEL_SETTINGS
@given(
    widths=st.lists(st.integers(1, 12), min_size=2, max_size=6),
    head=st.integers(1, 8),
    bias=st.booleans(),
    branchy=st.booleans(),
    cap=st.integers(4, 400),
    trace=st.sampled_from(["auto", "meta", "real"]),
)
def test_plan_order_is_the_observed_backward_order(widths, head, bias, branchy, cap, trace):
    torch.manual_seed(0)
    if branchy:
        module = Branchy(widths, head, 3, bias)
    else:
        module = nn.Sequential(*[nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:] + [3])])
    model, params, buffers = functionalize(module)
    loss_fn = model_loss(model, buffers)
    batch = (torch.randn(2, widths[0]), torch.randn(2, 3))
    expected = observed_order(loss_fn, params, batch)
    assert sorted(expected) == sorted(params)  # every parameter is used here
    assert gradient_ready_order(loss_fn, params, batch, trace=trace) == expected
    plan = plan_buckets(loss_fn, params, batch, bucket_cap_mb=cap / MiB, first_bucket_cap_mb=cap / MiB / 2, trace=trace)
    assert list(plan.names) == expected  # one dtype: plan order is the ready order
    order = [(n, tuple(params[n].shape), "float32", "cpu") for n in expected]
    check_greedy_packing(plan, order, (), cap / 2, cap)


def test_mixed_dtype_model_groups_by_dtype_in_ready_order():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 6)
            self.b = nn.Linear(6, 6).double()
            self.c = nn.Linear(6, 2)

        def forward(self, x):
            return self.c(self.b(self.a(x).double()).float())

    model, params, buffers = functionalize(Mixed())
    loss_fn = model_loss(model, buffers)
    batch = (torch.randn(3, 4), torch.randn(3, 2))
    expected = observed_order(loss_fn, params, batch)
    plan = plan_buckets(loss_fn, params, batch, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
    order = [(n, tuple(params[n].shape), str(params[n].dtype)[6:], "cpu") for n in expected]
    check_greedy_packing(plan, order, (), 1e-4 * MiB, 1e-4 * MiB)
    assert {b.dtype for b in plan.buckets} == {"float32", "float64"}


def test_independently_built_models_give_equal_plans():
    def build(seed: int):
        torch.manual_seed(seed)  # other values, same architecture
        model, params, buffers = functionalize(Branchy([6, 9, 5], 4, 3, bias=True))
        batch = (torch.randn(2, 6), torch.randn(2, 3))
        return plan_buckets(model_loss(model, buffers), params, batch, bucket_cap_mb=1e-3, first_bucket_cap_mb=2e-4)

    a, b = build(0), build(1)
    assert a is not b and a == b and hash(a) == hash(b)
    assert a.fingerprint() == b.fingerprint() and a.first_difference(b) is None
    assert len(a) > 1


def test_tied_weights_appear_once():
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.mid = nn.Linear(8, 8)
            self.head = nn.Linear(8, 20, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(torch.tanh(self.mid(self.emb(idx))))

    model, params, buffers = functionalize(TiedLM())
    assert "head.weight" not in params and "emb.weight" in params

    def loss_fn(p, batch):
        logits, _ = model.apply(p, buffers, batch)
        return nn.functional.cross_entropy(logits.reshape(-1, 20), batch.reshape(-1))

    batch = torch.randint(0, 20, (2, 5))
    expected = observed_order(loss_fn, params, batch)
    plan = plan_buckets(loss_fn, params, batch)
    assert list(plan.names) == expected
    assert sorted(plan.names) == ["emb.weight", "mid.bias", "mid.weight"]


def test_frozen_parameters_are_left_out():
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    module[0].requires_grad_(False)
    model, params, buffers = functionalize(module)
    loss_fn = model_loss(model, buffers)
    batch = (torch.randn(2, 4), torch.randn(2, 2))
    plan = plan_buckets(loss_fn, params, batch)
    assert list(plan.names) == observed_order(loss_fn, params, batch) == ["2.bias", "2.weight"]


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head1 = nn.Linear(8, 2)
        self.head2 = nn.Linear(8, 2)  # never called in forward

    def forward(self, x):
        return self.head1(torch.relu(self.body(x)))


def test_unused_parameters_are_named_or_bucketed_last():
    model, params, buffers = functionalize(TwoHeads())
    loss_fn = model_loss(model, buffers)
    batch = (torch.randn(2, 4), torch.randn(2, 2))
    with pytest.raises(ValueError, match=r"receive no gradient: \['head2.weight', 'head2.bias'\].*allow_unused"):
        plan_buckets(loss_fn, params, batch)
    plan = plan_buckets(loss_fn, params, batch, allow_unused=True)
    expected = observed_order(loss_fn, params, batch)
    assert "head2.weight" not in expected
    assert [n for b in plan.buckets if not b.unused for n in b.names] == expected
    assert plan.buckets[-1].unused and plan.buckets[-1].names == ("head2.weight", "head2.bias")
    assert "(unused)" in str(plan).splitlines()[-2]


def test_loss_with_aux_is_accepted():
    model, params, buffers = functionalize(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)))

    def loss_and_aux(p, x):
        out, new_buffers = model.apply(p, buffers, x)
        return out.square().mean(), {"buffers": new_buffers, "out": out}

    x = torch.randn(2, 3)
    expected = observed_order(loss_and_aux, params, x)
    assert gradient_ready_order(loss_and_aux, params, x) == expected
    assert list(plan_buckets(loss_and_aux, params, x).names) == expected


def test_batchnorm_buffers_not_planned_and_model_still_trains():
    module = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    model, params, buffers = functionalize(module)
    loss_fn = model_loss(model, buffers)
    batch = (torch.randn(5, 4), torch.randn(5, 2))
    # The loss captures real buffers, so the meta trace fails and the real one is used.
    with pytest.raises(RuntimeError):
        gradient_ready_order(loss_fn, params, batch, trace="meta")
    plan = plan_buckets(loss_fn, params, batch)
    assert list(plan.names) == observed_order(loss_fn, params, batch)
    assert not set(plan.names) & set(buffers)
    assert set(plan.names) == set(params)
    out, new_buffers = model.apply(params, buffers, batch[0])
    assert out.shape == (5, 2)
    assert not torch.equal(new_buffers["1.running_mean"], buffers["1.running_mean"])


def test_transformer_layer_meta_trace_matches_real_backward():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    module = nn.Sequential(nn.Linear(8, 16), layer, nn.Linear(16, 4))
    model, params, buffers = functionalize(module)

    def loss_fn(p, batch):
        x, y = batch
        out, _ = model.apply(p, buffers, x)
        return nn.functional.mse_loss(out, y), out

    batch = (torch.randn(2, 5, 8), torch.randn(2, 5, 4))
    expected = observed_order(loss_fn, params, batch)
    assert sorted(expected) == sorted(params)
    assert gradient_ready_order(loss_fn, params, batch, trace="meta") == expected  # meta path supported
    assert gradient_ready_order(loss_fn, params, batch, trace="real") == expected
    plan = plan_buckets(loss_fn, params, batch, bucket_cap_mb=0.01, first_bucket_cap_mb=0.002)
    assert list(plan.names) == expected
    assert len(plan) > 1


def test_failed_meta_trace_falls_back_to_the_real_batch():
    params = {"a": torch.randn(3), "b": torch.randn(3)}

    def loss_fn(p, x):
        # Data-dependent control flow: impossible on meta tensors.
        first = p["a"] if bool((x > 0).all()) else p["b"]
        return (first * p["b"] * x).sum()

    x = torch.ones(3)
    with pytest.raises(Exception):
        gradient_ready_order(loss_fn, params, x, trace="meta")
    assert gradient_ready_order(loss_fn, params, x) == observed_order(loss_fn, params, x)


def test_trace_argument_is_checked():
    with pytest.raises(ValueError, match="trace='gpu'"):
        gradient_ready_order(lambda p, x: p["w"].sum(), {"w": torch.ones(1)}, None, trace="gpu")
