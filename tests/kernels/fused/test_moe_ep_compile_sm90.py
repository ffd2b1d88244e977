"""The fused expert-parallel kernels (kernels/fused/moe_ep.py: counts, row push, collect, publish, pull + weighted
sum) compile for sm_90a without a GPU, as a launch on an H100 would compile them, with no spills. The interpreter
does not type-check like the compiler (the int64 row arithmetic on loaded counts, the per-source waits unrolled over
W, the ``%globaltimer`` spins, the inline ``mul.rn.f32``), so this is the check that their GPU build exists. Same
method as tests/kernels/fused/test_moe_compile_sm90.py (:mod:`tests.kernels.fused.sm90`), at DeepSeek-V3-like sizes
(W = 8, hidden 7168, top-8, 256 experts).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.triton


def main() -> None:
    import torch

    from kernels.fused import moe_ep, signals
    from tests.kernels.fused.sm90 import compile_like_launch, report_failures, resources

    world, num_e, k, topk, cap = 8, 256, 7168, 8, 8192
    bf16, i64 = torch.bfloat16, torch.int64
    tab = torch.empty(world, dtype=i64)
    idx = torch.empty(64, dtype=i64)
    chunks = moe_ep._CHUNKS["cuda"]
    block_r, block_c, warps = moe_ep._blocks(torch.device("cuda"))
    ag = signals.channel_offset(signals.CH_AG, world)
    rs = signals.channel_offset(signals.CH_RS, world)
    rows_heap = (tab, tab, world * num_e // 2, (world * num_e * 8 + cap * k * 2) // 8, rs)
    cases = {
        "counts": (
            moe_ep._counts_kernel,
            dict(
                COUNTS=(idx, idx, num_e),
                heap=(tab, tab, ag),
                rank=world - 2,
                timeout=10**9,
                CONFIG=moe_ep.CountsConfig(world, signals.AG_MAX_SPLITS, num_e, True),
            ),
            1,
        ),
        "push rows": (
            moe_ep._push_rows_kernel,
            dict(
                X=(torch.empty(64, dtype=bf16), k, 1, k),
                ROUTE=(idx, idx, idx, idx, topk),
                heap=rows_heap,
                rank=world - 2,
                CONFIG=moe_ep.RowsConfig(world, chunks, block_r, block_c, True),
            ),
            warps,
        ),
        "collect": (
            moe_ep._collect_kernel,
            dict(
                OUT=(torch.empty(64, dtype=bf16), idx, idx, cap, k),
                heap=rows_heap,
                rank=world - 2,
                timeout=10**9,
                CONFIG=moe_ep.RowsConfig(world, chunks, block_r, block_c, True),
            ),
            warps,
        ),
        "publish": (
            moe_ep._publish_kernel,
            dict(
                Y=(torch.empty(64, dtype=bf16), k, 1, cap, k),
                heap=(tab, tab, rs),
                rank=world - 2,
                CONFIG=moe_ep.RowsConfig(world, chunks, block_r, block_c, True),
            ),
            warps,
        ),
        "pull": (
            moe_ep._pull_kernel,
            dict(
                OPERANDS=(
                    (torch.empty(64, dtype=bf16), torch.empty(64, dtype=bf16), 4096, k),
                    (idx, torch.empty(64, dtype=torch.float32), topk, topk),
                ),
                heap=(tab, tab, rs),
                rank=world - 2,
                timeout=10**9,
                CONFIG=moe_ep.RowsConfig(world, chunks, block_r, block_c, True),
            ),
            warps,
        ),
    }
    failures = []
    for label, (fn, args, num_warps) in cases.items():
        kernel = compile_like_launch(fn, args, num_warps, 1)
        regs, spills = resources(kernel)
        print(f"{label}: {regs} registers, {spills} spilled bytes", flush=True)
        if spills:
            failures.append(f"{label}: {spills} bytes of spills")
    report_failures(failures, "compiled: fused expert-parallel kernels, no spills")


def test_fused_moe_ep_kernels_compile_for_sm90() -> None:
    from tests.kernels.fused.sm90 import run_compile_check

    run_compile_check(
        "tests.kernels.fused.test_moe_ep_compile_sm90", "compiled: fused expert-parallel kernels", timeout=600
    )
