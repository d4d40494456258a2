"""torch.func.grad over functional_call against an eager backward, same model, same batch.

    python benchmarks/func_overhead.py [--quick]

Both sides alternate in one process (one torch thread); prints each median and the ratio
and writes benchmarks/results/func_overhead.md.
"""
import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import grad_and_value

from fdp.functional import functionalize
from fdp.models import MLP, CharTransformer, ConvNet

RESULTS = Path(__file__).parent / "results" / "func_overhead.md"


def cases():
    yield "mlp (digits default)", MLP(64, 256, 2, 10), (torch.randn(64, 64), torch.randint(0, 10, (64,)))
    yield "convnet (digits default)", ConvNet(), (torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,)))
    yield "charlm (default)", CharTransformer(101, 64, 128, 4, 4), (torch.randint(0, 101, (32, 64)), torch.randint(0, 101, (32, 64)))
    yield "mlp 25M", MLP(1024, 1024, 24, 10), (torch.randn(32, 1024), torch.randint(0, 10, (32,)))


def eager_step(module, batch):
    module.zero_grad(set_to_none=True)
    x, y = batch
    logits = module(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()


def func_step_fn(module):
    model, params, buffers = functionalize(module)

    def loss(p, b, batch):
        x, y = batch
        logits, new_b = model.apply(p, b, x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), new_b

    grad_fn = grad_and_value(loss, has_aux=True)
    return lambda batch: grad_fn(params, buffers, batch)


def timed(fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reps = 10 if args.quick else 40
    rows = []
    for name, module, batch in cases():
        func_step = func_step_fn(module)
        for _ in range(3):  # warm-up: torch.func's first call imports and traces
            eager_step(module, batch)
            func_step(batch)
        eager, func = [], []
        for _ in range(reps):
            eager.append(timed(eager_step, module, batch))
            func.append(timed(func_step, batch))
        e, f = statistics.median(eager) * 1e3, statistics.median(func) * 1e3
        rows.append((name, e, f, f / e, f - e))
        print(f"{name:26s} eager {e:8.2f} ms   torch.func {f:8.2f} ms   ratio {f / e:.2f}   (+{f - e:.2f} ms)", flush=True)
    load = os.getloadavg()[0]
    lines = [
        f"# torch.func grad vs eager backward ({datetime.date.today()})",
        "",
        f"torch {torch.__version__}, 1 thread, {reps} alternating repetitions, medians; load average {load:.2f} on 2 cores.",
        "",
        "| model | eager ms | torch.func ms | ratio | difference ms |",
        "|---|---:|---:|---:|---:|",
        *[f"| {n} | {e:.2f} | {f:.2f} | {r:.2f} | {d:+.2f} |" for n, e, f, r, d in rows],
    ]
    if not args.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text("\n".join(lines) + "\n")
    print(f"torch.func/eager step time: {max(r[3] for r in rows):.2f}")


if __name__ == "__main__":
    main()
