"""Out-of-place ``torch._foreach_*`` vs a Python loop over tensors, for fdp.optim's updates.

Times ``fdp.optim.adam(...).update`` and ``sgd(momentum=0.9).update`` against the same math
written as a per-tensor loop (checked equal bit for bit), on 100 tensors of two sizes.
Prints the table and writes it to ``benchmarks/results/optim_foreach.md``.

    python -m benchmarks.optim_foreach [--threads 1] [--device cpu]   # from the repo root
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from fdp import optim as fo

N_TENSORS = 100


def _loop_adam(lr, b1=0.9, b2=0.999, eps=1e-8):
    def update(grads, state, params):
        count = state.count + 1
        bc1, bc2 = 1.0 - b1**count, (1.0 - b2**count) ** 0.5
        updates, mu, nu = {}, {}, {}
        for k, g in grads.items():
            mu[k] = state.mu[k].lerp(g, 1.0 - b1)
            nu[k] = (state.nu[k] * b2).addcmul_(g, g, value=1.0 - b2)
            updates[k] = (mu[k] * (-lr / bc1)).div_(nu[k].sqrt().div_(bc2).add_(eps))
        return updates, fo.AdamState(count, lr, mu, nu)

    return update


def _loop_sgd(lr, momentum):
    def update(grads, state, params):
        bufs = {k: (state.momentum[k] * momentum).add_(g) for k, g in grads.items()}
        return {k: b * -lr for k, b in bufs.items()}, fo.SGDState(state.count + 1, lr, bufs)

    return update


def _time_pair(fns, repeats, inner):
    """Min over interleaved samples: robust to other load on a shared machine."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            fn()  # warm-up, and evens out cache state between the two
            sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            best[i] = min(best[i], (time.perf_counter() - t0) / inner)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "optim_foreach.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    rows = []
    for numel in (256, 4096, 65_536):
        params = {f"p{i}": torch.randn(numel, device=args.device) for i in range(N_TENSORS)}
        grads = {k: torch.randn_like(p) for k, p in params.items()}
        inner = max(3, 20_000 // numel)
        for name, opt, loop_update in (
            ("adam", fo.adam(1e-3), _loop_adam(1e-3)),
            ("sgd momentum", fo.sgd(1e-2, momentum=0.9), _loop_sgd(1e-2, 0.9)),
        ):
            _, state = opt.update(grads, opt.init(params), params)  # count 1: the full code path
            for a, b in zip(
                opt.update(grads, state, params)[0].values(), loop_update(grads, state, params)[0].values()
            ):
                assert torch.equal(a, b), "loop reference diverged from fdp.optim"
            t_foreach, t_loop = _time_pair(
                [lambda: opt.update(grads, state, params), lambda: loop_update(grads, state, params)],
                args.repeats,
                inner,
            )
            rows.append((name, numel, t_foreach * 1e6, t_loop * 1e6, t_loop / t_foreach))

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {args.threads} thread(s)"
    lines = [
        f"# fdp.optim: foreach vs Python loop ({N_TENSORS} float32 tensors, {device}, torch {torch.__version__})",
        "",
        f"Best of {args.repeats} interleaved samples: time of one `update` call (out of place, same results bit for "
        "bit).",
        "",
        "| update | elements/tensor | foreach (us) | loop (us) | loop / foreach |",
        "|---|---:|---:|---:|---:|",
        *(f"| {n} | {numel:,} | {tf:,.0f} | {tl:,.0f} | {r:.2f}x |" for n, numel, tf, tl, r in rows),
        "",
        "On CPU the foreach ops run a C++ loop over the tensors (no fused kernel), so they save",
        "only Python dispatch overhead; with large tensors each op sweeps the whole list (26 MB per",
        "list at 65,536 elements) while the loop keeps one tensor's intermediates in cache.",
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table)


if __name__ == "__main__":
    main()
