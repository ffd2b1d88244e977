"""Fused FP8 ops (all-gather + scaled GEMM, scaled GEMM + reduce-scatter / all-reduce) under the interpreter.

Every op x scaling mode on spawned gloo ranks against the fp64 product of the dequantized inputs,
within the bound of kernels.fp8.numerics (promoted model; kernels.testing.fp8); k = 136 and 200 (not multiples
of 128: partial scale blocks), odd row counts, bf16 / fp32 outputs; the gathered payload and scales
bit-exact; repeated reducing calls bitwise identical; ranks that disagree refused by name.
"""

import pytest
import torch

from kernels.fused.blocks import CPU_FP8_BLOCKS
from kernels.testing import fp8 as fp8_reference
from kernels.testing import run_ranks
from tests.kernels.fused import fp8_cases

MODES = ("tensor", "row", "block")
OPS = ("ag", "ag_v2", "rs", "ar_one", "ar_two")
# (m, k, n, bias, out_dtype): odd m, k past one or two scale blocks, n past one tile but not two.
SHAPES = ((5, 200, 24, True, torch.bfloat16), (3, 136, 20, False, torch.float32))


@pytest.mark.parametrize("mode", MODES)
def test_fp8_ops_world2(mode):
    # Block mode (the DeepSeek-V3 recipe) runs both shapes, the others one each (interpreter time).
    shapes = {"tensor": SHAPES[:1], "row": SHAPES[1:], "block": SHAPES}[mode]
    assert run_ranks(fp8_cases.ops_body, 2, (mode,), OPS, shapes, timeout=600) == [len(OPS) * len(shapes)] * 2


@pytest.mark.one_triton  # W = 3 index arithmetic; the kernels rerun at W = 2 under Triton 3.6 (tests/conftest.py)
def test_fp8_ops_world3_block():
    shapes = SHAPES[:1]
    assert run_ranks(fp8_cases.ops_body, 3, ("block",), OPS, shapes, timeout=600) == [len(OPS)] * 3


@pytest.mark.one_triton  # W = 4, as above
def test_fp8_all_gather_world4_row():
    shapes = ((3, 136, 20, True, torch.float16),)
    assert run_ranks(fp8_cases.ops_body, 4, ("row",), ("ag_v2",), shapes, timeout=600) == [1] * 4


def test_fp8_reductions_are_deterministic_and_ranks_agree():
    outs = run_ranks(fp8_cases.determinism_body, 2, "block", timeout=600)
    for op in ("rs", "ar_one", "ar_two"):
        for rank_outs in outs:
            assert all(torch.equal(rank_outs[op][0], o) for o in rank_outs[op][1:]), f"{op}: repeats differ"
    for op in ("ar_one", "ar_two"):
        assert torch.equal(outs[0][op][0], outs[1][op][0]), f"{op}: ranks differ"


@pytest.mark.parametrize(
    ("field", "named"),
    [
        ("quant_mode", "rank 0 has format=fp8:block, rank 1 has format=fp8:row"),
        ("out_dtype", "out_dtype=torch.bfloat16"),
        ("weight_dtype", "torch.float8_e5m2"),
    ],
)
def test_fp8_ranks_that_disagree_are_refused_by_name(field, named):
    messages = run_ranks(fp8_cases.mismatch_body, 2, field, timeout=300)
    for message in messages:
        assert "scaled_matmul_all_reduce: ranks disagree" in message and named in message, message


def _scaled_matmul(fmt, tensors, out_dtype, cfg):
    """The local GEMM (the tile core every FP8 op uses) of ``(x, x_scale, w, w_scale, bias)``."""
    from kernels.fused.matmul import gemm
    from kernels.ops.gemm import Operands

    x, xs, w, ws, b = tensors
    return gemm(fmt, Operands(x, (w,), (b,), xs, (ws,)), out_dtype=out_dtype, cfg=cfg)


@pytest.mark.parametrize("mode", MODES)
def test_scaled_tile_core_every_k_step(mode):
    """The W == 1 kernel (the tile core every FP8 op uses) at k steps of 16 (the fp16 path of
    unaligned rows), 32, 64 and 128, with partial scale blocks, odd m and an e5m2 x."""
    from dataclasses import replace

    from kernels.format import fp8

    g = torch.Generator().manual_seed(1)
    for m, k, n, x_dtype, out_dtype in (
        (7, 200, 40, torch.float8_e4m3fn, torch.bfloat16),
        (1, 130, 5, torch.float8_e5m2, torch.float32),
    ):
        x, xs = fp8_reference.quantize(torch.randn(m, k, generator=g), mode, False, x_dtype)
        w, ws = fp8_reference.quantize(torch.randn(n, k, generator=g) * 3, mode, True)
        b = torch.randn(n, generator=g).to(out_dtype)
        want, bound = fp8_reference.reference("ar", [(x, xs)], [(w, ws)], b, 0, mode=mode, out_dtype=out_dtype)
        for block_k in (16, 32, 64, 128):
            got = _scaled_matmul(fp8(mode), (x, xs, w, ws, b), out_dtype, replace(CPU_FP8_BLOCKS, block_k=block_k))
            fp8_reference.assert_close(f"{mode} m={m} k={k} block_k={block_k}", got, want, bound, out_dtype)


# The NaN payload is the point of the test: the interpreter's numpy matmul warns about it.
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_scaled_tile_core_propagates_nan_and_inf_payloads():
    """Non-finite FP8 payloads reach the result as on a GPU (the interpreter itself decodes e4m3 NaN
    as 480 and e5m2 Inf as 57344 * 2 ** ...; the kernels restore them from the bits)."""
    from dataclasses import replace

    from kernels.format import fp8

    one = torch.ones((), dtype=torch.float32)
    w = torch.ones(3, 40, dtype=torch.float8_e4m3fn)
    for x_dtype, special, want in (
        (torch.float8_e4m3fn, 0x7F, float("nan")),
        (torch.float8_e5m2, 0x7C, float("inf")),
        (torch.float8_e5m2, 0xFC, float("-inf")),
    ):
        x = torch.ones(2, 40, dtype=x_dtype)
        x.view(torch.uint8)[1, 5] = special
        for block_k in (16, 64):
            y = _scaled_matmul(
                fp8("tensor"), (x, one, w, one, None), torch.float32, replace(CPU_FP8_BLOCKS, block_k=block_k)
            )
            assert torch.equal(y[0], torch.full((3,), 40.0)), (x_dtype, block_k, y)
            assert torch.equal(y[1], torch.full((3,), want)) or (want != want and bool(y[1].isnan().all())), (
                x_dtype,
                special,
                block_k,
                y,
            )


@pytest.mark.parametrize("mode", MODES)
def test_fp8_public_ops_dispatch_to_fused(mode):
    assert run_ranks(fp8_cases.public_ops_body, 2, mode, timeout=600) == [3, 3]
