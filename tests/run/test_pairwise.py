"""Every pair of features that composes trains, and trains as its reference does.

The pairs are those of ``fdp.run.compatibility.FEATURES`` that the config checks accept
(``pair_configs``: a pair refused there is on docs/reference/compatibility.md with its reason, which
tests/test_compatibility.py checks); a refusal removed from the code adds its pair here by itself.

The rule. Each setting a feature turns on either leaves the math alone (``EXACT``: the ZeRO stage, hierarchical
reduction, the checkpoint format, activation checkpointing, shrink/respawn while no rank is lost, early stopping,
keep_best and max_time while they do not stop the run, compile up to float rounding) or changes it (``MATH``:
precision, reduce_dtype, hooks, outer loops, the moving average of the params (what is evaluated, not the params),
and the model, data and world it runs on). A pair's reference is the run with its ``EXACT`` settings back at their
defaults: it must end with the same params, step losses and moving average, within float rounding in fp32
(``TIGHT``), looser where compile (``COMPILED``) or a 16-bit format (``LOW_PRECISION``) is involved. Stage 2 x
PowerSGD equals stage 0 x PowerSGD; stage 3 x compile equals stage 0 uncompiled. One exception, by design:
hierarchical reduction with a hook whose codes are not linear in the gradient (``NODE_SUM_HOOKS``: top-k, low-bit)
compresses each node's sum, so it equals the run with one rank per node (two ranks), not the flat world of four.

How, within the suite's time. The ranks start once (``run_ranks``: two, and four for ``hierarchical``, two nodes of
two) and build each pair's run in-process from its config through the run's own path:
``fdp.run.memory.auto_stage.built_at_stage`` (the stage, then ``fdp.run.build.build_run``: data, model, plan, hook,
optimizer, ZeRO update, first state), ``fdp.run.loop.Loop`` (its step and this rank's
batches, as ``fdp.run.trainer`` makes them) and ``fdp.run.loop_controls.LoopControls`` (the moving average,
max_time's clock, the monitors' checks), three steps of a small model each. A pair with a checkpoint format saves
its state after step 2 in that format (the loop's ``Checkpointer``), resumes from it as a run does
(``fdp.run.checkpoint.resume``, the loop's state too) and takes its last step from there; its reference does not.
References are computed once and shared by the pairs that have them; pairs that merge to the same config share
one run (as do configs that differ only in naming the checkpoint format their world's ``auto`` picks), and a
reference that is a pair's own config is that pair's run taken on from its live state at the save, before it
resumes (the steps before the save are the same; the last ones run straight, as the reference's). A rank's runs
share the compiles that dynamo's guards accept (``_share_compiles``), as a run's steps share its first. What this
in-process form does not run is covered by the whole runs at the end (``WHOLE_RUNS``): the keeper that holds each
rank of a world that may shrink or respawn, early stopping and keep_best deciding on real evaluations, max_time's
deadline inside a running loop, and a sharded checkpoint resumed by a second invocation.
"""

from __future__ import annotations

import copy
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fdp.comm import Comm
from fdp.run.compatibility import BASE, FEATURES, pair_configs

# The first test to read ``trained`` trains ~260 runs on two ranks and ~26 on four: about a minute and a half on
# an unloaded 2-core machine, several on a loaded one.
pytestmark = [pytest.mark.timeout(900), pytest.mark.heavy]  # heavy: run first (tests/conftest.py)

STEPS = 3
SAVED_AT = 2  # a pair's checkpoint, resumed for its last step
SETTINGS = {"trainer.max_steps": STEPS, "trainer.eval_every": 0, "trainer.checkpoint_every": 0}
# Where the pair has them: PowerSGD compresses from step 1 (not after 10 steps reduced whole), an outer loop syncs
# at step 2, so that each acts within the run.
ACTING = {"hooks.start_iter": 0, "outer.sync_every": SAVED_AT}
# The char model small (activation_checkpointing's pairs run it): two blocks, a short context.
TINY_CHARLM = {
    "model.d_model": 16,
    "model.n_layer": 2,
    "model.n_head": 2,
    "data.block_size": 8,
    "data.max_chars": 5000,
    "data.global_batch_size": 12,
}
# Hooks whose codes are not linear in the gradient: under world.hierarchical they compress each node's sum, so the
# pair equals the run with one rank per node (a node's ranks split its samples contiguously), not the flat world.
NODE_SUM_HOOKS = {"topk", "lowbit"}
# Settings that leave the params alone (while nothing triggers them), and those that change them.
EXACT = {
    "trainer.zero_stage",
    "trainer.compile",
    "world.hierarchical",
    "world.node_size",
    "trainer.checkpoint_format",
    "trainer.activation_checkpointing",
    "world.on_rank_loss",
    "world.respawn",
    "trainer.early_stopping.patience",
    "trainer.keep_best",
    "trainer.max_time",
}
MATH = {
    "trainer.precision",
    "trainer.reduce_dtype",
    "hooks",
    "outer",
    "outer.overlap",
    "trainer.ema_decay",
    "model",
    "data",
    "world",
}
TIGHT = dict(rtol=1e-5, atol=1e-6)
COMPILED = dict(rtol=1e-4, atol=1e-5)
LOW_PRECISION = dict(rtol=2e-2, atol=2e-3)


def _key(override: str) -> str:
    return override.split("=", 1)[0]


def test_every_feature_setting_is_classified_as_exact_or_math_changing():
    unknown = {_key(o) for f in FEATURES for o in f.overrides} - EXACT - MATH
    assert not unknown, f"classify {sorted(unknown)} in tests/run/test_pairwise.py: EXACT or MATH"
    assert all("." in key for key in EXACT), "an exact setting is a key, not a config group: reset to its default"


def _reference(cfg, defaults):
    """``cfg`` with its exact settings at their defaults (and one rank per node where a hook codes node sums)."""
    ref = copy.deepcopy(cfg)
    if cfg.world.hierarchical and cfg.hooks.name in NODE_SUM_HOOKS and cfg.trainer.zero_stage == 0:
        ref.world.nproc_per_node = cfg.world.nproc_per_node // cfg.world.node_size
    for key in EXACT:
        OmegaConf.update(ref, key, OmegaConf.select(defaults, key), merge=False)
    return ref


def _small(cfg):
    """``cfg`` with the test's settings: few steps, each feature acting within them, a tiny model."""
    settings = {**SETTINGS, **(TINY_CHARLM if cfg.model.name == "charlm" else {})}
    settings.update({key: value for key, value in ACTING.items() if OmegaConf.select(cfg, key) is not None})
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def _resumes(cfg) -> bool:
    """Whether a pair's run saves and resumes in its checkpoint's format (its reference does not)."""
    return cfg.trainer.checkpoint_format != "whole"


def _tolerance(cfg) -> dict:
    if cfg.trainer.precision != "32-true" or cfg.trainer.reduce_dtype != "float32":
        return LOW_PRECISION
    return COMPILED if cfg.trainer.compile is True else TIGHT


# -- in the ranks ---------------------------------------------------------------------------------------
def _controls(cfg, parts, comm, state, resumed=None):
    from fdp.data import SPLITS, has_split
    from fdp.run.loop_controls import LoopControls
    from fdp.run.report.records import evaluated_names

    splits = tuple(split for split in SPLITS if has_split(parts.data, split))
    evaluated = evaluated_names(parts.metrics, bool(cfg.trainer.ema_decay)) if splits else ()
    return LoopControls(cfg.trainer, comm, parts.plan, state, splits, evaluated, STEPS, resumed, parts.update.comm)


_DATA: dict = {}  # each data set loaded once in a rank, as a run loads it once for its build and its loop


def _key_of(cfg) -> str:
    """A config as a string, equal for equal configs (a tenth of ``OmegaConf.to_yaml``'s time)."""
    return repr(OmegaConf.to_container(cfg))


def _run_key(cfg) -> str:
    """``cfg``'s key with the checkpoint format its world writes (``auto`` is ``sharded`` on more than one rank,
    ``fdp.run.checkpoint.format``): configs that differ in that alone are one run."""
    from fdp.run.checkpoint.format import resolved_format

    tree = OmegaConf.to_container(cfg)
    tree["trainer"]["checkpoint_format"] = resolved_format(cfg.trainer.checkpoint_format, cfg.world.nproc_per_node)
    return repr(tree)


def _data(cfg):
    from fdp.run.build import build_data

    key = _key_of(cfg.data) + str(cfg.seed)
    if key not in _DATA:
        _DATA[key] = build_data(cfg.data, cfg.seed)
    return _DATA[key]


def _train(cfg, comm: Comm, resume: bool, directory: Path, straight: bool) -> tuple[dict, dict | None]:
    """This rank's run of ``cfg`` for ``STEPS`` steps (saved after step ``SAVED_AT`` and resumed there if
    ``resume``); on rank 0 its whole params, step losses and moving average. ``straight``: the same run's last
    steps taken from its live state too, before it resumes (the run with neither save nor resume, ``cfg``'s
    reference where that is ``cfg`` itself): the second result, ``None`` otherwise."""
    from fdp.procs.budget import MemoryPhase
    from fdp.run import checkpoint
    from fdp.run.config.validate import allowed_stages
    from fdp.run.loop import Loop
    from fdp.run.loop_controls import read_resumed
    from fdp.run.memory.auto_stage import built_at_stage
    from fdp.run.rundir import RunDir
    from fdp.trace import NullTimeline

    device = torch.device("cpu")
    # trainer.zero_stage=auto decided as a run decides it (no budget: the lowest stage the other settings allow)
    cfg, parts, _ = built_at_stage(cfg, comm, device, _data(cfg), None, allowed_stages(cfg), 0.0, 0.0)
    controls = _controls(cfg, parts, comm, parts.state)
    loop = Loop(cfg, parts, comm, NullTimeline(), device, parts.state, STEPS, cfg.trainer.compile is True, controls,
                MemoryPhase())  # fmt: skip
    try:
        state, losses = _steps(loop, controls, parts.state, 1, SAVED_AT, [])
        if not resume:
            state, losses = _steps(loop, controls, state, SAVED_AT + 1, STEPS, losses)
            return _result(loop, parts, controls, state, losses, comm), None
        loop.train_step.settle()
        written = loop.checkpoints.save(
            RunDir(directory).checkpoints, state, parts.update, parts.plan, controls.payload(SAVED_AT)
        )
        loop.checkpoints.wait()
        written = _broadcast(written, comm)
        last = [next(loop.batches) for _ in range(SAVED_AT, STEPS)]  # the last steps' batches, for both
        uninterrupted = None
        if straight:  # taken whole before the resume reads the checkpoint into the built state
            uninterrupted = _result(
                loop, parts, controls, *_steps(loop, controls, state, SAVED_AT + 1, STEPS, losses, last), comm
            )
        state = checkpoint.resume(written, parts.state, parts.update, parts.plan, comm)
        controls.close()
        controls = _controls(cfg, parts, comm, state, read_resumed(written, comm))
        state, losses = _steps(loop, controls, state, SAVED_AT + 1, STEPS, losses, last)
        return _result(loop, parts, controls, state, losses, comm), uninterrupted
    finally:
        controls.close()


def _steps(loop, controls, state, first: int, last: int, losses: list, batches: list | None = None):
    """Steps ``first`` to ``last`` from ``state`` (on ``batches``, or the loop's next), and the losses so far."""
    losses = list(losses)
    for step in range(first, last + 1):
        batch = batches[step - first] if batches is not None else next(loop.batches)
        state, metrics = loop.train_step(state, batch)
        losses.append(float(metrics["loss"]))
        controls.stepped(state)
    return state, losses


def _result(loop, parts, controls, state, losses: list, comm: Comm) -> dict:
    """The run's end on rank 0, copied: its whole params, step losses and moving average (every rank calls)."""
    loop.train_step.settle()
    whole = parts.update.to_checkpoint(state, comm)
    average = controls.payload(state.step).get("ema")
    if comm.rank != 0:
        return {}
    params = {name: t.detach().float().cpu().clone() for name, t in whole.params.items()}
    average = None if average is None else {name: t.detach().clone() for name, t in average.items()}
    return {"params": params, "losses": losses, "ema": average}


def _broadcast(value, comm: Comm):
    """Rank 0's ``value`` on every rank (the path rank 0 wrote)."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, group=comm.group, group_src=0)
    return box[0]


def _share_compiles() -> None:
    """This rank's compiles shared by the runs whose compiled code dynamo's guards accept, as one run's steps share
    its first compile (most compile pairs differ in what the compiled gradient does not see: the hook, the outer
    loop, the ZeRO stage's update, the checkpoints). A run whose guards fail compiles its own, from its first call
    and with its shapes static, as a fresh run's process does (not dynamic, as dynamo makes a frame it recompiles
    for new shapes); one that could not compile fails rather than running eager."""
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def _train_all(rank: int, world: int, jobs: list) -> dict:
    """Each job ``(name, config, resume, straight)`` trained in turn (``straight``: the name its uninterrupted run
    is reported under, or ``None``); a job that fails gives its error's line."""
    torch.manual_seed(0)
    _share_compiles()
    comm = Comm()
    out = {}
    with tempfile.TemporaryDirectory(prefix=f"pairwise-{rank}-") as scratch:
        for index, (name, cfg, resume, straight) in enumerate(jobs):
            directory = Path(scratch) / str(index) if rank == 0 else Path(scratch)
            directory = _broadcast(str(directory), comm)
            began, cpu = time.perf_counter(), time.process_time()
            try:
                out[name], uninterrupted = _train(cfg, comm, resume, Path(directory), straight is not None)
                out[name].update(seconds=time.perf_counter() - began, cpu_s=time.process_time() - cpu)
                if straight is not None:
                    out[straight] = uninterrupted
            except Exception as error:  # noqa: BLE001 - every pair is reported, not only the first to fail
                out[name] = {"error": f"{type(error).__name__}: {error}".splitlines()[0]}
                if rank == 0:
                    out[name]["traceback"] = traceback.format_exc()
                if straight is not None:
                    out[straight] = out[name]
    return out


# -- the pairs -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pairs():
    """``(pair name, its config, its reference's config)`` for every pair the checks accept."""
    from fdp.run.config.compose import compose

    defaults = compose(*BASE)
    out = []
    for a, b, cfg, refused in pair_configs():
        if refused is not None:
            continue
        _small(cfg)
        name = a.name if a == b else f"{a.name} x {b.name}"
        out.append((name, cfg, _reference(cfg, defaults)))
    return out


# The features a whole run has that the in-process form does not, combined into few whole runs (each combination
# composes: the page's pairs among them are accepted): the keeper of each rank of a world that may shrink and
# respawn, early stopping and keep_best deciding on real evaluations, max_time's deadline in a running loop, and a
# sharded checkpoint resumed by a second invocation (trainer.stop_at, then trainer.resume=true).
WHOLE_RUNS = {
    "respawn_stage1": (("respawn", "zero_stage=1", "early_stopping", "keep_best=1", "ema_decay=0.9"), ()),
    "sharded_stage3_resumed": (
        ("checkpoint_format=sharded", "zero_stage=3", "max_time", "early_stopping", "keep_best=1"),
        (f"trainer.stop_at={SAVED_AT}",),
    ),
}
WHOLE = ("trainer.eval_every=1", "trainer.checkpoint_every=1", f"trainer.max_steps={STEPS}")


def _whole_run_overrides(names: tuple[str, ...]) -> list[str]:
    by_name = {f.name: f for f in FEATURES}
    return [*BASE, *(o for name in names for o in by_name[name].overrides), *WHOLE]


@pytest.fixture(scope="module")
def trained(pairs, module_run_ranks):
    """Every pair, every reference and every whole run's reference trained, by world size: one start of the
    ranks each. ``{name: (its result, its reference's result, its reference's config)}``."""
    from fdp.run.config.compose import compose

    defaults = compose(*BASE)
    wholes = []
    for name, (names, _) in WHOLE_RUNS.items():
        cfg = _small(compose(*_whole_run_overrides(names)))
        wholes.append((name, None, _reference(cfg, defaults)))
    # One job per distinct config (pairs that merge to the same overrides share it). A reference whose config is a
    # pair's that resumes is that job's uninterrupted run: the pair's steps before the save, then its last steps
    # from the live state (``_train``'s ``straight``); the other references are jobs of their own.
    jobs: dict[tuple[str, bool], list] = {}  # (run, resumes) -> [name, config, resume, straight]
    job_of: dict[str, str] = {}  # pair or reference -> the job whose result it reads
    for name, cfg, _ in pairs:
        job = jobs.setdefault((_run_key(cfg), _resumes(cfg)), [name, cfg, _resumes(cfg), None])
        job_of[name] = job[0]
    for name, cfg, ref in [*pairs, *wholes]:
        ref_yaml = _run_key(ref)
        if (ref_yaml, True) in jobs:
            job = jobs[(ref_yaml, True)]
            job[3] = job[3] or f"reference of {job[0]}"
            job_of[f"reference: {name}"] = job[3]
        else:
            job = jobs.setdefault((ref_yaml, False), [f"reference {len(jobs)}", ref, False, None])
            job_of[f"reference: {name}"] = job[0]
    by_world: dict[int, list] = {}
    for name, cfg, resume, straight in jobs.values():
        by_world.setdefault(int(cfg.world.nproc_per_node), []).append((name, cfg, resume, straight))
    results = {}
    for world, world_jobs in sorted(by_world.items()):
        began = time.perf_counter()
        results.update(module_run_ranks(_train_all, world_jobs, world_size=world, timeout_s=120)[0])
        names = {job[0] for job in world_jobs}
        took = sorted((r.get("cpu_s", 0.0), name) for name, r in results.items() if name in names)
        print(
            f"pairwise: {len(world_jobs)} runs on {world} ranks in {time.perf_counter() - began:.1f} s "
            f"(rank 0's CPU {sum(t for t, _ in took):.1f} s); the most CPU: {took[-4:]}"
        )
    return {
        name: (results.get(job_of.get(name)), results[job_of[f"reference: {name}"]], ref)
        for name, _, ref in [*pairs, *wholes]
    }


def _mismatch(name, got, want, tolerance, same_world: bool = True) -> str | None:
    """Why a pair's run is not its reference's (``None`` if it is). The step losses are rank 0's batch's: compared
    only on worlds of one size."""
    if "error" in got:
        return f"{name}: {got['error']}"
    if "error" in want:
        return f"{name}: its reference failed: {want['error']}"
    for what in ("losses", "params", "ema")[0 if same_world else 1 :]:
        a, b = got[what], want[what]
        if a is None and b is None:
            continue
        try:
            torch.testing.assert_close(a, b, **tolerance)
        except AssertionError as error:
            return f"{name}: {what} differ from the reference's: {str(error).strip().splitlines()[0]}"
    return None


def test_every_pair_that_composes_trains_as_its_reference(pairs, trained):
    assert len(pairs) >= 150, f"only {len(pairs)} pairs compose: expected the page's (pair_configs)"
    failures = [
        _mismatch(name, *trained[name][:2], _tolerance(cfg), cfg.world.nproc_per_node == ref.world.nproc_per_node)
        for name, cfg, ref in pairs
    ]
    failures = [line for line in failures if line]
    assert not failures, f"{len(failures)} of {len(pairs)} pairs:\n" + "\n".join(failures)


def _final(run_dir: Path) -> dict:
    """The params and moving average of a whole run's last checkpoint (whole or sharded)."""
    from fdp.run.checkpoint import whole_payload

    payload = whole_payload(run_dir / "checkpoints")
    return {"params": payload["params"], "ema": payload.get("ema")}


@pytest.mark.parametrize("name", list(WHOLE_RUNS))
def test_whole_runs_of_the_features_a_step_does_not_show_train_as_their_reference(name, trained, tmp_path):
    from fdp.run.checkpoint import BEST
    from fdp.run.config.compose import compose
    from fdp.run.trainer import run

    names, first = WHOLE_RUNS[name]
    overrides = _whole_run_overrides(names)
    if first:  # the first invocation stops early; the second resumes from its checkpoint
        run(compose(*overrides, *first), tmp_path)
        overrides = [*overrides, "trainer.resume=true"]
    summary = run(compose(*overrides), tmp_path)
    assert summary["steps"] == STEPS and not summary.get("stopped"), summary  # nothing triggered
    assert any((tmp_path / "checkpoints" / BEST).iterdir())  # keep_best kept one, ranked on evaluations
    want = trained[name][1]
    got = _final(tmp_path)
    torch.testing.assert_close(got["params"], want["params"], **TIGHT)
    if want["ema"] is not None:
        torch.testing.assert_close(got["ema"], want["ema"], **TIGHT)
