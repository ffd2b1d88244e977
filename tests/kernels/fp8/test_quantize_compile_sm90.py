"""The Triton 1 x 128 FP8 quantize kernel compiles for sm_90a without a GPU: no spills, the hardware
FP8 conversion (``cvt.rn.satfinite.e4m3x2.f32`` / ``e5m2x2``) and correctly rounded divisions.

Same method as tests/kernels/fused/test_compile_sm90.py: compiled in a subprocess without
``TRITON_INTERPRET`` (the interpreter-only rounding branch is then a constant False and must be absent).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.triton


def main() -> None:
    import torch

    from kernels.fp8 import quantize_triton
    from kernels.fp8.scales import EPS, FP8_MAX
    from tests.kernels.fused.sm90 import compile_like_launch, report_failures, resources

    failures = []
    for dtype, cvt in ((torch.float8_e4m3fn, "e4m3x2.f32"), (torch.float8_e5m2, "e5m2x2.f32")):
        mantissa, min_exp = quantize_triton.FP8_FORMAT[dtype]
        args = dict(
            x_ptr=torch.empty(64, dtype=torch.bfloat16),
            q_ptr=torch.empty(64, dtype=dtype),
            s_ptr=torch.empty(64, dtype=torch.float32),
            M=4096,
            K=8192,
            stride_xm=8192,
            stride_xk=1,
            stride_qm=8192,
            stride_sm=64,
            FP8_MAX_VALUE=FP8_MAX[dtype],
            AMAX_EPS=EPS,
            MANTISSA=mantissa,
            MIN_EXP=min_exp,
            BLOCK_M=quantize_triton.BLOCK_M,
            BLOCK_K=128,
        )
        kernel = compile_like_launch(quantize_triton._quantize_block_kernel, args, 4, 1)
        regs, spills = resources(kernel)
        ptx = kernel.asm["ptx"]
        print(f"quantize_block {dtype}: {regs} registers, {spills} spilled bytes", flush=True)
        if spills:
            failures.append(f"{dtype}: {spills} bytes of spills")
        if f"cvt.rn.satfinite.{cvt}" not in ptx:
            failures.append(f"{dtype}: no cvt.rn.satfinite.{cvt} in the PTX")
        if "div.rn.f32" not in ptx:
            failures.append(f"{dtype}: the divisions are not div.rn.f32")
    report_failures(failures, "compiled: quantize kernel, no spills, hardware FP8 conversion")


def test_quantize_kernel_compiles_for_sm90() -> None:
    from tests.kernels.fused.sm90 import run_compile_check

    run_compile_check("tests.kernels.fp8.test_quantize_compile_sm90", "compiled: quantize kernel", timeout=600)
