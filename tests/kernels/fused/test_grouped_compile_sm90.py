"""The grouped GEMM kernel (kernels/fused/grouped.py) compiles for sm_90a without a GPU, as a launch on an H100 would
compile it: no spills, wgmma (``HGMMA`` for bf16, FP8 ``QGMMA .E4M3.E4M3`` for the FP8 block format) and 16-byte
cp.async operand loads. The interpreter does not type-check like the compiler (the walk's loop-carried cursor, the
device-side while loop over the offsets), so this is the check that the GPU build exists.

Same method as tests/kernels/fused/test_compile_sm90.py (whose case table is shared with other kernels): compiled
in a subprocess without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.triton


def main() -> None:
    import torch

    from kernels.format import PLAIN, fp8
    from kernels.fused import blocks, grouped, matmul
    from tests.kernels.fused.sm90 import CP_ASYNC_16, compile_like_launch, report_failures, resources, sass

    m, n, k, experts = 4096, 2048, 7168, 64
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    sk = -(-k // 128)
    cases = [
        (PLAIN, torch.bfloat16, "HGMMA", (None, 0, 0), (None, None, 0, 0, 1)),
        (
            fp8("block"),
            e4m3,
            "QGMMA",
            (torch.empty(64, dtype=f32), sk, 1),
            (torch.empty(64, dtype=f32), None, sk, 1, 1),
        ),
    ]
    failures = []
    for fmt, dtype, gmma, x_tail, w_tail in cases:
        cfg = blocks.block_config(fmt, torch.device("cuda"), m // experts, k, dtype=dtype, n=n)
        args = dict(
            OPERANDS=((torch.empty(64, dtype=dtype), k, 1, *x_tail), (torch.empty(64, dtype=dtype), k, 1, *w_tail)),
            OUT=(torch.empty(64, dtype=torch.bfloat16), n, 1, None),
            GROUPS=(torch.empty(64, dtype=torch.int32), experts, m, n, k, n * k, -(-n // 128) * sk),
            CONFIG=grouped.GroupedConfig(blocks.kernel_format(fmt, cfg), cfg.tile(), matmul.ROUNDING[fmt.kind]),
            MATH=blocks.dot_math(dtype, torch.device("cuda")),
        )
        kernel = compile_like_launch(grouped._grouped_kernel, args, cfg.num_warps, cfg.num_stages)
        regs, spills = resources(kernel)
        code = sass(kernel)
        label = f"grouped {fmt.encode()} {dtype}"
        print(f"{label}: {regs} registers, {spills} spilled bytes, tiles {cfg.tile()}", flush=True)
        if spills:
            failures.append(f"{label}: {spills} bytes of spills")
        if gmma not in code or (gmma == "QGMMA" and ".E4M3.E4M3" not in code):
            failures.append(f"{label}: no {gmma} (FP8 operands for QGMMA) in the SASS")
        if not CP_ASYNC_16.search(kernel.asm["ptx"]):
            failures.append(f"{label}: operand tiles not loaded by 16-byte cp.async")
    report_failures(failures, "compiled: grouped GEMM kernel, no spills, wgmma")


def test_grouped_kernel_compiles_for_sm90() -> None:
    from tests.kernels.fused.sm90 import run_compile_check

    run_compile_check("tests.kernels.fused.test_grouped_compile_sm90", "compiled: grouped GEMM kernel", timeout=600)
