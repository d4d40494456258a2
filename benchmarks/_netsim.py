"""Shared pieces of the netsim benchmarks (``netsim_multinode.py``, ``bucket_size.py``).

* ``Cluster`` (from ``benchmarks/netsim``): the simulated cluster, network namespaces
  ``fdpsim-node<K>`` with shaped veth links, taken down again on exit, on an exception, on
  Ctrl-C and on SIGTERM/SIGHUP.
* ``run_ranks``: one process per simulated node (``ip netns exec fdpsim-node<K> cmd`` with
  torchrun's environment), each in its own session so that a Ctrl-C or a timeout stops
  exactly the processes started here. Every rank imports fdp from this checkout.
* ``fdp_run``: the user path, ``python recipes/train.py world=torchrun ...`` on every node;
  reads back ``metrics.jsonl`` (one line per step: ``trainer.log_every=1``).
* ``ddp_run``: the same model, data, optimizer and world under
  ``torch.nn.parallel.DistributedDataParallel`` with torch's own comm hook; the worker is
  this file (``python benchmarks/_netsim.py ddp-worker ...``). Model and data are built by
  fdp's own builders from the same Hydra overrides, so both sides start from the same
  weights and see the same batches and their losses can be compared step for step.

Threads: both simulated nodes run on this host's cores. fdp's ``init_distributed`` gives
each rank ``os.cpu_count() // LOCAL_WORLD_SIZE`` torch threads, so the ranks are started
with ``LOCAL_WORLD_SIZE`` = the number of ranks on this host (1 thread each on 2 cores);
the DDP worker sets the same number of threads.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
RUNS = REPO / "benchmarks" / "runs"  # logs and run directories (git ignores it)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.netsim import DEFAULT_PREFIX, Cluster, NetsimError, node_command, node_env  # noqa: E402,F401

PYTHON = sys.executable
WARMUP_STEPS = 2  # fdp's StepTimes skips the first 2 steps; the DDP worker does the same

# The two models of benchmarks/vs_ddp.py, built by the recipe on its own data.
# mlp: 64 digits pixels -> 25 x (Linear(1024) + ReLU) -> 10 classes = 25.27M parameters,
#      global batch 64 = 32 per rank.
# transformer: charlm d_model 512, 5 layers, 8 heads on stdlib_text (vocab ~100), 15.85M
#      parameters, global batch 8 = 4 windows of 64 tokens per rank. A small test split
#      keeps the evaluation that every run does at its end short.
# Optimizer: Adam(1e-3) for both (torch.optim.Adam(fused=True) on the DDP side): with SGD the
# transformer diverges at the recipe's lr 0.1, and neither SGD nor Adam moves the 25-layer
# MLP off chance level within tens of steps (see the report).
MODELS = {
    "mlp": ["model=mlp", "data=digits", "model.hidden=1024", "model.depth=25", "data.global_batch_size=64"],
    # A window char LM (benchmarks/models.py): 19.85M params, 32 tokens per rank; its step is mostly the link's.
    "charmlp": [
        "model=custom",
        "model._target_=benchmarks.models.CharMLP",
        "+model.hidden=3000",
        "+model.depth=3",
        "+model.context=16",
        "data=stdlib_text",
        "data.block_size=32",
        "data.global_batch_size=2",
        "data.test_fraction=0.002",
    ],
    "transformer": [
        "model=charlm",
        "data=stdlib_text",
        "model.d_model=512",
        "model.n_layer=5",
        "model.n_head=8",
        "data.global_batch_size=8",
        "data.block_size=64",
        "data.test_fraction=0.002",
    ],
}
COMMON = [
    "optim=adam",
    "optim.lr=0.001",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.eval_batches=1",
    "trainer.checkpoint_every=0",
    "trainer.progress=false",
]

# hook name -> (fdp recipe overrides, DDP hook spec or None when torch has no such hook)
POWERSGD_START = 2  # plain averaging for steps 1-2 (the untimed warm-up), compression from step 3


def hook_overrides(variant: str) -> list[str]:
    if variant.startswith("powersgd"):
        return ["hooks=powersgd", f"hooks.rank={int(variant[len('powersgd') :])}", f"hooks.start_iter={POWERSGD_START}"]
    return [f"hooks={variant}"]


DDP_HOOKS = {"allreduce", "fp16", "noop", "powersgd1", "powersgd2", "powersgd4", "powersgd8"}


# ----------------------------------------------------------------------------- host load
def _cpu_fields() -> list[float]:
    # /proc/stat's first line: user nice system idle iowait irq softirq steal ..., in clock ticks, all cores.
    return [int(v) / os.sysconf("SC_CLK_TCK") for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def busy_seconds() -> float:
    """CPU seconds this host's cores ran work (user, system, interrupts), all cores together.

    Steal (time the hypervisor ran something else while a core of this VM wanted to run)
    is not work done here: it is ``steal_seconds``.
    """
    user, nice, system, _idle, _iowait, irq, softirq, _steal = _cpu_fields()
    return user + nice + system + irq + softirq


def steal_seconds() -> float:
    """CPU seconds the hypervisor took from this VM's cores (0 on bare metal)."""
    return _cpu_fields()[7]


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class LoadMeter:
    """Load average at start/end and the CPU (in cores) other processes took meanwhile."""

    def __enter__(self):
        self.load0 = os.getloadavg()[0]
        self.busy0, self.child0, self.t0 = busy_seconds(), children_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.load1 = os.getloadavg()[0]
        busy, mine = busy_seconds() - self.busy0, children_cpu_s() - self.child0
        self.own_cores = mine / self.wall if self.wall else 0.0
        self.others_cores = max(0.0, busy - mine) / self.wall if self.wall else 0.0
        return False

    def as_dict(self) -> dict:
        return {
            "load_start": round(self.load0, 2),
            "load_end": round(self.load1, 2),
            "others_cores": round(self.others_cores, 2),
            "own_cores": round(self.own_cores, 2),
            "wall_s": round(self.wall, 1),
        }


# ----------------------------------------------------------------------------- stopping
class _Stop(BaseException):
    """Raised by the SIGTERM/SIGHUP handler, so ``finally`` blocks run."""


def install_signal_handlers() -> None:
    def handler(signum, frame):
        raise _Stop(f"stopped by {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
    # Ctrl-C raises KeyboardInterrupt even where SIGINT was inherited as ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def keeping_partial_results(name: str, meta: dict, started: float, save: Callable[[], None]):
    """Whatever ends a benchmark run, save what it measured and exit with a clear status.

    Ctrl-C (130), SIGTERM/SIGHUP (143), a netsim failure (its message) and any other error
    (1, with a traceback) each add a note to ``meta`` first; ``save()`` runs at the end in
    every case, after ``meta["elapsed_s"]`` is set.
    """
    try:
        yield
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr, flush=True)
        meta["notes"].append("run interrupted (Ctrl-C); results are partial")
        raise SystemExit(130)
    except _Stop as stop:
        meta["notes"].append(f"run {stop}; results are partial")
        raise SystemExit(143)
    except NetsimError as error:
        raise SystemExit(f"{name}: {error}")
    except Exception:
        traceback.print_exc()
        meta["notes"].append("run aborted by an error; results are partial")
        raise SystemExit(1)
    finally:
        meta["elapsed_s"] = time.perf_counter() - started
        save()


# ----------------------------------------------------------------------------- launching ranks
_PORT = [29700 + (os.getpid() % 200) * 10]


def run_meta(started: float, load_before: float, **extra) -> dict:
    """What a results table's header says of the run: when, on what, how loaded, how long (``started``: its
    ``time.perf_counter()``), and the run's own settings (``extra``)."""
    import platform

    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "wall_s": time.perf_counter() - started,
        **extra,
    }


def next_port() -> int:
    _PORT[0] += 1
    return _PORT[0]


def _kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the session this benchmark started for this rank
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_ranks(
    argv: list[str],
    logs: list[Path],
    timeout_s: float,
    netsim: bool,
    extra_env: dict | None = None,
    per_node: int = 1,
    prefix: str = DEFAULT_PREFIX,
) -> list[int]:
    """Run ``argv`` once per rank (``len(logs)`` ranks); return the exit codes.

    ``netsim``: rank K runs in node K // ``per_node`` with torchrun's env; otherwise ``argv``
    runs once on this host (a ``world=local2`` recipe spawns its ranks); ``prefix`` names the cluster's
    namespaces (``Cluster(prefix=...)``). Either way fdp is
    imported from this checkout, whatever else is installed.
    """
    world = len(logs) if netsim else 1
    port = next_port()
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for k, log in enumerate(logs[:world]):
            path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
            env = dict(
                os.environ, PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR", PYTHONPATH=path, **(extra_env or {})
            )
            if netsim:
                node, local = divmod(k, per_node)
                env.update(node_env(node, world, port))
                env.update(RANK=str(k), LOCAL_RANK=str(local), GROUP_RANK=str(node))
                env["LOCAL_WORLD_SIZE"] = str(world)  # all nodes share this host's cores: see the module doc
                cmd = node_command(node, argv, prefix)
            else:
                cmd = list(argv)
            f = open(log, "w")
            files.append(f)
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout_s
        codes = []
        for p in procs:
            left = deadline - time.monotonic()
            try:
                codes.append(p.wait(max(1.0, left)))
            except subprocess.TimeoutExpired:
                for q in procs:
                    _kill_group(q)
                raise TimeoutError(f"ranks still running after {timeout_s:.0f} s; stopped them") from None
            if codes[-1] != 0:  # one rank failed: the others would wait for it until their timeout
                time.sleep(2.0)
                for q in procs:
                    _kill_group(q)
                codes += [q.wait() for q in procs[len(codes) :]]
                break
        return codes
    finally:
        for p in procs:
            _kill_group(p)
        for f in files:
            f.close()


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ----------------------------------------------------------------------------- summaries
def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    i = q * (len(s) - 1)
    lo = int(i)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def summarise_steps(rows: list[dict]) -> dict:
    """rows: per-step dicts with step, loss, step_ms, bytes_sent (+ compute/comm for fdp)."""
    rows = sorted(rows, key=lambda r: r["step"])
    timed = rows[WARMUP_STEPS:] or rows
    ms = [r["step_ms"] for r in timed]
    out = {
        "steps": len(rows),
        "timed_steps": len(timed),
        "median_ms": statistics.median(ms),
        "q1_ms": quantile(ms, 0.25),
        "q3_ms": quantile(ms, 0.75),
        "bytes_per_step": int(statistics.median(r["bytes_sent"] for r in timed)),
        "loss_final": rows[-1]["loss"],
        "loss_last5": statistics.mean(r["loss"] for r in rows[-5:]),
        "losses": [round(r["loss"], 5) for r in rows],
        "step_ms_all": [round(r["step_ms"], 2) for r in rows],
        "bytes_all": [r["bytes_sent"] for r in rows],
    }
    for key in ("compute_ms", "comm_wait_ms"):
        if all(key in r for r in timed):
            out[key] = statistics.median(r[key] for r in timed)
    if all("compute_ms" in r for r in rows):
        out["compute_ms_all"] = [round(r["compute_ms"], 2) for r in rows]
    return out


def merge_reps(reps: list[dict]) -> dict:
    """One row from several repetitions of a run: medians over the timed steps of all of them."""
    ok = [r for r in reps if "median_ms" in r]
    if not ok:
        return reps[-1]
    if len(ok) == 1:
        return ok[0]
    ms = []
    for r in ok:
        ms += r["step_ms_all"][WARMUP_STEPS:]
    out = dict(ok[-1])
    out["median_ms"] = statistics.median(ms)
    out["q1_ms"], out["q3_ms"] = quantile(ms, 0.25), quantile(ms, 0.75)
    out["rep_medians_ms"] = [round(r["median_ms"], 1) for r in ok]
    if all("comm_wait_ms" in r for r in ok):
        out["comm_wait_ms"] = statistics.median(r["comm_wait_ms"] for r in ok)
    out["reps"] = len(ok)
    out["load_reps"] = [r["load"] for r in ok if "load" in r]
    return out


def parse_fdp_log(log: Path) -> dict:
    """Parameter and bucket counts from rank 0's ``[rank0] mlp: 25,267,210 parameters in 5 buckets (...), world 2``."""
    import re

    text = log.read_text(errors="replace") if log.exists() else ""
    m = re.search(r"([\d,]+) parameters(?:,| in) (\d+) buckets.*?world (\d+)", text)
    if not m:
        return {}
    return {"params": int(m.group(1).replace(",", "")), "buckets": int(m.group(2)), "world": int(m.group(3))}


# ----------------------------------------------------------------------------- fdp through the recipe
def fdp_run(
    model: str,
    variant: str,
    steps: int,
    run_dir: Path,
    netsim: bool,
    timeout_s: float,
    extra: list[str] | None = None,
    world: int = 2,
    per_node: int = 1,
) -> dict:
    """``recipes/train.py`` on ``world`` ranks (``per_node`` in each simulated node); per-step metrics from
    ``metrics.jsonl``."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    overrides = [
        "world=torchrun" if netsim else f"world=local{world}",
        *MODELS[model],
        *COMMON,
        *hook_overrides(variant),
        f"trainer.max_steps={steps}",
        *(extra or []),
        f"hydra.run.dir={shown(run_dir)}",  # the ranks run in REPO
    ]
    argv = [PYTHON, str(REPO / "recipes" / "train.py"), *overrides]
    logs = [run_dir.parent / f"{run_dir.name}.rank{k}.log" for k in range(world)]
    codes = run_ranks(argv, logs, timeout_s, netsim, per_node=per_node)
    metrics = run_dir / "metrics.jsonl"
    if any(codes) or not metrics.exists():
        raise RuntimeError(f"fdp {model} {variant} failed (exit codes {codes}); log {logs[0]}:\n{tail(logs[0])}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in records if "step" in r and not r.get("summary")]
    summary = next((r for r in records if r.get("summary")), {})
    out = summarise_steps(rows)
    out.update(parse_fdp_log(logs[0]))
    out["fdp_summary_step_ms"] = summary.get("step_ms")
    out["command"] = " ".join(overrides)
    _drop_checkpoints(run_dir)
    return out


def _drop_checkpoints(run_dir: Path) -> None:
    # The run's final checkpoint (params + optimizer + hook state, ~300 MB for the MLP) is not needed here.
    ckpt = run_dir / "checkpoints"
    if ckpt.is_dir():
        for p in ckpt.iterdir():
            p.unlink()
        ckpt.rmdir()


# ----------------------------------------------------------------------------- DDP
def ddp_run(
    model: str,
    variant: str,
    steps: int,
    out_dir: Path,
    timeout_s: float,
    world: int = 2,
    bucket_cap_mb: float | None = None,
) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"ddp-{model}-{variant}.json"
    out.unlink(missing_ok=True)
    argv = [
        PYTHON,
        str(Path(__file__).resolve()),
        "ddp-worker",
        "--variant",
        variant,
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
    if bucket_cap_mb:
        argv += ["--bucket-cap-mb", str(bucket_cap_mb)]
    argv += ["--", *MODELS[model], *COMMON, f"trainer.max_steps={steps}"]
    logs = [out_dir / f"ddp-{model}-{variant}.rank{k}.log" for k in range(world)]
    codes = run_ranks(argv, logs, timeout_s, netsim=True)
    if any(codes) or not out.exists():
        raise RuntimeError(f"ddp {model} {variant} failed (exit codes {codes}); log {logs[0]}:\n{tail(logs[0])}")
    res = json.loads(out.read_text())
    summary = summarise_steps(res["rows"])
    summary.update({k: res[k] for k in ("params", "buckets", "threads")})
    return summary


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from fdp.run.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def _ddp_hook(ddp, variant: str):
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    if variant == "allreduce":
        ddp.register_comm_hook(None, D.allreduce_hook)
    elif variant == "fp16":
        ddp.register_comm_hook(None, D.fp16_compress_hook)
    elif variant == "noop":
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
    elif variant.startswith("powersgd"):
        state = P.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=int(variant[len("powersgd") :]),
            start_powerSGD_iter=POWERSGD_START,
        )

        def powersgd_waiting(state, bucket):
            # torch's powerSGD_hook races on gloo with more than one bucket (the ranks interleave
            # the P/Q allreduces of different buckets differently): wait inside the hook.
            fut = P.powerSGD_hook(state, bucket)
            fut.wait()
            return fut

        ddp.register_comm_hook(state, powersgd_waiting)
    else:
        raise ValueError(f"torch has no DDP comm hook for {variant!r}")


def ddp_worker(args) -> None:
    """One DDP rank: the recipe's model and data, torch's hook, Adam; per-step times, bytes, losses."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from fdp.data import global_batch, rank_share
    from fdp.procs.allocator import tune_allocator
    from fdp.run.build import build_data, build_module

    tune_allocator()  # as fdp's trainer does in every rank
    cfg = _compose(args.overrides)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    threads = max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    torch.set_num_threads(threads)  # what fdp's init_distributed sets on gloo
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    data = build_data(cfg.data)
    torch.manual_seed(cfg.seed)
    module = build_module(cfg.model, data)
    params = sum(p.numel() for p in module.parameters())
    kwargs = {"bucket_cap_mb": args.bucket_cap_mb} if args.bucket_cap_mb else {}
    ddp = DistributedDataParallel(module, **kwargs)  # broadcasts rank 0's weights
    _ddp_hook(ddp, args.variant)
    if cfg.optim.name != "adam":
        raise SystemExit("the DDP side implements optim=adam only")
    # fused=True: the kernel fdp's trainer steps with (torch's CPU default loops over tensors).
    opt = torch.optim.Adam(
        ddp.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.b1, cfg.optim.b2), eps=cfg.optim.eps, fused=True
    )

    # Count what each collective hands over, as fdp's Comm does (numel * element size).
    sent = [0]
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **kw):
        sent[0] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, *a, **kw)

    dist.all_reduce = counting_all_reduce
    gbs = cfg.data.global_batch_size
    rows = []
    for step in range(args.steps):
        x, y = rank_share(global_batch(data, step, gbs, cfg.seed), rank, world)
        sent[0] = 0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - t0
        nbytes = sent[0]
        mean_loss = loss.detach().clone() / world
        real_all_reduce(mean_loss)  # not counted, not timed (fdp logs its loss the same way)
        rows.append({"step": step + 1, "loss": mean_loss.item(), "step_ms": 1e3 * elapsed, "bytes_sent": nbytes})
        if rank == 0:
            print(
                f"ddp {args.variant} step {step + 1}: {1e3 * elapsed:.0f} ms loss {mean_loss.item():.4f} "
                f"bytes {nbytes}",
                flush=True,
            )
    buckets = None
    try:
        buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
    except Exception:  # noqa: BLE001 - private API, informational only
        pass
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps({"rows": rows, "params": params, "buckets": buckets, "threads": threads}))
        tmp.replace(args.out)


def work_dir(name: str) -> Path:
    """``benchmarks/runs/<name>/<date-time>``: logs and run directories of one invocation."""
    root = RUNS / name / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    return root


def shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it: what tables and logs record."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description="netsim benchmark helper (the DDP worker)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("ddp-worker")
    w.add_argument("--variant", required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--bucket-cap-mb", type=float)
    w.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.cmd == "ddp-worker":
        ddp_worker(args)


if __name__ == "__main__":
    main()
