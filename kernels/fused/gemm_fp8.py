"""The scaled FP8 tile core of the fused FP8 ops, and a bare scaled matmul over it (the W == 1 path).

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

from dataclasses import replace

import torch
import triton
import triton.language as tl

from .gemm import SMALL_M, BlockConfig, grouped_tile, tile_grid, tile_launch_options
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

# Tiles. BLOCK_N must divide 128 (a tile's columns share one weight scale row in block mode) and
# BLOCK_K must divide 128 (a k step never straddles a scale block). On sm_90 a 128-deep FP8 k step
# is 128 bytes per row, the same smem tile as a 64-deep bf16 step.
CPU_FP8_BLOCKS = BlockConfig(block_m=16, block_n=16, block_k=64, num_warps=1, num_stages=1, ag_splits=2, group_m=2)
GPU_FP8_BLOCKS = BlockConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, ag_splits=4, group_m=8)
# Decode-size m (at most gemm.SMALL_M rows): 64-row tiles, as for the bf16 GEMM.
GPU_FP8_SMALL_M_BLOCKS = replace(GPU_FP8_BLOCKS, block_m=64, num_warps=4, num_stages=4)
# Operand rows that do not start 16-byte aligned (k % 16 != 0) are loaded a byte at a time (no
# cp.async below 4 bytes): every k step of 32 or more spilled on sm_90 (48 to 600 bytes, even with
# one stage), so such shapes take 16-deep steps through the fp16 dot (see ``fp8_dot``).
NARROW_BLOCK_K = 16


def fp8_block_config(device: torch.device, rows: int | None = None, k: int | None = None) -> BlockConfig:
    """Tile configuration of an FP8 GEMM launch on ``device``.

    ``rows`` (the rows a tile owner has) must come from shapes every rank agrees on: ``block_m`` and
    ``block_n`` set the tile counts that become signal targets. ``k`` (which may differ between
    ranks of the reducing ops) selects only ``block_k``, which no count depends on.
    """
    if device.type != "cuda":
        return CPU_FP8_BLOCKS
    cfg = GPU_FP8_SMALL_M_BLOCKS if rows is not None and rows <= SMALL_M else GPU_FP8_BLOCKS
    if k is not None and k % 16:
        cfg = replace(cfg, block_k=NARROW_BLOCK_K)
    return cfg


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


@triton.jit
def _scaled_matmul_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bk,
    stride_bsn,
    stride_bsk,
    stride_cm,
    stride_cn,
    PER_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    offs_m, mask_m, offs_n, mask_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = scaled_tile(
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
        PER_BLOCK,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    store_scaled_tile(c_ptr, acc, bias_ptr, offs_m, mask_m, offs_n, mask_n, stride_cm, stride_cn, HAS_BIAS)


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
    """``dequant(x) @ dequant(weight).T + bias`` rounded once to ``out_dtype``: the W == 1 path.

    x FP8 ``[m, k]``, weight FP8 ``[n, k]``, scales as validated by the public op for ``mode``,
    bias ``[n]`` or None -> ``[m, n]`` ``out_dtype``. ``cfg`` overrides the tile configuration
    (tests use it to run 128-deep and narrower k steps). Reference semantics::

        xd = x.double() * x_scale broadcast (tensor: scalar, row: per row, block: per row per 128 columns)
        wd = weight.double() * w_scale broadcast (block: per 128 x 128 block)
        y = (xd @ wd.T + bias).to(out_dtype)     # the kernel: fp32 sums, scales per 128-deep k block
    """
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    cfg = cfg if cfg is not None else fp8_block_config(x.device, m, k)
    grid = tile_grid(m, n, cfg)
    if grid[0] == 0:
        return out
    stride_xsm, stride_xsk = scale_strides(mode, x_scale)
    stride_wsn, stride_wsk = scale_strides(mode, w_scale)
    # The kernel indexes bias with unit stride.
    bias = bias.contiguous() if bias is not None else None
    _scaled_matmul_kernel[grid](
        x,
        x_scale,
        weight,
        w_scale,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        stride_xsm,
        stride_xsk,
        weight.stride(0),
        weight.stride(1),
        stride_wsn,
        stride_wsk,
        out.stride(0),
        out.stride(1),
        PER_BLOCK=mode == "block",
        HAS_BIAS=bias is not None,
        **tile_launch_options(cfg),
    )
    return out
