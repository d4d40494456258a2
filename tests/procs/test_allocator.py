"""This process's memory (fdp.procs.allocator): under a CPU budget the data segment counts what the process holds."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Run in a fresh interpreter: the allocator's settings are the whole process's.
_PROBE = """
import ctypes, re, threading
import torch
from fdp.procs.allocator import budget_accounting, tune_allocator

def data():
    return int(re.search(r"VmData:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

libc = ctypes.CDLL("libc.so.6")
libc.pthread_self.restype = ctypes.c_ulong

def own_stack():  # the stack size glibc gave the calling thread (pthread_getattr_np)
    attr, size = ctypes.create_string_buffer(128), ctypes.c_size_t()
    libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr)
    libc.pthread_attr_getstacksize(attr, ctypes.byref(size))
    libc.pthread_attr_destroy(attr)
    return size.value

def thread_cost(n=3):  # what n threads alive at once add to the data segment, and the stack each was given
    ready, done, stacks = [threading.Event() for _ in range(n)], threading.Event(), []
    before = data()
    threads = [threading.Thread(target=lambda e=e: (stacks.append(own_stack()), e.set(), done.wait())) for e in ready]
    for t in threads:
        t.start()
    for e in ready:
        e.wait()
    grown = data() - before
    done.set()
    for t in threads:
        t.join()
    return grown, max(stacks)

def freed_kept():  # what a step's freed tensors leave counted: ten 3 MiB blocks, then smaller ones in their place
    before = data()
    blocks = [torch.empty(3 * 2**18) for _ in range(10)]
    del blocks
    smaller = [torch.empty(2**18 + 1024) for _ in range(10)]
    del smaller
    return data() - before

tune_allocator(sharded_params=True)  # as a stage-3 run sets it up first
print(*thread_cost(), freed_kept())
budget_accounting()
print(*thread_cost(), freed_kept())
"""


def test_under_a_budget_a_thread_reserves_one_mib_of_stack_and_freed_tensors_stop_counting():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout.split()
    before_grown, before_stack, before_freed, grown, stack, freed = map(int, out)
    assert before_stack >= 4 * 2**20 and before_grown >= 3 * before_stack  # glibc's default (8 MiB): counted whole
    assert stack <= 2**20
    # Three new stacks of 1 MiB; the interpreter may map one 1 MiB arena of its own objects meanwhile.
    assert grown <= 3 * (2**20 + 2**16) + 2**20
    assert freed <= 2**18  # mapped blocks go back; the heap's top is given back
    print(
        f"thread stack {before_stack >> 10} -> {stack >> 10} KiB, three threads {before_grown >> 10} -> "
        f"{grown >> 10} KiB, freed kept {before_freed >> 10} -> {freed >> 10} KiB"
    )


_NO_THREAD_PROBE = """
import errno, os, threading
import torch
from fdp.procs.budget import is_out_of_memory, limit_memory

unlimited = is_out_of_memory(RuntimeError(os.strerror(errno.EAGAIN)))
limit_memory(64, torch.device("cpu"))
held = []
try:
    while True:
        held.append(torch.ones(2**18))  # 1 MiB each, until the limit is hit
except (MemoryError, RuntimeError):
    pass
try:
    threads = [threading.Thread(target=lambda: None) for _ in range(64)]
    for thread in threads:
        thread.start()
    error = None
except RuntimeError as failed:
    error = failed
print(unlimited, error is not None and is_out_of_memory(error))
"""


def test_under_a_budget_a_thread_that_cannot_start_is_out_of_memory_and_without_one_it_is_not():
    """A rank at its data limit fails to start a thread (gloo starts them for each group) with ``EAGAIN``; that is
    the run not fitting, the same refusal as a failed allocation, not an unexplained error of the rank."""
    out = subprocess.run([sys.executable, "-c", _NO_THREAD_PROBE], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"], out


_MAPPED_PROBE = """
import ctypes
import torch
from fdp.procs.allocator import budget_accounting, tune_allocator

class Mallinfo2(ctypes.Structure):  # glibc's malloc statistics (malloc.h); hblkhd: bytes in mapped blocks
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in names.split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
tune_allocator(sharded_params={sharded})  # as the run sets it up first, before its budget
budget_accounting()
before = libc.mallinfo2().hblkhd
block = torch.ones(2**20)  # 4 MiB: a step's gradients, the params it replaces
print(libc.mallinfo2().hblkhd - before)
"""


@pytest.mark.parametrize("sharded", [False, True])
def test_under_a_budget_a_block_from_64_kib_is_mapped_at_every_stage(sharded):
    """At stages 0-2 too, where ``tune_allocator`` serves every block from the heap: under a budget a large block is
    mapped, so freeing it hands it back at once (in the heap it stays counted while any block above it is held:
    measured, the build's freed whole params, 20 MiB of an 8 MiB MLP at stage 1 on 2 ranks)."""
    out = subprocess.run(
        [sys.executable, "-c", _MAPPED_PROBE.format(sharded=sharded)], capture_output=True, text=True, check=True
    )
    assert int(out.stdout) >= 4 * 2**20, f"{int(out.stdout)} bytes of a 4 MiB block mapped"
