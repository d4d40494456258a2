"""Flat bucket buffers: pack/unpack round trips, zero-copy views, reuse, errors."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fdp.model.functional import functionalize
from fdp.plan import pack_into_buckets, plan_buckets
from fdp.plan.buckets import allocate, allocate_released, pack, regrow, slot_views, unpack

torch.set_num_threads(1)

MiB = 2**20
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@st.composite
def plans_and_grads(draw):
    n = draw(st.integers(1, 20))
    specs = [
        (f"m{i}.p", tuple(draw(st.lists(st.integers(0, 5), max_size=3))), draw(st.sampled_from(sorted(DTYPES))), "cpu")
        for i in range(n)
    ]
    n_unused = draw(st.integers(0, min(3, n - 1)))
    cap = draw(st.integers(1, 300)) / MiB
    plan = pack_into_buckets(specs[n_unused:], cap, cap / 2, unused=specs[:n_unused])
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    grads = {
        name: torch.randn(shape, generator=gen, dtype=torch.float64).to(DTYPES[dtype])
        for name, shape, dtype, _ in specs[n_unused:]
    }
    return plan, grads, [s[0] for s in specs[:n_unused]]


def storage_range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


@SETTINGS
@given(case=plans_and_grads())
def test_pack_then_unpack_is_identity_and_zero_copy(case):
    plan, grads, unused = case
    flats = allocate(plan)
    assert [f.dtype for f in flats] == [b.torch_dtype for b in plan.buckets]
    assert [f.numel() for f in flats] == [b.numel for b in plan.buckets]
    assert all(bool((f == 0).all()) for f in flats)
    for f in flats:  # dirty buffers: unused slots must still come back as zeros
        f.fill_(7)
    ptrs = [f.data_ptr() for f in flats]
    packed = pack(plan, grads, flats)
    assert all(p is f for p, f in zip(packed, flats))  # in place, same buffers
    assert [f.data_ptr() for f in flats] == ptrs
    out = unpack(plan, flats)
    assert list(out) == list(plan.names)  # plan order
    for name, g in grads.items():
        assert out[name].dtype == g.dtype and torch.equal(out[name], g)
    for name in unused:
        assert out[name].shape == plan.slot(name)[1].shape
        assert bool((out[name] == 0).all())
    for name, view in out.items():
        b, slot = plan.slot(name)
        lo, hi = storage_range(flats[b])
        assert view.shape == slot.shape
        if view.numel():  # an empty tensor reports data_ptr 0: nothing to share
            # Zero copy: the view lives inside its bucket buffer, at its slot's offset.
            assert view.data_ptr() == lo + slot.offset * flats[b].element_size()
            assert view.data_ptr() + view.numel() * view.element_size() <= hi
            flats[b][slot.offset] = 3.0
            assert view.reshape(-1)[0].item() == 3.0
    # Packing again reuses the buffers and overwrites the old values.
    doubled = {n: g * 2 for n, g in grads.items()}
    pack(plan, doubled, flats)
    for name, g in doubled.items():
        assert torch.equal(out[name], g)  # the old views see the new step


def test_pack_hand_computed_layout():
    plan = pack_into_buckets(
        [("b", (2,), "float32", "cpu"), ("w", (2, 2), "float32", "cpu"), ("h", (3,), "float16", "cpu")],
        unused=[("u", (2,), "float32", "cpu")],
    )
    flats = allocate(plan)
    grads = {
        "b": torch.tensor([1.0, 2.0]),
        "w": torch.tensor([[3.0, 4.0], [5.0, 6.0]]),
        "h": torch.tensor([7.0, 8.0, 9.0]),
    }
    pack(plan, grads, flats)
    assert [f.tolist() for f in flats] == [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [0.0, 0.0]]


def test_non_contiguous_and_expanded_grads_pack_correctly():
    plan = pack_into_buckets([("w", (3, 2), "float32", "cpu"), ("e", (2, 3), "float32", "cpu")])
    w = torch.arange(6.0).reshape(2, 3).t()  # transposed view
    e = torch.tensor([1.0, 2.0, 3.0]).expand(2, 3)  # stride-0 broadcast view
    flats = pack(plan, {"w": w, "e": e}, allocate(plan))
    assert flats[0].tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0]


def test_pack_rejects_unknown_names_and_wrong_shapes():
    plan = pack_into_buckets([("a", (2, 3), "float32", "cpu"), ("b", (4,), "float32", "cpu")])
    flats = allocate(plan)
    with pytest.raises(KeyError, match="'zzz'"):
        pack(plan, {"a": torch.ones(2, 3), "b": torch.ones(4), "zzz": torch.ones(1)}, flats)
    with pytest.raises(ValueError, match=r"'a' has shape \(3,\)"):
        pack(plan, {"a": torch.ones(3), "b": torch.ones(4)}, flats)  # would broadcast if unchecked
    with pytest.raises(ValueError, match=r"'b' has shape \(2, 2\)"):
        pack(plan, {"b": torch.ones(2, 2)}, flats)  # partial bucket path
    with pytest.raises(ValueError, match="2 buffers for a plan of 1 buckets"):
        pack(plan, {}, flats + flats)
    with pytest.raises(ValueError, match="dtype"):
        unpack(plan, (torch.zeros(10, dtype=torch.float64),))
    with pytest.raises(ValueError, match="10 elements"):
        unpack(plan, (torch.zeros(11),))
    with pytest.raises(ValueError, match="contiguous"):
        unpack(plan, (torch.zeros(20)[::2],))


def test_same_buffer_with_another_plan_uses_the_new_layout():
    # Both plans have one 6-element bucket: a stale cached layout would scramble values.
    p1 = pack_into_buckets([("x", (2,), "float32", "cpu"), ("y", (4,), "float32", "cpu")])
    p2 = pack_into_buckets([("y", (4,), "float32", "cpu"), ("x", (2,), "float32", "cpu")])
    flats = allocate(p1)
    g = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([3.0, 4.0, 5.0, 6.0])}
    assert pack(p1, g, flats)[0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert pack(p2, g, flats)[0].tolist() == [3.0, 4.0, 5.0, 6.0, 1.0, 2.0]


def test_buffers_that_are_slices_of_a_larger_tensor():
    plan = pack_into_buckets([("x", (2,), "float32", "cpu"), ("y", (2, 2), "float32", "cpu")])
    arena = torch.zeros(10)
    flats = (arena[3:9],)
    g = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([[3.0, 4.0], [5.0, 6.0]])}
    pack(plan, g, flats)
    assert arena.tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 0]
    assert torch.equal(unpack(plan, flats)["y"], g["y"])


def test_pack_does_not_keep_buffers_alive():
    plan = pack_into_buckets([("x", (1000,), "float32", "cpu")])
    flats = allocate(plan)
    pack(plan, {"x": torch.ones(1000)}, flats)
    ref = weakref.ref(flats[0])
    del flats
    gc.collect()
    assert ref() is None


def test_slot_views_match_unpack():
    plan = pack_into_buckets([(f"t{i}", (i, 2), "float16", "cpu") for i in range(1, 5)], 24 / MiB, 8 / MiB)
    assert len(plan) > 1
    flats = tuple(torch.arange(b.numel, dtype=torch.float16) for b in plan.buckets)
    everything = unpack(plan, flats)
    for bucket, flat in zip(plan.buckets, flats):
        views = slot_views(bucket, flat)
        assert list(views) == list(bucket.names)
        for name, v in views.items():
            slot = plan.slot(name)[1]
            expected = torch.arange(slot.offset, slot.stop, dtype=torch.float16).reshape(slot.shape)
            assert torch.equal(v, expected) and v.data_ptr() == everything[name].data_ptr()


def test_real_model_grads_round_trip_through_buffers():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3))
    model, params, buffers = functionalize(module)

    def loss_fn(p, batch):
        out, _ = model.apply(p, buffers, batch[0])
        return nn.functional.cross_entropy(out, batch[1])

    batch = (torch.randn(6, 5), torch.randint(0, 3, (6,)))
    plan = plan_buckets(loss_fn, params, batch, bucket_cap_mb=100 / MiB, first_bucket_cap_mb=50 / MiB)
    grads = torch.func.grad(loss_fn)(params, batch)
    flats = pack(plan, grads, allocate(plan))
    assert sum(f.numel() for f in flats) == sum(math.prod(p.shape) for p in params.values())
    out = unpack(plan, flats)
    assert out.keys() == grads.keys()
    for name in grads:
        assert torch.equal(out[name], grads[name])


def test_lay_out_keeps_names_order_and_values_in_one_buffer_per_bucket():
    from fdp.plan.buckets import flat_buffers, lay_out

    plan = pack_into_buckets(
        [("b", (3,), "float32", "cpu"), ("w", (2, 3), "float32", "cpu"), ("s", (), "float32", "cpu")],
        bucket_cap_mb=1e-5,
        first_bucket_cap_mb=1e-5,
    )
    params = {"w": torch.arange(6.0).reshape(2, 3), "s": torch.tensor(7.0), "b": torch.tensor([1.0, 2.0, 3.0])}
    laid = lay_out(plan, params)
    assert list(laid) == list(params) and all(torch.equal(laid[n], params[n]) for n in params)
    flats = flat_buffers(plan, laid)
    assert len(flats) == len(plan.buckets) > 1
    for bucket, flat in zip(plan.buckets, flats):
        assert flat.numel() == bucket.numel
        for slot in bucket.slots:  # each param is its slot of the bucket's buffer
            assert laid[slot.name].data_ptr() == flat.data_ptr() + slot.offset * 4
    flats[0].add_(1.0)  # the buffers are the params' memory
    assert torch.equal(laid[plan.buckets[0].slots[0].name], params[plan.buckets[0].slots[0].name] + 1)


def test_flat_buffers_refuse_params_not_laid_out_as_the_plan_says():
    from fdp.plan.buckets import flat_buffers, lay_out

    plan = pack_into_buckets([("a", (2,), "float32", "cpu"), ("b", (2, 2), "float32", "cpu")])
    laid = lay_out(plan, {"a": torch.ones(2), "b": torch.ones(2, 2)})
    assert flat_buffers(plan, laid) is not None
    assert flat_buffers(plan, {"a": torch.ones(2), "b": torch.ones(2, 2)}) is None  # separate tensors
    assert flat_buffers(plan, {**laid, "b": laid["b"].t()}) is None  # the right memory, not contiguous
    assert flat_buffers(plan, {"a": laid["b"].reshape(-1)[:2], "b": laid["b"]}) is None  # another offset
    assert flat_buffers(plan, {k: v.double() for k, v in laid.items()}) is None


def test_views_in_split_a_bucket_and_their_gradient_is_the_flat_one():
    from fdp.plan.buckets import views_in

    plan = pack_into_buckets(
        [("b", (2,), "float32", "cpu"), ("w", (2, 3), "float32", "cpu"), ("s", (), "float32", "cpu")]
    )
    flat = torch.arange(9.0, requires_grad=True)
    views = dict(zip(plan.buckets[0].names, views_in(plan.buckets[0], flat)))
    assert {n: tuple(v.shape) for n, v in views.items()} == {"b": (2,), "w": (2, 3), "s": ()}
    (views["w"].sum() * 2 + views["s"] * 3).backward()  # "b" unused: zeros in its slot
    order = [s.name for s in plan.buckets[0].slots]
    expected = torch.cat(
        [{"b": torch.zeros(2), "w": torch.full((6,), 2.0), "s": torch.tensor([3.0])}[n] for n in order]
    )
    assert torch.equal(flat.grad, expected)


def test_released_buffers_are_made_one_at_a_time_and_their_views_see_the_memory_given_back():
    plan = pack_into_buckets(
        [("a", (300,), "float32", "cpu"), ("b", (2, 150), "float32", "cpu"), ("c", (300,), "float32", "cpu")],
        bucket_cap_mb=300 * 4 / 2**20,
        first_bucket_cap_mb=300 * 4 / 2**20,
    )
    assert len(plan.buckets) == 3
    made: list[torch.Tensor] = []

    def views(bucket, buffer):  # every buffer made before this one already released
        assert [m.untyped_storage().nbytes() for m in made] == [0] * len(made)
        made.append(buffer)
        return slot_views(bucket, buffer)

    flats, parts = allocate_released(plan, views)
    assert [f.untyped_storage().nbytes() for f in flats] == [0, 0, 0]
    by_name = {name: view for part in parts for name, view in part.items()}
    for flat in flats:
        regrow(flat)
        flat.copy_(torch.arange(flat.numel(), dtype=flat.dtype))
    assert by_name["b"].shape == (2, 150) and torch.equal(by_name["b"].reshape(-1), torch.arange(300.0))
