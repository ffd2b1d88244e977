"""The norm kernel of ``kernels.fused.all_reduce_norm`` (interpreted): its in-kernel FP8 quantization ("row",
"block") gives the bits of ``kernels.fp8.quantize.quantize_fp8`` applied to the kernel's own fp32 ``y32``."""

import pytest
import torch

from kernels.fp8.quantize import quantize_fp8
from kernels.fused import all_reduce_norm

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _h(m: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(m * 1000 + n)
    h = torch.randn(m, n, generator=g) * torch.logspace(-3, 3, m).unsqueeze(1)
    if m >= 5:
        h[1] = 0.0  # an all-zero row: amax floored at EPS, a finite scale
        h[2, n // 2] = float("inf")  # non-finite rows and blocks get a NaN scale, as quantize_fp8 gives them
        h[3, 0] = float("nan")
    return h


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# (8, 1000): a sum-of-squares step (64 columns on CPU) other than the block mode's 128-column quantize step.
@pytest.mark.parametrize("shape", [(5, 40), (7, 136), (1, 256), (8, 1000), (0, 24)], ids=str)
@pytest.mark.parametrize("mode", ["row", "block"])
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_in_kernel_quantization_has_quantize_fp8s_bits(shape: tuple[int, int], mode: str, fp8: torch.dtype) -> None:
    h = _h(*shape)
    weight = 1 + 0.5 * torch.randn(shape[1], generator=torch.Generator().manual_seed(7))
    dtypes = (torch.bfloat16, torch.bfloat16)
    y32, residual_32, none = all_reduce_norm.rmsnorm(h, weight, eps=1e-6, dtypes=dtypes, quant=("tensor", fp8))
    assert none is None and y32.dtype == torch.float32
    q, residual_out, scale = all_reduce_norm.rmsnorm(h, weight, eps=1e-6, dtypes=dtypes, quant=(mode, fp8))
    want_q, want_scale = quantize_fp8(y32, mode, dtype=fp8)
    assert q.dtype == fp8 and scale is not None and scale.shape == want_scale.shape, (q.dtype, scale, want_scale)
    assert torch.equal(_bits(scale.nan_to_num(-1.0)), _bits(want_scale.nan_to_num(-1.0))), (scale, want_scale)
    # Under a NaN scale (a non-finite row or block, which every op refuses) the payload is not defined: the
    # kernel's clamp returns the bound where torch's keeps the NaN.
    finite = scale.isfinite() if mode == "row" else scale.isfinite().repeat_interleave(128, 1)[:, : shape[1]]
    finite = finite.expand(shape)
    assert torch.equal(_bits(q[finite]), _bits(want_q[finite]))
    assert torch.equal(_bits(residual_out), _bits(residual_32))
    if shape[0] >= 5:
        assert scale[1].isfinite().all() and scale[2].isnan().any() and scale[3].isnan().any(), scale


@pytest.mark.parametrize("mode", ["row", "block", "tensor"])
def test_fp64_rows_come_back_as_y32_for_the_callers_quantization(mode: str) -> None:
    """An fp64 x reduces into fp64 rows; the kernel's correctly rounded division is fp32's, so every mode returns
    the fp64 ``y32`` and no scale (kernels.ops.norm.finish quantizes it with quantize_fp8)."""
    h = _h(5, 40).double()
    weight = torch.ones(40, dtype=torch.float64)
    y, residual_out, scale = all_reduce_norm.rmsnorm(
        h, weight, eps=1e-6, dtypes=(torch.float64,) * 2, quant=(mode, FP8[0])
    )
    assert y.dtype == torch.float64 and scale is None and residual_out.dtype == torch.float64
