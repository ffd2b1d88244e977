"""Fused FP8 all-gather + scaled GEMM: ``y = all_gather_dim0(dequant(x)) @ dequant(weight).T + bias``.

The protocol of :mod:`ag_gemm` (call check, push kernel with per-chunk ready flags ``AG[src, c]``,
GEMM that reads its own rows from ``x`` and waits for the peers' chunks, finish), with two changes:

* the heap holds the FP8 payload ``G [W * m_local, k]`` (one byte per element: half the bytes a
  bf16 all-gather moves) and, 16-byte aligned after it, the activation scales
  ``S [W * m_local, sk]`` fp32 (``sk = ceil(k / 128)`` in block mode, else 1). The push kernel
  copies a chunk's payload rows *and* their scale rows before it raises the chunk's flag, so one
  flag covers both: a GEMM program never reads a scale row that has not arrived. A tensorwise
  scale is the scale of its rank's rows: it travels as that scalar in every row of the shard, so
  each shard is dequantized with the scale its rank passed;
* the GEMM is :func:`gemm_fp8.scaled_tile` (FP8 tensor cores, scales applied to the fp32
  accumulator per 128-deep k block), rounding once to ``out_dtype`` after adding bias in fp32.

With ``return_gathered`` a copy kernel launched after the GEMM (whose programs acquired every
chunk's flag, so it waits for nothing) copies the gathered FP8 rows and scale rows out, so the
caller gets the gathered payload bit for bit and its scales as ``[W * m_local, sk]`` (tensor mode:
``sk = 1``, each row its rank's scalar, as the sequential reference returns).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import agree
from . import runtime, signals
from .ag_gemm import _side_stream
from .gemm import BlockConfig
from .gemm_fp8 import fp8_block_config, scale_cols, scale_strides, scaled_matmul, scaled_tile, store_scaled_tile

OP = "all_gather_scaled_matmul"


@triton.jit
def copy_rows(src_ptr, stride_sm, stride_sk, src_rows, dst_ptr, dst_rows, mask_r, COLS, BLOCK_C: tl.constexpr):
    """``dst[dst_rows, :COLS] = src[src_rows, :COLS]`` (``dst`` contiguous, row stride ``COLS``):
    payload rows and fp32 scale rows alike."""
    for c0 in range(0, COLS, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
        mask = mask_r[:, None] & (cols < COLS)[None, :]
        v = tl.load(src_ptr + src_rows[:, None] * stride_sm + cols[None, :] * stride_sk, mask=mask)
        tl.store(dst_ptr + dst_rows[:, None] * COLS + cols[None, :], v, mask=mask)


@triton.jit
def gathered_scales(data_tab_ptr, rank, s_base):
    """This rank's gathered scale region ``S`` (fp32, ``s_base`` elements into the data region, a
    multiple of 4: 16-byte aligned)."""
    return signals.peer_ptr(data_tab_ptr, rank, tl.float32) + tl.multiple_of(s_base, 4)


@triton.jit(do_not_specialize=["rank"])
def _push_scaled_shard_kernel(
    x_ptr,
    xs_ptr,
    data_tab_ptr,
    sig_tab_ptr,
    M_LOCAL,
    K,
    SK,
    s_base,
    stride_xm,
    stride_xk,
    stride_xsm,
    stride_xsk,
    chunk_rows,
    n_chunks,
    rank,
    WORLD: tl.constexpr,
    FLAG_OFFSET: tl.constexpr,
    FLAG_STRIDE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # As ag_gemm._push_shard_kernel: program (step, c) copies chunk c to rank (rank - 1 - step),
    # here payload and scale rows, and then raises AG[rank, c] there once for both.
    pid = tl.program_id(0)
    step = pid // n_chunks
    c = pid % n_chunks
    dst = (rank - 1 - step + WORLD) % WORLD
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    # Nothing may be written into any peer after a failed call check.
    if signals.failed(pad) == 0:
        g = signals.peer_ptr(data_tab_ptr, dst, x_ptr.dtype.element_ty)
        gs = gathered_scales(data_tab_ptr, dst, s_base)
        end = tl.minimum(c * chunk_rows + chunk_rows, M_LOCAL)
        for r0 in range(c * chunk_rows, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
            mask_r = rows < end
            copy_rows(x_ptr, stride_xm, stride_xk, rows, g, rank * M_LOCAL + rows, mask_r, K, BLOCK_K)
            copy_rows(xs_ptr, stride_xsm, stride_xsk, rows, gs, rank * M_LOCAL + rows, mask_r, SK, BLOCK_S)
        signals.send_signal(
            signals.peer_ptr(sig_tab_ptr, dst, tl.int64) + FLAG_OFFSET + rank * FLAG_STRIDE + c, signals.call_epoch(pad)
        )


@triton.jit(do_not_specialize=["rank", "timeout"])
def _ag_scaled_gemm_kernel(
    x_ptr,
    xs_ptr,
    data_tab_ptr,
    sig_tab_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    y_ptr,
    M_LOCAL,
    N,
    K,
    SK,
    s_base,
    n_tiles,
    chunk_rows,
    stride_xm,
    stride_xk,
    stride_xsm,
    stride_xsk,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    stride_ym,
    stride_yn,
    rank,
    timeout: tl.int64,
    flag_offset,
    WORLD: tl.constexpr,
    CHANNEL: tl.constexpr,
    FLAG_STRIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The tile order and waits of ag_gemm._ag_gemm_kernel: own shard first, then ring order.
    pid = tl.program_id(0)
    tiles_per_shard = tl.cdiv(M_LOCAL, BLOCK_M)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    src = (rank + pid_m // tiles_per_shard) % WORLD
    first_row = (pid_m % tiles_per_shard) * BLOCK_M
    # chunk_rows is a multiple of BLOCK_M, so a tile lies in exactly one chunk.
    flag = flag_offset + src * FLAG_STRIDE + first_row // chunk_rows
    local_rows = first_row + tl.arange(0, BLOCK_M).to(tl.int64)
    mask_m = local_rows < M_LOCAL
    offs_m = src * M_LOCAL + local_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = offs_n < N
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    if src == rank:
        # Own rows and scales straight from x / x_scale: no flag to wait for.
        if signals.failed(pad) == 0:
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
                local_rows,
                mask_m,
                offs_n,
                mask_n,
                K,
                PER_BLOCK,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            store_scaled_tile(y_ptr, acc, bias_ptr, offs_m, mask_m, offs_n, mask_n, stride_ym, stride_yn, HAS_BIAS)
    else:
        epoch = signals.call_epoch(pad)
        if signals.wait_signal(pad + flag, epoch, pad, timeout, 1 + src + WORLD * CHANNEL, USE_GLOBALTIMER):
            g_local = signals.peer_ptr(data_tab_ptr, rank, x_ptr.dtype.element_ty)
            s_local = gathered_scales(data_tab_ptr, rank, s_base)
            acc = scaled_tile(
                g_local,
                K,
                1,
                s_local,
                SK,
                1,
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
            store_scaled_tile(y_ptr, acc, bias_ptr, offs_m, mask_m, offs_n, mask_n, stride_ym, stride_yn, HAS_BIAS)


@triton.jit(do_not_specialize=["rank"])
def _copy_gathered_kernel(
    x_ptr,
    xs_ptr,
    data_tab_ptr,
    g_ptr,
    gs_ptr,
    M_LOCAL,
    K,
    SK,
    s_base,
    stride_xm,
    stride_xk,
    stride_xsm,
    stride_xsk,
    rank,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # Launched after the GEMM, whose programs acquired every chunk's flag: the gathered rows are
    # all here (stream order), so nothing waits. Own rows come from x, as in the GEMM.
    pid = tl.program_id(0)
    tiles_per_shard = tl.cdiv(M_LOCAL, BLOCK_R)
    src = pid // tiles_per_shard
    local_rows = (pid % tiles_per_shard) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    mask_r = local_rows < M_LOCAL
    rows = src * M_LOCAL + local_rows
    if src == rank:
        copy_rows(x_ptr, stride_xm, stride_xk, local_rows, g_ptr, rows, mask_r, K, BLOCK_K)
        copy_rows(xs_ptr, stride_xsm, stride_xsk, local_rows, gs_ptr, rows, mask_r, SK, BLOCK_S)
    else:
        g_local = signals.peer_ptr(data_tab_ptr, rank, x_ptr.dtype.element_ty)
        copy_rows(g_local, K, 1, rows, g_ptr, rows, mask_r, K, BLOCK_K)
        copy_rows(gathered_scales(data_tab_ptr, rank, s_base), SK, 1, rows, gs_ptr, rows, mask_r, SK, BLOCK_S)


def copy_cols(device: torch.device, k: int) -> int:
    """Payload columns per step of the row copies: 256 bytes on GPU, 64 for unaligned rows (byte
    loads: 256 spilled on sm_90), 64 in the interpreter."""
    return 256 if device.type == "cuda" and k % 16 == 0 else 64


def push_cols(device: torch.device, k: int) -> int:
    """Payload columns per step of the push: at most 128 (with 256, Triton 3.6's build of the
    block-mode push kept an 8-byte stack frame on sm_90)."""
    return min(copy_cols(device, k), 128)


def _block_s(sk: int) -> int:
    return min(triton.next_power_of_2(sk), 64)


def scale_base(w: int, m_local: int, k: int) -> int:
    """Offset of the scale region ``S`` in the data region, in fp32 elements (16-byte aligned)."""
    return triton.cdiv(w * m_local * k, 16) * 4


def _push(
    call: runtime.FusedCall,
    x: torch.Tensor,
    x_scale: torch.Tensor,
    mode: str,
    chunk_rows: int,
    side: torch.cuda.Stream | None,
) -> bool:
    """Launch the push kernel (GPU: on the high-priority side stream, as :func:`ag_gemm._push_shard`);
    returns whether it forked ``side`` from the current stream (the caller joins it back)."""
    heap, r, w = call.heap, call.rank, call.world_size
    m_local, k = x.shape
    n_chunks = triton.cdiv(m_local, chunk_rows)
    if n_chunks == 0:
        return False
    sk = scale_cols(mode, k)
    stride_sm, stride_sk = scale_strides(mode, x_scale)
    gpu = side is not None
    if gpu:
        side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side) if gpu else contextlib.nullcontext():
        _push_scaled_shard_kernel[((w - 1) * n_chunks,)](
            x,
            x_scale,
            heap.data_ptrs,
            heap.sig_ptrs,
            m_local,
            k,
            sk,
            scale_base(w, m_local, k),
            x.stride(0),
            x.stride(1),
            stride_sm,
            stride_sk,
            chunk_rows,
            n_chunks,
            r,
            WORLD=w,
            FLAG_OFFSET=signals.channel_offset(signals.CH_AG, w),
            FLAG_STRIDE=signals.AG_MAX_SPLITS,
            BLOCK_R=32 if gpu else 16,
            BLOCK_K=push_cols(x.device, k),
            BLOCK_S=_block_s(sk),
            num_warps=4 if gpu else 1,
        )
    return gpu


def _gemm(
    call: runtime.FusedCall,
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    return_gathered: bool,
    cfg: BlockConfig,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate the outputs and launch the GEMM over the gathered rows: ``(y, x_gathered, scale_gathered)``
    (the last two are ``y`` when not returned)."""
    w = call.world_size
    m_local, k = x.shape
    n = weight.shape[0]
    sk = scale_cols(mode, k)
    y = torch.empty((w * m_local, n), dtype=out_dtype, device=x.device)
    x_gathered = torch.empty((w * m_local, k), dtype=x.dtype, device=x.device) if return_gathered else y
    s_gathered = torch.empty((w * m_local, sk), dtype=torch.float32, device=x.device) if return_gathered else y
    # A failed call fills these with NaN (at most two outputs): the gathered payload is left as it
    # is, but its scales are NaN, so the gathered pair never dequantizes to a result.
    call.outputs = (y, s_gathered) if return_gathered else (y,)
    # With n == 0 the gathered outputs still need one column of programs: they acquire the chunk
    # flags that the copy of the gathered rows (launched after the GEMM) relies on.
    n_tiles = max(triton.cdiv(n, cfg.block_n), 1 if return_gathered else 0)
    grid = (w * triton.cdiv(m_local, cfg.block_m) * n_tiles,)
    stride_xsm, stride_xsk = scale_strides(mode, x_scale)
    stride_wsn, stride_wsk = scale_strides(mode, w_scale)
    if grid[0] > 0:
        _ag_scaled_gemm_kernel[grid](
            x,
            x_scale,
            call.heap.data_ptrs,
            call.heap.sig_ptrs,
            weight,
            w_scale,
            bias if bias is not None else y,
            y,
            m_local,
            n,
            k,
            sk,
            scale_base(w, m_local, k),
            n_tiles,
            chunk_rows,
            x.stride(0),
            x.stride(1),
            stride_xsm,
            stride_xsk,
            weight.stride(0),
            weight.stride(1),
            stride_wsn,
            stride_wsk,
            y.stride(0),
            y.stride(1),
            call.rank,
            call.timeout_ticks,
            signals.channel_offset(signals.CH_AG, w),
            WORLD=w,
            CHANNEL=signals.CH_AG,
            FLAG_STRIDE=signals.AG_MAX_SPLITS,
            HAS_BIAS=bias is not None,
            PER_BLOCK=mode == "block",
            USE_GLOBALTIMER=call.use_globaltimer,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    if return_gathered and m_local > 0:
        gpu = x.device.type == "cuda"
        rows = 32 if gpu else 16
        _copy_gathered_kernel[(w * triton.cdiv(m_local, rows),)](
            x,
            x_scale,
            call.heap.data_ptrs,
            x_gathered,
            s_gathered,
            m_local,
            k,
            sk,
            scale_base(w, m_local, k),
            x.stride(0),
            x.stride(1),
            stride_xsm,
            stride_xsk,
            call.rank,
            BLOCK_R=rows,
            BLOCK_K=copy_cols(x.device, k),
            BLOCK_S=_block_s(sk),
            num_warps=4 if gpu else 1,
        )
    return y, x_gathered, s_gathered


def all_gather_scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    return_gathered: bool,
    comm_dim: int = 0,
    outer: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused FP8 all-gather + scaled GEMM over the group's symmetric heap.

    ``comm_dim`` / ``outer``: the caller's ``gather_dim`` and the product of x's dims before it, for
    the call check only (the public op moves that dim to dim 0 before this call).

    Shapes: x FP8 ``[m_local, k]`` (same ``m_local`` and ``k`` on every rank), weight FP8 ``[n, k]``,
    scales for ``mode`` (validated by the caller), bias ``[n]`` in ``out_dtype`` -> y ``[W * m_local, n]``
    ``out_dtype``; with ``return_gathered`` also the gathered payload ``[W * m_local, k]`` (x's dtype,
    bit-exact) and its scales: ``[W * m_local, sk]`` fp32 (``sk``: ``ceil(k / 128)`` for block, 1 for
    row and tensor: each row its rank's scale).

    Reference semantics::

        xd_r = x_r.double() * x_scale_r (broadcast per mode) on every rank r
        y = (cat([xd_0, ..., xd_{W-1}]) @ dequant(weight).T + bias).to(out_dtype)
        x_gathered = cat([x_0, ..., x_{W-1}])
        scale_gathered = cat([x_scale_0, ..., x_scale_{W-1}])   # tensor mode: x_scale_r on each row of rank r

    Nothing is reduced across ranks. Raises RuntimeError naming the peer if a wait exceeds
    ``COC_TIMEOUT`` and on every rank when the ranks' calls differ (shapes, mode, dtypes, flags).
    """
    group = runtime.resolve_group(group)
    w = runtime.world_size(group)
    # The kernels index bias with unit stride.
    bias = bias.contiguous() if bias is not None else None
    if w == 1:
        y = scaled_matmul(x, x_scale, weight, w_scale, bias, mode, out_dtype)
        if return_gathered:
            scales = x_scale.reshape(1, 1).expand(x.shape[0], 1) if mode == "tensor" else x_scale
            return (
                y,
                x.clone(memory_format=torch.contiguous_format),
                scales.clone(memory_format=torch.contiguous_format),
            )
        return y
    m_local, k = x.shape
    n = weight.shape[0]
    data_bytes = scale_base(w, m_local, k) * 4 + w * m_local * scale_cols(mode, k) * 4
    descriptor = agree.describe_call(
        OP,
        m_local,
        k,
        n,
        x.dtype,
        bias=bias is not None,
        flag=return_gathered,
        backend="fused",
        quant_mode=mode,
        weight_dtype=weight.dtype,
        out_dtype=out_dtype,
        comm_dim=comm_dim,
        outer=outer,
    )
    with runtime.fused_call(OP, group, x.device, data_bytes, descriptor) as call:
        # m_local and k are in the checked descriptor: every rank picks the same tiles and chunks.
        cfg = fp8_block_config(x.device, m_local, k)
        chunk_rows = max(1, triton.cdiv(triton.cdiv(m_local, cfg.ag_splits), cfg.block_m)) * cfg.block_m
        side = _side_stream(x.device) if x.device.type == "cuda" else None
        forked = _push(call, x, x_scale, mode, chunk_rows, side)
        try:
            y, x_gathered, s_gathered = _gemm(
                call, x, x_scale, weight, w_scale, bias, mode, out_dtype, return_gathered, cfg, chunk_rows
            )
        finally:
            if forked:
                # Joined on every path (see ag_gemm.all_gather_matmul).
                torch.cuda.current_stream(x.device).wait_stream(side)
    return (y, x_gathered, s_gathered) if return_gathered else y
