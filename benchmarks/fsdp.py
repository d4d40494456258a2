"""Benchmark: fdp's ZeRO stages 0-3 against torch's FSDP2 (``fully_shard``), on 2 and 4 gloo ranks.

A ``CharTransformer`` of ~100M parameters (d_model 1024, 8 blocks, 16 heads, vocab 256;
2 x 64 tokens per rank), Adam (lr 1e-3), gloo on loopback, one torch thread per rank.
fdp runs with ``donate=True``, the ``overlap`` schedule and 25 MiB buckets (first 1 MiB);
stage 3 with ``reshard_after_forward=True``. FSDP2 wraps each block in ``fully_shard``,
then the root (its defaults: params resharded after forward), with ``torch.optim.Adam``.
Both sides build the same seeded model on every rank before sharding it.

Every (world, side) runs in a fresh launch of its ranks, so its memory is its own: build,
warm up, time some steps. Reported per row:

* ``state MiB``: what a rank holds between steps (params, optimizer state, gradient
  buffers; fdp: the step's ``state_mib``; FSDP2: the local shards of its params, Adam's
  moments and gradients, measured the same way, each storage once);
* peak RSS per rank (``VmHWM``, the larger rank): over the timed steps (reset through
  ``/proc/self/clear_refs`` after warm-up), and over building and warm-up;
* median step time (rank 0) and its ratio to FSDP2 and to fdp's stage 0;
* bytes this rank hands to collectives per step (fdp: counted by its ``Comm``; FSDP2:
  counted by wrapping ``torch.distributed``'s all-gather and reduce-scatter, which its
  collectives call).

``--lowp`` runs the low-precision rows instead (2 ranks by default): stage 3 and FSDP2 in
float32, and under bf16 params (fdp ``trainer.precision=bf16-mixed``, whose stage 3 gathers
in bf16; FSDP2 ``MixedPrecisionPolicy(param_dtype=bfloat16)``) with gradients reduced in
float32 or bfloat16 (``bf16/bf16``: fdp ``trainer.reduce_dtype=bfloat16``, FSDP2
``reduce_dtype=bfloat16``). The loss is taken in float32 on both sides (fdp's autocast does
that; FSDP2 is handed float32 logits). Its table is the second section of ``fsdp.md``;
each run rewrites its own section only.

Goals at 4 ranks: stage 3 ``state MiB`` <= 0.30x stage 0; peak RSS <= 0.5x stage 0 and <= FSDP2;
step time <= 1.0x FSDP2 and <= 1.3x stage 0.

    python benchmarks/fsdp.py [--quick] [--lowp] [--worlds 2 4] [--d-model 1024] [--layers 8]

Writes ``benchmarks/results/fsdp.md`` and ``fsdp.json`` (``--quick``: a ~7M model, prints only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make ``fdp`` and this module importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._proc import reset_peak, status_mib  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
LR = 1e-3
BUCKET_CAP_MB, FIRST_BUCKET_CAP_MB = 25.0, 1.0
SIDES = ("fdp stage 0", "fdp stage 1", "fdp stage 2", "fdp stage 3", "FSDP2")
LOWP_SIDES = (
    "fdp stage 3",
    "fdp stage 3 bf16",
    "fdp stage 3 bf16/bf16",
    "FSDP2",
    "FSDP2 bf16",
    "FSDP2 bf16/bf16",
)
SECTIONS = {"stages": SIDES, "lowp": LOWP_SIDES}  # a section of fsdp.md per set of sides, each run rewrites its own


def _side(side: str) -> tuple[int | None, str, str]:
    """``(fdp's stage or None for FSDP2, precision, reduce dtype)`` of a side's name.

    >>> _side("fdp stage 3 bf16/bf16"), _side("FSDP2 bf16")
    ((3, 'bf16-mixed', 'bfloat16'), (None, 'bf16-mixed', 'float32'))
    """
    name, _, dtypes = side.partition(" bf16")
    stage = None if name == "FSDP2" else int(name[-1])
    return stage, ("bf16-mixed" if " bf16" in side else "32-true"), ("bfloat16" if dtypes == "/bf16" else "float32")


def _module(spec: dict):
    from fdp.model.builtin import CharTransformer

    torch.manual_seed(0)
    return CharTransformer(spec["vocab"], spec["seq"], spec["d_model"], spec["n_layer"], spec["n_head"])


def _batch(spec: dict, rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _nbytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def _fdp(spec: dict, stage: int, comm, warmup: int, steps: int, precision: str, reduce_dtype: str) -> dict:
    from fdp import (
        adam,
        cross_entropy_loss,
        functionalize,
        init_train_state,
        make_train_step,
        plan_buckets,
        planner_loss,
    )
    from fdp.comm import Comm
    from fdp.model.precision import Precision
    from fdp.update import zero

    batch = _batch(spec, comm.rank)
    model, params, buffers = functionalize(_module(spec), keep_module_weights=False)
    n_params = sum(p.numel() for p in params.values())
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(
        planner_loss(loss_fn, buffers),
        params,
        batch,
        bucket_cap_mb=BUCKET_CAP_MB,
        first_bucket_cap_mb=FIRST_BUCKET_CAP_MB,
    )
    optimizer = adam(LR)
    step = make_train_step(
        loss_fn,
        optimizer,
        plan,
        comm=Comm(),
        schedule="overlap",
        donate=True,
        zero_stage=stage,
        model=model,
        precision=Precision(precision, reduce_dtype=reduce_dtype),
    )
    state = (
        zero.init_state(params, buffers, optimizer, plan, comm, stage=stage)
        if stage
        else init_train_state(params, buffers, optimizer, plan)
    )
    del params, buffers
    return _timed(
        lambda s: step(s, batch),
        state,
        warmup,
        steps,
        n_params,
        lambda m, s: (m["state_mib"], m["bytes_sent"], float(m["loss"])),
    )


def _fsdp2(spec: dict, comm, warmup: int, steps: int, precision: str, reduce_dtype: str) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    x, y = _batch(spec, comm.rank)
    module = _module(spec)
    n_params = sum(p.numel() for p in module.parameters())
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce_dtype))
        if precision == "bf16-mixed"
        else MixedPrecisionPolicy()
    )
    for block in module.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)
    sent = _count_collectives()

    def step(_):
        t0 = time.perf_counter()
        sent[0] = 0
        logits = module(x).float()  # as fdp's autocast takes the loss: in float32
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, spec["vocab"]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients kept between steps, as fdp's stages keep their buffers
        return None, {"step_s": time.perf_counter() - t0, "loss": loss.detach(), "bytes_sent": sent[0]}

    def held(m, _):
        local = [p.to_local() for p in module.parameters()]
        grads = [p.grad.to_local() for p in module.parameters() if p.grad is not None]
        moments = [
            v.to_local() if hasattr(v, "to_local") else v
            for s in optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        return _nbytes([*local, *grads, *moments]) / 2**20, m["bytes_sent"], float(m["loss"])

    return _timed(step, None, warmup, steps, n_params, held)


def _count_collectives() -> list[int]:
    """Count the bytes this rank hands to all-gathers and reduce-scatters (FSDP2 calls these)."""
    sent = [0]
    # torch 2.13 renamed the flat collectives (all_gather_single, reduce_scatter_single); FSDP2 calls one name or
    # the other.
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(output, input, *args, _original=original, **kwargs):
            sent[0] += input.numel() * input.element_size()
            return _original(output, input, *args, **kwargs)

        setattr(dist, name, counting)
    return sent


def _timed(step, state, warmup: int, steps: int, n_params: int, measure) -> dict:
    from fdp.procs.allocator import release_free_memory

    release_free_memory()  # the whole model both sides built before sharding it (fdp's trainer does the same)
    dist.barrier()
    for _ in range(warmup):
        state, m = step(state)
    warm_peak = status_mib("VmHWM")
    reset_peak()
    times = []
    for _ in range(steps):
        state, m = step(state)
        times.append(m["step_s"])
    state_mib, bytes_sent, loss = measure(m, state)
    return {
        "params": n_params,
        "state_mib": state_mib,
        "ms": [1e3 * t for t in times],
        "bytes_sent": bytes_sent,
        "timed_peak_mib": status_mib("VmHWM"),
        "warm_peak_mib": warm_peak,
        "loss": loss,
    }


def worker(spec: dict, side: str, world: int, warmup: int, steps: int) -> dict:
    from fdp.procs.allocator import tune_allocator
    from fdp.procs.launch import WorldLayout, init_distributed

    # fdp's trainer's allocator policy; FSDP2 gathers and frees params like stage 3 and gets its policy.
    tune_allocator(sharded_params=side.startswith(("fdp stage 3", "FSDP2")))
    comm = init_distributed(WorldLayout("elastic", nproc_per_node=world, backend="gloo", timeout_s=1200))
    torch.set_num_threads(1)
    base = status_mib("VmRSS")
    stage, precision, reduce_dtype = _side(side)
    out = (
        _fsdp2(spec, comm, warmup, steps, precision, reduce_dtype)
        if stage is None
        else _fdp(spec, stage, comm, warmup, steps, precision, reduce_dtype)
    )
    dist.destroy_process_group()
    return {**out, "base_mib": base}


def _run(spec: dict, side: str, world: int, warmup: int, steps: int) -> list[dict]:
    from fdp.procs.launch import WorldLayout, spawn

    layout = WorldLayout("elastic", nproc_per_node=world, backend="gloo", timeout_s=1200)
    results = spawn(worker, (spec, side, world, warmup, steps), layout)
    return [results[r] for r in range(world)]


def _summary(row: dict, rows: list[dict]) -> dict:
    def find(side):
        return next((r for r in rows if r["world"] == row["world"] and r["side"] == side), None)

    ranks = row["ranks"]
    ms = statistics.median(ranks[0]["ms"])
    out = {
        "params_m": ranks[0]["params"] / 1e6,
        "state_mib": max(r["state_mib"] for r in ranks),
        "timed_peak": max(r["timed_peak_mib"] for r in ranks),
        "warm_peak": max(r["warm_peak_mib"] for r in ranks),
        "base": max(r["base_mib"] for r in ranks),
        "ms": ms,
        "mb_sent": ranks[0]["bytes_sent"] / 2**20,
        "loss": ranks[0]["loss"],
    }
    same_policy = "FSDP2" + row["side"][len(_side_fp32(row["side"])) :]  # FSDP2 with the row's precision
    references = (("vs_stage0", "fdp stage 0"), ("vs_fsdp2", "FSDP2"), ("vs_fp32", _side_fp32(row["side"])))
    for key, side in (*references, ("vs_policy", same_policy)):
        ref = find(side)
        if ref is not None:
            ref_ranks = ref["ranks"]
            out[key] = {
                "state": out["state_mib"] / max(r["state_mib"] for r in ref_ranks),
                "peak": out["timed_peak"] / max(r["timed_peak_mib"] for r in ref_ranks),
                "ms": ms / statistics.median(ref_ranks[0]["ms"]),
                "sent": ranks[0]["bytes_sent"] / ref_ranks[0]["bytes_sent"],
            }
    return out


def _side_fp32(side: str) -> str:
    """The float32 side a low-precision one is compared with: its own kind's."""
    return side.partition(" bf16")[0]


def _ratios(s: dict, key: str) -> str:
    r = s.get(key)
    return f"{r['state']:.2f} / {r['peak']:.2f} / {r['ms']:.2f}" if r else "-"


def _line(row: dict, rows: list[dict]) -> str:
    s = _summary(row, rows)
    return (
        f"{row['side']} on {row['world']} ranks: state {s['state_mib']:.0f} MiB, peak RSS {s['timed_peak']:.0f} MiB "
        f"(incl. build {s['warm_peak']:.0f}), step {s['ms']:.0f} ms, sent {s['mb_sent']:.0f} MiB, loss "
        f"{s['loss']:.4f}; vs stage 0 {_ratios(s, 'vs_stage0')}, vs FSDP2 {_ratios(s, 'vs_fsdp2')}"
    )


def _table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# fdp's ZeRO stages against torch's FSDP2 ({meta['date']})",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, {meta['machine']}, {meta['cpus']} CPU cores shared with "
        "other jobs; gloo on loopback, 1 torch thread per rank (4 ranks share 2 cores). Load average (1 min) before "
        f"{meta['load_before']:.1f}, after {meta['load_after']:.1f}.",
        f"CharTransformer {meta['spec']}, Adam lr {LR}. fdp: donate=True, overlap schedule, buckets "
        f"{BUCKET_CAP_MB:g} MiB (first {FIRST_BUCKET_CAP_MB:g}), stage 3 resharding after forward. FSDP2: "
        "fully_shard per block and the root. "
        f"Each row a fresh launch: {meta['warmup']} warm-up + {meta['steps']} timed steps; medians of rank 0. "
        f"Wall {meta['wall_s']:.0f} s.",
        "`state`: params + optimizer state + gradients a rank holds between steps (largest rank). `peak RSS`: largest "
        "rank's VmHWM over the timed steps; `incl. build`: over building and warm-up; `base`: RSS before building. "
        "`sent`: bytes this rank handed to collectives per step. Ratios are state / peak RSS / step time.",
        "",
        "| ranks | side | state MiB/rank | peak RSS MiB | incl. build MiB | base MiB | step ms | sent MiB/step | loss "
        "| vs fdp stage 0 | vs FSDP2 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        s = _summary(row, rows)
        lines.append(
            f"| {row['world']} | {row['side']} ({s['params_m']:.1f}M) | {s['state_mib']:.0f} | {s['timed_peak']:.0f} | "
            f"{s['warm_peak']:.0f} | {s['base']:.0f} | {s['ms']:.0f} | {s['mb_sent']:.0f} | {s['loss']:.4f} | "
            f"{_ratios(s, 'vs_stage0')} | {_ratios(s, 'vs_fsdp2')} |"
        )
    return "\n".join(lines) + "\n"


def _lowp_table(rows: list[dict], meta: dict) -> str:
    lines = [
        "## Low precision: bf16 gathers and reductions at stage 3 against FSDP2's MixedPrecisionPolicy "
        f"({meta['date']})",
        "",
        f"torch {meta['torch']}, {meta['machine']}, {meta['cpus']} CPU cores shared with other jobs "
        f"(load average before {meta['load_before']:.1f}, after {meta['load_after']:.1f}: times are rough, "
        "bytes exact); gloo on loopback, "
        "1 torch thread per rank. "
        f"CharTransformer {meta['spec']}, Adam lr {LR}, {meta['warmup']} warm-up + {meta['steps']} timed steps. "
        "`bf16`: fdp `trainer.precision=bf16-mixed` (stage 3 gathers bf16 params cast from the float32 master "
        "slices), FSDP2 `MixedPrecisionPolicy(param_dtype=bfloat16)`; `bf16/bf16`: gradients reduced in bfloat16 "
        "too (fdp `trainer.reduce_dtype=bfloat16`). `sent`: bytes this rank handed to collectives per step "
        "(fdp on gloo all-reduces each bucket whole where NCCL reduce-scatters it; FSDP2's gloo reduce-scatter is "
        "counted at its input, the whole bucket too). Ratios: sent / state / peak RSS / step time.",
        "",
        "| ranks | side | state MiB/rank | peak RSS MiB | step ms | sent MiB/step | loss | vs float32 side "
        "| vs FSDP2, same precision |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        s = _summary(row, rows)

        def ratios(key):
            r = s.get(key)
            return f"{r['sent']:.2f} / {r['state']:.2f} / {r['peak']:.2f} / {r['ms']:.2f}" if r else "-"

        lines.append(
            f"| {row['world']} | {row['side']} ({s['params_m']:.1f}M) | {s['state_mib']:.0f} | {s['timed_peak']:.0f} | "
            f"{s['ms']:.0f} | {s['mb_sent']:.1f} | {s['loss']:.4f} | {ratios('vs_fp32')} | {ratios('vs_policy')} |"
        )
    return "\n".join(lines) + "\n"


def _sections(path: Path, section: str, run: dict) -> dict:
    """The runs ``fsdp.json`` holds, by section, with ``run`` in ``section`` (a file of one run is ``stages``)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    runs = old.get("sections", {"stages": old} if "rows" in old else {})
    return {**runs, section: run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~7M model, 1 warm-up + 2 timed steps, print only")
    parser.add_argument("--lowp", action="store_true", help="the low-precision rows (bf16 gathers and reductions)")
    parser.add_argument("--worlds", type=int, nargs="+")
    parser.add_argument("--sides", nargs="+", choices=list(dict.fromkeys(SIDES + LOWP_SIDES)))
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    section = "lowp" if args.lowp else "stages"
    args.sides = args.sides or list(SECTIONS[section])
    args.worlds = args.worlds or ([2] if args.lowp else [2, 4])
    d_model, layers = (256, 8) if args.quick else (args.d_model, args.layers)
    spec = {"vocab": 256, "seq": 64, "d_model": d_model, "n_layer": layers, "n_head": max(1, d_model // 64), "batch": 2}
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    rows = []
    for world in args.worlds:
        for side in args.sides:
            row = {"world": world, "side": side, "ranks": _run(spec, side, world, warmup, steps)}
            rows.append(row)
            print(_line(row, rows), flush=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "wall_s": time.perf_counter() - t0,
        "warmup": warmup,
        "steps": steps,
        "spec": spec,
    }
    print((_lowp_table if args.lowp else _table)(rows, meta))
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        runs = _sections(RESULTS / "fsdp.json", section, {"meta": meta, "rows": rows})
        (RESULTS / "fsdp.json").write_text(json.dumps({"sections": runs}, indent=1))
        tables = [(_lowp_table if name == "lowp" else _table)(run["rows"], run["meta"]) for name, run in runs.items()]
        (RESULTS / "fsdp.md").write_text("\n".join(tables))


if __name__ == "__main__":
    main()
