"""The multi-rank harness itself: results, failures, hangs and dead ranks are all reported."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, run_ranks


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


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_results_in_rank_order(world):
    expected = float(sum(range(world)) + world * 10)
    assert run_ranks(_sum_ranks, world, 10) == [expected] * world


def test_env_is_scoped_to_the_call():
    assert run_ranks(_read_env, 2, env={"COC_HARNESS_PROBE": "x"}) == ["x", "x"]
    assert run_ranks(_read_env, 2) == [None, None]


def test_exception_names_rank():
    with pytest.raises(RankFailure, match="boom from rank 2"):
        run_ranks(_raise_on_last, 3)
    assert run_ranks(_sum_ranks, 3, 0) == [3.0] * 3  # the pool is usable (respawned) afterwards


def test_hang_is_bounded():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 0: no answer"):
        run_ranks(_hang_on_zero, 2, timeout=2)
    assert time.monotonic() - start < 15


def test_dead_rank_reported_or_allowed():
    with pytest.raises(RankFailure, match="rank 1: process died"):
        run_ranks(_die_on_last, 2)
    assert run_ranks(_die_on_last, 2, allow_dead=True) == [0, None]
