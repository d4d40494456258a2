"""The parts of a rank's memory and of what a step sends, one small pure function each, from the static plan and
the optimizer's and hooks' state made on ``meta`` (the sizes without the memory); ``fdp.run.memory.forecast`` adds
them up phase by phase.

>>> from fdp.plan import pack_into_buckets
>>> plan = pack_into_buckets([("w", (1000, 1000), "float32", "cpu")])
>>> params_bytes(plan, stage=3, world=3) * 3 - plan.nbytes  # the padding of the last slice: 2 elements
8
"""

from __future__ import annotations

from typing import Any

import torch

from fdp._torch import tree_flatten
from fdp.hooks import Hook
from fdp.optim import GradientTransformation, supports_inplace
from fdp.plan import BucketPlan
from fdp.step.reduce import reduces_each_micro_batch
from fdp.update.pieces import state_pieces
from fdp.update.zero.layout import slice_key, slice_numel, slice_range

# A sharded step's verdict: one all-reduce of two float32 values, the finite flag and the slices' squared gradient
# norm (fdp.update.zero.slice_step), from stage 2 where each rank sees its slices alone.
VERDICT_BYTES = 8


def slice_bytes(plan: BucketPlan, world: int) -> int:
    """Bytes of one rank's slices of every bucket (``1/world`` of each, the last ones padded).

    >>> from fdp.plan import pack_into_buckets
    >>> slice_bytes(pack_into_buckets([("w", (5,), "float32", "cpu")]), world=2)  # 3 of the 6 padded elements
    12
    """
    return sum(slice_numel(b, world) * b.torch_dtype.itemsize for b in plan.buckets)


def params_bytes(plan: BucketPlan, stage: int, world: int) -> int:
    """Bytes of params a rank holds between steps: the whole params, or at stage 3 its slices.

    >>> from fdp.plan import pack_into_buckets
    >>> params_bytes(pack_into_buckets([("w", (5,), "float32", "cpu")]), stage=0, world=2)
    20
    """
    return slice_bytes(plan, world) if stage == 3 else plan.nbytes


def tree_bytes(tree: Any) -> int:
    """Bytes of the tensors of a pytree (``meta`` tensors count their size), each storage once.

    >>> tree_bytes({"a": torch.ones(3), "b": (torch.empty(2, device="meta"), 1.0)})
    20
    """
    seen: dict[Any, int] = {}
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            seen[leaf.untyped_storage()._cdata] = leaf.untyped_storage().nbytes()
    return sum(seen.values())


def _meta_params(plan: BucketPlan, stage: int, world: int) -> dict[str, torch.Tensor]:
    """What the optimizer steps on a rank, on ``meta``: the params whole, or one flat slice per bucket."""
    if stage == 0:
        return {s.name: torch.empty(s.shape, dtype=b.torch_dtype, device="meta") for b in plan.buckets for s in b.slots}
    return {
        slice_key(b.index): torch.empty(slice_numel(b, world), dtype=b.torch_dtype, device="meta") for b in plan.buckets
    }


def optimizer_state_bytes(optimizer: GradientTransformation, plan: BucketPlan, stage: int, world: int) -> int:
    """Bytes of the optimizer state a rank holds: of the whole params at stage 0, of its slices from stage 1.

    >>> from fdp import sgd
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (10,), "float32", "cpu")])
    >>> optimizer_state_bytes(sgd(0.1, momentum=0.9), plan, stage=0, world=4)  # one momentum per param
    40
    >>> optimizer_state_bytes(sgd(0.1, momentum=0.9), plan, stage=1, world=4)  # of 3 of the 12 padded
    12
    """
    return tree_bytes(optimizer.init(_meta_params(plan, stage, world)))


def _meta_hook_states(hook: Hook, plan: BucketPlan) -> tuple:
    """The hook chain's state for every bucket, made on ``meta`` (the sizes without the memory)."""
    meta = plan.to_dict()
    meta = BucketPlan.from_dict({**meta, "buckets": [{**b, "device": "meta"} for b in meta["buckets"]]})
    return tuple(hook.init(b) for b in meta.buckets)


def hook_state_bytes(hook: Hook, plan: BucketPlan) -> int:
    """Bytes of the hook chain's state over every bucket (PowerSGD's factors, error feedback), made on ``meta``.

    >>> from fdp.hooks import allreduce, int8
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (10,), "float32", "cpu")])
    >>> hook_state_bytes(allreduce(), plan), hook_state_bytes(int8(), plan)  # int8 keeps its rounding error
    (0, 40)
    """
    return tree_bytes(_meta_hook_states(hook, plan))


def grad_buffer_bytes(plan: BucketPlan, stage: int, held: bool) -> int:
    """Bytes of gradient bucket buffers: kept between steps at stages 0 and 1 (``held``); during a step the
    whole gradient at stages 0-2, and at stage 3 the buckets backward fills at once (two of the largest).

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("a", (8,), "float32", "cpu"), ("b", (4,), "float32", "cpu")], 1e-5, 1e-5)
    >>> [grad_buffer_bytes(plan, s, held=True) for s in range(4)], grad_buffer_bytes(plan, 3, held=False)
    ([48, 48, 0, 0], 48)
    """
    if held:
        return plan.nbytes if stage < 2 else 0
    if stage < 3:
        return plan.nbytes
    return sum(sorted((b.nbytes for b in plan.buckets), reverse=True)[:2])


def reduces_each(hook: Hook, plan: BucketPlan) -> bool:
    """Whether ZeRO stage 3 reduces each micro-batch's buckets as they fill
    (``fdp.step.reduce.reduces_each_micro_batch`` on the hook chain's state, made on ``meta``): a chain that keeps no
    state; one that does (PowerSGD, top-k, low-bit codes) has the buckets accumulate whole and reduces them once a
    step.

    >>> from fdp.hooks import allreduce, powersgd
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (10,), "float32", "cpu")])
    >>> reduces_each(allreduce(), plan), reduces_each(powersgd(), plan)
    (True, False)
    """
    return reduces_each_micro_batch(_meta_hook_states(hook, plan))


def accumulated_grad_bytes(plan: BucketPlan, stage: int, world: int, accum: int, hook: Hook) -> int:
    """Bytes a step of ``accum`` micro-batches holds for its gradients beyond one micro-batch's buckets: at stage 3
    this rank's slices summed over the micro-batches (each reduce-scattered as its buckets fill), or with a hook
    chain that keeps state (``reduces_each``) the whole buckets and a micro-batch's whole gradients added into them;
    nothing at stages 0-2 (``grad_buffer_bytes`` counts their whole buckets).

    >>> from fdp.hooks import allreduce, powersgd
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (10,), "float32", "cpu")])
    >>> [accumulated_grad_bytes(plan, 3, 2, accum, allreduce()) for accum in (1, 4)]
    [0, 20]
    >>> accumulated_grad_bytes(plan, 3, 2, 4, powersgd()), accumulated_grad_bytes(plan, 2, 2, 4, allreduce())
    (80, 0)
    """
    if stage < 3 or accum == 1:
        return 0
    return slice_bytes(plan, world) if reduces_each(hook, plan) else 2 * plan.nbytes


def steps_in_place(optimizer: GradientTransformation, plan: BucketPlan) -> bool:
    """Whether the update steps each bucket's params in place with torch's fused kernels as its gradient is reduced
    (``fdp.optim.supports_inplace`` on the plan's dtypes and devices): no temporaries beside the state.

    >>> from fdp import sgd
    >>> from fdp.optim import chain
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (10,), "float32", "cpu")])
    >>> steps_in_place(sgd(0.1), plan) == supports_inplace(sgd(0.1), {"w": torch.zeros(1)})
    True
    """
    params = {str(b.index): torch.empty(0, dtype=b.torch_dtype, device=b.device) for b in plan.buckets}
    return optimizer.elementwise and supports_inplace(optimizer, params)


def update_temporaries(optimizer: GradientTransformation, plan: BucketPlan, stage: int, state: int) -> int:
    """Bytes the update makes beside what a rank holds (``state``: the optimizer state's bytes it holds). Stepped
    in place by torch's fused kernels (``steps_in_place``), nothing at stage 0 (measured on one rank: the MLP's
    update stayed under its backward's peak); else the optimizer's elementwise temporaries, about its state's size,
    or the params' where larger (at stage 0 the first step lays them out in their buckets). At stages 1-2 the new
    whole params are gathered while the old ones are held too (MLP at stage 1 on 2 ranks: 23 MiB over what is held,
    gloo's 8.3, Adam's slices' 8.3 and the params' 8.3).

    >>> from fdp import sgd
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (10,), "float32", "cpu")])
    >>> fused = steps_in_place(sgd(0.1), plan)
    >>> update_temporaries(sgd(0.1, momentum=0.9), plan, stage=0, state=40) == (0 if fused else 40)
    True
    >>> update_temporaries(sgd(0.1, momentum=0.9), plan, stage=1, state=20)  # its momentum's slice, the params
    60
    """
    if stage == 0:
        return 0 if steps_in_place(optimizer, plan) else max(state, plan.nbytes)
    return state if stage == 3 else state + plan.nbytes


def gathers_in_flight(plan: BucketPlan, world: int, itemsize: int | None = None, reshard: bool = True) -> int:
    """Bytes of params stage 3 holds gathered at once: the bucket being read and the next one, issued with it
    (``reshard=False`` keeps every bucket from forward to its gradient: the whole params).

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("a", (8,), "float32", "cpu"), ("b", (4,), "float32", "cpu")], 1e-5, 1e-5)
    >>> gathers_in_flight(plan, world=3)  # 9 + 6 padded elements
    60
    """
    sizes = [slice_numel(b, world) * world * (itemsize or b.torch_dtype.itemsize) for b in plan.buckets]
    return sum(sizes) if not reshard else sum(sorted(sizes, reverse=True)[:2])


def piece_bytes(
    optimizer: GradientTransformation, plan: BucketPlan, stage: int, world: int, rank: int, shards=0
) -> int:
    """Bytes of the pieces ``rank`` writes to a sharded checkpoint (``fdp.update.pieces``, on ``meta``): its range of
    each whole tensor, its part of each slice (``shards``: the ranks a slice is cut over, else ``world``), every leaf
    of no parameter whole. An asynchronous save stages each piece in a buffer of its own, kept from save to save
    (``fdp.run.checkpoint.staging``); a synchronous one has DCP copy each piece, a view of a larger storage, as it
    writes.

    >>> from fdp import adam
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (5, 3), "float32", "cpu")])
    >>> [piece_bytes(adam(0.1), plan, stage=1, world=2, rank=r) for r in (0, 1)]  # 8 + 7 params, 2 x 8 + 2 x 7
    [96, 84]
    """
    shards = shards or world
    params = _meta_params(plan, 3 if stage == 3 else 0, shards)
    tree = {"params": params, "opt_state": optimizer.init(_meta_params(plan, stage, shards))}
    sliced = (lambda i: slice_range(plan.buckets[i], rank % shards, shards)) if stage else None
    tensors, _ = state_pieces(tree, plan, rank, world, sliced)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def step_bytes_sent(
    plan: BucketPlan,
    stage: int,
    world: int,
    ratio: float = 1.0,
    gather_itemsize: int | None = None,
    reshard: bool = True,
    accum: int = 1,
    each: bool = True,
) -> int:
    """Bytes a rank sends per step of ``accum`` micro-batches (the payload it hands each collective, as
    ``fdp.comm.Comm`` counts it), from the second step on (the first also gathers stage 3's buckets once, to learn
    where):

    * every bucket reduced (``ratio``: the hook's compression), once a step; at stage 3, with a hook chain that keeps
      no state (``each``: ``reduces_each``), once a micro-batch. From stage 2 a reduction hands each rank its slice:
      NCCL reduce-scatters the bucket zero-padded to the slices, gloo all-reduces it as it is (a plan on the CPU);
    * from stage 1 the rank's slices gathered: once a step after the update at stages 1-2; at stage 3 in each
      micro-batch's forward and again in its backward (``reshard``), or with ``each`` false in the first forward and
      in every backward, a backward's gathers kept into the next micro-batch's forward; without ``reshard``, in each
      micro-batch's forward, or with ``each`` false once, kept to the step's end;
    * from stage 2 the verdict's one all-reduce of the finite flag and the slices' squared norm (``VERDICT_BYTES``).

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (10,), "float32", "cpu")])
    >>> [step_bytes_sent(plan, s, world=2) for s in range(4)]
    [40, 60, 68, 88]
    >>> [step_bytes_sent(plan, 3, world=2, accum=2, each=each) for each in (True, False)]
    [168, 108]
    >>> [step_bytes_sent(pack_into_buckets([("w", (5,), "float32", d)]), 2, world=2) for d in ("cpu", "cuda")]
    [40, 44]
    """
    if world == 1:
        return 0
    per_micro_batch = stage == 3 and each
    padded = stage >= 2 and plan.buckets[0].device != "cpu"
    bucket_bytes = slice_bytes(plan, world) * world if padded else plan.nbytes
    reduced = int(bucket_bytes * ratio) * (accum if per_micro_batch else 1)
    if stage == 0:
        return reduced
    slices = sum(slice_numel(b, world) * (gather_itemsize or b.torch_dtype.itemsize) for b in plan.buckets)
    if stage < 3:
        gathers = 1
    elif not reshard:
        gathers = accum if per_micro_batch else 1
    else:
        gathers = 2 * accum if per_micro_batch else accum + 1
    return reduced + slices * gathers + (VERDICT_BYTES if stage >= 2 else 0)
