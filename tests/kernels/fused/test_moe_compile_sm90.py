"""The fused MoE kernels (kernels/fused/moe.py: the combine + push, the W = 1 combine and the collect) compile for
sm_90a without a GPU, as a launch on an H100 would compile them, with no spills. The interpreter does not type-check
like the compiler (the runtime top-k loop, the int64 row clamps, the fp32-ids-to-int64 stores), so this is the check
that their GPU build exists. Same method as tests/kernels/fused/test_compile_sm90.py (:mod:`tests.kernels.fused.sm90`).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.triton


def main() -> None:
    import torch

    from kernels.fused import moe, signals
    from kernels.fused.scatter import ScatterProto
    from tests.kernels.fused.sm90 import compile_like_launch, report_failures, resources

    cuda = torch.device("cuda")
    cfg = moe.tile_config(cuda)
    world, tokens, k_out, topk, k = 8, 4096, 2048, 8, 7168
    bf16, f32, i64 = torch.bfloat16, torch.float32, torch.int64
    tab = torch.empty(world, dtype=i64)
    partial = (torch.empty(64, dtype=f32), k_out, tokens * topk, k_out)
    route = (torch.empty(64, dtype=i64), topk, torch.empty(64, dtype=f32), topk, topk)
    heap = (tab, tab, signals.channel_offset(signals.CH_DONE, world), signals.channel_offset(signals.CH_RS, world))
    chunk = 128
    cases = {
        "combine + push": (
            moe._combine_push_kernel,
            dict(
                OPERANDS=(partial, route, (tokens, k_out, 0, k_out, tokens // world)),
                heap=heap,
                rank=world - 2,
                timeout=10**9,
                CONFIG=moe.CombineConfig(cfg.tile(), ScatterProto(world, False, False, True)),
            ),
        ),
        "combine (W = 1)": (
            moe._combine_kernel,
            dict(P=partial, ROUTE=route, OUT=(torch.empty(64, dtype=bf16), k_out, tokens), TILE=cfg.tile()),
        ),
        "collect": (
            moe._collect_kernel,
            dict(
                ROWS=(
                    torch.empty(64, dtype=bf16),
                    k,
                    1,
                    torch.empty(64, dtype=torch.int32),
                    topk,
                    1,
                    torch.empty(64, dtype=bf16),
                    torch.empty(64, dtype=i64),
                    (tokens // world, k, topk, chunk, 4),
                ),
                heap=(tab, tab, signals.channel_offset(signals.CH_AG, world), world * tokens * k // 2),
                rank=world - 2,
                timeout=10**9,
                CONFIG=moe.CollectConfig(world, signals.AG_MAX_SPLITS, 32, 128, 8, True),
            ),
        ),
    }
    failures = []
    for label, (fn, args) in cases.items():
        kernel = compile_like_launch(fn, args, cfg.num_warps if fn is not moe._collect_kernel else 4, 1)
        regs, spills = resources(kernel)
        print(f"{label}: {regs} registers, {spills} spilled bytes", flush=True)
        if spills:
            failures.append(f"{label}: {spills} bytes of spills")
    report_failures(failures, "compiled: fused MoE kernels, no spills")


def test_fused_moe_kernels_compile_for_sm90() -> None:
    from tests.kernels.fused.sm90 import run_compile_check

    run_compile_check("tests.kernels.fused.test_moe_compile_sm90", "compiled: fused MoE kernels", timeout=600)
