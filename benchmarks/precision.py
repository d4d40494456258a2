"""Step time per precision: fdp eager and compiled against plain torch and DDP in the same precision.

    python benchmarks/precision.py [--size tiny|small|25m] [--steps N] [--precisions 32-true,bf16-mixed]
                                   [--no-compile] [--quick]

One process, one rank (DDP as a world of one: gloo on CPU, NCCL on CUDA), a char
transformer on random tokens, AdamW (torch's fused kernel on both sides where it
applies). Each variant warms up, then steps ``--steps`` times; the table gives the
median step time, its ratio to DDP in the same precision and to eager float32, and the
loss after the last step (same init, same batches on every row). ``32-true+tf32`` is
float32 with ``torch.set_float32_matmul_precision("high")``. Runs on CUDA where there is
one, else on CPU; writes benchmarks/results/precision_<device>.md (not with --quick).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fdp
from fdp.model.builtin import CharTransformer
from fdp.model.precision import Precision, check_precision

SIZES = {  # vocab, block, d_model, n_layer, n_head, batch
    "tiny": (64, 64, 64, 2, 4, 8),
    "small": (101, 128, 256, 4, 4, 16),
    "25m": (101, 256, 512, 8, 8, 32),
}


def _batches(vocab, block, batch, n, device):
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(0, vocab, (batch, block), generator=g).to(device) for _ in range(2)) for _ in range(n)]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def torch_step(module, precision: Precision, ddp: bool, device):
    """Plain torch: autocast, GradScaler for 16-mixed, bf16 weights for bf16-true."""
    if precision.name == "bf16-true":
        module = module.to(torch.bfloat16)
    if ddp:
        module = torch.nn.parallel.DistributedDataParallel(module)
    fused = device.type in ("cpu", "cuda") and (device.type == "cuda" or precision.param_dtype == torch.float32)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-4, weight_decay=0.01, fused=fused)
    scaler = torch.amp.GradScaler(device.type) if precision.loss_scaling else None

    def step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with precision.autocast(device.type):
            logits = module(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss.detach()

    return step


def fdp_step(module, precision: Precision, compile: bool, example):
    model, params, buffers = fdp.functionalize(module, keep_module_weights=False)
    params, buffers = precision.cast(params), precision.cast(buffers)
    loss_fn = fdp.cross_entropy_loss(model)
    plan = fdp.plan_buckets(fdp.planner_loss(loss_fn, buffers), params, example)
    optimizer = fdp.adamw(3e-4, weight_decay=0.01)
    train_step = fdp.make_train_step(loss_fn, optimizer, plan, precision=precision, donate=True, compile=compile)
    state = fdp.init_train_state(params, buffers, optimizer, plan, precision=precision)

    def step(batch):
        nonlocal state
        state, metrics = train_step(state, batch)
        return metrics["loss"]

    return step


def count_casts() -> list[str]:
    """Dtype casts (``aten._to_copy``) in one forward + backward: eager autocast against autocast under
    ``grad_and_value``.

    Counted below autograd with a dispatch mode, on the CPU; a model whose every weight is
    used once (the char transformer) and one that applies the same Linear four times.
    """
    from collections import Counter

    from torch.func import grad_and_value
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.down, self.up, self.ops = Counter(), Counter(), 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self.ops += 1
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") is not None:
                side = self.down if kwargs["dtype"] == torch.bfloat16 else self.up
                side[tuple(args[0].shape)] += 1
            return func(*args, **kwargs)

    class Reused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            for _ in range(4):
                x = self.linear(x)
            return x

    torch.manual_seed(0)
    cases = [
        (
            "char transformer (small)",
            CharTransformer(101, 128, 256, 4, 4),
            torch.randint(0, 101, (2, 128)),
            torch.randint(0, 101, (2, 128)),
        ),
        ("one Linear applied 4 times", Reused(), torch.randn(8, 16), torch.randint(0, 16, (8,))),
    ]
    bf16 = Precision("bf16-mixed")
    lines = ["| model | path | casts to bf16 | casts to fp32 | ops below autograd |", "|---|---|---:|---:|---:|"]
    for name, module, x, y in cases:
        with Casts() as eager:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = module(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            loss.backward()
        model, params, buffers = fdp.functionalize(module)
        grad_fn = grad_and_value(bf16.wrap(fdp.cross_entropy_loss(model)), has_aux=True)
        with Casts() as func:
            grad_fn(params, buffers, (x, y))
        for path, c in (("eager autocast", eager), ("grad_and_value + autocast", func)):
            lines.append(f"| {name} | {path} | {sum(c.down.values())} | {sum(c.up.values())} | {c.ops} |")
    return lines


def _init_world(device):
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=SIZES, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--precisions", default=None, help="comma-separated; 32-true+tf32 is float32 with TF32 matmuls")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--casts", action="store_true", help="only count autocast's casts, eager against grad_and_value"
    )
    args = parser.parse_args()
    if args.casts:
        print("\n".join(count_casts()))
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or ("25m" if device.type == "cuda" else "small")
    steps = args.steps or (5 if args.quick else 25 if device.type == "cuda" else 12)
    default = "32-true,32-true+tf32,bf16-mixed,16-mixed,bf16-true" if device.type == "cuda" else "32-true,bf16-mixed"
    names = (args.precisions or default).split(",")
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    vocab, block, d_model, n_layer, n_head, batch = SIZES[size]
    batches = _batches(vocab, block, batch, steps + 3, device)
    warmup = 3
    _init_world(device)
    # Every variant is built first, then they step round-robin, so a machine whose load
    # changes during the run slows them alike.
    runs = []
    for name in names:
        precision = check_precision(name.removesuffix("+tf32"), device.type)
        variants = [("torch eager", "torch"), ("DDP", "ddp"), ("fdp", "fdp")]
        if not args.no_compile:
            variants.append(("fdp compiled", "fdp_compiled"))
        for label, kind in variants:
            torch.manual_seed(0)
            module = CharTransformer(vocab, block, d_model, n_layer, n_head).to(device)
            if kind in ("torch", "ddp"):
                step = torch_step(module, precision, kind == "ddp", device)
            else:
                step = fdp_step(module, precision, kind == "fdp_compiled", batches[0])
            runs.append({"precision": name, "variant": label, "step": step, "times": [], "warmup_s": 0.0})
    for i, tokens in enumerate(batches):
        for r in runs:
            torch.set_float32_matmul_precision("high" if r["precision"].endswith("+tf32") else "highest")
            _sync(device)
            t0 = time.perf_counter()
            r["loss"] = float(r["step"](tokens))
            _sync(device)
            if i >= warmup:
                r["times"].append(time.perf_counter() - t0)
            else:
                r["warmup_s"] += time.perf_counter() - t0
    rows = []
    for r in runs:
        rows.append(
            {
                "precision": r["precision"],
                "variant": r["variant"],
                "ms": statistics.median(r["times"]) * 1e3,
                "loss": r["loss"],
                "setup_s": r["warmup_s"],
            }
        )
        print(
            f"{r['precision']:14s} {r['variant']:13s} {rows[-1]['ms']:9.2f} ms/step  loss {r['loss']:.4f}  (warm-up "
            f"{r['warmup_s']:.1f} s)",
            flush=True,
        )
    del runs
    dist.destroy_process_group()
    ddp_ms = {r["precision"]: r["ms"] for r in rows if r["variant"] == "DDP"}
    fp32 = next((r["ms"] for r in rows if r["precision"] == "32-true" and r["variant"] == "torch eager"), None)
    params = sum(p.numel() for p in CharTransformer(vocab, block, d_model, n_layer, n_head).parameters())
    load = os.getloadavg()
    hw = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads"
    )
    lines = [
        f"# Step time per precision, fdp against torch and DDP ({datetime.date.today()}, {device.type})",
        "",
        f"torch {torch.__version__}; {hw}; char transformer `{size}` ({params / 1e6:.1f}M parameters), batch "
        f"{batch}x{block},"
        f" AdamW; medians of {steps} steps after {warmup} warm-up steps (the compiled rows compile in the warm-up: see"
        f" 'warm-up s'); variants step round-robin, each step timed alone (the device synchronised before and after"
        f" it, so a host that queues ahead gains nothing here; `gpu.py` times steps back to back). Load average"
        f" {load[0]:.1f} / {load[1]:.1f} (1 / 5 min).",
        "",
        "| precision | variant | ms/step | vs DDP same precision | vs torch eager 32-true | loss after the last step "
        "| warm-up s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        vs_ddp = r["ms"] / ddp_ms[r["precision"]] if r["precision"] in ddp_ms else float("nan")
        vs_fp32 = r["ms"] / fp32 if fp32 else float("nan")
        lines.append(
            f"| {r['precision']} | {r['variant']} | {r['ms']:.2f} | {vs_ddp:.2f} | {vs_fp32:.2f} | {r['loss']:.4f} | "
            f"{r['setup_s']:.1f} |"
        )
    if device.type == "cpu":
        lines += ["", "Autocast's casts in one forward + backward (`--casts`):", "", *count_casts()]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        out = Path(__file__).parent / "results" / f"precision_{device.type}.md"
        out.parent.mkdir(exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
