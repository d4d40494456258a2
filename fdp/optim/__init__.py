"""Functional optimizers in the style of optax, with ``torch.optim`` numerics.

Params, grads and updates are flat dicts ``{name: tensor}``. A ``GradientTransformation``
is a pair of pure functions: ``init(params) -> state`` and
``update(grads, state, params) -> (updates, new_state)``. Updates are *added* to the
params (``apply_updates``), so a descent step is negative. Nothing is modified in place:
the same inputs always give the same outputs, and the caller's tensors stay intact.

States are NamedTuples of ints, floats, ``None`` and (dicts of) tensors, so they flatten
as pytrees and their leaves load with ``torch.load(weights_only=True)``.
Each optimizer state carries ``count`` (updates done so far; schedules are evaluated on
it) and ``lr`` (the learning rate of the last update, see ``current_lr``).

Tensor math goes through torch's multi-tensor ``_foreach_*`` ops (``fdp._torch.foreach``)
over the dict values (in the key order of the state that ``init`` made): one dispatch per op
instead of one per tensor, and the fused multi-tensor kernels on CUDA. Inputs are only read;
in-place ops touch only tensors allocated inside the same call.

A caller that will never look at its params and optimizer state again (a training loop)
can *donate* them: ``apply_gradients(opt, grads, state, params, donate=True)`` lets
``sgd``, ``adam`` and ``adamw`` (alone or last in a ``chain``) update them in place with
torch's fused optimizer kernels, the ones ``torch.optim`` uses with ``fused=True``: one
pass over memory instead of several, and no new params or state each step (on a 25M
model on CPU, Adam 14 ms instead of 76 ms, SGD with momentum 16 ms instead of 37 ms).
"""

from fdp.optim.decay import DECAY_FILTERS, decay_rule, embedding_names
from fdp.optim.optimizers import AdamState, SGDState, adam, adamw, sgd
from fdp.optim.registry import LR_SCHEDULES, OPTIMIZERS, build_optimizer, check_resumed_schedule
from fdp.optim.schedules import (
    Schedule,
    constant_schedule,
    warmup_constant_schedule,
    warmup_cosine_schedule,
    warmup_linear_schedule,
    wsd_schedule,
)
from fdp.optim.transforms import (
    ClipState,
    DecayMask,
    GradientTransformation,
    apply_gradients,
    apply_updates,
    chain,
    clip_by_global_norm,
    current_lr,
    supports_inplace,
    takes_sum_across,
)

__all__ = [
    "GradientTransformation",
    "Schedule",
    "SGDState",
    "AdamState",
    "ClipState",
    "constant_schedule",
    "warmup_constant_schedule",
    "warmup_linear_schedule",
    "warmup_cosine_schedule",
    "wsd_schedule",
    "sgd",
    "adam",
    "adamw",
    "DecayMask",
    "DECAY_FILTERS",
    "decay_rule",
    "embedding_names",
    "LR_SCHEDULES",
    "clip_by_global_norm",
    "chain",
    "apply_updates",
    "apply_gradients",
    "supports_inplace",
    "takes_sum_across",
    "current_lr",
    "OPTIMIZERS",
    "build_optimizer",
    "check_resumed_schedule",
]
