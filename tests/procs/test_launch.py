"""Starting and joining worlds: spawn with start_method="fork" (functions that cannot be pickled,
from ``python -c`` or notebook cells, train data-parallel and fail as under spawn), and a launched
process that is never silently a world of one."""

import json
import os
import sys
import textwrap

import _recipe
import pytest
import torch

from fdp.errors import ConfigError
from fdp.procs.launch import WorldLayout, init_distributed, spawn
from fdp.run.config.compose import compose
from fdp.run.world import layout_of

# Everything below runs in `python -c`: `train` and `fail` live in __main__, which a spawned
# worker could not import.
SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch, torch.distributed as dist
    import fdp
    from fdp.data import global_batch, load_digits, rank_share
    from fdp.hooks import allreduce
    from fdp.procs.launch import WorkerFailedError

    data = load_digits(seed=0)
    torch.matmul(torch.randn(256, 256), torch.randn(256, 256))  # the parent's thread pool is up before the fork
    torch.randn(1024, 1024).add(1).sum()

    def train(layout, steps):
        comm = fdp.init_distributed(layout)
        torch.manual_seed(0)
        model, params, buffers = fdp.functionalize(torch.nn.Sequential(
            torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)))
        loss_fn = fdp.cross_entropy_loss(model)
        first = rank_share(global_batch(data, 0, 32, seed=0), comm.rank, comm.world_size)
        plan = fdp.plan_buckets(
            fdp.planner_loss(loss_fn, buffers), params, first, bucket_cap_mb=0.002, first_bucket_cap_mb=0.002
        )
        optimizer = fdp.sgd(0.1, momentum=0.9)
        state = fdp.init_train_state(params, buffers, optimizer, plan, allreduce())
        step_fn = fdp.make_train_step(loss_fn, optimizer, plan, allreduce(), comm)
        for step in range(steps):
            state, _ = step_fn(state, rank_share(global_batch(data, step, 32, seed=0), comm.rank, comm.world_size))
        if dist.is_initialized():
            dist.destroy_process_group()
        return {k: v.tolist() for k, v in state.params.items()}, len(plan)

    def parallel_op(layout):
        fdp.init_distributed(layout)
        torch.randn(1024, 1024).add(1).sum()  # big enough to run on the thread pool
        if dist.is_initialized():
            dist.destroy_process_group()
        return torch.get_num_threads()

    def fail(how):
        if int(os.environ["RANK"]) == 1:
            if how == "raise":
                raise ValueError("a cell's own error")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)

    fork = fdp.WorldLayout("elastic", nproc_per_node=2, backend="gloo", timeout_s=60, start_method="fork")
    results = fdp.spawn(train, (fork, 5), fork)
    out = {"ranks": [results[0], results[1]], "one": train(fdp.WorldLayout(), 5)}
    alone = fdp.WorldLayout("elastic", nproc_per_node=1, backend="gloo", timeout_s=60, start_method="fork")
    out["threads"] = fdp.spawn(parallel_op, (alone,), alone)[0]
    for how in ("raise", "kill"):
        t0 = time.perf_counter()
        try:
            fdp.spawn(fail, (how,), fork)
        except WorkerFailedError as error:
            out[how] = [str(error), error.rank, error.signal, time.perf_counter() - t0]
    # A file, not stdout: a forked rank still exiting may write to the shared stdout mid-line.
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
""")


@pytest.fixture(scope="module")
def forked(tmp_path_factory):
    result = tmp_path_factory.mktemp("forked") / "out.json"
    # Forked from the preloaded server and run as `python -c` runs it (tests/_recipe.py): the imports were most of
    # its time. Its layouts name their own start method.
    command = [sys.executable, "-c", SCRIPT, str(result)]
    proc = _recipe.run(command, env=dict(os.environ), cwd=".", timeout=240, workers="spawn")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(result.read_text()), proc.stderr


def test_a_function_from_python_c_trains_on_two_forked_ranks_as_one_process_on_the_union_batch(forked):
    out, _ = forked
    (rank0, buckets), (rank1, _) = out["ranks"]
    one, _ = out["one"]
    assert buckets > 1  # several buckets, so the reduction really ran bucket by bucket
    for name in one:
        a, b, ref = torch.tensor(rank0[name]), torch.tensor(rank1[name]), torch.tensor(one[name])
        assert torch.equal(a, b), name
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-6)


def test_a_forked_worker_runs_parallel_ops_on_one_thread_instead_of_hanging(forked):
    # A worker forked after its parent used the thread pool hangs in a parallel op with
    # more threads (alone on this machine's 2 cores it would take both); the run got here.
    out, _ = forked
    assert out["threads"] == 1


def test_a_forked_rank_that_raises_or_dies_is_one_line_naming_it(forked):
    out, stderr = forked
    message, rank, signal_name, seconds = out["raise"]
    assert (message, rank, signal_name) == ("a cell's own error (rank 1)", 1, None)
    message, rank, signal_name, seconds = out["kill"]
    assert (
        rank == 1
        and signal_name == "SIGKILL"
        and message.startswith("rank 1 (pid ")
        and message.endswith("was killed by SIGKILL")
    )
    assert seconds < 25  # the surviving rank was stopped, not waited for (it sleeps 30 s)
    assert "Traceback" not in stderr  # the launcher's own logging of the failures was quieted


def test_fork_after_cuda_was_initialised_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    started = []
    with pytest.raises(ConfigError) as caught:
        spawn(started.append, (1,), WorldLayout("elastic", nproc_per_node=2, start_method="fork"))
    assert str(caught.value).startswith("start_method='fork': CUDA is already initialised in this process")
    assert "\n" not in str(caught.value) and not started


def test_an_unknown_start_method_is_refused():
    with pytest.raises(
        ConfigError, match=r"^start_method='thread': expected one of \('spawn', 'fork', 'forkserver'\)$"
    ):
        spawn(print, (), WorldLayout("elastic", nproc_per_node=2, start_method="thread"))


# -- joining: never silently a world of one ------------------------------------------------


def test_launcher_none_under_a_launch_of_several_processes_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError) as error:
        init_distributed(WorldLayout(nproc_per_node=2))
    message = str(error.value)
    assert "\n" not in message
    assert "init_distributed(WorldLayout(launcher='none')) is a world of one" in message
    assert "one of WORLD_SIZE=2" in message and "WorldLayout('elastic'" in message


def test_launcher_none_alone_or_under_a_launch_of_one_is_a_world_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed(WorldLayout()).world_size == 1
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed(WorldLayout()).world_size == 1


def test_the_trainer_names_its_config_key_instead(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(
        ConfigError,
        match=(
            r"^world=single is a world of one, but this process was started as one of WORLD_SIZE=4: expected "
            r"world=torchrun$"
        ),
    ):
        layout_of(compose("world=single"))


def test_the_failure_named_is_the_cause_not_the_broken_connection_it_left_a_peer():
    """A rank out of memory leaves its group; a peer's read error may be recorded first, and must not be named."""
    from types import SimpleNamespace

    from fdp.procs.launch import _root_failure

    def failed(at, text):
        return SimpleNamespace(timestamp=at, message={"message": text, "extraInfo": {}}, pid=1, exitcode=1)

    echo = failed(1, "RuntimeError: [gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer")
    cause = failed(2, "fdp.errors.RunDoesNotFit: rank 1 ran out of memory building the model")
    failures = {0: echo, 1: cause}
    error = SimpleNamespace(
        failures=failures, get_first_failure=lambda: min(failures.items(), key=lambda f: f[1].timestamp)
    )
    assert _root_failure(error) == (1, cause)
    only_echoes = SimpleNamespace(failures={0: echo}, get_first_failure=lambda: (0, echo))
    assert _root_failure(only_echoes) == (0, echo)
