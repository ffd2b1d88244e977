"""Fused GEMM + reduce-scatter: ``y = reduce_scatter_dim0(x @ weight.T) + bias``.

Heap region on each rank: ``slots [W, rows_own, ld]``; slot ``[src]`` of owner ``d`` receives the
partial product of rows ``[d * rows_own, (d + 1) * rows_own)`` computed by rank ``src``. The row
stride ``ld`` is ``n`` rounded up to a multiple of 8 elements (:func:`slot_stride`): every slot row
starts 16-byte aligned, so peer stores and reduce loads are vector accesses for any ``n``. Columns
``[n, ld)`` carry zeros (the GEMM's masked columns) and are never copied out.

Launch sequence on rank ``r`` for call epoch ``e``:

1. scatter GEMM: programs take owners in the order ``r + 1, r + 2, ..., r`` (own rows last, so
   the peers' data leaves first); a program computes its tile, waits for the owner's
   ``DONE >= e - 1`` (it no longer reads its slots of the previous call), stores the tile into
   the owner's slot ``[r]`` and release-adds 1 to the owner's counter ``RS[r]``;
2. reduce: a program waits until every ``RS[src]`` reached this call's tile count, then sums
   slot 0, 1, ..., W-1 in that fixed order in fp32, adds bias once and stores ``y``;
3. set ``DONE[r] = e`` on every rank.

The same two kernels serve :mod:`gemm_ar`: with ``BROADCAST`` the scatter GEMM sends every tile to
every rank (one-shot all-reduce) and with ``PUSH`` the reduce sends its rows to every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from . import runtime, signals
from .gemm import BlockConfig, acc_dtype, block_config, dot_precision, grouped_tile, matmul, tile_matmul


@triton.jit
def scatter_tile(
    pid,
    rank,
    M,
    N,
    ROWS_OWN,
    WORLD: tl.constexpr,
    BROADCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The tile of scatter-GEMM program ``pid``: ``(owner, local_rows, offs_m, mask_m, offs_n, mask_n)``.

    Owner by owner; within an owner's ``ROWS_OWN x N`` block the tiles go in grouped order
    (:func:`gemm.grouped_tile`), which changes no tile count.
    """
    tiles_per_owner = tl.cdiv(ROWS_OWN, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    if BROADCAST:
        owner = pid * 0
    else:
        # Peers' rows first (r + 1 first), own rows last: remote stores start as early as possible.
        owner = (rank + 1 + pid // tiles_per_owner) % WORLD
    local_rows, mask_local, offs_n, mask_n = grouped_tile(pid % tiles_per_owner, ROWS_OWN, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = owner * ROWS_OWN + local_rows
    return owner, local_rows, offs_m, mask_local & (offs_m < M), offs_n, mask_n


@triton.jit
def slot_tile(rows, offs_n, LD):
    """Offsets and mask of a tile of heap rows ``rows`` in a region of row stride ``LD``.

    ``LD`` is a multiple of 8 by construction (:func:`slot_stride`); stating it makes both the row
    starts and the column mask (``offs_n < LD``) 16-byte granular, so a tile moves in vector accesses.
    """
    ld = tl.multiple_of(LD, 8)
    # Row index first (small), then the int64 multiply: heap offsets can exceed 2**31.
    return rows[:, None] * ld + offs_n[None, :], offs_n[None, :] < ld


@triton.jit
def push_tile(
    tile,
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
    WORLD: tl.constexpr,
    BROADCAST: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
):
    """Store ``tile`` into slot ``[rank]`` of its owner (of every rank with ``BROADCAST``), each once
    that rank's ``DONE`` shows it no longer reads its slots of the previous call, then bump its
    ``RS[rank]`` counter. Columns ``[n, LD)`` of ``tile`` are zeros (masked weight rows)."""
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    epoch = signals.call_epoch(pad)
    # This rank's counter in the receiving rank's bank of this call (the bank is the epoch's parity
    # on every rank).
    cnt = signals.counter(pad, cnt_offset, rank, WORLD)
    slot_offs, col_mask = slot_tile(rank * ROWS_OWN + local_rows, offs_n, LD)
    slot_mask = mask_m[:, None] & col_mask
    if BROADCAST:
        for i in tl.static_range(WORLD):
            dst = (rank + 1 + i) % WORLD
            ok = signals.wait_signal(pad + done_offset + dst, epoch - 1, pad, timeout, 1 + dst, USE_GLOBALTIMER)
            if ok:
                tl.store(signals.peer_ptr(data_tab_ptr, dst, tile.dtype) + slot_offs, tile, mask=slot_mask)
                signals.add_signal(signals.peer_ptr(sig_tab_ptr, dst, tl.int64) + cnt, 1)
    else:
        ok = signals.wait_signal(pad + done_offset + owner, epoch - 1, pad, timeout, 1 + owner, USE_GLOBALTIMER)
        if ok:
            tl.store(signals.peer_ptr(data_tab_ptr, owner, tile.dtype) + slot_offs, tile, mask=slot_mask)
            signals.add_signal(signals.peer_ptr(sig_tab_ptr, owner, tl.int64) + cnt, 1)


@triton.jit(do_not_specialize=["rank", "timeout", "rows_per_block"])
def _gemm_scatter_kernel(
    x_ptr,
    w_ptr,
    data_tab_ptr,
    sig_tab_ptr,
    M,
    N,
    K,
    LD,
    ROWS_OWN,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    rows_per_block,
    rank,
    timeout: tl.int64,
    done_offset,
    cnt_offset,
    WORLD: tl.constexpr,
    BROADCAST: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    owner, local_rows, offs_m, mask_m, offs_n, mask_n = scatter_tile(
        tl.program_id(0), rank, M, N, ROWS_OWN, WORLD, BROADCAST, BLOCK_M, BLOCK_N, GROUP_M
    )
    if SPLIT_BLOCKS:
        # scatter_dim > 0: x's rows are outer blocks of W owner blocks of rows_per_block (R) rows
        # each, so owner-local row i is row (i // R) * W * R + owner * R + i % R of x: strided rows
        # instead of a transposing copy. mask_m stays valid (it masks local rows >= ROWS_OWN).
        # int32 division (local rows are below ROWS_OWN): an int64 one is a long subroutine.
        rows32 = local_rows.to(tl.int32)
        block = (rows32 // rows_per_block).to(tl.int64)
        offs_m = block * (WORLD * rows_per_block) + owner * rows_per_block + (rows32 % rows_per_block).to(tl.int64)
    acc = tile_matmul(
        x_ptr,
        stride_xm,
        stride_xk,
        w_ptr,
        stride_wn,
        stride_wk,
        offs_m,
        mask_m,
        offs_n,
        mask_n,
        K,
        x_ptr,
        0,
        mask_m,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        False,
        ACC_DTYPE,
        DOT_PRECISION,
    )
    push_tile(
        acc.to(x_ptr.dtype.element_ty),
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


@triton.jit(do_not_specialize=["rank", "target", "timeout"])
def _reduce_slots_kernel(
    data_tab_ptr,
    sig_tab_ptr,
    bias_ptr,
    out_ptr,
    ROWS_OWN,
    ROWS_VALID,
    N,
    LD,
    stride_om,
    stride_on,
    rank,
    target: tl.int64,
    timeout: tl.int64,
    cnt_offset,
    done_offset,
    push_offset,
    push_base,
    WORLD: tl.constexpr,
    CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PUSH: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_m = offs_m < ROWS_VALID
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    slots = signals.peer_ptr(data_tab_ptr, rank, out_ptr.dtype.element_ty)
    ok = True
    for src in tl.static_range(WORLD):
        ok = ok & signals.wait_signal(
            pad + signals.counter(pad, cnt_offset, src, WORLD),
            target,
            pad,
            timeout,
            1 + src + WORLD * CHANNEL,
            USE_GLOBALTIMER,
        )
    if ok:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
        # Fixed rank order: the result does not depend on which peer finished first (deterministic).
        # A runtime loop keeps one source's tile in registers at a time; unrolled over W sources the
        # compiler hoists every load and the W = 8 reduce spilled.
        for slot in range(WORLD):
            offs, col_mask = slot_tile(slot * ROWS_OWN + offs_m, offs_n, LD)
            acc += tl.load(slots + offs, mask=mask_m[:, None] & col_mask, other=0.0).to(ACC_DTYPE)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(ACC_DTYPE)[None, :]
        result = acc.to(out_ptr.dtype.element_ty)
        if PUSH:
            epoch = signals.call_epoch(pad)
            push_offs, col_mask = slot_tile(rank * ROWS_OWN + offs_m, offs_n, LD)
            push_mask = mask_m[:, None] & col_mask
            for i in tl.static_range(WORLD):
                dst = (rank + 1 + i) % WORLD
                ok_dst = signals.wait_signal(pad + done_offset + dst, epoch - 1, pad, timeout, 1 + dst, USE_GLOBALTIMER)
                if ok_dst:
                    # push_base is W * ROWS_OWN * LD elements, a multiple of 8 (LD is).
                    o_region = signals.peer_ptr(data_tab_ptr, dst, out_ptr.dtype.element_ty) + tl.multiple_of(
                        push_base, 8
                    )
                    tl.store(o_region + push_offs, result, mask=push_mask)
                    signals.add_signal(
                        signals.peer_ptr(sig_tab_ptr, dst, tl.int64) + signals.counter(pad, push_offset, rank, WORLD), 1
                    )
        else:
            tl.store(
                out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                result,
                mask=mask_m[:, None] & (offs_n < N)[None, :],
            )


def slot_stride(n: int) -> int:
    """Row stride of the heap's slot regions: ``n`` rounded up to a multiple of 8 elements."""
    return triton.cdiv(n, 8) * 8


def tiles(rows: int, n: int, cfg: BlockConfig) -> int:
    return triton.cdiv(rows, cfg.block_m) * triton.cdiv(n, cfg.block_n)


def scatter_partials(
    call: runtime.FusedCall,
    x: torch.Tensor,
    weight: torch.Tensor,
    rows_own: int,
    broadcast: bool,
    cfg: BlockConfig,
    *,
    outer: int = 1,
) -> int:
    """Launch the scatter GEMM; return the ``RS`` target (tiles per owner) every peer's counter must reach here.

    ``outer > 1`` (reduce-scatter only): the rows of ``x`` are ``outer`` blocks, each scattered on its
    own (``scatter_dim > 0``); owner ``d``'s ``rows_own`` rows are its block of every outer block."""
    heap, w = call.heap, call.world_size
    m, k = x.shape
    n = weight.shape[0]
    per_owner = tiles(rows_own, n, cfg)
    grid = (per_owner * (1 if broadcast else w),)
    if grid[0] > 0:
        _gemm_scatter_kernel[grid](
            x,
            weight,
            heap.data_ptrs,
            heap.sig_ptrs,
            m,
            n,
            k,
            slot_stride(n),
            rows_own,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            rows_own // outer,
            call.rank,
            call.timeout_ticks,
            signals.channel_offset(signals.CH_DONE, w),
            signals.channel_offset(signals.CH_RS, w),
            WORLD=w,
            BROADCAST=broadcast,
            SPLIT_BLOCKS=outer > 1,
            USE_GLOBALTIMER=call.use_globaltimer,
            ACC_DTYPE=acc_dtype(x.dtype),
            DOT_PRECISION=dot_precision(x.dtype, x.device),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return per_owner


def reduce_slots(
    call: runtime.FusedCall,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    rows_own: int,
    rows_valid: int,
    n: int,
    target: int,
    push_base: int | None,
    cfg: BlockConfig,
) -> int:
    """Launch the fixed-order reduce of the ``W`` slots; with ``push_base`` push the rows to every rank.

    Returns the ``AR`` target of the rows pushed (each owner's tile count; 0 unless pushing).
    """
    heap, w = call.heap, call.world_size
    grid = (tiles(rows_own, n, cfg),)
    push = push_base is not None
    # The kernel indexes bias with unit stride.
    bias = bias.contiguous() if bias is not None else None
    if grid[0] > 0:
        _reduce_slots_kernel[grid](
            heap.data_ptrs,
            heap.sig_ptrs,
            bias if bias is not None else out,
            out,
            rows_own,
            rows_valid,
            n,
            slot_stride(n),
            out.stride(0),
            out.stride(1),
            call.rank,
            target,
            call.timeout_ticks,
            signals.channel_offset(signals.CH_RS, w),
            signals.channel_offset(signals.CH_DONE, w),
            signals.channel_offset(signals.CH_AR, w),
            push_base if push else 0,
            WORLD=w,
            CHANNEL=signals.CH_RS,
            HAS_BIAS=bias is not None,
            PUSH=push,
            USE_GLOBALTIMER=call.use_globaltimer,
            ACC_DTYPE=acc_dtype(out.dtype),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
        )
    return grid[0] if push else 0


def group_and_size(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int]:
    """The group a fused op runs on (``None``: the default group) and its size."""
    group = runtime.resolve_group(group)
    return group, runtime.world_size(group)


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    deterministic: bool = False,
    *,
    outer: int = 1,
    comm_dim: int = 0,
) -> torch.Tensor:
    """Fused GEMM + reduce-scatter over the group's symmetric heap.

    Shapes: x ``[m, k_local]`` (``m % W == 0``, same on every rank), weight ``[n, k_local]``,
    bias ``[n]`` -> y ``[m / W, n]`` holding rows ``[r * m / W, (r + 1) * m / W)`` on rank ``r``.

    Reference semantics::

        partial_src = x_src @ weight_src.T                     # on every rank src, rounded to x.dtype
        y_r = sum(partial_src[rows of r] for src in 0..W-1)  # fp32, in rank order
        y_r = y_r + bias                                       # once, after the reduction

    ``rows of r``: ``[r * m / W, (r + 1) * m / W)`` for ``outer == 1``; with ``outer > 1`` (the
    product of the dims before ``scatter_dim``) block ``r`` of each of the ``outer`` row blocks,
    read in place by the scatter GEMM (no transposing copy). ``comm_dim`` (the normalized
    scatter_dim) goes into the call descriptor.

    The sum always runs in rank order, so results are bitwise reproducible whatever
    ``deterministic`` says (it costs nothing here). Raises RuntimeError naming the missing peer if a
    wait exceeds ``COC_TIMEOUT``.
    """
    group, w = group_and_size(group)
    if w == 1:
        return matmul(x, weight, bias)
    m = x.shape[0]
    n = weight.shape[0]
    rows_own = m // w
    cfg = block_config(x.device, rows_own, x.shape[1], x.dtype, op="matmul_reduce_scatter", n=n)
    data_bytes = w * rows_own * slot_stride(n) * x.element_size()
    # ``deterministic`` changes nothing here but is part of the call every rank must agree on.
    descriptor = runtime.describe(
        "matmul_reduce_scatter",
        m,
        x.shape[1],
        n,
        x.dtype,
        bias is not None,
        deterministic,
        comm_dim=comm_dim,
        tiles=(cfg.block_m, cfg.block_n),
        outer=outer,
    )
    with runtime.fused_call("matmul_reduce_scatter", group, x.device, data_bytes, descriptor) as call:
        target = scatter_partials(call, x, weight, rows_own, False, cfg, outer=outer)
        out = torch.empty((rows_own, n), dtype=x.dtype, device=x.device)
        call.outputs = (out,)
        reduce_slots(call, out, bias, rows_own, rows_own, n, target, None, cfg)
    return out
