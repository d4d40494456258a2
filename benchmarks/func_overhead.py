"""torch.func.grad over functional_call against an eager backward, same model, same batch; torch.func's own costs.

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

from fdp.model.builtin import MLP, CharTransformer, ConvNet
from fdp.model.functional import functionalize
from fdp.model.functional import grad_and_value as fdp_grad_and_value

RESULTS = Path(__file__).parent / "results" / "func_overhead.md"


def cases():
    yield "mlp (digits default)", MLP(64, 256, 2, 10), (torch.randn(64, 64), torch.randint(0, 10, (64,)))
    yield "convnet (digits default)", ConvNet(), (torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,)))
    yield (
        "charlm (default)",
        CharTransformer(101, 64, 128, 4, 4),
        (torch.randint(0, 101, (32, 64)), torch.randint(0, 101, (32, 64))),
    )
    yield "mlp 25M", MLP(1024, 1024, 24, 10), (torch.randn(32, 1024), torch.randint(0, 10, (32,)))


def eager_step(module, batch):
    module.zero_grad(set_to_none=True)
    x, y = batch
    logits = module(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()


def func_step_fn(module, engine=grad_and_value):
    """One gradient over ``functional_call``: ``torch.func.grad_and_value``, or fdp's (``vjp``, backward after)."""
    model, params, buffers = functionalize(module)

    def loss(p, b, batch):
        x, y = batch
        logits, new_b = model.apply(p, b, x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), new_b

    grad_fn = grad_and_value(loss, has_aux=True) if engine is grad_and_value else engine(loss)
    return lambda batch: grad_fn(params, buffers, batch)


def timed(fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def torch_costs(reps: int = 30) -> list[tuple[str, float, str]]:
    """Minimal reproductions of the host costs that are torch.func's own, in microseconds.

    Each is a few lines of plain torch (no fdp); one thread, medians of ``reps`` batches.
    """
    import torch
    from torch.func import grad_and_value, vjp

    def median_us(fn, n: int) -> float:
        for _ in range(20):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n)
        return 1e6 * statistics.median(times)

    def chain(x, ops=200):
        for _ in range(ops):
            x = x * 1.0001
        return x.sum()

    def after_transform(f, primal, aux=None):  # what fdp.model.functional.grad_and_value does
        if aux is None:
            value, backward = vjp(f, primal)
        else:
            value, backward, _ = vjp(lambda p: (f(p), aux), primal, has_aux=True)
        with torch.no_grad():
            return backward(torch.ones_like(value), retain_graph=False)

    x = torch.randn(4)

    def eager_chain():
        y = x.detach().requires_grad_()
        return torch.autograd.grad(chain(y), y)

    per_op = {
        "eager autograd": median_us(eager_chain, 5) / 200,
        "torch.func.grad_and_value": median_us(lambda: grad_and_value(chain)(x), 5) / 200,
        "torch.func.vjp, backward after the transform": median_us(lambda: after_transform(chain, x), 5) / 200,
        "no autograd (forward only)": median_us(lambda: torch.no_grad()(chain)(x), 5) / 200,
    }
    tensors = {k: torch.randn(4) for k in range(100)}

    def total(params):
        return sum(t.sum() for t in params.values())

    def eager_total():
        leaves = [t.detach().requires_grad_() for t in tensors.values()]
        return torch.autograd.grad(total(dict(enumerate(leaves))), leaves)

    per_tensor = {
        "eager autograd": median_us(eager_total, 5) / 100,
        "torch.func.grad_and_value": median_us(lambda: grad_and_value(total)(tensors), 5) / 100,
        "torch.func.vjp, backward after the transform": median_us(lambda: after_transform(total, tensors), 5) / 100,
    }
    buffers = {k: torch.zeros(3) for k in range(6)}
    w = torch.randn(10)

    def eager_call():
        v = w.detach().requires_grad_()
        return torch.autograd.grad((v * 2).sum(), v)

    def double_sum(p):
        return (p * 2).sum()

    per_call = {
        "eager autograd": median_us(eager_call, 50),
        "torch.func.grad_and_value": median_us(lambda: grad_and_value(double_sum)(w), 50),
        "torch.func.vjp, backward after the transform": median_us(lambda: after_transform(double_sum, w), 50),
        "the same, an aux of 6 tensors": median_us(lambda: after_transform(double_sum, w, buffers), 50),
    }
    rows = [(f"per op, forward + backward: {k}", v, "us per op") for k, v in per_op.items()]
    rows += [(f"per tensor differentiated (its sum included): {k}", v, "us per tensor") for k, v in per_tensor.items()]
    rows += [(f"one call: {k}", v, "us per call") for k, v in per_call.items()]
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reps = 10 if args.quick else 40
    rows = []
    for name, module, batch in cases():
        func_step, fdp_step = func_step_fn(module), func_step_fn(module, fdp_grad_and_value)
        for _ in range(3):  # warm-up: torch.func's first call imports and traces
            eager_step(module, batch)
            func_step(batch)
            fdp_step(batch)
        eager, func, vjp_after = [], [], []
        for _ in range(reps):
            eager.append(timed(eager_step, module, batch))
            func.append(timed(func_step, batch))
            vjp_after.append(timed(fdp_step, batch))
        e, f, v = (statistics.median(ts) * 1e3 for ts in (eager, func, vjp_after))
        rows.append((name, e, f, f / e, f - e, v, v / e))
        print(
            f"{name:26s} eager {e:8.2f} ms   torch.func {f:8.2f} ms   ratio {f / e:.2f}   (+{f - e:.2f} ms)   "
            f"fdp's vjp {v:8.2f} ms   ratio {v / e:.2f}",
            flush=True,
        )
    costs = torch_costs(10 if args.quick else 30)
    for what, us, unit in costs:
        print(f"{what}: {us:.2f} {unit}", flush=True)
    load = os.getloadavg()[0]
    lines = [
        f"# torch.func grad vs eager backward ({datetime.date.today()})",
        "",
        f"torch {torch.__version__}, 1 thread, {reps} alternating repetitions, medians; load average {load:.2f} on 2 "
        "cores.",
        "",
        "`torch.func` is `grad_and_value` over `functional_call`; fdp's is `fdp.model.functional.grad_and_value` "
        "(`torch.func.vjp`, its backward run once the transform is left), over the same params tree.",
        "",
        "| model | eager ms | torch.func ms | ratio | difference ms | fdp's (vjp) ms | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *[f"| {n} | {e:.2f} | {f:.2f} | {r:.2f} | {d:+.2f} | {v:.2f} | {vr:.2f} |" for n, e, f, r, d, v, vr in rows],
        "",
        "torch.func's own host costs, each reproduced in a few lines of plain torch (`torch_costs`; one thread, "
        "medians): a chain of 200 multiplications of a 4-element tensor (per op, forward and backward), the sum of "
        "100 tensors "
        "differentiated (per tensor), and the gradient of one 10-element function (per call; for `vjp` with an aux of "
        "0 or 6 tensors, as BatchNorm's buffers come back).",
        "",
        "| what | us | per |",
        "|---|---:|---|",
        *[f"| {w} | {us:.2f} | {u.split(' per ')[-1]} |" for w, us, u in costs],
    ]
    if not args.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text("\n".join(lines) + "\n")
    print(f"torch.func/eager step time: {max(r[3] for r in rows):.2f}")


if __name__ == "__main__":
    main()
