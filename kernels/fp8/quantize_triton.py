"""The fused 1 x 128 (``mode="block"``) FP8 quantization kernel for activations and gradients.

One program quantizes ``BLOCK_M`` rows by one 128-wide column block: it loads the tile once,
takes each row's amax, writes the fp32 scale and the FP8 payload. Same arithmetic as the torch
twin (``kernels.fp8.quantize.quantize_fp8_reference``): ``scale = max(amax, EPS) / FP8_MAX`` and
``q = clamp(t / scale)``, both divisions correctly rounded (``div_rn``: Triton's plain ``/`` is an
approximate division on NVIDIA GPUs), the cast rounding to nearest even; a row block holding a NaN or
Inf gets a NaN scale. Used on CUDA tensors; CPU tests run it under the Triton interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .scales import EPS, FP8_MAX, ceil_div

BLOCK_M = 16
# (mantissa bits, smallest normal exponent) of each format, for the interpreter's rounding below.
FP8_FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
# The interpreter's fp32 -> FP8 cast (Triton 3.6 and 3.9) truncates subnormals and rounds half up
# without carrying into the exponent, where the GPU's cvt.rn rounds to nearest even. Interpreted
# launches therefore round to the FP8 grid themselves first (so the cast sees representable values
# and is exact); compiled kernels cast directly: this is a constant False there.
ROUND_BEFORE_CAST = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def available() -> bool:
    """Triton can launch on CUDA here (the interpreter runs CPU tensors only)."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def round_to_fp8_grid(v, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """``v`` (fp32, |v| <= the format's max) rounded to nearest even on the FP8 grid, in fp32.

    Adding and subtracting ``1.5 * 2**23 * ulp`` rounds to a multiple of ``ulp`` in IEEE fp32
    (round to nearest even); ``ulp`` is the FP8 spacing at ``v``'s exponent, subnormals included."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)
    magic = (((e - MANTISSA + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(v) + magic) - magic
    # On |v|, then the sign bit back: a negative v rounding to zero, and -0 itself, give -0 as the hardware
    # cast (and torch's) does.
    return tl.where(bits < 0, r * -1.0, r)


@triton.jit
def _quantize_block_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_sm,
    FP8_MAX_VALUE: tl.constexpr,
    AMAX_EPS: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_k = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    ax = tl.abs(x)
    # NaN < inf is False: a row block with a NaN or an Inf is flagged and its scale made NaN.
    nonfinite = tl.max(tl.where(ax < float("inf"), 0.0, 1.0), axis=1)
    amax = tl.max(tl.where(ax < float("inf"), ax, 0.0), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, AMAX_EPS), tl.full(amax.shape, FP8_MAX_VALUE, tl.float32))
    scale = tl.where(nonfinite > 0, float("nan"), scale)
    scaled = tl.math.div_rn(x, scale[:, None])
    scaled = tl.minimum(tl.maximum(scaled, -FP8_MAX_VALUE), FP8_MAX_VALUE)
    if ROUND_BEFORE_CAST:
        scaled = round_to_fp8_grid(scaled, MANTISSA, MIN_EXP)
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], scaled.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + offs_m * stride_sm + pid_k, scale, mask=mask_m)


def quantize_block(t: torch.Tensor, block: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8(t, "block", block, dtype)`` by the Triton kernel; ``block`` a power of two."""
    if block & (block - 1):
        raise ValueError(f"block={block} is not accepted by the Triton quantize kernel; use a power of two")
    lead, k = t.shape[:-1], t.shape[-1]
    x = t.detach().reshape(-1, k) if k else t.detach().reshape(-1, 1)[:, :0]
    m = x.shape[0]
    kb = ceil_div(k, block)
    q = torch.empty((m, k), dtype=dtype, device=t.device)
    scale = torch.empty((m, kb), dtype=torch.float32, device=t.device)
    if m and kb:
        grid = (triton.cdiv(m, BLOCK_M), kb)
        _quantize_block_kernel[grid](
            x,
            q,
            scale,
            m,
            k,
            x.stride(0),
            x.stride(1),
            q.stride(0),
            scale.stride(0),
            FP8_MAX_VALUE=FP8_MAX[dtype],
            AMAX_EPS=EPS,
            MANTISSA=FP8_FORMAT[dtype][0],
            MIN_EXP=FP8_FORMAT[dtype][1],
            BLOCK_M=BLOCK_M,
            BLOCK_K=block,
            num_warps=4,
        )
    return q.view(lead + (k,)), scale.view(lead + (kb,))
