"""The plain GEMM core of the fused ops not yet on :mod:`tile` (all-gather), and the old
entry point of the plain local GEMM (:func:`matmul.linear`).

``tile_matmul`` computes one ``[BLOCK_M, BLOCK_N]`` fp32 tile of ``a @ b.T`` for ``b`` in
``F.linear`` layout ``[n, k]``; the fused kernels decide which rows a program owns, where the rows
come from (local or gathered memory) and where the tile goes (local output or a peer's slot).
Rows and columns outside the matrices are masked, so any ``m``, ``n``, ``k`` works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import PLAIN
from . import blocks
from .blocks import (  # noqa: F401  (the names the per-format modules import from here until they move)
    CPU_BLOCKS,
    GPU_BLOCKS,
    GPU_SMALL_M_BLOCKS,
    NARROW_BLOCK_K,
    SMALL_M,
    BlockConfig,
    acc_dtype,
    dot_precision,
)
from .gemm_configs import GemmConfig
from .matmul import linear
from .runtime import triton_interpreted

# The Triton interpreter (3.6 to 3.9 at least) multiplies bf16 dot operands wrongly (results off by
# 1e10: NumPy has no bf16 and the emulated product is garbage), while loads, stores and casts of
# bf16 are exact. A product of two bf16 values is exact in fp32 (8 + 8 significant bits) and the
# dot accumulates in fp32 anyway, so widening both operands first gives the tensor-core result.
# Compiled kernels keep bf16 operands: this is a constant False there.
_WIDEN_BF16_DOT = tl.constexpr(triton_interpreted())


def block_config(
    device: torch.device,
    rows: int | None = None,
    k: int | None = None,
    dtype: torch.dtype | None = None,
    *,
    op: str | None = None,
    n: int | None = None,
) -> BlockConfig:
    """:func:`blocks.block_config` of the plain format."""
    return blocks.block_config(PLAIN, device, rows, k, dtype=dtype, op=op, n=n)


@triton.jit
def load_a(a_ptr, stride_am, stride_ak, offs_m, mask_m, k0, K, BLOCK_K: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_K]`` A tile of k step ``k0`` (zeros outside), its ``offs_k`` and ``mask_k``."""
    offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    mask_k = offs_k < K
    a = tl.load(
        a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )
    return a, offs_k, mask_k


@triton.jit
def tile_matmul(
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
    K,
    g_ptr,
    stride_gm,
    g_mask_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STORE_A: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``a[offs_m, :] @ b[offs_n, :].T`` accumulated in ``ACC_DTYPE``; with ``STORE_A`` also copies the
    A rows selected by ``g_mask_m`` to ``g``.

    ``offs_m``/``offs_n``/``offs_k`` are int64 so addresses of large matrices cannot overflow (with a
    transposed operand such as ``weight.t()``, ``offs_k * stride`` reaches the operand's numel).
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        a, offs_k, mask_k = load_a(a_ptr, stride_am, stride_ak, offs_m, mask_m, k0, K, BLOCK_K)
        b = tl.load(
            b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )
        if STORE_A:
            tl.store(g_ptr + offs_m[:, None] * stride_gm + offs_k[None, :], a, mask=g_mask_m[:, None] & mask_k[None, :])
        acc = dot_acc(a, b, acc, DOT_PRECISION, ACC_DTYPE)
    return acc


@triton.jit
def dot_acc(a, b, acc, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """``acc + a @ b`` for every GEMM of the fused ops (see ``_WIDEN_BF16_DOT``)."""
    if _WIDEN_BF16_DOT and a.dtype == tl.bfloat16:
        # fp32 operands must not be rounded to TF32 here: they hold exact bf16 values.
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=ACC_DTYPE)
    else:
        # out_dtype must name the accumulator's type: Triton 3.6 rejects an fp64 acc with the fp32 default.
        result = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return result


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemmConfig | None = None,
    fallback: bool = True,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for plain 2-D operands: :func:`matmul.linear`."""
    return linear(x, weight, bias, config=config, fallback=fallback)
