"""The FP8 ops' behaviour beyond the bounds of test_numerics: empty k shards like the bf16 ops, and fp32 matmuls at
full precision whatever torch.set_float32_matmul_precision says."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.fp8 import numerics
from kernels.testing import run_ranks
from kernels.testing.fp8 import error_ratio, reference

MODES = ("tensor", "row", "block")
M, K, N = 4, 136, 24


def _quant(t: torch.Tensor, mode: str, weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.quantize_fp8(t, "block2d" if weight and mode == "block" else mode)


def _empty_k_rank(rank: int, world: int, backend: str) -> dict[str, float]:
    """Row-parallel shards of k where the last rank's is empty (k = 0): it contributes zeros, as in the bf16 ops.
    Returns the error / bound of every (op, mode) against the reference of every rank's shard."""
    ratios = {}
    ks = [K if r < world - 1 else 0 for r in range(world)]
    for mode in MODES:
        parts = []
        for r, k in enumerate(ks):
            g = torch.Generator().manual_seed(r)
            parts.append(
                (
                    _quant(torch.randn(M * world, k, generator=g), mode, False),
                    _quant(torch.randn(N, k, generator=g), mode, True),
                )
            )
        (xq, xs), (wq, ws) = parts[rank]
        opts = {"backend": backend, "out_dtype": torch.float32, "parallel_num": 2}
        with torch.no_grad():
            got = {
                "rs": kernels.scaled_matmul_reduce_scatter(xq, xs, wq, ws, **opts),
                "ar": kernels.scaled_matmul_all_reduce(xq, xs, wq, ws, **opts),
            }
        acc = numerics.accumulation_of(backend, mode)
        for op, y in got.items():
            xs_all, ws_all = [p[0] for p in parts], [p[1] for p in parts]
            ratios[f"{op}/{mode}"] = error_ratio(
                y, *reference(op, xs_all, ws_all, None, rank, mode=mode, out_dtype=torch.float32, accumulation=acc)
            )
    return ratios


@pytest.mark.parametrize("backend", ["sequential", "chunked", "fused"])
def test_an_empty_k_shard_contributes_zeros(backend: str) -> None:
    for ratios in run_ranks(_empty_k_rank, 2, backend, timeout=300):
        assert ratios and all(r <= 1 for r in ratios.values()), ratios


@pytest.mark.parametrize("backend", ["sequential", "chunked"])
def test_fp32_matmuls_ignore_a_lower_matmul_precision(backend: str, monkeypatch) -> None:
    """torch.set_float32_matmul_precision("high") lets fp32 matmuls run on TF32 on a GPU: the FP8 ops promise
    fp32 products (the bounds of kernels.fp8.numerics), so their own matmuls run at "highest" and the user's
    setting is restored afterwards."""
    x = torch.randn(M, K)
    xq, xs = _quant(x, "block", False)
    wq, ws = _quant(torch.randn(N, K), "block", True)
    seen: list[str] = []

    def spying(fn):
        def call(*args, **kwargs):
            if all(a.dtype == torch.float32 for a in args if isinstance(a, torch.Tensor)):
                seen.append(torch.get_float32_matmul_precision())
            return fn(*args, **kwargs)

        return call

    # Every fp32 matmul of the sequential and chunked paths goes through one of these two.
    monkeypatch.setattr(torch.nn.functional, "linear", spying(torch.nn.functional.linear))
    monkeypatch.setattr(torch, "mm", spying(torch.mm))
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with torch.no_grad():
            opts = {"out_dtype": torch.float32, "backend": backend, "parallel_num": 2}
            kernels.all_gather_scaled_matmul(xq, xs, wq, ws, **opts)
            kernels.scaled_matmul_reduce_scatter(xq, xs, wq, ws, **opts)
            kernels.scaled_matmul_all_reduce(xq, xs, wq, ws, **opts)
            kernels.scaled_matmul(xq, xs, wq, ws, out_dtype=torch.float32)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(saved)
    assert len(seen) >= 4 and set(seen) == {"highest"}, seen
