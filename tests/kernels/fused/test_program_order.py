"""Programs of one launch in any order: kernels/testing/program_order.py, and the fused ops under it."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from kernels.testing import program_order, run_ranks
from tests.kernels.fused import cases as fused_cases

ENV = program_order.ENV

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="program order is an interpreter mode (a GPU runs programs in any order)",
)


@triton.jit
def _record_kernel(counter_ptr, order_ptr):
    # The counter hands out slots in execution order; each program writes its linear id there.
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    slot = tl.atomic_add(counter_ptr, 1)
    tl.store(order_ptr + slot, pid)


@triton.jit
def _chain_kernel(flag_ptr, ok_ptr, SPINS: tl.constexpr):
    # Program i waits (a bounded spin) until program i - 1 of the same launch has set its flag: a
    # dependency on a lower program id that grid order satisfies and no GPU guarantees.
    pid = tl.program_id(0)
    prev = tl.maximum(pid - 1, 0)
    ready = (pid == 0) | (tl.atomic_add(flag_ptr + prev, 0) != 0)
    spins = pid * 0
    while (ready == 0) & (spins < SPINS):
        ready = tl.atomic_add(flag_ptr + prev, 0) != 0
        spins += 1
    tl.store(ok_ptr + pid, ready.to(tl.int32))
    tl.atomic_xchg(flag_ptr + pid, 1)


def record_order(grid: tuple[int, int]) -> list[int]:
    """Linear program ids (``x * grid[1] + y``) in the order the programs ran."""
    n = grid[0] * grid[1]
    counter = torch.zeros(1, dtype=torch.int32)
    order = torch.full((n,), -1, dtype=torch.int32)
    _record_kernel[grid](counter, order)
    assert int(counter) == n
    return order.tolist()


def chain_ok(n: int) -> list[int]:
    flags = torch.zeros(n, dtype=torch.int32)
    ok = torch.zeros(n, dtype=torch.int32)
    _chain_kernel[(n,)](flags, ok, SPINS=64)
    return ok.tolist()


def record_body(rank: int, world: int) -> list[int]:
    return record_order((3, 4))


def ops_body(rank: int, world: int) -> int:
    """Every fused op once, on a shape with several row, column and k tiles and a partial last tile."""
    import torch.distributed as dist

    assert program_order.parse(os.environ.get(ENV)) is not None, "the call's order did not reach the rank"
    group = dist.group.WORLD
    device = torch.device("cpu")
    fused_cases.presize(group, device)
    for seed, op in enumerate(fused_cases.OPS):
        fused_cases.check_case(rank, world, op, 17, 40, 48, True, seed, seed % 2 == 1, group, torch.float32, device)
    return len(fused_cases.OPS)


@pytest.mark.parametrize("value", ["backwards", "shuffle:", "shuffle:x", "reverse:1"])
def test_bad_order_is_refused_by_name(value):
    with pytest.raises(ValueError, match=f"{ENV}={value!r}"):
        program_order.parse(value)


def test_programs_run_in_the_requested_order(monkeypatch):
    program_order.install()
    grid = (3, 4)
    monkeypatch.delenv(ENV, raising=False)
    assert record_order(grid) == list(range(12))
    monkeypatch.setenv(ENV, "reverse")
    assert record_order(grid) == list(range(11, -1, -1))
    monkeypatch.setenv(ENV, "shuffle:7")
    first, second = record_order(grid), record_order(grid)
    assert sorted(first) == sorted(second) == list(range(12))
    assert first != list(range(12)) and second != first  # a new permutation per launch
    monkeypatch.setenv(ENV, "shuffle:8")
    other_seed = record_order(grid)
    monkeypatch.setenv(ENV, "shuffle:7")
    assert record_order(grid) == first  # a seed replays its sequence
    assert other_seed != first


def test_wait_on_an_earlier_program_of_the_launch_fails_out_of_grid_order(monkeypatch):
    program_order.install()
    monkeypatch.delenv(ENV, raising=False)
    assert chain_ok(6) == [1] * 6
    monkeypatch.setenv(ENV, "reverse")
    # Program 5 runs first, before the program it waits for: every wait but program 0's times out.
    assert chain_ok(6) == [1, 0, 0, 0, 0, 0]


def test_rank_processes_follow_the_call_order():
    assert run_ranks(record_body, 2, env={ENV: "reverse"}) == [list(range(11, -1, -1))] * 2
    # The pool's ranks read the variable per call: the next call without it is back in grid order.
    assert run_ranks(record_body, 2, env={ENV: None}) == [list(range(12))] * 2


# Each order once, one of them at the odd world (more peers to wait for than to signal).
@pytest.mark.parametrize(("world", "order"), [(2, "shuffle:2026"), (3, "reverse")])
def test_fused_ops_with_programs_out_of_order(world, order):
    assert run_ranks(ops_body, world, env={ENV: order}) == [len(fused_cases.OPS)] * world
