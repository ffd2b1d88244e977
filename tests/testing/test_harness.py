"""The multi-rank harness itself: results, failures, hangs and dead ranks are all reported."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from kernels.testing import RankFailure, run_ranks


def _sum_ranks(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_last(rank, world_size):
    if rank == world_size - 1:
        raise ValueError(f"boom from rank {rank}")
    return rank


def _hang_on_zero(rank, world_size):
    if rank == 0:
        time.sleep(30)
    return rank


def _die_on_last(rank, world_size):
    if rank == world_size - 1:
        os._exit(3)
    return rank


def _read_env(rank, world_size):
    return os.environ.get("COC_HARNESS_PROBE")


def _birth_env(rank, world_size):
    import sys

    return os.environ.get("COC_HARNESS_BIRTH"), os.environ.get("TRITON_INTERPRET"), "torch" in sys.modules


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_results_in_rank_order(world):
    expected = float(sum(range(world)) + world * 10)
    assert run_ranks(_sum_ranks, world, 10) == [expected] * world


def test_env_is_scoped_to_the_call():
    assert run_ranks(_read_env, 2, env={"COC_HARNESS_PROBE": "x"}) == ["x", "x"]
    assert run_ranks(_read_env, 2) == [None, None]


def test_ranks_start_with_the_environment_of_their_pools_start(monkeypatch):
    # Ranks fork from a server started with an earlier environment; each takes the one of its pool's
    # start (plus the pool kind's variables), as a spawned process would, and torch comes preloaded.
    from kernels.testing.ranks import RankPool, Task

    monkeypatch.setenv("COC_HARNESS_BIRTH", "cpu pool")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = RankPool(2)
    monkeypatch.setenv("COC_HARNESS_BIRTH", "cuda pool")
    cuda = RankPool(1, device="cuda")
    try:
        assert cpu.run(Task(_birth_env, (), {}, {}), timeout=60, allow_dead=False) == [("cpu pool", "1", True)] * 2
        assert cuda.run(Task(_birth_env, (), {}, {}), timeout=60, allow_dead=False) == [("cuda pool", None, True)]
    finally:
        cpu.close()
        cuda.close()


def test_exception_names_rank():
    with pytest.raises(RankFailure, match="boom from rank 2"):
        run_ranks(_raise_on_last, 3)
    assert run_ranks(_sum_ranks, 3, 0) == [3.0] * 3  # the pool is usable (respawned) afterwards


def test_hang_is_bounded():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 0: no answer") as failure:
        run_ranks(_hang_on_zero, 2, timeout=2)
    assert time.monotonic() - start < 15
    # The hung rank says where it waits: its own stack, down to the body's frame.
    assert "in _hang_on_zero" in str(failure.value), failure.value


class _Interrupted(Exception):
    pass


def test_an_interrupted_call_retires_its_pool():
    # A test-level timeout or Ctrl-C stops the caller while the ranks are still inside the task: the pool must not
    # serve the next call (its ranks would answer the old task, or wait in its collectives).
    import _thread
    import signal
    import threading

    from kernels.testing.ranks import RankPool, Task

    def interrupt(signum, frame):
        raise _Interrupted

    saved = signal.signal(signal.SIGUSR2, interrupt)
    pool = RankPool(2)
    try:
        timer = threading.Timer(1.0, _thread.interrupt_main, (signal.SIGUSR2,))
        timer.start()
        with pytest.raises(_Interrupted):
            pool.run(Task(_hang_on_zero, (), {}, {}), timeout=60, allow_dead=False)
        timer.join()
        assert pool.dead and not pool.alive
    finally:
        signal.signal(signal.SIGUSR2, saved)
        pool.close()


def test_dead_rank_reported_or_allowed():
    with pytest.raises(RankFailure, match="rank 1: process died"):
        run_ranks(_die_on_last, 2)
    assert run_ranks(_die_on_last, 2, allow_dead=True) == [0, None]


def _interpreter_and_device(rank, world_size):
    import torch

    return os.environ.get("TRITON_INTERPRET"), torch.cuda.current_device() if torch.cuda.is_available() else None


def test_gpu_pool_runs_compiled_kernels_and_shares_the_gpus():
    # device="cuda" ranks start without the interpreter (set at their birth, before they import triton)
    # and sit round robin on the GPUs; on a machine without one they still start.
    got = run_ranks(_interpreter_and_device, 3, device="cuda")
    assert [interp for interp, _ in got] == [None] * 3
    if torch.cuda.is_available():
        assert [dev for _, dev in got] == [r % torch.cuda.device_count() for r in range(3)]
    assert run_ranks(_interpreter_and_device, 2)[0][0] == "1"  # the CPU pool interprets


def test_bad_pool_kinds_are_named():
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        run_ranks(_sum_ranks, 2, 0, device="tpu")
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        run_ranks(_sum_ranks, 2, 0, backend="mpi")
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_ranks(_sum_ranks, 0, 0)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank: world_size=64"):
            run_ranks(_sum_ranks, 64, 0, backend="nccl")


def _die_while_rank_0_works(rank, world_size):
    if rank == 1:
        os._exit(0)
    time.sleep(5)  # longer than the grace after a failure: an expected death must not cut it short
    return "done"


def test_allowed_death_leaves_the_live_ranks_their_deadline():
    assert run_ranks(_die_while_rank_0_works, 2, allow_dead=True, timeout=60) == ["done", None]
