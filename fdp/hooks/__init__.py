"""Composable gradient-reduction hooks (see ``fdp.hooks.base`` for the interface)."""
from fdp.hooks.allreduce import allreduce
from fdp.hooks.base import GradBucket, Hook, chain, run_hook, run_stage, stateless

__all__ = ["GradBucket", "Hook", "allreduce", "chain", "run_hook", "run_stage", "stateless"]
