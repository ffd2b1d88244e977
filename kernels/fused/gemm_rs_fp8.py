"""Fused FP8 scaled GEMM + reduce-scatter: ``y = reduce_scatter_dim0(dequant(x) @ dequant(weight).T) + bias``.

The protocol of :mod:`gemm_rs` unchanged (scatter GEMM pushing tiles into the owners' slots and
counting them in ``RS``, fixed-order reduce, finish); only the scatter GEMM's tile core is the
scaled FP8 one (:func:`gemm_fp8.scaled_tile`), and the partial products travel and are summed in
fp32: the slots hold fp32 tiles, the reduce adds the ``W`` slots in rank order and bias in fp32,
and the result is rounded once to ``out_dtype``. The bf16 ops round each partial to the input
dtype before the exchange; FP8 partials have no such dtype, and the single rounding is the
semantics of the sequential reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import agree
from . import runtime, signals
from .gemm import BlockConfig
from .gemm_fp8 import fp8_block_config, scale_strides, scaled_matmul, scaled_tile
from .gemm_rs import group_and_size, push_tile, reduce_slots, scatter_tile, slot_stride, tiles

OP = "scaled_matmul_reduce_scatter"


@triton.jit(do_not_specialize=["rank", "timeout"])
def _scaled_gemm_scatter_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    data_tab_ptr,
    sig_tab_ptr,
    M,
    N,
    K,
    LD,
    ROWS_OWN,
    stride_xm,
    stride_xk,
    stride_xsm,
    stride_xsk,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    rank,
    timeout: tl.int64,
    done_offset,
    cnt_offset,
    WORLD: tl.constexpr,
    BROADCAST: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # gemm_rs's tile mapping and push, so its reduce and gemm_ar's gather consume these tiles.
    owner, local_rows, offs_m, mask_m, offs_n, mask_n = scatter_tile(
        tl.program_id(0), rank, M, N, ROWS_OWN, WORLD, BROADCAST, BLOCK_M, BLOCK_N, GROUP_M
    )
    acc = scaled_tile(
        x_ptr,
        stride_xm,
        stride_xk,
        xs_ptr,
        stride_xsm,
        stride_xsk,
        w_ptr,
        stride_wn,
        stride_wk,
        ws_ptr,
        stride_wsn,
        stride_wsk,
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
    # fp32 tiles: the partial products are rounded only once, after the reduction.
    push_tile(
        acc,
        data_tab_ptr,
        sig_tab_ptr,
        owner,
        local_rows,
        mask_m,
        offs_n,
        LD,
        ROWS_OWN,
        rank,
        timeout,
        done_offset,
        cnt_offset,
        WORLD,
        BROADCAST,
        USE_GLOBALTIMER,
    )


def scatter_scaled_partials(
    call: runtime.FusedCall,
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    mode: str,
    rows_own: int,
    broadcast: bool,
    cfg: BlockConfig,
) -> int:
    """Launch the scaled scatter GEMM (fp32 tiles into ``[W, rows_own, ld]`` fp32 slots); return the
    ``RS`` target (tiles per owner), as :func:`gemm_rs.scatter_partials`."""
    heap, w = call.heap, call.world_size
    m, k = x.shape
    n = weight.shape[0]
    per_owner = tiles(rows_own, n, cfg)
    grid = (per_owner * (1 if broadcast else w),)
    stride_xsm, stride_xsk = scale_strides(mode, x_scale)
    stride_wsn, stride_wsk = scale_strides(mode, w_scale)
    if grid[0] > 0:
        _scaled_gemm_scatter_kernel[grid](
            x,
            x_scale,
            weight,
            w_scale,
            heap.data_ptrs,
            heap.sig_ptrs,
            m,
            n,
            k,
            slot_stride(n),
            rows_own,
            x.stride(0),
            x.stride(1),
            stride_xsm,
            stride_xsk,
            weight.stride(0),
            weight.stride(1),
            stride_wsn,
            stride_wsk,
            call.rank,
            call.timeout_ticks,
            signals.channel_offset(signals.CH_DONE, w),
            signals.channel_offset(signals.CH_RS, w),
            WORLD=w,
            BROADCAST=broadcast,
            PER_BLOCK=mode == "block",
            USE_GLOBALTIMER=call.use_globaltimer,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return per_owner


def describe(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    deterministic: bool,
    comm_dim: int = 0,
    outer: int = 1,
) -> tuple[int, ...]:
    """This rank's descriptor of a reducing FP8 fused call (mode and all three dtypes included;
    ``comm_dim`` / ``outer``: the caller's ``scatter_dim`` and the product of x's dims before it)."""
    m, k = x.shape
    return agree.describe_call(
        op,
        m,
        k,
        weight.shape[0],
        x.dtype,
        bias=bias is not None,
        flag=deterministic,
        backend="fused",
        quant_mode=mode,
        weight_dtype=weight.dtype,
        out_dtype=out_dtype,
        comm_dim=comm_dim,
        outer=outer,
    )


def scaled_matmul_reduce_scatter(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    deterministic: bool,
    comm_dim: int = 0,
    outer: int = 1,
) -> torch.Tensor:
    """Fused FP8 scaled GEMM + reduce-scatter over the group's symmetric heap.

    ``comm_dim`` / ``outer``: the caller's ``scatter_dim`` and the product of x's dims before it, for
    the call check only (the public op moves that dim to dim 0 before this call).

    Shapes: x FP8 ``[m, k_local]`` (``m % W == 0``, same ``m`` on every rank), weight FP8
    ``[n, k_local]``, scales for ``mode`` (validated by the caller), bias ``[n]`` -> y ``[m / W, n]``
    ``out_dtype`` holding rows ``[r * m / W, (r + 1) * m / W)`` on rank ``r``.

    Reference semantics::

        partial_src = dequant(x_src) @ dequant(weight_src).T      # fp32 on every rank src, not rounded
        y_r = sum(partial_src[rows of r] for src in 0..W-1)      # fp32, in rank order
        y_r = (y_r + bias).to(out_dtype)                          # bias once, one rounding

    Always summed in rank order, so results are bitwise reproducible whatever ``deterministic``
    says (it is part of the call every rank must agree on).
    """
    group, w = group_and_size(group)
    if w == 1:
        return scaled_matmul(x, x_scale, weight, w_scale, bias, mode, out_dtype)
    m, k = x.shape
    n = weight.shape[0]
    rows_own = m // w
    cfg = fp8_block_config(x.device, rows_own, k)
    data_bytes = w * rows_own * slot_stride(n) * 4
    descriptor = describe(OP, x, weight, bias, mode, out_dtype, deterministic, comm_dim, outer)
    with runtime.fused_call(OP, group, x.device, data_bytes, descriptor) as call:
        target = scatter_scaled_partials(call, x, x_scale, weight, w_scale, mode, rows_own, False, cfg)
        # The reduce sums the fp32 slots into an fp32 tile and stores it in its output's dtype.
        out = torch.empty((rows_own, n), dtype=torch.float32, device=x.device)
        call.outputs = (out,)
        reduce_slots(call, out, bias, rows_own, rows_own, n, target, None, cfg)
    # The single rounding (a failed call's NaN carries over).
    return out if out_dtype == torch.float32 else out.to(out_dtype)
