"""The Triton GEMM core shared by the fused ops, and a bare ``matmul`` launcher over it.

``tile_matmul`` computes one ``[BLOCK_M, BLOCK_N]`` fp32 tile of ``a @ b.T`` for ``b`` in
``F.linear`` layout ``[n, k]``; the fused kernels decide which rows a program owns, where the rows
come from (local or gathered memory) and where the tile goes (local output or a peer's slot).
Rows and columns outside the matrices are masked, so any ``m``, ``n``, ``k`` works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch parameters; identical on every rank (tile counts drive the signal targets).

    ``ag_splits``: chunks per all-gather shard, each with its own ready flag, so the GEMM starts on
    a shard's first rows before the rest arrive (at most ``signals.AG_MAX_SPLITS``).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    ag_splits: int


# The interpreter costs per program and per loop step, so CPU tiles stay small to keep tests fast
# while still crossing tile boundaries with test shapes of a few dozen rows.
CPU_BLOCKS = BlockConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, ag_splits=2)
GPU_BLOCKS = BlockConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, ag_splits=4)


def block_config(device: torch.device) -> BlockConfig:
    return GPU_BLOCKS if device.type == "cuda" else CPU_BLOCKS


def acc_dtype(dtype: torch.dtype) -> tl.dtype:
    """Accumulator of products and reductions: fp64 for fp64 inputs, else fp32 (fp16/bf16/fp32 inputs)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    """``tl.dot``'s input precision. Triton multiplies fp32 operands as TF32 by default; on CUDA fp32
    follows ``torch.backends.cuda.matmul.allow_tf32`` instead (off by default), as the sequential
    path's cuBLAS GEMM does, so the fused result stays within fp32 tolerance of it."""
    if dtype == torch.float32 and device.type == "cuda" and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@triton.jit
def tile_matmul(a_ptr, stride_am, stride_ak, b_ptr, stride_bn, stride_bk, offs_m, mask_m, offs_n, mask_n, K,
                g_ptr, stride_gm, g_mask_m,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STORE_A: tl.constexpr,
                ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``a[offs_m, :] @ b[offs_n, :].T`` accumulated in ``ACC_DTYPE``; with ``STORE_A`` also copies the
    A rows selected by ``g_mask_m`` to ``g``.

    ``offs_m``/``offs_n``/``offs_k`` are int64 so addresses of large matrices cannot overflow (with a
    transposed operand such as ``weight.t()``, ``offs_k * stride`` reaches the operand's numel).
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        mask_k = offs_k < K
        a_mask = mask_m[:, None] & mask_k[None, :]
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak, mask=a_mask, other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        if STORE_A:
            tl.store(g_ptr + offs_m[:, None] * stride_gm + offs_k[None, :], a, mask=g_mask_m[:, None] & mask_k[None, :])
        # out_dtype must name the accumulator's type: Triton 3.6 rejects an fp64 acc with the fp32 default.
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
                   stride_cm, stride_cn, HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tile_matmul(a_ptr, stride_am, stride_ak, b_ptr, stride_bn, stride_bk, offs_m, mask_m, offs_n, mask_n, K,
                      c_ptr, 0, mask_m, BLOCK_M, BLOCK_N, BLOCK_K, False, ACC_DTYPE, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(ACC_DTYPE)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with the fused ops' GEMM core (fp32 accumulate, fp64 for fp64); the W == 1 path.

    x ``[m, k]`` (any strides), weight ``[n, k]`` (any strides), bias ``[n]`` or None -> ``[m, n]``.
    Reference: ``torch.nn.functional.linear(x, weight, bias)``.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [m, k] and [n, k]")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = block_config(x.device)
    bias_arg = bias.contiguous() if bias is not None else out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _matmul_kernel[grid](x, weight, bias_arg, out, m, n, k, x.stride(0), x.stride(1), weight.stride(0),
                         weight.stride(1), out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
                         ACC_DTYPE=acc_dtype(x.dtype), DOT_PRECISION=dot_precision(x.dtype, x.device),
                         BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
