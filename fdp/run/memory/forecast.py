"""Before a run: the memory each rank will need, by part and phase, and the bytes each step sends.

Everything here follows from the static plan (every bucket, slice and gather is known
before step 1), the optimizer's and hooks' state made on ``meta`` (the sizes without the
memory), and the activations a forward keeps, counted on a tiny trace of one and two
samples and scaled to the micro-batch (``fdp.model.activations``). Each part is a small
pure function of those values (``fdp.run.memory.parts``); ``forecast`` adds them up phase by phase:

* ``build``: building the model and its train state (stages 0-2 make the whole params
  and lay them out, stage 3 only its slices and one parameter);
* ``step``: forward and backward of one micro-batch, with what the rank holds between steps,
  its gradient buffers and, at stage 3, the buckets gathered in flight;
* ``update``: the optimizer's step over the reduced gradients, bucket by bucket;
* ``save``: a checkpoint, as its format writes it (``fdp.run.checkpoint.CheckpointFormat``: a sharded save copies
  the rank's pieces: an asynchronous one keeps the copy for the run, so the steps after a save and the evaluation
  after the last hold it too; a whole-file save at a sharding stage gathers the whole state on rank 0).

``fixed`` is what a rank process adds at its first gradient whatever the model
(torch's first meta and autograd operations, the process group's threads and buffers,
the allocator's caches): measured by ``first_use_mib`` in the forecasting process.
The peak is over what the process held once it had loaded its data (what
``world.memory_per_rank_mb`` counts); ``recipes/plan.py`` prints it, and a run prints it at
start and its own measured peak in its summary.

>>> MiB
1048576
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fdp.hooks import Hook
from fdp.optim import GradientTransformation
from fdp.plan import BucketPlan
from fdp.procs.allocator import release_free_memory, resident_mib
from fdp.run.checkpoint.format import CheckpointFormat
from fdp.run.memory.parts import (
    accumulated_grad_bytes,
    gathers_in_flight,
    grad_buffer_bytes,
    hook_state_bytes,
    optimizer_state_bytes,
    params_bytes,
    piece_bytes,
    reduces_each,
    slice_bytes,
    step_bytes_sent,
    tree_bytes,
    update_temporaries,
)

__all__ = [
    "MiB",
    "Forecast",
    "Terms",
    "forecast",
    "first_use_mib",
    "built_mib",
    "largest_micro_batch",
    "phase_peaks",
]

MiB = 2**20
PHASES = ("build", "step", "update", "save")
# A recomputed block holds, while backward passes it, its own saves made again and, its graph kept for the pullback,
# the gradients its backward makes beside them (traced on the CPU, VmHWM read at each block, benchmarks/results/
# forecast.md: the char transformer at stage 0 on 2 ranks made 16.1 MiB again and 9.2 more in its backward, 1.6 x
# the traced 16.0; on 4 ranks at stage 3, 8.1 and 5.5, 1.7 x; GPT-2 at stage 3, 36 and 24.8, 2.0 x a traced 30).
RECOMPUTE_FACTOR = 2


# -- adding them up ---------------------------------------------------------------------------
class Terms(NamedTuple):
    """What a forecast is made of (bytes), for one rank at one stage."""

    params: int
    grads_held: int
    grads_step: int
    optimizer: int
    hooks: int
    extra_state: int  # an outer loop's anchor and momentum, the params' moving average
    gathers: int
    staging: int
    activations: int
    largest_activation: int
    recomputed: int
    fixed: int
    build_params: int  # what a build makes at once beyond the state it keeps (the whole params at stages 0-2)
    collectives: int  # gloo's own buffers for the buckets a step reduces (CPU worlds of more than one rank, stage 1 on)
    update: int  # the optimizer's temporaries over one bucket
    grads_made: int = 0  # gradients backward returns beside the buckets (autograd's own, at stages 0-2)
    staging_kept: int = 0  # an asynchronous save's copy, held by the steps after a save made before the run's end
    after_save: int = 0  # what a forward adds after a save whose copy it keeps (evaluation or steps)


class Forecast(NamedTuple):
    """The memory one rank needs by part and phase (bytes), and the bytes it sends per step."""

    rank: int
    stage: int
    terms: Terms
    phases: dict[str, int]
    bytes_sent: dict[str, int]

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def parts(self) -> dict[str, float]:
        """The parts in MiB, by the names ``recipes/plan.py`` prints."""
        t = self.terms
        named = {
            "fixed per process": t.fixed,
            "params" + (" (slices)" if self.stage == 3 else ""): t.params,
            "gradient buckets (held)": t.grads_held,
            "gradient buckets (in a step)": t.grads_step,
            "optimizer state" + (" (slices)" if self.stage else ""): t.optimizer,
            "hook state": t.hooks,
            "outer loop / moving average": t.extra_state,
            "gathers in flight": t.gathers,
            "collective buffers": t.collectives,
            "checkpoint staging": t.staging,
            "activations (micro-batch)": t.activations,
        }
        return {name: round(value / MiB, 2) for name, value in named.items()}

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "stage": self.stage,
            "peak_mib": round(self.peak / MiB, 2),
            "phase": self.phase,
            "phases_mib": {k: round(v / MiB, 2) for k, v in self.phases.items()},
            "parts_mib": self.parts(),
            "bytes_sent": self.bytes_sent,
        }


def phase_peaks(t: Terms) -> dict[str, int]:
    """Each phase's peak (bytes over the loaded process) from the terms.

    >>> t = Terms(100, 100, 100, 200, 0, 0, 0, 0, 50, 10, 0, 7, 100, 0, 20)
    >>> phase_peaks(t)
    {'build': 507, 'step': 467, 'update': 427, 'save': 407}
    >>> phase_peaks(t._replace(staging=60, staging_kept=60, after_save=20))  # an asynchronous copy, kept
    {'build': 507, 'step': 527, 'update': 487, 'save': 487}
    """
    held = t.params + t.grads_held + t.optimizer + t.hooks + t.extra_state + t.fixed
    in_step = t.collectives
    # Backward starts from the kept activations and the gradient of the largest one (with a recomputed block's saves
    # and their gradients); as it goes on it frees them while it fills the gradient buffers not held between steps
    # (stage 2's, stage 3's buckets in flight) or the gradients it returns: the larger of the two.
    activations = t.activations + t.largest_activation + RECOMPUTE_FACTOR * t.recomputed
    filled = max(0, t.grads_step - t.grads_held) + t.grads_made + t.largest_activation
    step = held + t.staging_kept + in_step + t.gathers + max(activations, filled)
    update = held + t.staging_kept + in_step + max(0, t.grads_step - t.grads_held) + t.update
    # A save follows a step, whose blocks are handed back as they are freed (under a budget, every block from 64 KiB:
    # fdp.procs.allocator.budget_accounting), so it starts from what is held between steps; an asynchronous save's
    # copy stays while what follows it runs (the evaluation at the run's end, a forward of two activations at once).
    save = held + t.staging + t.after_save
    return {"build": held + t.build_params, "step": step, "update": update, "save": save}


def forecast(
    plan: BucketPlan,
    optimizer: GradientTransformation,
    hook: Hook,
    activations,
    *,
    stage: int,
    world: int,
    rank: int = 0,
    fixed: int = 0,
    extra_state: int = 0,
    saving: CheckpointFormat = CheckpointFormat("whole", asynchronous=False),
    gather_itemsize: int | None = None,
    reshard: bool = True,
    hook_ratio: float = 1.0,
    node_size: int = 0,
    outer: bool = False,
    saves_mid_run: bool = True,
    accum: int = 1,
) -> Forecast:
    """One rank's forecast at ``stage`` over ``world`` ranks; ``activations``: an ``fdp.model.activations``
    ``Activations`` for the micro-batch; ``extra_state``: bytes of state beyond params and optimizer (outer loop,
    moving average) for the whole params, sharded with the pieces a rank syncs; ``saving``: how the run writes its
    checkpoints (``fdp.run.checkpoint.format_of``); ``node_size``: a node's ranks under ``world.hierarchical`` (0:
    flat), over which a ZeRO stage shards (hybrid sharding); ``saves_mid_run``: whether steps follow a save (an
    asynchronous save's copy is then held by them); ``accum``: micro-batches per step.

    >>> from fdp import sgd
    >>> from fdp.hooks import allreduce
    >>> from fdp.model.activations import Activations
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (1024, 1024), "float32", "cpu")])
    >>> [forecast(plan, sgd(0.1, momentum=0.9), allreduce(), Activations(0, 0), stage=s, world=4, rank=1).peak // MiB
    ...  for s in range(4)]
    [16, 18, 18, 14]
    """
    # Hybrid sharding (world.hierarchical=true with a ZeRO stage) splits each bucket over a node's ranks, not the world.
    hybrid = bool(node_size) and world > node_size and stage > 0
    shards = node_size if hybrid else world
    params = params_bytes(plan, stage, shards)
    share = slice_bytes(plan, shards)
    opt = optimizer_state_bytes(optimizer, plan, stage, shards)
    whole_opt = opt if stage == 0 else optimizer_state_bytes(optimizer, plan, 0, shards)
    # An outer loop's anchor and momentum (and the moving average that follows the anchor) are kept for the pieces a
    # rank syncs: its slices at stage 3, and under an outer loop over hybrid-sharded replicas at every ZeRO stage.
    sliced_extra = stage == 3 or (outer and stage > 0)
    extra = extra_state * share // plan.nbytes if sliced_extra else extra_state
    # What a sharded save writes: under an outer loop the rank's own params and optimizer state whole, and its piece
    # of what the ranks share (the anchor, the outer optimizer's state); else its pieces of the state.
    pieces = 0
    if saving.sharded:
        pieces = (
            params + opt + extra_state // world if outer else piece_bytes(optimizer, plan, stage, world, rank, shards)
        )
    staging = saving.save_bytes(pieces, plan.nbytes + whole_opt, rank, stage)
    kept = saving.keeps_staging  # the staging buffers stay from the first save to the run's end
    terms = Terms(
        params=params,
        grads_held=grad_buffer_bytes(plan, stage, held=True),
        grads_step=grad_buffer_bytes(plan, stage, held=False)
        + accumulated_grad_bytes(plan, stage, shards, accum, hook),
        optimizer=opt,
        hooks=hook_state_bytes(hook, plan),
        extra_state=extra,
        gathers=gathers_in_flight(plan, shards, gather_itemsize, reshard) if stage == 3 else 0,
        staging=staging,
        activations=activations.kept,
        largest_activation=activations.largest,
        recomputed=activations.recomputed,
        fixed=fixed,
        build_params=plan.nbytes if stage < 3 else max(s.numel for b in plan.buckets for s in b.slots) * 4,
        update=update_temporaries(optimizer, plan, stage, opt),
        # Measured on 2 CPU ranks: from stage 1, whose steps gather params as well, gloo holds about a bucket's size
        # of its own for each bucket it reduces in a step; at stage 3, which maps its buckets, each is handed back
        # once reduced: the largest one. Stage 0 only all-reduces, in the bucket itself (fdp.comm): nothing of gloo's
        # (the char transformer with checkpointed blocks on 2 ranks: its reduction ended 2 MiB over the step's start).
        collectives=(max(b.nbytes for b in plan.buckets) if stage == 3 else plan.nbytes)
        if world > 1 and stage > 0 and plan.buckets[0].device == "cpu"
        else 0,
        staging_kept=staging if kept and saves_mid_run else 0,
        # Below stage 3 the bucket hooks keep autograd's own gradients, which backward returns at its end (stage 3
        # puts a placeholder in their place).
        grads_made=plan.nbytes if stage < 3 else 0,
        after_save=2 * activations.largest if kept else 0,
    )
    each = stage == 3 and accum > 1 and reduces_each(hook, plan)
    links = _links(plan, stage, world, node_size, outer, hook_ratio, gather_itemsize, reshard, accum, each)
    return Forecast(rank, stage, terms, phase_peaks(terms), links)


def _links(
    plan: BucketPlan,
    stage: int,
    world: int,
    node_size: int,
    outer: bool,
    ratio: float,
    gather_itemsize: int | None,
    reshard: bool,
    accum: int = 1,
    each: bool = False,
) -> dict[str, int]:
    """Bytes a rank sends per step of ``accum`` micro-batches on each link: inside a node, across nodes
    (``world.hierarchical``), and per outer sync (``fdp.run.memory.parts.step_bytes_sent``; ``each``: stage 3
    reduces each micro-batch's buckets). Under hybrid sharding a step's reductions and gathers stay in the node, and
    only the rank's slice of each reduced bucket crosses (through the hook chain), as often as the bucket is reduced;
    its stage 1 reduces and checks as stage 2 does, each rank handed its slice. Under an outer loop over
    hybrid-sharded replicas nothing crosses in a step, and a sync sends the rank's slices, each with the ranks holding
    it in the other groups.

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (10,), "float32", "cpu")])
    >>> _links(plan, 3, 4, 2, False, 1.0, None, True, accum=2, each=True)  # 2 x (40 + 2 x 20) + 8; 2 x 20
    {'inside_node': 168, 'across_nodes': 40}
    """
    hierarchical = bool(node_size) and world > node_size
    if hierarchical and stage > 0:
        inside = step_bytes_sent(plan, max(stage, 2), node_size, 1.0, gather_itemsize, reshard, accum, each)
        slices = slice_bytes(plan, node_size)
        if outer:
            return {"inside_node": inside, "across_nodes": 0, "per_outer_sync": slices}
        return {"inside_node": inside, "across_nodes": int(slices * ratio) * (accum if each else 1)}
    sent = step_bytes_sent(plan, stage, world, ratio, gather_itemsize, reshard, accum, each)
    if outer:  # every rank a replica of its own: local steps send nothing; a sync averages the whole params
        return {"per_step": 0, "per_outer_sync": plan.nbytes if world > 1 else 0}
    if hierarchical:  # the node's sum inside, the leaders' chain across
        return {"inside_node": sent, "across_nodes": sent // node_size}
    return {"per_step": sent}


def largest_micro_batch(fits: Callable[[int], bool], most: int) -> int:
    """The largest micro-batch ``b <= most`` with ``fits(b)`` (forecasts grow with it), or 0.

    >>> largest_micro_batch(lambda b: b * 10 <= 75, most=64)
    7
    """
    low, high = 0, most
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def built_mib(before_mib: float, state: Any) -> float:
    """What building a run left resident beyond the state it made: the model's own code imported at its first
    build, the first forwards' one-time costs, the heap's blocks the build freed in pieces. Measured: resident memory
    now over ``before_mib`` (taken before the build), less the bytes of ``state`` (a ``TrainState``).

    >>> built_mib(resident_mib(), {"w": torch.ones(4)}) < 1
    True
    """
    held = tree_bytes([getattr(state, f, None) for f in ("params", "buffers", "opt_state", "hook_state", "outer")])
    if isinstance(state, dict):
        held = tree_bytes(state)
    return max(0.0, resident_mib() - before_mib - held / MiB)


def first_use_mib() -> float:
    """What this process's resident memory grows by at the first operations every rank makes whatever its model:
    a meta-device op, a ``torch.func`` gradient, a matmul large enough for MKL to keep its GEMM buffers. Call it
    once, before anything else runs them.

    MKL keeps 1.5 MiB after a first matmul of 128 x 128 by 128 x 2048 and its gradient (1 MiB each), and then none
    for the benchmarks' MLP and char transformer layers, whose first backward alone left 1.2-1.6 MiB for the run
    (measured): made here, they are counted, and a run meets them before its first step, not at its peak.

    >>> first_use_mib() >= 0
    True
    """
    before = resident_mib()
    x = torch.ones(8, 8, requires_grad=False)
    torch.empty(8, 8, device="meta").add_(1)
    torch.func.grad(lambda w: torch.nn.functional.linear(x, w).square().sum())(torch.ones(8, 8))
    wide = torch.ones(128, 128)
    torch.func.grad(lambda w: (wide @ w).square().sum())(torch.ones(128, 2048))
    release_free_memory()  # what the matmul freed, where the heap would keep it (no budget)
    return max(0.0, resident_mib() - before)
