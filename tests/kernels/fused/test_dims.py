"""Fused ``gather_dim`` / ``scatter_dim`` and the list-of-weights all-gather, under the interpreter on
gloo ranks, against torch in fp64 at the smallest shapes.

The kernels address the strided rows of a dim > 0 in place (no transposing copy); these cases put
rows of several outer blocks into one tile (blocks of 3 rows, 16-row tiles), so a wrong block or
source index lands a row in the wrong place and fails exactly. fp64: the gathered x is compared
exactly, y (single dot products of <= 5 terms) and the reduce-scatter (W partials) within 1e-12.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import kernels
from kernels.testing import run_ranks

TOL = dict(rtol=1e-12, atol=1e-12)
K, N = 5, 3


def _tensors(world: int, shape: tuple[int, ...], ns: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(world)]
    ws = [torch.randn(n, shape[-1], generator=g, dtype=torch.float64) for n in ns]
    bs = [torch.randn(n, generator=g, dtype=torch.float64) for n in ns]
    return xs, ws, bs


def _gather_body(rank: int, world: int) -> int:
    checked = 0
    for seed, (shape, dim) in enumerate([((2, 3, K), 1), ((3, 2, 1, K), -3), ((3, 2, K), 0)]):
        xs, ws, bs = _tensors(world, shape, [N, 2], seed)
        x_ref = torch.cat(xs, dim=dim)
        y, xg = kernels.all_gather_matmul(xs[rank], ws[0], bs[0], backend="fused", return_gathered=True, gather_dim=dim)
        torch.testing.assert_close(xg, x_ref, rtol=0, atol=0)
        torch.testing.assert_close(y, torch.nn.functional.linear(x_ref, ws[0], bs[0]), **TOL)
        # Two weights, one gather (the second bias None), with and without the gathered x.
        ys = kernels.all_gather_matmul(xs[rank], ws, [bs[0], None], backend="fused", gather_dim=dim)
        torch.testing.assert_close(ys[0], torch.nn.functional.linear(x_ref, ws[0], bs[0]), **TOL)
        torch.testing.assert_close(ys[1], torch.nn.functional.linear(x_ref, ws[1]), **TOL)
        if seed == 0:
            ys, xg = kernels.all_gather_matmul(
                xs[rank], [ws[1]], None, backend="fused", return_gathered=True, gather_dim=dim
            )
            torch.testing.assert_close(xg, x_ref, rtol=0, atol=0)
            torch.testing.assert_close(ys[0], torch.nn.functional.linear(x_ref, ws[1]), **TOL)
        checked += 1
    return checked


def _scatter_body(rank: int, world: int) -> int:
    checked = 0
    for seed, (template, dim) in enumerate([((2, 3, K), 1), ((3, 1, 2, K), -3), ((3, 2, K), 0)]):
        shape = list(template)
        shape[dim] *= world
        xs, ws, bs = _tensors(world, tuple(shape), [N] * world, seed)
        full = sum(torch.nn.functional.linear(xs[r], ws[r]) for r in range(world))
        y = kernels.matmul_reduce_scatter(xs[rank], ws[rank], bs[0], backend="fused", scatter_dim=dim)
        torch.testing.assert_close(y, torch.chunk(full, world, dim=dim)[rank] + bs[0], **TOL)
        checked += 1
    return checked


def _dim_mismatch_body(rank: int, world: int) -> list[str]:
    """The last rank passes another gather_dim / scatter_dim with the same shapes: every rank is
    refused by name (on a fresh group whose heap exists, so the in-kernel check compares)."""
    messages = []
    x = torch.randn(2, 2 * world, K, dtype=torch.float64)
    w = torch.randn(N, K, dtype=torch.float64)
    for op, name in ((kernels.all_gather_matmul, "gather_dim"), (kernels.matmul_reduce_scatter, "scatter_dim")):
        group = dist.new_group(list(range(world)))
        op(x, w, group=group, backend="fused", **{name: 0})
        try:
            op(x, w, group=group, backend="fused", **{name: 1 if rank == world - 1 else 0})
        except RuntimeError as e:
            messages.append(str(e))
        else:
            raise AssertionError(f"ranks differing in {name} got a result")
    return messages


def _layout_mismatch_body(rank: int, world: int) -> list[str]:
    """The last rank's x is [4W, 2, K] where its peers' is [2, 4W, K], all with dim 1: the same
    flattened rows, but other blocks before the dim, so the rows would land elsewhere. Refused by
    name on every backend, at a group's first call and later (the admission compares x's shape)."""
    messages = []
    x = torch.randn(2, 4 * world, K, dtype=torch.float64)
    x_odd = x.reshape(4 * world, 2, K)
    w = torch.randn(N, K, dtype=torch.float64)
    mine = x_odd if rank == world - 1 else x
    for op, name in ((kernels.all_gather_matmul, "gather_dim"), (kernels.matmul_reduce_scatter, "scatter_dim")):
        for backend, warm in (("fused", False), ("fused", True), ("sequential", False)):
            group = dist.new_group(list(range(world)))
            if warm:
                op(x, w, group=group, backend=backend, **{name: 1})
            try:
                op(mine, w, group=group, backend=backend, **{name: 1})
            except RuntimeError as e:
                messages.append(str(e))
            else:
                raise AssertionError(f"{backend} (warm={warm}): ranks with other blocks before {name} got a result")
    return messages


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fused_gather_dim_and_weight_lists_match_torch(world: int) -> None:
    assert run_ranks(_gather_body, world, timeout=300) == [3] * world


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fused_scatter_dim_matches_torch(world: int) -> None:
    assert run_ranks(_scatter_body, world, timeout=300) == [3] * world


def test_fused_ranks_disagreeing_on_the_dim_are_refused_by_name() -> None:
    for messages in run_ranks(_dim_mismatch_body, 2, timeout=300):
        assert len(messages) == 2
        assert "gather_dim=0" in messages[0] and "gather_dim=1" in messages[0], messages[0]
        assert "scatter_dim=0" in messages[1] and "scatter_dim=1" in messages[1], messages[1]


def test_ranks_with_other_blocks_before_the_dim_are_refused_by_name() -> None:
    for messages in run_ranks(_layout_mismatch_body, 2, timeout=300):
        assert len(messages) == 6, messages
        for i, message in enumerate(messages):
            field = "x.shape" if i < 3 else "x.shape[:-1]"
            last = f"{field}=(8, 2, {K})" if i < 3 else f"{field}=(8, 2)"
            assert "ranks disagree" in message, message
            assert f"rank 0 has {field}=(2, 8" in message and last in message, message
