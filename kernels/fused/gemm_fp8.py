"""The scaled FP8 tile core of the fused FP8 ops not yet on :mod:`tile` (all-gather), and the
old entry point of the FP8 local GEMM (:func:`matmul.gemm` of the FP8 format).

``scaled_tile`` computes one ``[BLOCK_M, BLOCK_N]`` fp32 tile of ``dequant(a) @ dequant(b).T`` for FP8
payloads ``a [m, k]`` and ``b`` in ``F.linear`` layout ``[n, k]`` with their fp32 scales, without
ever materializing a dequantized operand: the FP8 bytes go straight into the tensor cores (FP8
wgmma on sm_90) and the scales are applied to fp32 accumulators. Per 128-deep k block ``kb``::

    blk = a[:, kb] @ b[:, kb].T                     # FP8 products (exact in fp32), fp32 sum
    acc += blk * a_scale[:, kb] * b_scale[n // 128, kb]    # "block": 1x128 / 128x128 scales
    acc += blk                                      # "tensor" / "row": scales constant along k,
    ...                                             # applied once: acc * a_scale[m] * b_scale[n]

Promoting the tensor-core sum into a separate fp32 accumulator every 128 k is also what keeps the
result accurate on Hopper, whose FP8 wgmma accumulates with about 14 significant bits (DeepSeek-V3,
section 3.3.2): each promoted partial sums only 128 products. Scale layouts (contiguous fp32):
tensor 0-dim; row ``a [m, 1]``, ``b [n, 1]``; block ``a [m, ceil(k / 128)]``,
``b [ceil(n / 128), ceil(k / 128)]``. A tensorwise scale is passed as a row scale of stride 0, so
the kernels know two layouts only: per row (constant along k) and per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import fp8
from . import blocks
from .blocks import CPU_FP8_BLOCKS, GPU_FP8_BLOCKS, GPU_FP8_SMALL_M_BLOCKS, BlockConfig  # noqa: F401
from .legacy import operands
from .matmul import gemm
from .runtime import triton_interpreted

# Columns of k per scale, and rows of n per weight scale in block mode (DeepSeek-V3's 1x128 / 128x128).
SCALE_BLOCK = 128
MODES = ("tensor", "row", "block")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)
# The Triton interpreter (3.6 and 3.9) loads, stores and converts FP8 exactly except for the
# special values: it decodes e4m3fn NaN (0x7f) as 480 and e5m2 Inf/NaN as finite numbers, in casts
# and in its fp8 dot alike. Interpreted kernels therefore widen the operands themselves, restore
# NaN/Inf from the bits and multiply in fp32 (FP8 products are exact in fp32, so this is the
# tensor-core result). Compiled kernels feed the FP8 operands to tl.dot: this is a constant False there.
_WIDEN_FP8_DOT = tl.constexpr(triton_interpreted())

# The interpreter (3.6 and 3.9) converts fp32 to bf16 by truncation, whatever the rounding mode
# asked for (fp16 is right); the kernels' single rounding to out_dtype must be to nearest even, as
# compiled kernels and torch round, so interpreted kernels round the bits themselves first.
_ROUND_BF16_BITS = tl.constexpr(triton_interpreted())


def fp8_block_config(device: torch.device, rows: int | None = None, k: int | None = None) -> BlockConfig:
    """:func:`blocks.block_config` of the FP8 format (untuned)."""
    return blocks.block_config(fp8("block"), device, rows, k)


def scale_strides(mode: str, scale: torch.Tensor) -> tuple[int, int]:
    """``(stride along rows, stride along k blocks)`` of a validated scale for the kernels (0: broadcast)."""
    if mode == "tensor":
        return 0, 0
    if mode == "row":
        return scale.stride(0), 0
    return scale.stride(0), scale.stride(1)


def scale_cols(mode: str, k: int) -> int:
    """Scale columns per activation row as the all-gather moves them: 1 (tensor, row) or ceil(k / 128)."""
    return triton.cdiv(k, SCALE_BLOCK) if mode == "block" else 1


@triton.jit
def _widen(v):
    """FP8 ``v`` as fp32, NaN and Inf included (see ``_WIDEN_FP8_DOT``)."""
    f = v.to(tl.float32)
    bits = v.to(tl.uint8, bitcast=True)
    if v.dtype == tl.float8e5:
        inf = tl.where((bits & 0x80) != 0, float("-inf"), float("inf"))
        f = tl.where((bits & 0x7C) == 0x7C, tl.where((bits & 0x03) == 0, inf, float("nan")), f)
    else:
        f = tl.where((bits & 0x7F) == 0x7F, float("nan"), f)
    return f


@triton.jit
def fp8_dot(a, b, acc, BLOCK_K: tl.constexpr):
    """``acc + a @ b`` for FP8 ``a``, ``b`` and an fp32 ``acc`` (FP8 wgmma when compiled for sm_90).

    k steps narrower than FP8 wgmma's 32 (:data:`NARROW_BLOCK_K`, unaligned rows) widen the
    operands to fp16 in registers, which holds every e4m3 and e5m2 value exactly: the products
    and their fp32 sum are the same, at fp16 tensor-core rate.
    """
    if BLOCK_K < 32:
        if _WIDEN_FP8_DOT:
            a16 = _widen(a).to(tl.float16)
            b16 = _widen(b).to(tl.float16)
        else:
            a16 = a.to(tl.float16)
            b16 = b.to(tl.float16)
        result = tl.dot(a16, b16, acc, out_dtype=tl.float32)
    elif _WIDEN_FP8_DOT:
        result = tl.dot(_widen(a), _widen(b), acc, input_precision="ieee", out_dtype=tl.float32)
    else:
        result = tl.dot(a, b, acc, out_dtype=tl.float32)
    return result


@triton.jit
def round_to(v, DTYPE: tl.constexpr):
    """fp32 ``v`` rounded to nearest even in ``DTYPE`` (see ``_ROUND_BF16_BITS``)."""
    if _ROUND_BF16_BITS and DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        # Round the low 16 bits away, ties to even; Inf and NaN keep their class.
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(DTYPE)


@triton.jit
def store_scaled_tile(
    c_ptr, acc, bias_ptr, offs_m, mask_m, offs_n, mask_n, stride_cm, stride_cn, HAS_BIAS: tl.constexpr
):
    """``c[offs_m, offs_n] = acc + bias``: bias added in fp32, then the single rounding to ``c``'s dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
        round_to(acc, c_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _k_step(
    a_ptr,
    stride_am,
    stride_ak,
    b_ptr,
    stride_bn,
    stride_bk,
    offs_m,
    mask_m,
    offs_n,
    mask_n,
    k0,
    K,
    blk,
    BLOCK_K: tl.constexpr,
):
    """``blk + a[offs_m, k0:k0+BLOCK_K] @ b[offs_n, k0:k0+BLOCK_K].T`` (masked)."""
    offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    mask_k = offs_k < K
    a = tl.load(
        a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
        mask=mask_n[None, :] & mask_k[:, None],
        other=0.0,
    )
    return fp8_dot(a, b, blk, BLOCK_K)


@triton.jit
def scaled_tile(
    a_ptr,
    stride_am,
    stride_ak,
    as_ptr,
    stride_asm,
    stride_ask,
    b_ptr,
    stride_bn,
    stride_bk,
    bs_ptr,
    stride_bsn,
    stride_bsk,
    offs_m,
    mask_m,
    offs_n,
    mask_n,
    K,
    PER_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 ``dequant(a)[offs_m, :] @ dequant(b)[offs_n, :].T``.

    ``PER_BLOCK``: scales per 128-deep k block (``a_scale[m, kb]``, ``b_scale[n // 128, kb]``),
    applied to each block's partial sum; otherwise per row (``a_scale[m]``, ``b_scale[n]``, stride 0
    for a tensorwise scalar), applied once at the end. Offsets are int64 (addresses of large
    operands cannot overflow).
    """
    tl.static_assert(_SCALE_BLOCK % BLOCK_K == 0, "BLOCK_K must divide the 128-deep scale block")
    tl.static_assert(_SCALE_BLOCK % BLOCK_N == 0, "BLOCK_N must divide the 128-row weight scale block")
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PER_BLOCK:
        # BLOCK_N divides 128 and tiles start at multiples of BLOCK_N: one weight scale row per tile.
        bs_row = bs_ptr + (tl.min(offs_n, axis=0) // _SCALE_BLOCK) * stride_bsn
        as_rows = as_ptr + offs_m * stride_asm
    for k0 in range(0, K, _SCALE_BLOCK):
        blk = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCK_K == _SCALE_BLOCK:
            # One step per scale block: the k-block loop itself is the innermost, pipelined loop.
            blk = _k_step(
                a_ptr,
                stride_am,
                stride_ak,
                b_ptr,
                stride_bn,
                stride_bk,
                offs_m,
                mask_m,
                offs_n,
                mask_n,
                k0,
                K,
                blk,
                BLOCK_K,
            )
        else:
            # A loop, not unrolled: eight unrolled 16-deep steps of byte loads spilled on sm_90.
            for k1 in range(k0, tl.minimum(k0 + _SCALE_BLOCK, K), BLOCK_K):
                blk = _k_step(
                    a_ptr,
                    stride_am,
                    stride_ak,
                    b_ptr,
                    stride_bn,
                    stride_bk,
                    offs_m,
                    mask_m,
                    offs_n,
                    mask_n,
                    k1,
                    K,
                    blk,
                    BLOCK_K,
                )
        if PER_BLOCK:
            kb = k0 // _SCALE_BLOCK
            sa = tl.load(as_rows + kb * stride_ask, mask=mask_m, other=0.0)
            sb = tl.load(bs_row + kb * stride_bsk)
            acc += blk * (sa[:, None] * sb)
        else:
            acc += blk
    if not PER_BLOCK:
        sa = tl.load(as_ptr + offs_m * stride_asm, mask=mask_m, other=0.0)
        sb = tl.load(bs_ptr + offs_n * stride_bsn, mask=mask_n, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    return acc


def scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    cfg: BlockConfig | None = None,
) -> torch.Tensor:
    """``dequant(x) @ dequant(weight).T + bias`` rounded once to ``out_dtype`` for 2-D FP8 operands:
    :func:`matmul.gemm` of the FP8 format."""
    ops = operands(x, [weight], [bias], x_scale=x_scale, w_scales=[w_scale])
    return gemm(fp8(mode), ops, out_dtype=out_dtype, cfg=cfg)
