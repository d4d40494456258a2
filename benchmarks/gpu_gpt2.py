"""GPT-2 124M on one GPU, bf16 autocast: fdp's step time and peak memory against eager torch and ``torch.compile``.

Hugging Face ``GPT2LMHeadModel`` built from its config (vocab 50304, 12 layers, n_embd 768,
1024 positions, dropout 0.1 as GPT-2's config has it; nothing downloaded), batch 8 x 1024
tokens, AdamW (lr 3e-4; torch's fused kernel on the torch side), the same init and batch on
every side, attention through SDPA and through the model's eager code. Variants, each built
in this process after the one before is freed:

* ``eager torch``: the module under ``torch.autocast(bfloat16)``, ``loss.backward()``;
* ``torch.compile``: the same with the module compiled (SDPA only: a compile costs a minute);
* ``fdp``: ``fdp.make_train_step`` with ``precision=Precision("bf16-mixed")``, ``donate=True``,
  as fdp's trainer runs it; its plan traced on two samples, as ``fdp.run.build`` does;
* ``fdp compile``: the same with ``compile=True``.

Per variant: ``build peak``: the most allocated while building (model, plan, first state)
over what was allocated before; ``steady``: allocated between steps; ``step peak``: the most
allocated during the timed steps (``max_memory_allocated`` reset after the warm-up), the
figure compared; ``step ms``: median interval between CUDA events after consecutive steps.

    python benchmarks/gpu_gpt2.py [--steps 10] [--warmup 3] [--attention sdpa eager] [--no-compile]
                                  [--snapshot DIR] [--layers 12] [--batch 8]

``benchmarks/gpu.py`` runs it too and puts the rows in ``benchmarks/results/gpu.md``.
``--snapshot DIR`` records fdp's step with ``torch.cuda.memory._record_memory_history`` and
prints what is alive at its peak, by the source line that allocated it.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

LR = 3e-4
GIB = 2**30
SPEC = {"vocab": 50304, "seq": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "batch": 8}


def _module(spec: dict, attention: str, device: torch.device) -> torch.nn.Module:
    from fdp.model.builtin import hf_model

    torch.manual_seed(0)
    module = hf_model(
        "transformers.GPT2LMHeadModel",
        vocab_size=spec["vocab"],
        n_positions=spec["seq"],
        n_embd=spec["n_embd"],
        n_layer=spec["n_layer"],
        n_head=spec["n_head"],
        attn_implementation=attention,
    )
    return module.to(device)


def _batch(spec: dict, device: torch.device):
    g = torch.Generator().manual_seed(1000)
    tokens = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def torch_train_step(module: torch.nn.Module, device: torch.device, compile: bool):
    """Eager torch's step (``torch.compile``'s with ``compile``) of ``module``: ``step((x, y)) -> loss``."""
    forward = torch.compile(module) if compile else module
    opt = torch.optim.AdamW(module.parameters(), lr=LR, fused=device.type == "cuda")

    def step(batch) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = forward(x).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _torch_step(spec: dict, attention: str, batch, device: torch.device, compile: bool):
    step = torch_train_step(_module(spec, attention, device), device, compile)
    return lambda: step(batch)


def _fdp_step(spec: dict, attention: str, batch, device: torch.device, compile: bool):
    from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
    from fdp.data.batches import head
    from fdp.model.functional import functionalize
    from fdp.model.precision import Precision
    from fdp.optim import adamw
    from fdp.plan import plan_buckets
    from fdp.procs.devices import to_device

    precision = Precision("bf16-mixed")
    model, params, buffers = functionalize(_module(spec, attention, device), keep_module_weights=False)
    params, buffers = to_device(params, device), to_device(buffers, device)
    loss_fn = cross_entropy_loss(model)
    plan = plan_buckets(planner_loss(precision.wrap(loss_fn), buffers), params, head(batch, 2))
    optimizer = adamw(LR)
    train_step = make_train_step(loss_fn, optimizer, plan, donate=True, precision=precision, compile=compile)
    state = [init_train_state(params, buffers, optimizer, plan)]

    def step() -> torch.Tensor:
        state[0], metrics = train_step(state[0], batch)
        return metrics["loss"]

    return step


def measure(name: str, build, warmup: int, steps: int) -> dict:
    """Build one variant, step it, and free it: its memory figures (GiB) and median step time (ms)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step = build()
    torch.cuda.synchronize()
    build_peak = torch.cuda.max_memory_allocated() - start
    first_loss = float(step())
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    steady = torch.cuda.memory_allocated() - start
    torch.cuda.reset_peak_memory_stats()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        step()
        events[i + 1].record()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    times = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    del step
    gc.collect()
    torch.cuda.empty_cache()
    row = {
        "variant": name,
        "build_peak_gib": build_peak / GIB,
        "steady_gib": steady / GIB,
        "peak_gib": peak / GIB,
        "step_ms": statistics.median(times),
        "first_loss": first_loss,
    }
    print(
        f"  {name:>16}: step {row['step_ms']:.1f} ms, step peak {row['peak_gib']:.2f} GiB, "
        f"steady {row['steady_gib']:.2f}, build peak {row['build_peak_gib']:.2f}, first loss {first_loss:.4f}",
        flush=True,
    )
    return row


def snapshot(build, directory: Path, warmup: int = 2, top: int = 15) -> None:
    """Record one step of ``build()``'s variant and print what is alive at its peak, by allocating line."""
    from torch.cuda import memory as cuda_memory

    step = build()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    cuda_memory._record_memory_history(max_entries=200_000)
    step()
    torch.cuda.synchronize()
    snap = cuda_memory._snapshot()
    cuda_memory._record_memory_history(enabled=None)
    directory.mkdir(parents=True, exist_ok=True)
    import pickle

    (directory / "fdp_step.pickle").write_bytes(pickle.dumps(snap))
    live, total, best, best_live = {}, 0, -1, {}
    for event in snap["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] in ("free_completed",) and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > best:
            best, best_live = total, dict(live)
    by_line: dict[str, int] = {}
    for event in best_live.values():
        frames = [f for f in event.get("frames", []) if "/torch/" not in f["filename"] or "/nn/" in f["filename"]]
        where = next((f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames), "?")
        by_line[where] = by_line.get(where, 0) + event["size"]
    print(f"  alive at the step's peak, over what was alive before it: {best / GIB:.2f} GiB", flush=True)
    for where, size in sorted(by_line.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {size / GIB:7.3f} GiB  {where}", flush=True)
    del step
    gc.collect()
    torch.cuda.empty_cache()


def run(attentions: list[str], compile: bool, warmup: int, steps: int, spec: dict = SPEC) -> list[dict]:
    """Every variant, attention by attention; rows with ratios to the torch side of the same attention."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = True
    batch = _batch(spec, device)
    plain = [("eager torch", _torch_step, False), ("fdp", _fdp_step, False)]
    compiled = [("torch.compile", _torch_step, True), ("fdp compile", _fdp_step, True)]
    # The compiled variants last: a compile costs a minute, and a short session keeps the rest.
    runs = [(a, v) for a in attentions for v in plain] + [(a, v) for a in attentions[:1] if compile for v in compiled]
    measured: dict[tuple[str, str], dict] = {}
    for attention, (name, make, jit) in runs:
        print(f"GPT-2 ({spec['n_layer']} layers, batch {spec['batch']}x{spec['seq']}), attention {attention}:")
        build = lambda make=make, jit=jit, attention=attention: make(spec, attention, batch, device, jit)  # noqa: E731
        measured[attention, name] = measure(name, build, warmup, steps)
    rows = []
    for (attention, name), row in measured.items():
        against = "torch.compile" if name == "fdp compile" else "eager torch"
        base = measured[attention, against]
        row.update(attention=attention, against=against)
        row["peak_ratio"], row["time_ratio"] = row["peak_gib"] / base["peak_gib"], row["step_ms"] / base["step_ms"]
        rows.append(row)
    return rows


def table(rows: list[dict], spec: dict = SPEC) -> str:
    lines = [
        f"GPT-2 124M from its config (vocab {spec['vocab']}, {spec['n_layer']} layers), batch {spec['batch']} x "
        f"{spec['seq']}, bf16 autocast, AdamW, dropout 0.1, one GPU:",
        "",
        "| attention | variant | step ms | step peak GiB | steady GiB | build peak GiB | peak vs | time vs "
        "| first loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['attention']} | {r['variant']} | {r['step_ms']:.1f} | {r['peak_gib']:.2f} | {r['steady_gib']:.2f} | "
            f"{r['build_peak_gib']:.2f} | {r['peak_ratio']:.2f}x {r['against']} | {r['time_ratio']:.2f}x | "
            f"{r['first_loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--attention", nargs="+", default=["sdpa", "eager"], choices=["sdpa", "eager"])
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--snapshot", type=Path, help="record fdp's step (SDPA) and print what is alive at its peak")
    parser.add_argument("--layers", type=int, default=SPEC["n_layer"])
    parser.add_argument("--batch", type=int, default=SPEC["batch"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"benchmarks/gpu_gpt2.py: needs a CUDA GPU; torch {torch.__version__} sees none", file=sys.stderr)
        sys.exit(2)
    spec = {**SPEC, "n_layer": args.layers, "batch": args.batch}
    rows = run(args.attention, not args.no_compile, args.warmup, args.steps, spec)
    print(table(rows, spec))
    if args.snapshot:
        device = torch.device("cuda", torch.cuda.current_device())
        snapshot(lambda: _fdp_step(spec, "sdpa", _batch(spec, device), device, False), args.snapshot)


if __name__ == "__main__":
    main()
