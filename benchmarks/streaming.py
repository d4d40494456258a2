"""Benchmark: streaming DiLoCo (fragments, overlap, fp4 outer gradients) against DDP and torchft's DiLoCo.

Every side trains the same char transformer (``fdp.model.builtin.CharTransformer``), or with
``--model gpt2`` transformers' ``GPT2LMHeadModel`` built from a small ``GPT2Config`` (nothing
downloaded), from the same init on the same batches (random windows of the Python standard
library's sources, a seeded stream per rank), two ranks over gloo on this host, with the
same Adam inside (``--lr``, constant or with ``--cosine`` a warm-up and cosine decay):

* ``DDP allreduce``: torch's ``DistributedDataParallel``, a gradient allreduce every step;
* fdp's outer loop (``fdp.step.outer``): DiLoCo every H steps, and streaming DiLoCo with F
  fragments, overlap tau and the pseudo-gradient in fp32 or as fp4 codes (``hooks=lowbit``);
* ``torchft``: torchft 0.2.0's ``DiLoCo`` with the same fragments (the same param sets),
  ``sync_every=H`` (it syncs one fragment every H / F steps, in order), the same delay
  and alpha, an outer Nesterov SGD per fragment. Its quantised allreduce
  (``should_quantize``) runs Triton kernels on CUDA tensors only, so on CPU it is fp32.

Per side: the final loss (mean of the last ``--window`` steps), the bytes each rank sent
over the run and the most in one step (fdp's ``bytes_sent``; DDP and torchft counted the
same way: the payload each rank hands to its allreduce), and the median step time here,
where the network is fast (the overhead of the outer loop's bookkeeping). The time to
DDP's loss at 100 Mbit/s and 1 Gbit/s comes from the time-to-loss model
(``benchmarks/netsim/projection.py``): the measured compute time and bytes of every
step, projected over the link for N = 2..64 nodes, and checked against the two-node runs
on the simulated cluster in ``results/slow_links*.json``.

A table of the goals streaming DiLoCo with fp4 outer gradients was built for (DDP's loss
within 1% at the same samples, >= 100x fewer bytes, peak bytes per step <= 1/F of DiLoCo's,
>= 10x sooner at 100 Mbit/s, torchft's loss and bytes at the same settings) says which the
run met.

    python benchmarks/streaming.py                       # ~30 min on 2 busy cores
    python benchmarks/streaming.py --model gpt2 --variants ddp,streaming_fp4,torchft --name streaming_gpt2
    python benchmarks/streaming.py --d-model 512 --layers 2 --batch 2 --lr 2.5e-4 \
        --variants ddp,streaming_fp4,torchft --name streaming_wide   # where the link sets DDP's pace
    python benchmarks/streaming.py --seed 1 --variants ddp,streaming_fp4 --name streaming_seed1  # another seed
    python benchmarks/streaming.py --spread              # the seeds' gaps to DDP in one table (--model gpt2 too)
    python benchmarks/streaming.py --steps 64 --quick    # a smoke run, to a scratch directory

Writes ``benchmarks/results/<name>.{md,json}`` (``streaming`` by default).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.netsim import projection as P  # noqa: E402

RESULTS = HERE / "results"
MODELS = {"char": "char transformer", "gpt2": "GPT-2 from a GPT2Config"}
TOLERANCE = 0.02  # reaching DDP's loss: a window mean within 2% of it (slow_links.py's rule)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--sync-every", type=int, default=16)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--overlap", type=int, default=1)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.7)
    p.add_argument("--mix", type=_mix, default=0.0, help="streaming's alpha, every streaming side; keep: fdp's default")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's peak rate inside, every side")
    p.add_argument("--warmup", type=int, default=0, help="with --cosine: linear warm-up steps")
    p.add_argument("--cosine", action="store_true", help="inner rate: warm-up then cosine decay to lr/10, every side")
    p.add_argument("--model", choices=("char", "gpt2"), default="char", help="gpt2: GPT2LMHeadModel from a GPT2Config")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="the init's and the batches' seed (0: the tables' runs)")
    p.add_argument("--latency-ms", type=float, default=0.5, help="per link, for the projection")
    p.add_argument("--variants", help="comma list of the variants' keys (default: all)")
    p.add_argument("--quick", action="store_true", help="write to a scratch directory")
    p.add_argument("--name", default="streaming")
    p.add_argument("--reuse", action="store_true", help="tabulate the rows a previous run left in the work directory")
    p.add_argument("--spread", action="store_true", help="only tabulate streaming.json and streaming_seed*.json")
    return p.parse_args()


def _mix(text: str) -> float | None:
    """``--mix``: a number in [0, 1], or ``keep`` (fdp's ``outer.mix=null``: keep the steps since the send)."""
    if text == "keep":
        return None
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"--mix={text}: expected a number in [0, 1] or keep")
    return value


def variants(a) -> dict:
    """name -> settings; ``kind`` is how the projection sends a sync.

    The streaming sides share ``--mix``; torchft has no "keep", so under ``--mix keep`` it runs alpha=0.
    """
    h, f, tau = a.sync_every, a.fragments, a.overlap
    mix = "keep" if a.mix is None else f"{a.mix:g}"
    stream = f"F={f} tau={tau}"
    streaming = {"side": "fdp", "fragments": f, "overlap": tau, "mix": a.mix}
    return {
        "ddp": {"name": "DDP allreduce", "side": "ddp", "kind": "allreduce"},
        "diloco": {"name": f"fdp DiLoCo H={h}", "side": "fdp", "kind": "allreduce", "fragments": 1, "overlap": 0},
        "streaming_fp4": {
            **streaming,
            "name": f"fdp streaming {stream} mix={mix} fp4",
            "kind": "allgather",
            "hook": "fp4",
        },
        "streaming_fp32": {**streaming, "name": f"fdp streaming {stream} mix={mix} fp32", "kind": "allreduce"},
        "torchft": {
            "name": f"torchft DiLoCo {stream} alpha={a.mix or 0:g} fp32",
            "side": "torchft",
            "kind": "allreduce",
            "fragments": f,
            "overlap": tau,
            "mix": a.mix or 0.0,
        },
    }


# ----------------------------------------------------------------------------- data and model
def corpus() -> str:
    """The Python standard library's sources, concatenated in a fixed order (~1 MB)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    text, files = [], sorted(p for p in root.glob("*.py"))
    for path in files:
        text.append(path.read_text(errors="replace"))
        if sum(map(len, text)) > 1_000_000:
            break
    return "".join(text)


def batches(rank: int, steps: int, batch: int, block: int, seed: int = 0) -> tuple[int, list]:
    text = corpus()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    g = torch.Generator().manual_seed(1000 + rank + 7919 * seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - block - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + block] for s in starts])
        y = torch.stack([data[s + 1 : s + block + 1] for s in starts])
        out.append((x, y))
    return len(chars), out


def model(vocab: int, a):
    """The char transformer, or GPT-2 (``transformers.GPT2LMHeadModel``) built from a small config, seeded."""
    from fdp.model.builtin import CharTransformer, hf_model

    torch.manual_seed(a.seed)
    if a.model == "gpt2":
        drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        shape = dict(n_layer=a.layers, n_embd=a.d_model, n_head=4, n_positions=a.block)
        return hf_model("transformers.GPT2LMHeadModel", vocab_size=vocab, **shape, **drop)
    return CharTransformer(vocab_size=vocab, block_size=a.block, d_model=a.d_model, n_layer=a.layers, n_head=4)


def logits(module, x):
    from fdp.model.losses import logits_of

    return logits_of(module(x))


def inner_lr(a):
    """Adam's rate inside: ``--lr``, or warm-up then cosine decay to lr/10 over the run (fdp's schedule)."""
    from fdp.optim import warmup_cosine_schedule

    return warmup_cosine_schedule(a.lr, a.warmup, a.steps, a.lr / 10) if a.cosine else a.lr


def torch_inner(params, a):
    """torch's Adam with the same rates as fdp's: ``lr(t)`` for update ``t + 1``, a LambdaLR stepped after each."""
    opt = torch.optim.Adam(params, lr=a.lr)
    lr = inner_lr(a)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr(t) / a.lr) if a.cosine else None
    return opt, sched


# ----------------------------------------------------------------------------- the sides
def run_ddp(module, data, a) -> list[dict]:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(module)
    opt, sched = torch_inner(ddp.parameters(), a)
    payload = 4 * sum(p.numel() for p in module.parameters())
    rows = []
    for x, y in data:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(logits(ddp, x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        rows.append({"loss": loss.item(), "step_s": time.perf_counter() - t0, "bytes": payload})
    # compute alone: the same step without the allreduce, for the projection
    return _with_compute(rows, module, data, a)


def _with_compute(rows, module, data, a):
    """DDP's rows with the compute seconds of the same steps on a copy, without communication."""
    import copy

    alone = copy.deepcopy(module)
    opt = torch.optim.Adam(alone.parameters(), lr=1e-3)
    for row, (x, y) in zip(rows, data):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(logits(alone, x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        row["compute_s"] = time.perf_counter() - t0
    return rows


def fdp_fragments(module, data, a, fragments: int):
    """The bucket plan fdp's benchmark runs use, and its fragments' param names."""
    from fdp import functionalize, plan_buckets
    from fdp.model.losses import cross_entropy_loss, planner_loss
    from fdp.plan import split_fragments

    fm, params, buffers = functionalize(module)
    loss_fn = cross_entropy_loss(fm)
    plan = plan_buckets(planner_loss(loss_fn, buffers), params, data[0], bucket_cap_mb=0.05, first_bucket_cap_mb=0.05)
    names = [[n for i in run for n in plan.buckets[i].names] for run in split_fragments(plan, fragments)]
    return fm, params, buffers, loss_fn, plan, names


def run_fdp(module, data, a, v) -> list[dict]:
    from fdp import Comm, adam, init_train_state
    from fdp.hooks import allreduce, lowbit
    from fdp.step.outer import init_outer_state, make_outer_step
    from fdp.step.outer_spec import check_outer

    _, params, buffers, loss_fn, plan, _ = fdp_fragments(module, data, a, v["fragments"])
    spec = check_outer(
        {
            "name": "diloco",
            "sync_every": a.sync_every,
            "start_step": 0,
            "lr": a.outer_lr,
            "momentum": a.outer_momentum,
            "nesterov": a.outer_momentum > 0,  # plain SGD (rate 1: local SGD) without momentum
            "overlap": v["overlap"],
            "fragments": v["fragments"],
            "fragment_schedule": "strided",
            "mix": v.get("mix"),
        }
    )
    hook = lowbit("fp4") if v.get("hook") == "fp4" else allreduce()
    state = init_train_state(params, buffers, adam(inner_lr(a)), plan, hook)
    state = state._replace(outer=init_outer_state(spec, params, plan, hook))
    step = make_outer_step(loss_fn, adam(inner_lr(a)), plan, spec, hook, Comm(), donate=True)
    rows = []
    for batch in data:
        t0 = time.perf_counter()
        state, m = step(state, batch)
        rows.append(
            {
                "loss": float(m["loss"]),
                "step_s": time.perf_counter() - t0,
                "bytes": m["bytes_sent"],
                "compute_s": m["compute_s"],
            }
        )
    return rows


def run_torchft(module, data, a, v, rank: int, lighthouse: str, store_port: int) -> list[dict]:
    from datetime import timedelta

    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    *_, names = fdp_fragments(module, data, a, v["fragments"])
    named = dict(module.named_parameters())
    fragments = []
    for group in names:  # the same param sets as fdp's fragments
        part = torch.nn.Module()
        for i, n in enumerate(group):
            part.register_parameter(f"p{i}", named[n])
        fragments.append(part)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=2,
        load_state_dict=None,
        state_dict=None,
        replica_id=f"replica{rank}",
        lighthouse_addr=lighthouse,
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=0,
        world_size=1,
        use_async_quorum=False,
        timeout=timedelta(seconds=120),
        quorum_timeout=timedelta(seconds=120),
    )
    inner, sched = torch_inner(module.parameters(), a)
    outers = [
        torch.optim.SGD(f.parameters(), lr=a.outer_lr, momentum=a.outer_momentum, nesterov=a.outer_momentum > 0)
        for f in fragments
    ]
    sizes = [4 * sum(p.numel() for p in f.parameters()) for f in fragments]
    rows = []
    with DiLoCo(
        manager,
        fragments,
        inner,
        outers,
        sync_every=a.sync_every,
        fragment_sync_delay=v["overlap"],
        fragment_update_alpha=v["mix"],
    ) as diloco:
        for step, (x, y) in enumerate(data, start=1):
            t0 = time.perf_counter()
            inner.zero_grad()
            loss = F.cross_entropy(logits(module, x).flatten(0, 1), y.flatten())
            loss.backward()
            sends = step % (a.sync_every // v["fragments"]) == (a.sync_every // v["fragments"]) - v["overlap"]
            fragment = diloco._current_fragment() if sends else None
            inner.step()
            if sched is not None:
                sched.step()
            rows.append(
                {
                    "loss": loss.item(),
                    "step_s": time.perf_counter() - t0,
                    "bytes": sizes[fragment] if fragment is not None else 0,
                }
            )
    manager.shutdown(wait=False)
    del store
    return rows


def worker(rank: int, world: int, port: int, key: str, a, lighthouse: str, store_port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    v = variants(a)[key]
    vocab, data = batches(rank, a.steps, a.batch, a.block, a.seed)
    module = model(vocab, a)
    if v["side"] == "torchft":
        rows = run_torchft(module, data, a, v, rank, lighthouse, store_port + rank)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        rows = run_ddp(module, data, a) if v["side"] == "ddp" else run_fdp(module, data, a, v)
        dist.destroy_process_group()
    Path(out, f"{key}.rank{rank}.json").write_text(json.dumps(rows))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_side(key: str, a, work: Path) -> list[dict]:
    lighthouse, server = "", None
    if variants(a)[key]["side"] == "torchft":
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=10_000)
        lighthouse = server.address()
    try:
        mp.spawn(worker, args=(2, free_port(), key, a, lighthouse, free_port(), str(work)), nprocs=2)
    finally:
        if server is not None:
            server.shutdown()
    return json.loads(Path(work, f"{key}.rank0.json").read_text())


# ----------------------------------------------------------------------------- the table
def summarise(a, results: dict) -> dict:
    ddp = results["ddp"]["rows"]
    target = statistics.mean(r["loss"] for r in ddp[-a.window :])
    latency = a.latency_ms / 1e3
    table = []
    for key, res in results.items():
        rows, v = res["rows"], res["variant"]
        final = statistics.mean(r["loss"] for r in rows[-a.window :])
        sent = [r["bytes"] for r in rows]
        compute = [r.get("compute_s", r["step_s"]) for r in rows]
        row = {
            "key": key,
            "variant": v["name"],
            "final_loss": final,
            "vs_ddp_loss": final / target - 1,
            "bytes_total": sum(sent),
            "bytes_peak": max(sent),
            "median_step_ms": 1e3 * statistics.median(r["step_s"] for r in rows),
            "median_compute_ms": 1e3 * statistics.median(compute),
            "to_target": {},
            "mean_step_s": {},
        }
        for rate in ("100mbit", "1gbit"):
            for nodes in (2, 8, 64):
                steps = P.projected_steps(compute, sent, v["kind"], nodes, P.RATES[rate], latency, v.get("overlap", 0))
                row["mean_step_s"][f"{rate} N={nodes}"] = statistics.mean(steps)
                row["to_target"][f"{rate} N={nodes}"] = P.time_to(
                    target, [r["loss"] for r in rows], steps, a.window, TOLERANCE
                )
        table.append(row)
    ddp_row = table[0]
    for row in table:
        row["bytes_vs_ddp"] = ddp_row["bytes_total"] / row["bytes_total"] if row["bytes_total"] else None
        row["speedup"] = {k: (ddp_row["to_target"][k][1] / s if s else None) for k, (_, s) in row["to_target"].items()}
    params = ddp_row["bytes_peak"] / 4  # DDP hands every fp32 param to each allreduce
    return {"target": target, "params": params, "rows": table, "goals": goals(a, table), "checks": netsim_checks()}


def goals(a, table: list[dict]) -> list[dict]:
    """Streaming DiLoCo's fp4 row against the goals it was built for, as measured (those its run has rows for)."""
    rows = {row["key"]: row for row in table}
    fp4 = rows.get("streaming_fp4")
    if fp4 is None:
        return []
    out = [
        (
            "loss within 1% of DDP's at the same samples",
            f"{100 * fp4['vs_ddp_loss']:+.2f}%",
            fp4["vs_ddp_loss"] <= 0.01,
        ),
        ("bytes over the run >= 100x fewer than DDP's", f"{fp4['bytes_vs_ddp']:.0f}x", fp4["bytes_vs_ddp"] >= 100),
    ]
    speedup = fp4["speedup"]["100mbit N=2"]
    out.append(
        (
            "reaches DDP's loss >= 10x sooner at 100 Mbit/s (2 nodes; this model, projected)",
            f"{speedup:.1f}x" if speedup else "not reached",
            bool(speedup and speedup >= 10),
        )
    )
    # Where the link sets DDP's pace (slow_links.py), with this benchmark's default outer settings.
    simulated = RESULTS / "slow_links_streaming_100mbit_m07.json"
    if simulated.exists():
        row = next((r for r in json.loads(simulated.read_text())["rows"] if r["variant"].startswith("Streaming")), None)
        if row is not None:
            out.append(
                (
                    f"the same, measured on the simulated cluster ({simulated.stem}.md, charmlp)",
                    f"{row['speedup']:.1f}x" if row["speedup"] else "not reached",
                    bool(row["speedup"] and row["speedup"] >= 10),
                )
            )
    if "diloco" in rows:
        share = fp4["bytes_peak"] / rows["diloco"]["bytes_peak"]
        out.append(
            (f"peak bytes in a step <= 1/{a.fragments} of DiLoCo's", f"1/{1 / share:.0f}", share <= 1 / a.fragments)
        )
    if "torchft" in rows:
        ft = rows["torchft"]
        out.append(
            (
                "loss <= torchft DiLoCo's with the same settings",
                f"{fp4['final_loss']:.4f} vs {ft['final_loss']:.4f}",
                fp4["final_loss"] <= ft["final_loss"],
            )
        )
        out.append(
            (
                "bytes <= torchft DiLoCo's",
                f"{fp4['bytes_total'] / 1e6:.1f} vs {ft['bytes_total'] / 1e6:.1f} MB",
                fp4["bytes_total"] <= ft["bytes_total"],
            )
        )
    return [{"goal": goal, "measured": measured, "met": met} for goal, measured, met in out]


def netsim_checks() -> list[dict]:
    """The model's two-node step times beside the simulated cluster's (charmlp, 19.85M fp32 params)."""
    checks = []
    for name, rate in (("slow_links", "1gbit"), ("slow_links_100mbit", "100mbit")):
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
        outer = rows.get("local SGD H=16")  # its median step has no sync: the compute alone, on that host
        if "DDP allreduce" in rows and outer:
            check = P.check_against(
                rows["DDP allreduce"]["median_ms"], outer["median_ms"], 4 * 19.85e6, "allreduce", rate
            )
            checks.append({"run": f"{name}.json", "rate": rate, "variant": "DDP allreduce (every step)", **check})
            synced = [ms for i, ms in enumerate(outer["step_ms_all"], start=1) if i % 16 == 0]
            check = P.check_against(statistics.median(synced), outer["median_ms"], 4 * 19.85e6, "allreduce", rate)
            checks.append({"run": f"{name}.json", "rate": rate, "variant": "local SGD H=16 (a sync step)", **check})
    return checks


def write(a, summary: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(a), **summary}, indent=1))
    lines = [
        f"# Streaming DiLoCo against DDP and torchft ({MODELS[a.model]}, {a.steps} steps, 2 ranks)",
        "",
        f"Command: `python benchmarks/streaming.py {' '.join(w for w in sys.argv[1:] if w != '--reuse')}`. "
        f"H={a.sync_every}, "
        f"outer Nesterov SGD lr={a.outer_lr} momentum={a.outer_momentum}, Adam({a.lr:g}) inside"
        f"{f' with {a.warmup} warm-up steps and a cosine decay to {a.lr / 10:g}' if a.cosine else ''} on every side, "
        f"{summary['params'] / 1e6:.2f}M params (d_model={a.d_model}, {a.layers} layers), "
        f"{a.batch}x{a.block} tokens per rank and step. DDP's loss (mean of the last "
        f"{a.window} steps): {summary['target']:.4f}.",
        "",
        "| variant | final loss | vs DDP | bytes sent per rank | DDP's / its bytes | peak bytes in a step | "
        "median step ms (fast network) | mean step at 100 Mbit/s (DDP's / its) | "
        "to DDP's loss at 100 Mbit/s | at 1 Gbit/s | 100 Mbit/s, 64 nodes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def reach(row, key):
        _, seconds = row["to_target"][key]
        return f"{seconds:.1f} s ({row['speedup'][key]:.1f}x)" if seconds else "not reached"

    def step_at(row, key="100mbit N=2"):  # the projected step alone: what the link costs, whatever the loss
        seconds = row["mean_step_s"][key]
        return f"{1e3 * seconds:.0f} ms ({summary['rows'][0]['mean_step_s'][key] / seconds:.1f}x)"

    for row in summary["rows"]:
        ratio = f"{row['bytes_vs_ddp']:.0f}x" if row["bytes_vs_ddp"] else "-"
        lines.append(
            f"| {row['variant']} | {row['final_loss']:.4f} | {100 * row['vs_ddp_loss']:+.2f}% | "
            f"{row['bytes_total'] / 1e6:.1f} MB | {ratio} | {row['bytes_peak'] / 1e3:.0f} kB | "
            f"{row['median_step_ms']:.0f} | {step_at(row)} | {reach(row, '100mbit N=2')} | {reach(row, '1gbit N=2')} | "
            f"{reach(row, '100mbit N=64')} |"
        )
    if summary["goals"]:
        lines += ["", "| goal (streaming fp4) | measured | met |", "|---|---|---|"]
        lines += [f"| {g['goal']} | {g['measured']} | {'yes' if g['met'] else 'no'} |" for g in summary["goals"]]
    lines += [
        "",
        f"Times to DDP's loss (a {a.window}-step mean within 2% of it) are projected "
        "(`benchmarks/netsim/projection.py`) from each step's "
        f"measured compute and bytes, {a.latency_ms} ms per link; the model against the simulated cluster:",
        "",
        "| run | rate | variant | measured ms | model ms | model / measured |",
        "|---|---|---|---|---|---|",
    ]
    for c in summary["checks"]:
        lines.append(
            f"| {c['run']} | {c['rate']} | {c['variant']} | {c['measured_ms']:.0f} | {c['model_ms']:.0f} | "
            f"{c['ratio']:.2f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


_SETTINGS = ("steps", "sync_every", "fragments", "overlap", "outer_lr", "outer_momentum", "mix", "lr", "model")


def spread(model: str) -> Path:
    """One row per seed (``results/streaming.json``: seed 0, ``streaming_seed<N>.json``; ``streaming_gpt2*`` for
    GPT-2): how far each run of the same settings ends from DDP's loss, so a single run's gap is read against the
    spread between runs."""
    name = "streaming" if model == "char" else f"streaming_{model}"
    runs = [RESULTS / f"{name}.json", *sorted(RESULTS.glob(f"{name}_seed*.json"))]
    lines = [
        f"# Streaming DiLoCo (fp4) against DDP, seed by seed ({MODELS[model]})",
        "",
        f"Command: `python benchmarks/streaming.py --spread --model {model}`, over `{name}.json` (seed 0) and "
        f"`{name}_seed<N>.json` (`--seed N --variants ddp,streaming_fp4`). The same settings, a different init "
        "and batches per seed.",
        "",
        "Settings (seed 0's run): "
        + ", ".join(f"{k}={v}" for k, v in json.loads(runs[0].read_text())["args"].items() if k in _SETTINGS)
        + ".",
        "",
        "| seed | steps | DDP's loss | fp4 streaming's | vs DDP | torchft's (fp32) | vs DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    gaps, against = [], []
    for path in runs:
        data = json.loads(path.read_text())
        rows = {r["key"]: r for r in data["rows"]}
        if "streaming_fp4" not in rows:
            continue
        gap = rows["streaming_fp4"]["vs_ddp_loss"]
        gaps.append(gap)
        ft = rows.get("torchft")
        if ft is not None:
            against.append(rows["streaming_fp4"]["final_loss"] / ft["final_loss"] - 1)
        lines.append(
            f"| {data['args'].get('seed', 0)} | {data['args']['steps']} | {data['target']:.4f} | "
            f"{rows['streaming_fp4']['final_loss']:.4f} | {100 * gap:+.2f}% | "
            + (f"{ft['final_loss']:.4f} | {100 * ft['vs_ddp_loss']:+.2f}% |" if ft else "- | - |")
        )
    lines += [
        "",
        f"Mean {100 * statistics.mean(gaps):+.2f}%, from {100 * min(gaps):+.2f}% to {100 * max(gaps):+.2f}% over "
        f"{len(gaps)} seeds; {sum(g <= 0.01 for g in gaps)} of {len(gaps)} within 1%."
        + (
            f" Against torchft's loss where both ran ({len(against)} seed{'s' * (len(against) > 1)}): "
            f"{100 * statistics.mean(against):+.2f}% "
            f"on average, from {100 * min(against):+.2f}% to {100 * max(against):+.2f}%."
            if against
            else ""
        ),
    ]
    out = RESULTS / f"{name}_spread.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def main() -> None:
    a = parse_args()
    if a.spread:
        print(f"wrote {spread(a.model)}")
        return
    keys = a.variants.split(",") if a.variants else list(variants(a))
    if keys[0] != "ddp":
        keys = ["ddp", *[k for k in keys if k != "ddp"]]
    # One work directory per model and seed: --reuse must never tabulate another run's rows.
    work = Path(
        os.environ.get("TMPDIR", "/tmp"),
        "fdp-streaming" + (f"-{a.model}" if a.model != "char" else "") + (f"-seed{a.seed}" if a.seed else ""),
    )
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for key in keys:
        t0 = time.perf_counter()
        saved = Path(work, f"{key}.rank0.json")
        rows = json.loads(saved.read_text()) if a.reuse and saved.exists() else run_side(key, a, work)
        results[key] = {"variant": variants(a)[key], "rows": rows}
        rows = results[key]["rows"]
        print(
            f"{variants(a)[key]['name']}: loss {statistics.mean(r['loss'] for r in rows[-a.window :]):.4f}, "
            f"{sum(r['bytes'] for r in rows) / 1e6:.1f} MB sent, {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    out = (RESULTS if not a.quick else work) / a.name
    write(a, summarise(a, results), out)
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
