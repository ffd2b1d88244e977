"""Rank bodies of fused calls that differ between ranks (module level so the rank pools can unpickle them): the
admission names the field on every rank before any kernel runs, and the heap's own check names what only it sees
(the tuned tiles each rank reads)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tests.kernels.fused.cases import assert_close, make_inputs, reference, run_op

# (op, field, what the last rank changes); the other ranks make the base call of ``mismatch_call``.
MISMATCH_CASES = (
    ("ag", "x.shape", {"rows": 6}),
    ("ag", "x.shape", {"rows": 64}),  # the last rank's call needs a larger heap: it must not enter the growth
    ("ag", "x.shape", {"k": 9}),
    ("ag", "x.dtype", {"dtype": torch.float64}),
    ("ag", "return_gathered", {"flag": True}),
    ("rs", "x.shape[:-1]", {"rows_per_rank": 4}),
    ("rs", "weight.shape[0] (n)", {"n": 7}),
    ("rs", "deterministic", {"flag": False}),
    ("ar", "weight.shape[0] (n)", {"n": 5}),
    ("ar", "x.dtype", {"dtype": torch.float64}),
    ("ar", "deterministic", {"flag": False}),
)


def mismatch_call(op: str, rank: int, world: int, group: Any, changes: dict[str, Any]) -> Any:
    """One fused call of the public op with a small base shape; ``changes`` alter rows (``rows_per_rank``: rows / W
    of the reduce-scatter), k, n, dtype or the flag (``return_gathered`` / ``deterministic``)."""
    import kernels

    rows = changes.get("rows", changes.get("rows_per_rank", 2) * world if op == "rs" else 5)
    k, n = changes.get("k", 8), changes.get("n", 6)
    dtype = changes.get("dtype", torch.float32)
    flag = changes.get("flag", op != "ag")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    opts = {"group": group, "backend": "fused"}
    if op == "ag":
        return kernels.all_gather_matmul(x, w, b, return_gathered=flag, **opts)
    fn = kernels.matmul_reduce_scatter if op == "rs" else kernels.matmul_all_reduce
    return fn(x, w, b, deterministic=flag, **opts)


def mismatch_body(rank: int, world: int) -> list[str]:
    """Every case of MISMATCH_CASES on a fresh group whose heap exists, then one at a group's first call; returns
    each case's error message. After each, the group is in step: the next call answers."""
    messages = []
    for op, field, changes in MISMATCH_CASES:
        group = dist.new_group(list(range(world)))
        mismatch_call(op, rank, world, group, {})  # creates the heap
        try:
            got = mismatch_call(op, rank, world, group, changes if rank == world - 1 else {})
        except RuntimeError as e:
            messages.append(str(e))
        else:
            raise AssertionError(
                f"{op} with ranks differing in {field} returned a tensor of shape "
                f"{tuple(got[0].shape if isinstance(got, tuple) else got.shape)} on rank {rank}"
            )
        # The admission refused the call on every rank before anything moved: the next call answers.
        mismatch_call(op, rank, world, group, {})
    # At the first call of a group: nothing is created, and the group stays usable.
    group = dist.new_group(list(range(world)))
    try:
        mismatch_call("rs", rank, world, group, {"n": 7} if rank == world - 1 else {})
    except RuntimeError as e:
        messages.append(str(e))
        assert "group stays usable" in str(e), e
    else:
        raise AssertionError("a first call with ranks differing in n returned a tensor")
    from kernels.heap import peek_heap

    assert peek_heap(group, torch.device("cpu")) is None
    assert mismatch_call("rs", rank, world, group, {}).shape == (2, 6)
    # A fresh group after all that works, and valid per-rank differences are never reported:
    # all_gather_matmul's n (uneven column shards) and the reducing ops' k (uneven contracted shards).
    group = dist.new_group(list(range(world)))
    xs, ws, b = make_inputs("ag", world, 5, 8, 6, bias=True, seed=9)
    assert_close(
        f"ag after mismatches, rank {rank}",
        run_op("ag", xs[rank], ws[rank], b, group),
        reference("ag", xs, ws, b, rank),
        torch.float32,
    )
    assert mismatch_call("ag", rank, world, group, {"n": 6 + rank}).shape == (5 * world, 6 + rank)
    assert mismatch_call("rs", rank, world, group, {"k": 8 + rank}).shape == (2, 6)
    return messages


def tuned_tiles_body(rank: int, world: int, tuned_dir: str) -> list[str]:
    """The last rank reads a tuned file (``tuned_dir``) that gives the reducing ops other GEMM tiles
    than its peers' defaults: their tile counts are signal targets, so each call must raise naming
    the tiles, at a group's first call (the heap exchange) and at a later one (the kernel check), and the
    next call (every rank reading its own file again) answers."""
    from kernels.fused import tuned

    messages = []
    saved = os.environ.get(tuned.ENV_TUNED_DIR)
    try:
        for op in ("rs", "ar"):
            for warm in (False, True):
                group = dist.new_group(list(range(world)))
                if warm:
                    mismatch_call(op, rank, world, group, {})  # the same tiles: the heap exists
                if rank == world - 1:
                    os.environ[tuned.ENV_TUNED_DIR] = tuned_dir
                try:
                    mismatch_call(op, rank, world, group, {})
                except RuntimeError as e:
                    messages.append(str(e))
                else:
                    raise AssertionError(f"{op} (warm={warm}) with other tiles on rank {world - 1} returned")
                finally:
                    os.environ.pop(tuned.ENV_TUNED_DIR, None)
                mismatch_call(op, rank, world, group, {})
    finally:
        if saved is not None:
            os.environ[tuned.ENV_TUNED_DIR] = saved
    return messages
