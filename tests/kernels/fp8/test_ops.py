"""The FP8 ops' behaviour beyond the bounds of the per-op tests (tests/kernels/test_all_gather.py,
test_reduce_scatter.py, test_all_reduce.py): fp32 matmuls at full precision whatever
torch.set_float32_matmul_precision says."""

from __future__ import annotations

import pytest
import torch

import kernels

M, K, N = 4, 136, 24


def _quant(t: torch.Tensor, mode: str, weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.quantize_fp8(t, "block2d" if weight and mode == "block" else mode)


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
