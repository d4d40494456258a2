"""GPT-2 124M on one GPU: tokens per second of fdp's step against torch's, where the time goes, and fp8.

What `benchmarks/results/gpu.md`'s throughput section is made of (one call on a lent GPU machine):

* ``eager``: eager torch against fdp uncompiled, SDPA, batch 8 x 1024, in two rounds (torch, fdp,
  torch, fdp) so that one ratio is confirmed by a second in the same process;
* ``compiled``: ``torch.compile(module)`` against fdp's ``compile=True`` step at ``--batch``
  (default 16 x 1024), each trained ``--curve`` steps from the same init on the same cycle of
  batches, fdp uncompiled too: tokens per second over the steps after the compile, and the loss
  curves' largest difference to the eager run's (bf16 noise is ~1e-2);
* ``profile``: three steps of each compiled side under ``torch.profiler``: the kernels' time by
  kind (matmuls, attention, fused Triton kernels, optimizer, copies) and the GPU's busy fraction,
  and the top kernels, written to ``--out``;
* ``fp8``: torchao's float8 training (tensorwise scaling) on every linear layer, compiled, against
  the same model in bf16, torch's side and fdp's side; a side that does not run says why in one line.

GPT-2's ``Conv1D`` layers are replaced by the ``nn.Linear`` they equal (weight transposed) in every
variant, so that float8 training, which converts ``nn.Linear``, sees every matmul of the blocks.

With dropout (GPT-2's 0.1), the compiled and eager sides draw different masks, so their loss
curves part by more than bf16 noise: compare curves with ``--dropout 0``.

    python benchmarks/gpu_throughput.py [--batch 16] [--dropout 0.1] [--curve 200] [--out DIR] [--skip fp8 ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
from gpu_gpt2 import LR, SPEC, _module, torch_train_step  # noqa: E402

KINDS = {  # kernel name fragments by kind, first match wins (cuDNN's attention names hold "sm90", Triton's "copy")
    "attention": ("sdpa", "flash", "fmha", "attention", "cudnn::fusion"),
    "cross-entropy": ("log_softmax", "nll_loss", "cross_entropy", "softmax"),
    "fused (Triton)": ("triton",),
    "optimizer": ("adam", "multi_tensor", "foreach", "optimizer"),
    "matmul": ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "sm90_"),
    "norms and sums": ("reduce_kernel",),
    "copy": ("copy", "memcpy", "memset", "cat", "fill", "elementwise_kernel"),
}


def linearize(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every transformers ``Conv1D`` (``x @ W + b``) with the ``nn.Linear`` it equals."""
    for name, child in list(module.named_children()):
        if type(child).__name__ == "Conv1D":
            nx, nf = child.weight.shape
            linear = torch.nn.Linear(nx, nf, device=child.weight.device, dtype=child.weight.dtype)
            with torch.no_grad():
                linear.weight.copy_(child.weight.t())
                linear.bias.copy_(child.bias)
            setattr(module, name, linear)
        else:
            linearize(child)
    return module


def gpt2(spec: dict, device: torch.device, fp8: bool = False) -> torch.nn.Module:
    module = linearize(_module(spec, "sdpa", device))
    for layer in module.modules():  # GPT-2's config has 0.1; llm.c and nanoGPT's pretraining runs use none
        if isinstance(layer, torch.nn.Dropout):
            layer.p = spec["dropout"]
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        def wanted(m: torch.nn.Module, fqn: str) -> bool:
            return isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0

        convert_to_float8_training(
            module, config=Float8LinearConfig.from_recipe_name("tensorwise"), module_filter_fn=wanted
        )
    return module


def batches(spec: dict, device: torch.device, count: int = 8) -> list:
    g = torch.Generator().manual_seed(1000)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=g)
        out.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return out


def torch_side(spec: dict, device: torch.device, compile: bool, fp8: bool = False):
    return torch_train_step(gpt2(spec, device, fp8), device, compile)


def fdp_side(spec: dict, device: torch.device, compile: bool, fp8: bool = False):
    from fdp import cross_entropy_loss, init_train_state, make_train_step, planner_loss
    from fdp.model.functional import functionalize
    from fdp.model.precision import Precision
    from fdp.optim import adamw
    from fdp.plan import plan_buckets
    from fdp.procs.devices import to_device

    precision = Precision("bf16-mixed")
    model, params, buffers = functionalize(gpt2(spec, device, fp8), keep_module_weights=False)
    params, buffers = to_device(params, device), to_device(buffers, device)
    loss_fn = cross_entropy_loss(model)
    sample = batches({**spec, "batch": 2}, device, 1)[0]
    plan = plan_buckets(planner_loss(precision.wrap(loss_fn), buffers), params, sample)
    optimizer = adamw(LR)
    train_step = make_train_step(loss_fn, optimizer, plan, donate=True, precision=precision, compile=compile)
    state = [init_train_state(params, buffers, optimizer, plan)]

    def step(batch) -> torch.Tensor:
        state[0], metrics = train_step(state[0], batch)
        return metrics["loss"]

    return step


def train(name: str, build, data: list, steps: int, skip: int) -> dict:
    """Build a variant and step it ``steps`` times over ``data``: median ms after ``skip`` steps, losses, compile s."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    step = build()
    losses = [step(data[0])]
    torch.cuda.synchronize()
    first_s = time.perf_counter() - started
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    events[0].record()
    for i in range(1, steps):
        losses.append(step(data[i % len(data)]))
        events[i].record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in zip(events, events[1:])][skip:]
    row = {
        "variant": name,
        "step_ms": statistics.median(times),
        "first_step_s": first_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": [float(v) for v in torch.stack(losses).float().cpu()],
        "step": step,
    }
    print(
        f"  {name:>22}: {row['step_ms']:.2f} ms/step, first step (build+compile) {first_s:.1f} s, "
        f"peak {row['peak_gib']:.2f} GiB, loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}",
        flush=True,
    )
    return row


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, parts in KINDS.items() if any(p in low for p in parts)), "other")


def profile(name: str, step, data: list, out: Path, steps: int = 3) -> str:
    """Profile ``steps`` steps: the kernels' time by kind, the GPU's busy fraction, the top kernels to a file."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for i in range(steps):
            step(data[i % len(data)])
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1e3
    by_kind: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device_us <= 0 or getattr(event, "device_type", None) is None:
            continue
        if "cuda" not in str(event.device_type).lower():
            continue
        by_kind[kind_of(event.key)] = by_kind.get(kind_of(event.key), 0.0) + device_us / 1e3
        kernels.append((device_us / 1e3, event.count, event.key))
    busy = sum(by_kind.values())
    lines = [f"{name}: {steps} steps, wall {wall_ms:.1f} ms, GPU busy {busy:.1f} ms ({busy / wall_ms:.0%})"]
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:>15}: {ms / steps:7.2f} ms/step  {ms / busy:5.1%}")
    top = [
        f"  {ms / steps:8.3f} ms/step  x{count // steps:<4} {key[:110]}"
        for ms, count, key in sorted(kernels)[::-1][:30]
    ]
    (out / f"profile_{name.replace(' ', '_').replace('.', '')}.txt").write_text("\n".join(lines + ["", *top]) + "\n")
    return "\n".join(lines)


def curve_gap(a: dict, b: dict) -> float:
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.1, help="every dropout layer's rate (llm.c trains with 0)")
    parser.add_argument("--curve", type=int, default=200, help="steps of each compiled side (and fdp eager)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/runs/gpu_throughput"))
    parser.add_argument("--skip", nargs="*", default=[], choices=["eager", "compiled", "profile", "fp8"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"benchmarks/gpu_throughput.py: needs a CUDA GPU; torch {torch.__version__} sees none", file=sys.stderr)
        sys.exit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", flush=True)
    SPEC["dropout"] = args.dropout
    tokens = lambda spec, row: spec["batch"] * spec["seq"] / row["step_ms"] * 1e3  # noqa: E731

    if "eager" not in args.skip:
        spec = {**SPEC, "batch": 8}
        data = batches(spec, device)
        print(f"eager, SDPA, batch {spec['batch']} x {spec['seq']}, two rounds:", flush=True)
        for round_ in (1, 2):
            t = train(f"eager torch ({round_})", lambda: torch_side(spec, device, False), data, 25, 5)
            f = train(f"fdp ({round_})", lambda: fdp_side(spec, device, False), data, 25, 5)
            print(f"  round {round_}: fdp / eager torch = {f['step_ms'] / t['step_ms']:.3f}", flush=True)
            del t, f

    spec = {**SPEC, "batch": args.batch}
    data = batches(spec, device)
    if "compiled" not in args.skip:
        print(f"compiled, SDPA, batch {spec['batch']} x {spec['seq']}, {args.curve} steps each:", flush=True)
        skip = min(10, args.curve // 4)
        rows = {}
        for name, make, jit in (
            ("fdp eager", fdp_side, False),
            ("torch.compile", torch_side, True),
            ("fdp compile", fdp_side, True),
        ):
            rows[name] = train(name, lambda make=make, jit=jit: make(spec, device, jit), data, args.curve, skip)
            if jit and "profile" not in args.skip:
                print(profile(name, rows[name]["step"], data, args.out), flush=True)
            rows[name].pop("step")
            torch.cuda.empty_cache()
        for name in ("torch.compile", "fdp compile"):
            print(
                f"  {name}: {tokens(spec, rows[name]) / 1e3:.0f}k tokens/s; loss curve vs fdp eager: largest gap "
                f"{curve_gap(rows[name], rows['fdp eager']):.4f} over {args.curve} steps",
                flush=True,
            )
        ratio = rows["fdp compile"]["step_ms"] / rows["torch.compile"]["step_ms"]
        print(f"  fdp compile / torch.compile = {ratio:.3f}", flush=True)

    if "fp8" not in args.skip:
        print(f"fp8 (torchao float8, tensorwise) against bf16, compiled, batch {spec['batch']}:", flush=True)
        for name, make in (("torch", torch_side), ("fdp", fdp_side)):
            try:
                bf16 = train(f"{name} bf16", lambda make=make: make(spec, device, True), data, 40, 10)
                bf16.pop("step")
                fp8 = train(f"{name} fp8", lambda make=make: make(spec, device, True, True), data, 40, 10)
                fp8.pop("step")
                print(
                    f"  {name}: fp8 / bf16 step = {fp8['step_ms'] / bf16['step_ms']:.3f}, loss at 40 steps "
                    f"{fp8['losses'][-1]:.4f} vs {bf16['losses'][-1]:.4f}",
                    flush=True,
                )
            except Exception as error:  # one line per side: the figure is what this run is for
                print(
                    f"  {name} fp8: did not run: {type(error).__name__}: {str(error).splitlines()[0][:300]}", flush=True
                )
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
