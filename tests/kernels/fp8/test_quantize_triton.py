"""The Triton 1 x 128 quantize kernel (run under the interpreter here; CUDA uses it for mode="block")
gives the bits of the torch twin, subnormals, zero blocks, partial blocks and non-finite inputs included."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8.quantize import quantize_fp8_reference

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(5, 200), (17, 128), (3, 1), (2, 3, 260)])
def test_kernel_matches_twin_bitwise(shape: tuple, dtype: torch.dtype) -> None:
    from kernels.fp8 import quantize_triton

    g = torch.Generator().manual_seed(1)
    t = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[-1])
    flat = t.view(-1, shape[-1])
    flat[0, 0] = 0
    flat[-1, 0] = -0.0  # keeps its sign bit, as the hardware cast and torch do
    if shape[-1] >= 128:
        flat[1, :128] = 0  # a zero block: EPS scale, exact zeros
        flat[-1, -1] = float("nan")
    q0, s0 = quantize_fp8_reference(t, "block", 128, dtype)
    q1, s1 = quantize_triton.quantize_block(t, 128, dtype)
    assert torch.equal(s0.isnan(), s1.isnan())
    assert torch.equal(s0.nan_to_num(), s1.nan_to_num())
    finite = torch.isfinite(s0).repeat_interleave(128, -1)[..., : shape[-1]]
    assert torch.equal(q0.view(torch.uint8)[finite], q1.view(torch.uint8)[finite])
