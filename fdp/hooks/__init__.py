"""Composable gradient-reduction hooks (see ``fdp.hooks.base`` for the interface)."""

from fdp.hooks.allreduce import allreduce
from fdp.hooks.base import (
    GradBucket,
    Hook,
    chain,
    drive_hook,
    for_slices,
    hook_name,
    init_hook_states,
    run_hook,
    stateless,
    with_result_checks,
)
from fdp.hooks.compress import (
    bf16,
    bf16_compress,
    bf16_decompress,
    fp16,
    fp16_compress,
    fp16_decompress,
    reduced_in,
)
from fdp.hooks.hierarchical import NodeComms, hierarchical, node_comms
from fdp.hooks.int8 import Int8State, int8, int8_compress, int8_decompress, int8_sum
from fdp.hooks.lowbit import LowBitState, lowbit, lowbit_compress, lowbit_decompress, lowbit_sum
from fdp.hooks.noop import noop
from fdp.hooks.powersgd import PowerSGDState, batched_powersgd, powersgd
from fdp.hooks.registry import HOOKS, build_hook
from fdp.hooks.topk import TopKState, topk

__all__ = [
    "GradBucket",
    "Hook",
    "allreduce",
    "chain",
    "with_result_checks",
    "for_slices",
    "init_hook_states",
    "run_hook",
    "drive_hook",
    "hook_name",
    "stateless",
    "fp16",
    "bf16",
    "fp16_compress",
    "fp16_decompress",
    "bf16_compress",
    "bf16_decompress",
    "reduced_in",
    "hierarchical",
    "node_comms",
    "NodeComms",
    "noop",
    "powersgd",
    "batched_powersgd",
    "PowerSGDState",
    "topk",
    "TopKState",
    "int8",
    "int8_compress",
    "int8_sum",
    "int8_decompress",
    "Int8State",
    "lowbit",
    "lowbit_compress",
    "lowbit_sum",
    "lowbit_decompress",
    "LowBitState",
    "HOOKS",
    "build_hook",
]
