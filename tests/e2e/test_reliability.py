"""Reliability: lost and hung ranks, restarts, crash-safe checkpoints, bad input,
non-finite gradients, uneven shares, and local worlds that listen on loopback only.

Every run is a tiny MLP on two gloo ranks started by the elastic launcher. Faults come
from outside the run (the test signals a worker whose pid it reads from
``<run dir>/ranks/rank<N>.txt``) or from a test-only worker entry that wraps
``run_rank``; nothing here needs a knob in the production path.
"""

from __future__ import annotations

import hashlib
import io
import ipaddress
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import _recipe
import pytest
import torch
import torch.distributed as dist
from _paths import pythonpath_first
from _procs import alive
from _saved import saved
from omegaconf import OmegaConf

from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
from fdp.comm import Comm
from fdp.data import dataset_share, load_digits
from fdp.errors import ConfigError
from fdp.model.functional import functionalize
from fdp.optim import sgd
from fdp.plan import plan_buckets
from fdp.procs.launch import RankLostError, WorkerFailedError, WorldLayout, init_distributed, loopback_interface, spawn
from fdp.run import checkpoint
from fdp.run.checkpoint import whole
from fdp.run.config import register_configs
from fdp.run.config.compose import compose as make_cfg
from fdp.run.config.validate import validate
from fdp.run.rundir import RankStatus
from fdp.run.trainer import run, run_rank
from fdp.run.world import layout_of

ROOT = Path(__file__).resolve().parents[2]
register_configs()

TINY = ["model.hidden=16", "data.global_batch_size=16", "trainer.eval_every=0", "trainer.progress=false"]
LOCAL2 = ["world=local2", "world.backend=gloo", "world.timeout_s=30"]
# The run that is interrupted and restarted: a tiny character transformer with dropout (so the
# per-rank RNG matters) and AdamW with a warm-up schedule (optimizer state and step count).
STEPS, EVERY = 200, 20
REFERENCE = [
    "model=charlm",
    "data=stdlib_text",
    "model.d_model=16",
    "model.n_layer=1",
    "model.n_head=2",
    "model.dropout=0.1",
    "data.block_size=8",
    "data.max_chars=5000",
    "data.global_batch_size=8",
    "optim=adamw",
    "optim.warmup_steps=10",
    "trainer.eval_every=0",
    "trainer.progress=false",
    *LOCAL2,
    f"trainer.max_steps={STEPS}",
    f"trainer.checkpoint_every={EVERY}",
    "trainer.checkpoint_format=whole",  # its files, written by rank 0 (sharded ones: tests/test_sharded_checkpoint.py)
]


def final_params(run_dir):
    return saved(Path(run_dir))["params"]


def assert_same_params(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def wait_for(predicate, timeout=120.0, every=0.005):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(every)
    return value


class Background(threading.Thread):
    """``fn()`` in a thread; ``result()`` joins it and returns its value or raises its error."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.value, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.value = self.fn()
        except BaseException as e:  # handed to the test thread
            self.error = e

    def result(self, timeout=120.0):
        self.join(timeout)
        if self.error is not None:
            raise self.error
        return self.value


def checkpointed(run_dir, step):
    """Whether checkpoint ``step`` is complete, in either format (a sharded one's directory is renamed in whole)."""
    checkpoints = Path(run_dir) / "checkpoints"
    return (checkpoints / f"step_{step:08d}.pt").exists() or (checkpoints / f"step_{step:08d}").is_dir()


# -- the uninterrupted run, and what listened while it ran ---------------------------------
def _proc_children():
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def _descendants(pid):
    children, out, todo = _proc_children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _socket_inodes(pid):
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _listening():
    """``{inode: ip address}`` of every TCP socket in LISTEN state (IPv4 and IPv6)."""
    out = {}
    for table, width in (("tcp", 4), ("tcp6", 16)):
        try:
            rows = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            # /proc prints each 32-bit word in host (little-endian) order.
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            out[int(fields[9])] = ipaddress.ip_address(packed)
    return out


class ListenWatch(Background):
    """Records the listening addresses of this process and its descendants until stopped."""

    def __init__(self):
        self.seen: set[tuple[str, str]] = set()
        self.halt = threading.Event()
        super().__init__(self._watch)

    def _watch(self):
        me = os.getpid()
        while not self.halt.is_set():
            listening = _listening()
            for pid in _descendants(me):
                for inode in _socket_inodes(pid) & listening.keys():
                    self.seen.add(("launcher" if pid == me else "worker", str(listening[inode])))
            self.halt.wait(0.25)
        return self.seen

    def stop(self):
        self.halt.set()
        return self.result()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank run that interrupted ones must reproduce bit for bit."""
    run_dir = tmp_path_factory.mktemp("reference")
    watch = ListenWatch()
    try:
        summary = run(make_cfg(*REFERENCE), run_dir)
    finally:
        listening = watch.stop()
    assert summary["steps"] == STEPS
    return {"params": final_params(run_dir), "listening": listening}


def test_local_world_listens_on_loopback_only(reference):
    """The rendezvous store (in the launcher) and gloo (in each worker) bind 127.0.0.1, not every interface."""
    roles = {role for role, _ in reference["listening"]}
    assert roles == {"launcher", "worker"}, reference["listening"]
    for role, address in reference["listening"]:
        ip = ipaddress.ip_address(address)
        mapped = getattr(ip, "ipv4_mapped", None)
        assert ip.is_loopback or (mapped is not None and mapped.is_loopback), (role, address)


def test_local_worlds_pin_gloo_and_nccl_to_the_loopback_interface(monkeypatch):
    """Where the hostname resolves to a LAN address (not on every machine, so the run above
    may not show it) gloo would listen there; local worlds name the loopback interface."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.setenv(var, "unset")  # recorded, so the teardown restores the original state
        monkeypatch.delenv(var)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: None)
    threads = torch.get_num_threads()
    try:
        init_distributed(WorldLayout("elastic", nproc_per_node=1, backend="gloo"))
    finally:
        torch.set_num_threads(threads)
    interface = os.environ["GLOO_SOCKET_IFNAME"]
    assert interface == os.environ["NCCL_SOCKET_IFNAME"] == loopback_interface()
    if Path(f"/sys/class/net/{interface}/flags").exists():
        assert int(Path(f"/sys/class/net/{interface}/flags").read_text(), 16) & 0x8  # IFF_LOOPBACK


# -- 1. a lost rank ------------------------------------------------------------------------
def test_killed_rank_stops_the_run_naming_the_rank_and_the_step(tmp_path):
    timeout_s = 30
    cfg = make_cfg(
        *TINY, *LOCAL2, f"world.timeout_s={timeout_s}", "trainer.max_steps=5000", "trainer.checkpoint_every=20"
    )

    def kill_rank1():
        wait_for(lambda: checkpointed(tmp_path, 20))
        victim = RankStatus.read(tmp_path, 1)
        os.kill(victim["pid"], signal.SIGKILL)
        return victim, time.monotonic()

    killer = Background(kill_rank1)
    with pytest.raises(RankLostError) as caught:
        run(cfg, tmp_path)
    stopped = time.monotonic()
    victim, killed_at = killer.result()
    message = str(caught.value)
    match = re.fullmatch(
        r"rank 1 was lost at step (\d+): process (\d+) was killed by SIGKILL; the other ranks were stopped; "
        r"the last checkpoint is step (\d+) \(continue with trainer.resume=true, or set world.max_restarts .*\)",
        message,
    )
    assert match, message
    assert int(match[2]) == victim["pid"]
    assert int(match[1]) >= victim["step"] >= 20 and int(match[3]) >= 20
    assert stopped - killed_at < timeout_s
    assert not alive(RankStatus.read(tmp_path, 0)["pid"])


def test_hung_rank_is_named_by_the_survivor_within_the_timeout(tmp_path):
    """A stopped (not dead) rank: the survivor's collective times out, and the heartbeat says who is gone."""
    timeout_s = 4
    cfg = make_cfg(
        *TINY, *LOCAL2, f"world.timeout_s={timeout_s}", "trainer.max_steps=5000", "trainer.checkpoint_every=20"
    )

    def stop_rank1():
        wait_for(lambda: checkpointed(tmp_path, 20))
        survivor, victim = RankStatus.read(tmp_path, 0), RankStatus.read(tmp_path, 1)
        os.kill(victim["pid"], signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            wait_for(lambda: not alive(survivor["pid"]), timeout=timeout_s + 60)
            return victim, time.monotonic() - stopped_at
        finally:
            os.kill(victim["pid"], signal.SIGCONT)  # so it takes the launcher's SIGTERM

    stopper = Background(stop_rank1)
    with pytest.raises(WorkerFailedError) as caught:
        run(cfg, tmp_path)
    victim, survivor_stopped_after = stopper.result()
    message = str(caught.value)
    match = re.fullmatch(
        r"rank 1 was lost at step (\d+): it stopped answering \(killed, hung or unreachable\); "
        r"the collective on rank 0 failed with: (.*) \(rank 0\)",
        message,
    )
    assert match, message
    assert int(match[1]) >= victim["step"] >= 20
    assert "imed out" in match[2]  # gloo's "Timed out waiting 4000ms for recv operation to complete"
    # The collective may have begun just before the stop; the heartbeat check adds ~1.5 s.
    assert timeout_s - 1 <= survivor_stopped_after < timeout_s + 10


# -- restarts, and a rank killed while saving (item 2), in one interrupted run -------------------
def _die_while_saving(cfg, run_dir, kill_at):
    """``run_rank``, except that on the first attempt rank 0 is SIGKILLed halfway
    through writing checkpoint ``kill_at`` (half its bytes are on disk, fsynced)."""
    if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(obj, dict) and obj.get("step") == kill_at:
                buffer = io.BytesIO()
                real_save(obj, buffer, *args, **kwargs)
                f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                f.flush()
                os.fsync(f.fileno())
                Path(run_dir, "killed-while-saving").write_text(str(kill_at))
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
    return run_rank(cfg, run_dir)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The reference run with ``world.max_restarts=2``, interrupted twice:

    1. rank 0 is SIGKILLed halfway through writing checkpoint 2*EVERY (``_die_while_saving``);
       the launcher restarts the world, which resumes from checkpoint EVERY;
    2. once that world has written checkpoint 4*EVERY, the test SIGKILLs rank 1 from outside;
       the launcher restarts the world again, which resumes and finishes the run.
    """
    run_dir = tmp_path_factory.mktemp("interrupted")
    cfg = make_cfg(*REFERENCE, "world.max_restarts=2")
    validate(cfg, run_dir)
    checkpoints = run_dir / "checkpoints"

    def interrupt():
        seen = {}
        wait_for(lambda: (run_dir / "killed-while-saving").exists())
        wait_for(lambda: not alive(RankStatus.read(run_dir, 0)["pid"]))
        seen["last_after_save_kill"] = checkpoint.load(checkpoint.last_of(checkpoints))["step"]
        seen["partial"] = sorted(p.name for p in checkpoints.glob(".step_*.tmp"))
        wait_for(lambda: checkpointed(run_dir, 4 * EVERY))
        seen["victim"] = RankStatus.read(run_dir, 1)
        os.kill(seen["victim"]["pid"], signal.SIGKILL)
        return seen

    interrupter = Background(interrupt)
    results = spawn(
        _die_while_saving, (OmegaConf.to_container(cfg, resolve=True), str(run_dir), 2 * EVERY), layout_of(cfg)
    )
    return {"dir": run_dir, "summary": results[0], **interrupter.result()}


def test_rank_killed_while_saving_leaves_the_previous_checkpoint(interrupted):
    assert interrupted["last_after_save_kill"] == EVERY  # last still named the previous, whole checkpoint
    partial = interrupted["partial"]  # the dead writer's half-written temporary, never renamed
    assert len(partial) == 1 and partial[0].startswith(f".step_{2 * EVERY:08d}.pt."), partial
    assert not list((interrupted["dir"] / "checkpoints").glob(".*.tmp"))  # later saves cleared it


def test_restarted_world_resumes_from_the_last_checkpoint_bit_identically(interrupted, reference):
    """Two restarts (max_restarts=2), each resuming from the last checkpoint: data position,
    optimizer state and each rank's dropout RNG are restored, so the run ends with exactly
    the reference's parameters."""
    victim = interrupted["victim"]
    assert 4 * EVERY <= victim["step"] < STEPS  # rank 1 was killed mid-run
    assert RankStatus.read(interrupted["dir"], 1)["pid"] != victim["pid"]  # a new rank 1 finished it
    assert interrupted["summary"]["steps"] == STEPS
    assert_same_params(final_params(interrupted["dir"]), reference["params"])


# -- 3. bad input ----------------------------------------------------------------------------
def _snapshot(directory):
    return {
        str(p.relative_to(directory)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(Path(directory).rglob("*"))
        if p.is_file()
    }


def _unchanged(before, directory):
    after = _snapshot(directory)
    return {name: stamp for name, stamp in before.items() if after.get(name) != stamp}


def recipe(*overrides, timeout=120):
    """The recipe's command, forked from the preloaded server (tests/_recipe.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return _recipe.run(
        [sys.executable, str(ROOT / "recipes" / "train.py"), *overrides], env=env, cwd=ROOT, timeout=timeout
    )


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory):
    """A finished run made by the recipe, and a copy of it whose last checkpoint is cut in half."""
    run_dir = tmp_path_factory.mktemp("previous")
    proc = recipe("trainer.max_steps=4", "model.hidden=16", "trainer.progress=false", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / ".hydra" / "config.yaml").exists() and checkpoint.last_of(run_dir / "checkpoints").exists()
    corrupt = tmp_path_factory.mktemp("corrupt")
    shutil.copytree(run_dir, corrupt, dirs_exist_ok=True)
    last = checkpoint.last_of(corrupt / "checkpoints")
    last.write_bytes(last.read_bytes()[: len(last.read_bytes()) // 2])
    return run_dir, corrupt


M = ["model.hidden=16"]
EXAMPLES = ROOT / "examples"  # examples/my_project: a user's own model and data
MINE = ["data=custom", "data._target_=my_project.data.make"]
NET = ["model=custom", "model._target_=my_project.models.Net"]
# TensorDataset items are 3-tuples here: random_split hands back (train, test) of them.
TRIPLES = [
    "data=custom",
    "data._target_=torch.utils.data.random_split",
    "+data.lengths=[8,2]",
    "data.global_batch_size=4",
    "+data.dataset={_target_:torch.utils.data.TensorDataset,_args_:[{_target_:torch.zeros,_args_:[10,3]},"
    "{_target_:torch.zeros,_args_:[10]},{_target_:torch.zeros,_args_:[10]}]}",
]
CHARLM = [
    "model=charlm",
    "data=stdlib_text",
    "model.d_model=16",
    "model.n_layer=1",
    "model.n_head=2",
    "data.block_size=8",
]
# (overrides, where it is refused, what the first line of the error must say). Where:
# "compose" = Hydra refuses the override; "validate" = fdp.run.config.validate before anything
# runs; "run" = fdp.run.trainer.run once the data or the checkpoint is loaded. "{run_dir}" is
# the previous run's directory, which must be left exactly as it was.
BAD_INPUTS = [
    (["trainer.bucket_cap_mb=0"], "validate", r"^trainer\.bucket_cap_mb=0\.0: expected a size in MiB > 0$"),
    (["trainer.bucket_cap_mb=-1"], "validate", r"^trainer\.bucket_cap_mb=-1\.0: expected a size in MiB > 0$"),
    (["trainer.first_bucket_cap_mb=-0.5"], "validate", r"^trainer\.first_bucket_cap_mb=-0\.5: expected"),
    (["hooks.name=foo"], "validate", r"^hooks\.name='foo': unknown hook; known hooks: allreduce, "),
    (["hooks=foo"], "compose", r"Could not find 'hooks/foo'"),
    (["model=resnet"], "compose", r"Could not find 'model/resnet'"),
    (["hooks=powersgd", "hooks.rank=0"], "validate", r"^hooks\.rank=0: expected an integer >= 1$"),
    (["hooks=powersgd", "hooks.start_iter=-1"], "validate", r"^hooks\.start_iter=-1: expected an integer >= 0$"),
    (["hooks=topk", "hooks.ratio=1.5"], "validate", r"^hooks\.ratio=1\.5: expected a fraction with 0 < ratio <= 1$"),
    (["hooks=topk", "hooks.ratio=0"], "validate", r"^hooks\.ratio=0\.0: expected a fraction"),
    (
        ["world=local2", "data.global_batch_size=33"],
        "validate",
        r"^data\.global_batch_size=33: expected a multiple of the world size 2$",
    ),
    (
        ["world=local4", "data.global_batch_size=2"],
        "validate",
        r"^data\.global_batch_size=2: expected a multiple of the world size 4$",
    ),
    (
        ["data.global_batch_size=5000", "trainer.max_steps=2"],
        "run",
        r"^data\.global_batch_size=5000: expected at most the 1438 training samples of digits$",
    ),
    (
        ["trainer.resume=true", "hydra.run.dir={missing}"],
        "validate",
        r"^trainer\.resume=True: expected a checkpoint at .*missing/checkpoints/last\.pt",
    ),
    (
        ["trainer.resume=true", "hydra.run.dir={corrupt}"],
        "validate",
        r"^checkpoint .*/step_00000004\.pt is unreadable \(truncated or corrupted\?\)",
    ),
    (
        ["trainer.resume=true", "model.hidden=32", "trainer.max_steps=8"],
        "run",
        r"^checkpoint .*/step_00000004\.pt was written with another bucket plan",
    ),
    (
        ["optim.warmup_steps=500", "trainer.max_steps=100"],
        "validate",
        r"^optim\.warmup_steps=500: expected between 0 and trainer\.max_steps=100",
    ),
    (["trainer.max_steps=abc"], "compose", r"trainer\.max_steps=abc"),
    (["hooks=powersgd", "hooks.rank=four"], "compose", r"hooks\.rank=four"),
    (["trainer.max_stpes=5"], "compose", r"trainer\.max_stpes"),
    (["trainer.nonfinite=maybe"], "validate", r"^trainer\.nonfinite='maybe': expected raise or skip$"),
    (
        ["trainer.sync_buffers=mean"],
        "validate",
        r"^trainer\.sync_buffers='mean': expected broadcast, average or local$",
    ),
    (["hooks=int8", "hooks.error_feedback=maybe"], "compose", r"hooks\.error_feedback=maybe"),
    (
        ["trainer.accum_steps=3"],
        "validate",
        r"^trainer\.accum_steps=3: expected a divisor of the per-rank batch of 64 samples$",
    ),
    (["model=charlm"], "validate", r"^data='digits': expected stdlib_text for model=charlm$"),
    ([*CHARLM, "model.n_head=3"], "validate", r"^model\.n_head=3: expected a divisor of model\.d_model=16$"),
    ([*CHARLM, "model.n_head=0"], "validate", r"^model\.n_head=0: expected an integer >= 1$"),
    (
        [*CHARLM, "data.max_chars=12", "trainer.max_steps=2"],
        "run",
        r"^data=stdlib_text: max_chars=12 gives 11 train / 1 test characters; each split needs at least block_size \+ "
        r"1 = 9$",
    ),
    ([*CHARLM, "model.dropout=1.0"], "validate", r"^model\.dropout=1\.0: expected a probability in \[0, 1\)$"),
    (["world.timeout_s=0"], "validate", r"^world\.timeout_s=0\.0: expected seconds > 0$"),
    (["world.timeout_s=-5"], "validate", r"^world\.timeout_s=-5\.0: expected seconds > 0$"),
    (["world.max_restarts=-1"], "validate", r"^world\.max_restarts=-1: expected an integer >= 0$"),
    (["world.backend=mpi"], "validate", r"^world\.backend='mpi': expected one of"),
    (["trainer.eval_batches=0"], "validate", r"^trainer\.eval_batches=0: expected an integer >= 1$"),
    (["trainer.max_steps=0"], "validate", r"^trainer\.max_steps=0: expected an integer >= 1$"),
    (["trainer.schedule=sometimes"], "validate", r"^trainer\.schedule='sometimes': expected auto, after or overlap$"),
    (["model.hidden=0"], "validate", r"^model\.hidden=0: expected an integer >= 1$"),
    (["optim.lr=0"], "validate", r"^optim\.lr=0\.0: expected a learning rate > 0$"),
    (
        ["optim.lr_schedule=linear"],
        "validate",
        r"^optim\.lr_schedule='linear': expected constant or warmup_constant or warmup_linear or warmup_cosine or wsd$",
    ),
    (["optim.clip_norm=0"], "validate", r"^optim\.clip_norm=0\.0: expected null \(off\) or > 0$"),
    (["data.test_fraction=1.0"], "validate", r"^data\.test_fraction=1\.0: expected a fraction in \(0, 1\)$"),
    # Registries of models, datasets and losses, and targets of one's own.
    (
        ["model.name=resnet"],
        "validate",
        r"^model\.name='resnet': unknown model; known models: charlm, convnet, custom, mlp$",
    ),
    (
        ["data.name=mnist"],
        "validate",
        r"^data\.name='mnist': unknown dataset; known datasets: custom, digits, stdlib_text$",
    ),
    (
        ["loss.name=hinge"],
        "validate",
        r"^loss\.name='hinge': unknown loss; known losses: causal_lm, cross_entropy, custom, masked_lm, mse$",
    ),
    (
        ["model=custom"],
        "validate",
        r"^model\._target_: missing; model=custom needs the dotted path to a class or function "
        r"\(e\.g\. model\._target_=my_pkg\.models\.Net\)$",
    ),
    (
        ["model=custom", "model._target_=no_such_pkg.models.Net"],
        "validate",
        r"^model\._target_='no_such_pkg\.models\.Net': cannot import it \(No module named 'no_such_pkg'; is its "
        r"directory on PYTHONPATH\?\)$",
    ),
    (
        ["data=custom", "data._target_=my_project.data.mkae"],
        "validate",
        r"^data\._target_='my_project\.data\.mkae': module my_project\.data has no attribute 'mkae'$",
    ),
    ([*MINE, "data.num_workers=-1"], "validate", r"^data\.num_workers=-1: expected an integer >= 0$"),
    (
        [*MINE, "+model.widht=3"],
        "run",
        r"^model=mlp: (MLP\.)?__init__\(\) got an unexpected keyword argument 'widht' "
        r"\(called with hidden=16, depth=2, widht=3, in_features=8, out_features=3\)$",
    ),
    (
        [*NET, *MINE, "+model.in_features=5"],
        "run",
        r"^model\._target_='my_project\.models\.Net' does not fit data\._target_='my_project\.data\.make' with "
        r"loss=cross_entropy: mat1 and mat2 shapes cannot be multiplied \(64x8 and 5x64\) \(first batch: inputs \(64, "
        r"8\) float32, targets \(64,\) int64\)$",
    ),
    (
        [*MINE, "loss=mse"],
        "run",
        r"^model=mlp does not fit data\._target_='my_project\.data\.make' with loss=mse: mse: outputs of "
        r"shape \(64, 3\) and targets of shape \(64,\) differ; expected the same shape",
    ),
    (
        [*MINE, "loss=custom", "loss._target_=torch.nn.functional.l1_loss", "+loss.smoothing=0.1"],
        "run",
        r"^loss\._target_='torch\.nn\.functional\.l1_loss': got an unexpected keyword argument 'smoothing'$",
    ),
    (
        [*MINE, "loss=custom", "loss._target_=torch.nn.functional.cross_entropy", "+loss.reduction=none"],
        "run",
        r"^loss\._target_='torch\.nn\.functional\.cross_entropy': returned shape \(64,\) torch\.float32; expected a "
        r"floating-point scalar$",
    ),
    (
        TRIPLES,
        "run",
        r"^data\._target_='torch\.utils\.data\.random_split': train item 0 is a 3-tuple; expected a pair \(input, "
        r"target\) or a dict with a 'labels' entry$",
    ),
    (
        ["data=custom", "data._target_=torch.zeros", "+data._args_=[3]"],
        "run",
        r"^data\._target_='torch\.zeros': returned a Tensor; expected \(train, test\) or \(train, test, collate\): "
        r"map-style torch Datasets \(test may be None\)",
    ),
    # Class scores that do not fit the labels, and a model output the loss cannot read.
    (
        [*MINE, "model=custom", "model._target_=torch.nn.Linear", "+model.out_features=5"],
        "run",
        r"^model\._target_='torch\.nn\.Linear' does not fit data\._target_='my_project\.data\.make' with "
        r"loss=cross_entropy: the model "
        r"outputs 5 class scores but data\._target_='my_project\.data\.make' has 3 classes; expected "
        r"model\.out_features=3$",
    ),
    (
        [
            "model=custom",
            "model._target_=torchvision.models.resnet18",
            "data=custom",
            "data._target_=vision.data.make",
            "+data.size=16",
        ],
        "run",
        r"^model\._target_='torchvision\.models\.resnet18' does not fit data\._target_='vision\.data\.make' with "
        r"loss=cross_entropy: the model outputs 1000 class scores but data\._target_='vision\.data\.make' has 10 "
        r"classes; expected \+model\.num_classes=10$",
    ),
    (
        [
            "model=custom",
            "model._target_=fdp.model.builtin.hf_model",
            "+model.model_class=transformers.GPT2LMHeadModel",
            "+model.n_layer=1",
            "+model.n_embd=16",
            "+model.n_head=2",
            "+model.n_positions=32",
            "data=custom",
            "data._target_=hf_text.data.make",
            "data.global_batch_size=4",
            "loss=custom",
            "loss._target_=torch.nn.functional.cross_entropy",
        ],
        "run",
        r"^loss\._target_='torch\.nn\.functional\.cross_entropy' cannot read what the model returns, a "
        r"CausalLMOutputWithCrossAttentions: .*; expected a loss that reads it \(outputs\.logits\), or a built-in one",
    ),
    (
        [*MINE, "+data.n_train=10"],
        "run",
        r"^data\.global_batch_size=64: expected at most the 10 training samples of my_project\.data\.make$",
    ),
    (
        [],
        "validate",
        r"^hydra\.run\.dir='.*': expected a directory without a previous run \(or set trainer\.resume=true",
    ),
]


def test_bad_inputs_are_refused_with_one_line_naming_the_setting(previous_run, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    previous, corrupt = previous_run
    before = {d: _snapshot(d) for d in (previous, corrupt)}
    dirs = {"missing": tmp_path / "missing", "corrupt": corrupt}
    for case, (overrides, where, expected) in enumerate(BAD_INPUTS):
        run_dir = previous
        args = []
        for o in overrides:
            if o.startswith("hydra.run.dir="):
                run_dir = dirs[o[len("hydra.run.dir={") : -1]]
            else:
                args.append(o)
        if not any(a.startswith("model=") for a in args):
            args = [*M, *args]
        if where == "compose":
            with pytest.raises(Exception) as caught:
                make_cfg(*args)
            assert not isinstance(caught.value, ConfigError)
        else:
            cfg = make_cfg("trainer.progress=false", *args)
            if where == "validate":
                with pytest.raises((ConfigError, checkpoint.CheckpointError)) as caught:
                    validate(cfg, run_dir)
            else:
                validate(cfg, run_dir if "trainer.resume=true" in args else None)
                with pytest.raises((ConfigError, checkpoint.CheckpointError)) as caught:
                    run(cfg, run_dir if "trainer.resume=true" in args else tmp_path / f"fresh{case}")
        first_line = str(caught.value).strip().splitlines()[0]
        assert re.search(expected, first_line), (overrides, first_line)
        if where != "compose":
            assert "\n" not in str(caught.value), overrides
    assert len(BAD_INPUTS) >= 20
    for d, snapshot in before.items():
        assert not _unchanged(snapshot, d), d
    assert not (tmp_path / "missing").exists()


# Through the real shell entry point: exit status, the printed line, and the previous run's files.
RECIPE_CASES = [
    # Refused by the workers of a local world, after the launcher started them.
    (
        ["world=local2", "data.global_batch_size=2000", "hydra.run.dir={fresh}"],
        2,
        r"error: data\.global_batch_size=2000: expected at most the 1438 training samples of digits \(rank [01]\)",
    ),
    # Valid config, refused once the checkpoint is read: .hydra/ of the previous run is kept.
    (
        ["trainer.resume=true", "model.hidden=32"],
        2,
        r"error: checkpoint .*/step_00000004\.pt was written with another bucket plan .*",
    ),
    (
        ["trainer.resume=true", "hydra.run.dir={corrupt}"],
        2,
        r"error: checkpoint .*/step_00000004\.pt is unreadable \(truncated or corrupted\?\): .*",
    ),
    # Hydra's own errors, one line naming the key and what was expected (fdp.run.cli).
    (
        ["trainer.max_stpes=5"],
        2,
        r"error: trainer\.max_stpes=5: unknown key; expected a key of trainer \(did you mean trainer\.max_steps\? .*\)",
    ),
    (
        ["model.name=resnet"],
        2,
        r"error: model\.name='resnet': unknown model; known models: charlm, convnet, custom, mlp",
    ),
    (
        ["data.name=mnist"],
        2,
        r"error: data\.name='mnist': unknown dataset; known datasets: custom, digits, stdlib_text",
    ),
    # A model that does not fit the data, refused by the workers before step 1.
    (
        ["world=local2", *MINE, "+model.in_features=5", "hydra.run.dir={fresh2}"],
        2,
        r"error: model=mlp does not fit data\._target_='my_project\.data\.make' with loss=cross_entropy: .*\(rank "
        r"[01]\)",
    ),
]


FRESH_CASE = 1


def test_bad_inputs_through_the_recipe_exit_non_zero_with_one_line(previous_run, tmp_path):
    previous, corrupt = previous_run
    dirs = {"corrupt": corrupt, "fresh": tmp_path / "fresh", "fresh2": tmp_path / "fresh2"}
    before = {d: _snapshot(d) for d in (previous, corrupt)}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath_first(EXAMPLES)}
    procs = []
    # Concurrently, each forked from the preloaded server but one, which runs as the shell starts it
    # (tests/_recipe.py): the imports were most of each case's time. That one is a case of one process (a resume
    # refused once the checkpoint is read): a local world's workers from a fresh interpreter would import again.
    for case, (overrides, status, expected) in enumerate(RECIPE_CASES):
        run_dir = next(
            (dirs[o[len("hydra.run.dir={") : -1]] for o in overrides if o.startswith("hydra.run.dir=")), previous
        )
        args = [
            *M,
            "trainer.progress=false",
            *(o for o in overrides if not o.startswith("hydra.run.dir=")),
            f"hydra.run.dir={run_dir}",
        ]
        command = [sys.executable, str(ROOT / "recipes" / "train.py"), *args]
        procs.append(_recipe.start(command, env=env, cwd=ROOT, fresh=case == FRESH_CASE))
    for (overrides, status, expected), started in zip(RECIPE_CASES, procs):
        proc = started.result(timeout=180)
        stdout, stderr = proc.stdout, proc.stderr
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert proc.returncode == status, (overrides, stderr[-2000:])
        assert len(lines) == 1 and re.fullmatch(expected, lines[0]), lines
        assert "fdp: " not in stdout
    for d, snapshot in before.items():
        assert not _unchanged(snapshot, d), d


# -- 4. non-finite gradients end to end --------------------------------------------------------
DIVERGING = [*TINY, *LOCAL2, "optim.lr=1e30"]  # step 1 is finite, then the weights overflow


def test_nonfinite_raise_names_the_step_and_the_first_bad_parameter(tmp_path):
    with pytest.raises(FloatingPointError) as single:
        run(make_cfg(*TINY, "optim.lr=1e30", "trainer.max_steps=20"), tmp_path / "single")
    with pytest.raises(WorkerFailedError) as two:
        run(make_cfg(*DIVERGING, "trainer.max_steps=20"), tmp_path / "local2")
    pattern = (
        r"non-finite gradient at step (\d+) in parameter '(net\.\d+\.(?:weight|bias))' \(set trainer\.nonfinite=skip "
        r"to skip such steps\)"
    )
    one = re.fullmatch(pattern, str(single.value))
    both = re.fullmatch(pattern + r" \(rank [01]\)", str(two.value))
    assert one and both, (str(single.value), str(two.value))
    assert int(both[1]) >= 2 and (both[1], both[2]) == (one[1], one[2])


def _with_every_ranks_params(cfg, run_dir):
    """``run_rank`` whose checkpoints also hold each rank's own parameters (under ``ranks``)."""
    rank_payload = whole.rank_payload
    whole.rank_payload = lambda state: {**rank_payload(state), "params": dict(state.params)}
    return run_rank(cfg, run_dir)


def test_nonfinite_skip_keeps_every_rank_unchanged_and_counts_skips(tmp_path):
    steps = 6
    cfg = make_cfg(
        *DIVERGING,
        "trainer.nonfinite=skip",
        "trainer.checkpoint_format=whole",  # each rank's params, added to the whole file's rank parts
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.checkpoint_every=1",
        f"trainer.keep_checkpoints={steps}",
    )
    validate(cfg, tmp_path)
    spawn(_with_every_ranks_params, (OmegaConf.to_container(cfg, resolve=True), str(tmp_path)), layout_of(cfg))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged, summary = records[:-1], records[-1]
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    skipped = [r["skipped_steps"] for r in logged]
    assert skipped == [0] + list(range(1, steps))  # step 1 is finite; every later one is skipped
    assert summary["summary"] and summary["skipped_steps"] == steps - 1
    payloads = [
        torch.load(tmp_path / "checkpoints" / f"step_{s:08d}.pt", weights_only=True) for s in range(1, steps + 1)
    ]
    for payload in payloads:
        assert_same_params(payload["ranks"][0]["params"], payload["params"])
        assert_same_params(payload["ranks"][1]["params"], payload["params"])  # every rank alike
    for later in payloads[1:]:  # skipped steps leave params and optimizer state as they were
        assert_same_params(later["params"], payloads[0]["params"])
        for a, b in zip(later["opt_state"], payloads[0]["opt_state"]):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


# -- 5. uneven inputs -----------------------------------------------------------------------
def _epoch_on_own_share(rank, world, n, batch_size):
    """One epoch over this rank's ``dataset_share`` of the first ``n`` digits, in local batches."""
    digits = load_digits()
    data = digits._replace(train_x=digits.train_x[:n], train_y=digits.train_y[:n])
    out = {}
    for drop_last in (False, True):
        torch.manual_seed(0)
        model, params, buffers = functionalize(torch.nn.Linear(64, 10))
        loss_fn = cross_entropy_loss(model)
        mine = dataset_share(data, rank, world, drop_last=drop_last)
        plan = plan_buckets(planner_loss(loss_fn, buffers), params, (mine.train_x[:2], mine.train_y[:2]))
        step = make_train_step(loss_fn, sgd(0.1), plan, comm=Comm())
        state = init_train_state(params, buffers, sgd(0.1), plan)
        for start in range(0, len(mine.train_y), batch_size):
            state, _ = step(state, (mine.train_x[start : start + batch_size], mine.train_y[start : start + batch_size]))
        out[drop_last] = (len(mine.train_y), state.step, state.params)
    return out


def test_uneven_shares_give_every_rank_the_same_steps_and_no_hang(run_ranks):
    n, batch_size = 33, 4
    # Dealt round-robin without evening out, rank 0 would hold 17 samples (5 batches) and
    # rank 1 16 (4 batches): rank 0's fifth step would wait for a peer that never comes.
    assert [-(-len(range(r, n, 2)) // batch_size) for r in range(2)] == [5, 4]
    start = time.monotonic()
    results = run_ranks(_epoch_on_own_share, n, batch_size, timeout_s=15.0)
    assert time.monotonic() - start < 120
    for drop_last, (samples, steps) in {False: (17, 5), True: (16, 4)}.items():
        assert [r[drop_last][:2] for r in results] == [(samples, steps)] * 2
        assert_same_params(results[0][drop_last][2], results[1][drop_last][2])
