"""One torchft replica group (one process) of ``benchmarks.elastic``: the run fdp trains, under torchft's ``Manager``.

The same model, data, batch split and optimizer as the fdp runs: fdp's char transformer
built from the same config (``fdp.run.build``), this replica's third of each global
batch (``fdp.data.train_batches``), torch's Adam; torchft's ``DistributedDataParallel``
and ``Optimizer`` wrappers over a gloo process group, a quorum each step through the
lighthouse (``TORCHFT_LIGHTHOUSE``), a restarted replica healed from a peer over HTTP.
Each committed step is a line of ``--out``: ``time step participants loss``.

    python -m benchmarks._torchft_replica --replica 2 --out r2.txt -- <fdp overrides>
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time

import torch


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from omegaconf import OmegaConf
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    from fdp.data import train_batches
    from fdp.model.losses import build_loss
    from fdp.run.build import build_data, build_module
    from fdp.run.compose import compose

    cfg = compose(*args.overrides)
    data = build_data(cfg.data)
    torch.manual_seed(cfg.seed)
    module = build_module(cfg.model, data)
    criterion = build_loss(OmegaConf.to_container(cfg.loss, resolve=True))
    inner = torch.optim.Adam(module.parameters(), lr=cfg.optim.lr)

    def state_dict():
        return {"model": module.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state):
        module.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # this group's
    timeout = datetime.timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=60),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=port,
        replica_id=f"replica_{args.replica}",
        hostname="127.0.0.1",
    )
    model = DistributedDataParallel(manager, module)
    optimizer = Optimizer(manager, inner)
    gbs, steps = cfg.data.global_batch_size, cfg.trainer.max_steps
    with open(args.out, "a", buffering=1) as out:
        out.write(f"start {time.time():.4f} pid {os.getpid()}\n")
        while manager.current_step() < steps:
            step = manager.current_step()
            x, y = next(train_batches(data, gbs, cfg.seed, args.replica, args.replicas, step, step + 1))
            optimizer.zero_grad()  # the quorum starts here (asynchronously)
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()  # commits (or not) once every participant's gradient arrived
            out.write(f"{time.time():.4f} {manager.current_step()} {manager.num_participants()} {loss.item():.6f}\n")
    manager.shutdown()
    del store


if __name__ == "__main__":
    main()
