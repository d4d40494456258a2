"""Deterministic offline data, with batches defined by the GLOBAL batch size.

Every batch is a pure function of its arguments: ``global_batch(data, step, size, seed)``
builds the whole batch of optimizer step ``step`` from local generators, so a run resumed
at step k sees exactly the batches of an uninterrupted one, whatever the world size.
Ranks then take their contiguous share (``rank_share``) and may split it into micro-batches.
A user's own data (``MapData``: map-style torch Datasets) is read through a ``DataLoader``
whose ``StepSampler`` follows the same order, so the same holds for it. A batch is any
pytree of tensors with a common batch dimension (``(inputs, targets)``, or a dict whose
``labels`` go to the loss and whose other entries go to the model by name).

>>> data = load_dataset("digits")
>>> x, y = global_batch(data, step=0, global_batch_size=8, seed=0)
>>> [t.shape for t in rank_share((x, y), rank=1, world_size=2)]
[torch.Size([4, 64]), torch.Size([4])]
"""

from fdp.data.batches import (
    as_batch,
    check_global_batch,
    check_micro_batches,
    dataset_share,
    global_batch,
    model_inputs,
    rank_share,
    split_micro_batches,
)
from fdp.data.builtin import (
    DATASETS,
    STDLIB_TEXT_MODULES,
    Dataset,
    load_dataset,
    load_digits,
    load_stdlib_text,
)
from fdp.data.loaders import (
    eval_batches,
    has_test_split,
    model_arguments,
    num_train_samples,
    targets_shifted,
    train_batches,
)
from fdp.data.mapped import MapData, StepSampler, as_map_data, collate
from fdp.data.splits import SPLITS, check_val_fraction, has_split, hold_out

__all__ = [
    "Dataset",
    "load_digits",
    "load_stdlib_text",
    "check_global_batch",
    "check_micro_batches",
    "global_batch",
    "rank_share",
    "dataset_share",
    "split_micro_batches",
    "model_inputs",
    "as_batch",
    "eval_batches",
    "load_dataset",
    "MapData",
    "StepSampler",
    "as_map_data",
    "collate",
    "train_batches",
    "num_train_samples",
    "has_test_split",
    "has_split",
    "hold_out",
    "check_val_fraction",
    "SPLITS",
    "model_arguments",
    "targets_shifted",
    "DATASETS",
    "STDLIB_TEXT_MODULES",
]
