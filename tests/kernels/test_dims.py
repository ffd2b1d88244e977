"""``gather_dim`` / ``scatter_dim`` and the list-of-weights all-gather on the sequential and chunked
backends, against plain torch (``torch.cat`` along the dim, then linear; linear, sum over ranks,
then ``chunk`` along the dim).

Every rank builds every rank's inputs from one seed and computes the global reference locally, in
fp64: the all-gather results are single dot products of the same rows (the chunked path multiplies
the same rows with the same kernel), so the gathered x is compared exactly and y to fp64 rounding;
the reduce-scatter sums W fp64 partials, within ``1e-12``.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.testing import run_ranks

BACKENDS = [("sequential", None), ("chunked", 2), ("chunked", 4)]
TOL = dict(rtol=1e-12, atol=1e-12)
K, N = 5, 3


def _xs(world: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(world)]


def _weights(ns: list[int], k: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1)
    ws = [torch.randn(n, k, generator=g, dtype=torch.float64) for n in ns]
    bs = [torch.randn(n, generator=g, dtype=torch.float64) for n in ns]
    return ws, bs


# (local shape of x, gather_dim): odd sizes, 2-D to 4-D, negative dims.
GATHER_CASES = [
    ((3, K), 0),
    ((3, K), -2),
    ((2, 3, K), 0),
    ((2, 3, K), 1),
    ((2, 3, K), -2),
    ((3, 1, K), 1),
    ((2, 3, 1, K), 1),
    ((1, 2, 3, K), -2),
    ((2, 0, K), 1),
]


def _gather_rank(rank: int, world: int) -> int:
    checked = 0
    for seed, (shape, dim) in enumerate(GATHER_CASES):
        xs = _xs(world, shape, seed)
        x_ref = torch.cat(xs, dim=dim)
        ws, bs = _weights([N, 4, 1], shape[-1], seed)
        for backend, num in BACKENDS:
            opts = dict(backend=backend, parallel_num=num, gather_dim=dim)
            y, xg = kernels.all_gather_matmul(xs[rank], ws[0], bs[0], return_gathered=True, **opts)
            torch.testing.assert_close(xg, x_ref, rtol=0, atol=0)
            torch.testing.assert_close(y, torch.nn.functional.linear(x_ref, ws[0], bs[0]), **TOL)
            y_only = kernels.all_gather_matmul(xs[rank], ws[0], **opts)
            torch.testing.assert_close(y_only, torch.nn.functional.linear(x_ref, ws[0]), **TOL)
            # Several weights, one gather; biases mixed with None.
            biases = [bs[0], None, bs[2]]
            ys = kernels.all_gather_matmul(xs[rank], ws, biases, **opts)
            assert isinstance(ys, list) and len(ys) == 3
            for y_i, w_i, b_i in zip(ys, ws, biases, strict=True):
                torch.testing.assert_close(y_i, torch.nn.functional.linear(x_ref, w_i, b_i), **TOL)
            ys, xg = kernels.all_gather_matmul(xs[rank], (ws[1], ws[2]), None, return_gathered=True, **opts)
            torch.testing.assert_close(xg, x_ref, rtol=0, atol=0)
            torch.testing.assert_close(ys[1], torch.nn.functional.linear(x_ref, ws[2]), **TOL)
            checked += 1
    return checked


# (full shape of x on every rank, with W placeholder for the scattered size, scatter_dim)
SCATTER_CASES = [
    ((1, K), 0),
    ((3, K), -2),
    ((3, 2, K), 0),
    ((2, 3, K), 1),
    ((2, 3, K), -2),
    ((2, 1, 3, K), 1),
    ((3, 2, 1, K), -2),
]


def _scatter_rank(rank: int, world: int) -> int:
    checked = 0
    for seed, (template, dim) in enumerate(SCATTER_CASES):
        shape = list(template)
        shape[dim] *= world  # the scattered dim: a multiple of W, odd per-rank size
        xs = _xs(world, tuple(shape), seed)
        ws, bs = _weights([N] * world, shape[-1], seed)
        full = sum(torch.nn.functional.linear(xs[r], ws[r]) for r in range(world))
        for backend, num in BACKENDS:
            for det in (False, True):
                for bias in (None, bs[0]):
                    y = kernels.matmul_reduce_scatter(
                        xs[rank], ws[rank], bias, backend=backend, parallel_num=num, deterministic=det, scatter_dim=dim
                    )
                    ref = torch.chunk(full, world, dim=dim)[rank]
                    torch.testing.assert_close(y, ref if bias is None else ref + bias, **TOL)
                    checked += 1
    return checked


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gather_dim_and_weight_lists_match_torch(world: int) -> None:
    assert run_ranks(_gather_rank, world) == [len(GATHER_CASES) * len(BACKENDS)] * world


@pytest.mark.parametrize("world", [1, 2, 3])
def test_scatter_dim_matches_torch(world: int) -> None:
    assert run_ranks(_scatter_rank, world) == [len(SCATTER_CASES) * len(BACKENDS) * 4] * world


def _dim_disagreement(rank: int, world: int, backend: str) -> str:
    """The last rank passes another gather_dim / scatter_dim, same shapes (COC_CHECK=1)."""
    x = torch.randn(2, 2 * world, K)
    w = torch.randn(N, K)
    messages = []
    for op, name in ((kernels.all_gather_matmul, "gather_dim"), (kernels.matmul_reduce_scatter, "scatter_dim")):
        with pytest.raises(RuntimeError) as e:
            op(x, w, backend=backend, parallel_num=2 if backend == "chunked" else None, **{name: rank // (world - 1)})
        messages.append(str(e.value))
    # -2 and 1 are the same dim of a 3-D x: the same call, not a disagreement.
    y = kernels.all_gather_matmul(x, w, backend=backend, gather_dim=-2 if rank else 1)
    assert y.shape == (2, 2 * world * world, N)
    return "\n".join(messages)


@pytest.mark.parametrize("backend", ["sequential", "chunked"])
def test_ranks_disagreeing_on_the_dim_are_refused_by_name_under_coc_check(backend: str) -> None:
    for text in run_ranks(_dim_disagreement, 2, backend, env={"COC_CHECK": "1"}):
        gather, scatter = text.split("\n")
        assert "all_gather_matmul: ranks disagree: rank 0 has gather_dim=0, rank 1 has gather_dim=1" in gather
        assert "matmul_reduce_scatter: ranks disagree: rank 0 has scatter_dim=0, rank 1 has scatter_dim=1" in scatter
