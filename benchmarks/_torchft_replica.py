"""One process of a torchft replica group for ``benchmarks.elastic``/``elastic_hsdp``: the run fdp trains, under
torchft's ``Manager``.

The same model, data, batch split and optimizer as the fdp runs: fdp's char transformer
built from the same config (``fdp.run.build``), this process's share of each global batch
(``fdp.data.train_batches``, rank ``replica * group_size + group_rank`` of all), torch's Adam;
a quorum each step through the lighthouse (``TORCHFT_LIGHTHOUSE``), a restarted replica group
healed from a peer over HTTP, all over gloo.

* ``--group-size 1`` (``benchmarks.elastic``): a group of one process, torchft's
  ``DistributedDataParallel`` and ``Optimizer`` wrappers.
* ``--group-size N`` (``benchmarks.elastic_hsdp``): one rank of a group of N that shards the
  model with FSDP2 (``fully_shard`` per block and the root on the group's 1-D mesh) and
  all-reduces each reduce-scattered gradient slice across the groups through the manager
  (``set_all_reduce_hook``: torchft's HSDP, replicate across groups, shard inside). The
  group's store is the launcher's (``--store-port``, as torchrun's agent hosts it); the
  heal sends each rank's local shards to the same group rank of the restarted group.

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


def _local(tree):
    """``tree`` with each DTensor replaced by this rank's shard (a plain tensor the HTTP transport sends)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_local(v) for v in tree]
    return tree.to_local() if isinstance(tree, DTensor) else tree


def _sharded(module: torch.nn.Module, optim_state: dict) -> dict:
    """A received optimizer state (local shards) as DTensors laid out like the parameters they belong to."""
    from torch.distributed.tensor import DTensor

    params = list(module.parameters())
    state = {}
    for index, entry in optim_state["state"].items():
        p = params[int(index)]
        state[index] = {
            k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            if isinstance(v, torch.Tensor) and v.dim() > 0
            else v
            for k, v in entry.items()
        }
    return {**optim_state, "state": state}


def _shard(module: torch.nn.Module, group_size: int, manager) -> None:
    """FSDP2 inside the group, the gradient slices averaged across the groups by ``manager`` (a failed peer: the
    manager records the error and the step is not committed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (group_size,))
    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)

    def across_groups(reduced: torch.Tensor) -> None:
        manager.allreduce(reduced).wait()

    for part in (*module.blocks, module):
        part.set_all_reduce_hook(across_groups)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument("--group-rank", type=int, default=0)
    parser.add_argument("--store-port", type=int, default=0, help="the group's store (0: this process hosts one)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    from fdp.data import train_batches
    from fdp.model.losses import build_loss
    from fdp.run.build import build_data, build_module
    from fdp.run.config.compose import compose

    cfg = compose(*args.overrides)
    data = build_data(cfg.data)
    torch.manual_seed(cfg.seed)
    module = build_module(cfg.model, data)
    criterion = build_loss(OmegaConf.to_container(cfg.loss, resolve=True))
    timeout = datetime.timedelta(seconds=args.timeout)
    port = args.store_port or _free_port()
    store = torch.distributed.TCPStore(  # this group's (the launcher's when given)
        "127.0.0.1", port, is_master=not args.store_port, wait_for_workers=False
    )
    sharded = args.group_size > 1
    if sharded:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("group", store),
            rank=args.group_rank,
            world_size=args.group_size,
            timeout=timeout,
        )

    shards: dict[str, torch.Tensor] = {}  # name -> this rank's slice of the parameter (FSDP2 keeps it in place)

    def state_dict():
        if not sharded:
            return {"model": module.state_dict(), "optim": inner.state_dict()}
        # The manager reads this on its quorum thread while the forward runs: read the kept slices, not
        # module.state_dict(), whose FSDP2 hooks would reshard the parameters the forward is using.
        return {
            "model": {name: shard.to_local() for name, shard in shards.items()},
            "optim": _local(inner.state_dict()),
        }

    def load_state_dict(state):
        if not sharded:
            module.load_state_dict(state["model"])
            inner.load_state_dict(state["optim"])
            return
        with torch.no_grad():
            for name, shard in shards.items():
                shard.to_local().copy_(state["model"][name])
        inner.load_state_dict(_sharded(module, state["optim"]))

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=60),
        rank=args.group_rank,
        world_size=args.group_size,
        store_addr="127.0.0.1",
        store_port=port,
        replica_id=f"replica_{args.replica}",
        hostname="127.0.0.1",
    )
    if sharded:
        _shard(module, args.group_size, manager)
        shards.update(module.named_parameters())
        model = module
    else:
        model = DistributedDataParallel(manager, module)
    inner = torch.optim.Adam(module.parameters(), lr=cfg.optim.lr)
    optimizer = Optimizer(manager, inner)
    gbs, steps = cfg.data.global_batch_size, cfg.trainer.max_steps
    me, world = args.replica * args.group_size + args.group_rank, args.replicas * args.group_size
    with open(args.out, "a", buffering=1) as out:
        out.write(f"start {time.time():.4f} pid {os.getpid()}\n")
        while manager.current_step() < steps:
            step = manager.current_step()
            x, y = next(train_batches(data, gbs, cfg.seed, me, world, step, step + 1))
            optimizer.zero_grad()  # the quorum starts here (asynchronously)
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()  # commits (or not) once every participant's gradient arrived
            out.write(f"{time.time():.4f} {manager.current_step()} {manager.num_participants()} {loss.item():.6f}\n")
    manager.shutdown()
    if sharded:
        dist.destroy_process_group()
    del store


if __name__ == "__main__":
    main()
