"""kernels/format.py: the FP8 rows an all-gather moves pack and unpack to the same bits, for any row count."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.format import fp8, pack_rows, unpack_rows


@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_fp8_rows_pack_and_unpack_to_the_same_bits(mode: str, rows: int) -> None:
    k = 136  # two 128-wide scale blocks, the last partial
    q, s = kernels.quantize_fp8(torch.randn(rows, k), mode)
    packed = pack_rows(fp8(mode), q, s)
    cols = 2 if mode == "block" else 1
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (rows, k + 4 * cols)
    x, scales = unpack_rows(fp8(mode), packed, k, q.dtype)
    assert torch.equal(x.view(torch.uint8), q.view(torch.uint8))
    want = s.reshape(1, 1).expand(rows, 1) if mode == "tensor" else s
    assert scales is not None and torch.equal(scales, want)


@pytest.mark.parametrize("backend", ["sequential", "chunked"])
def test_fp8_all_gather_of_a_rank_without_rows(backend: str) -> None:
    """W = 1 with zero rows: an empty result of the right shape (the packing raised on reshape before)."""
    xq, xs = kernels.quantize_fp8(torch.randn(0, 136), "row")
    w, ws = kernels.quantize_fp8(torch.randn(24, 136), "row")
    y, xg, xsg = kernels.all_gather_scaled_matmul(
        xq, xs, w, ws, backend=backend, parallel_num=2, return_gathered=True, out_dtype=torch.float32
    )
    assert tuple(y.shape) == (0, 24) and tuple(xg.shape) == (0, 136) and tuple(xsg.shape) == (0, 1)
