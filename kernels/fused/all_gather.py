"""Fused all-gather + GEMM for every operand format: ``y_i = all_gather(x) @ dequant(w_i).T + b_i``.

Launch sequence on rank ``r`` for call epoch ``e`` (W ranks; heap region ``G [W * m_local, k]`` of x's
payload and, for formats whose rows carry scales (FP8), ``S [W * m_local, sk]`` fp32 16-byte aligned
after it, ``sk = ceil(k / 128)`` in block mode, else 1):

1. call check (:func:`runtime.begin`): publish this call's descriptor to every peer and wait for
   theirs of epoch ``e``. A peer publishes only after its kernels of call ``e - 1`` finished, so
   once the check passes no peer still reads its ``G`` of the previous call;
2. push kernel (GPU: on a high-priority side stream): copy ``x`` (and its scale rows) into rows
   ``[r * m_local, (r + 1) * m_local)`` of every peer's ``G`` (and ``S``) chunk by chunk (chunks of
   whole untuned row tiles, the same on every rank), peers in the order ``r - 1, r - 2, ...`` (the
   order in which they need shard ``r``), setting flag ``AG[r, c] = e`` on the receiving rank after
   chunk ``c``: one flag covers payload and scales. Skipped entirely if the check failed. A
   tensorwise FP8 scale is the scale of its rank's rows: it travels as that scalar on every row;
3. GEMM kernel: programs walk this rank's rows first (read straight from ``x``, no wait), then
   the ring ``r + 1, r + 2, ...``; a program waits for ``AG[src, c] >= e`` of every chunk its rows
   overlap (one unless its tuned tile is taller than the untuned one) before loading them from the
   local ``G`` (and ``S``); the ``n``-tile-0 programs also write the rows they load (and their scale
   rows) to ``x_gathered`` (``x_scale_gathered``) when asked;
4. finish kernel: set ``DONE[r] = e`` on every rank, or fill the outputs with NaN after a failure.

Each rank only reads its own ``G`` and only peers write it, so step 1 is the whole flow control.
Under the interpreter the GEMM of step 3 waits only on other ranks' step 2, never on a later program
of its own launch. Further weights multiply the gathered rows with the local GEMM (:mod:`matmul`).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..format import OperandFormat
from ..ops.gemm import GemmCall, Operands
from . import matmul, runtime, signals
from .blocks import BlockConfig, block_config, chunk_rows, dot_math, kernel_format, scale_rows, w_operand, x_operand
from .matmul import ROUNDING
from .tile import copy_rows, split_rows, store_tile, tile_matmul

# STORE_A of the GEMM kernel: where the gathered rows are written to x_gathered, if at all. Inside the
# plain tile core's k loop (as it loads them), or copied by the n-tile-0 programs before their GEMM
# (strided output rows, and every scaled format: its k loop gains no registers).
NO_STORE, STORE_IN_GEMM, COPY_FIRST = 0, 1, 2
_STORE_IN_GEMM = tl.constexpr(STORE_IN_GEMM)
_COPY_FIRST = tl.constexpr(COPY_FIRST)


class PushProto(NamedTuple):
    """``PROTO`` of :func:`push_kernel`: flag ``AG[src, c]`` lies at ``FLAG_OFFSET + src * FLAG_STRIDE + c``."""

    WORLD: int
    FLAG_OFFSET: int
    FLAG_STRIDE: int


class PushBlocks(NamedTuple):
    """``BLOCKS`` of :func:`push_kernel`: ``BLOCK_R`` rows per copy step, ``BLOCK_K`` payload and ``BLOCK_S``
    scale columns per step."""

    BLOCK_R: int
    BLOCK_K: int
    BLOCK_S: int


class AllGatherProto(NamedTuple):
    """``PROTO`` of :func:`_ag_gemm_kernel`: ``CHANNEL``, the phase its timeouts report (``AG``); the flags'
    stride per source; ``SPLIT_BLOCKS``, x's rows are outer blocks gathered on their own (``gather_dim > 0``);
    ``STORE_A``, where the gathered rows are written (the constants above); ``BLOCK_S``, scale columns per copy
    step; ``ROUND``, the epilogue's rounding (:func:`tile.store_tile`)."""

    WORLD: int
    CHANNEL: int
    FLAG_STRIDE: int
    SPLIT_BLOCKS: bool
    STORE_A: int
    BLOCK_S: int
    ROUND: int
    USE_GLOBALTIMER: bool


@triton.jit
def _scale_region(data_tab_ptr, rank, s_base):
    """Rank ``rank``'s gathered scale region ``S`` (fp32, ``s_base`` elements into the data region, a
    multiple of 4: 16-byte aligned)."""
    return signals.peer_ptr(data_tab_ptr, rank, tl.float32) + tl.multiple_of(s_base, 4)


@triton.jit(do_not_specialize=["rank"])
def push_kernel(X, heap, dims, rank, PROTO: tl.constexpr, BLOCKS: tl.constexpr):
    # X as the GEMM's (scale None: no scale rows); heap = (data table, signal table, S base);
    # dims = (M_LOCAL, K, SK, chunk_rows, n_chunks); PROTO: PushProto; BLOCKS: PushBlocks.
    # Program (step, c) copies chunk c of x into row block ``rank`` of rank (rank - 1 - step)'s
    # gather buffer and then raises that rank's flag AG[rank, c]. Rank d's GEMM reads its own rows
    # (from its x) first and shard d + 1 next, so rank - 1 is served first, then rank - 2, ...
    x_ptr, stride_xm, stride_xk, xs_ptr, stride_xsm, stride_xsk = X
    data_tab_ptr, sig_tab_ptr, s_base = heap
    M_LOCAL, K, SK, chunk_rows, n_chunks = dims
    WORLD: tl.constexpr = PROTO.WORLD
    BLOCK_R: tl.constexpr = BLOCKS.BLOCK_R
    BLOCK_K: tl.constexpr = BLOCKS.BLOCK_K
    BLOCK_S: tl.constexpr = BLOCKS.BLOCK_S
    pid = tl.program_id(0)
    step = pid // n_chunks
    c = pid % n_chunks
    dst = (rank - 1 - step + WORLD) % WORLD
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    # The call check of this epoch ran before this kernel: if it failed (a peer missing, or a peer
    # described another call), nothing may be written into any peer.
    if signals.failed(pad) == 0:
        g = signals.peer_ptr(data_tab_ptr, dst, x_ptr.dtype.element_ty)
        if xs_ptr is not None:
            gs = _scale_region(data_tab_ptr, dst, s_base)
        end = tl.minimum(c * chunk_rows + chunk_rows, M_LOCAL)
        for r0 in range(c * chunk_rows, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
            mask_r = rows < end
            copy_rows((x_ptr, stride_xm, stride_xk, rows), (g, rank * M_LOCAL + rows), mask_r, K, BLOCK_K)
            if xs_ptr is not None:
                # Before the flag: one flag covers a chunk's payload and scale rows.
                copy_rows((xs_ptr, stride_xsm, stride_xsk, rows), (gs, rank * M_LOCAL + rows), mask_r, SK, BLOCK_S)
        signals.send_signal(
            signals.peer_ptr(sig_tab_ptr, dst, tl.int64) + PROTO.FLAG_OFFSET + rank * PROTO.FLAG_STRIDE + c,
            signals.call_epoch(pad),
        )


@triton.jit
def _gemm_tile(A, W, OUT, where, FMT: tl.constexpr, TILE: tl.constexpr, MATH: tl.constexpr, PROTO: tl.constexpr):
    """One tile of the all-gather GEMM on rows that are here: ``A`` as ``X`` (this rank's x, or the
    gather buffer ``G`` and scale region ``S``), ``where = (a_rows, local_rows, offs_m, mask_m, offs_n,
    mask_n, src, rows_per_block, pid_n, g_base, K, SK)``: the rows of ``A``, of the shard, of ``G``,
    and where the gathered rows start in ``x_gathered`` for the copy inside the GEMM core."""
    a_rows, local_rows, offs_m, mask_m, offs_n, mask_n, src, rows_per_block, pid_n, g_base, K, SK = where
    y_ptr, stride_ym, stride_yn, bias_ptr, g_ptr, gs_ptr = OUT
    WORLD: tl.constexpr = PROTO.WORLD
    SPLIT_BLOCKS: tl.constexpr = PROTO.SPLIT_BLOCKS
    STORE_A: tl.constexpr = PROTO.STORE_A
    if STORE_A == _COPY_FIRST:
        # Before the GEMM (nothing of it live yet): x_gathered's rows are strided (SPLIT_BLOCKS), or
        # the k loop of a scaled format would carry the copy's registers.
        if pid_n == 0:
            if SPLIT_BLOCKS:
                g_rows = split_rows(local_rows, src, rows_per_block, WORLD)
            else:
                g_rows = offs_m
            a_ptr, stride_am, stride_ak, as_ptr, stride_asm, stride_ask = A
            copy_rows((a_ptr, stride_am, stride_ak, a_rows), (g_ptr, g_rows), mask_m, K, TILE.BLOCK_K)
            if gs_ptr is not None:
                copy_rows((as_ptr, stride_asm, stride_ask, a_rows), (gs_ptr, g_rows), mask_m, SK, PROTO.BLOCK_S)
    if STORE_A == _STORE_IN_GEMM:
        # Only the n-tile-0 programs write x_gathered (the interpreter cannot broadcast a scalar
        # predicate into a mask, hence the vector form).
        G = (g_ptr + g_base, K, mask_m & ((offs_m * 0 + pid_n) == 0))
    else:
        G = None
    acc = tile_matmul(A, W, (a_rows, mask_m, offs_n, mask_n), K, G, FMT, TILE, MATH)
    if SPLIT_BLOCKS:
        offs_y = split_rows(local_rows, src, rows_per_block, WORLD)
    else:
        offs_y = offs_m
    store_tile((y_ptr, stride_ym, stride_yn, bias_ptr), acc, (offs_y, mask_m, offs_n, mask_n), PROTO.ROUND)


@triton.jit(do_not_specialize=["rank", "timeout", "rows_per_block"])
def _ag_gemm_kernel(
    X,
    W,
    OUT,
    heap,
    dims,
    rows_per_block,
    rank,
    timeout: tl.int64,
    FMT: tl.constexpr,
    TILE: tl.constexpr,
    MATH: tl.constexpr,
    PROTO: tl.constexpr,
):
    # X: this rank's x (and scales); OUT = (y, stride_ym, stride_yn, bias, x_gathered, x_scale_gathered);
    # heap = (data table, signal table, AG offset, S base); dims = (M_LOCAL, N, K, SK, n_tiles, chunk_rows);
    # PROTO: AllGatherProto.
    x_ptr, _, _, xs_ptr, _, _ = X
    data_tab_ptr, sig_tab_ptr, flag_offset, s_base = heap
    M_LOCAL, N, K, SK, n_tiles, chunk_rows = dims
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    WORLD: tl.constexpr = PROTO.WORLD
    pid = tl.program_id(0)
    tiles_per_shard = tl.cdiv(M_LOCAL, BLOCK_M)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    # Own shard first (already local), then ring order: the flags arrive roughly in that order.
    src = (rank + pid_m // tiles_per_shard) % WORLD
    first_row = (pid_m % tiles_per_shard) * BLOCK_M
    # chunk_rows is the same on every rank (it follows the checked m_local only) while BLOCK_M is this
    # rank's own (tuned by its n, which column shards need not share): a tile waits for every chunk
    # of src's shard its rows overlap.
    flags = flag_offset + src * PROTO.FLAG_STRIDE
    first_chunk = first_row // chunk_rows
    last_chunk = (tl.minimum(first_row + BLOCK_M, M_LOCAL) - 1) // chunk_rows
    local_rows = first_row + tl.arange(0, BLOCK_M).to(tl.int64)
    mask_m = local_rows < M_LOCAL
    # Rows of the gather buffer G (source-major: shard src at rows [src * M_LOCAL, ...)).
    offs_m = src * M_LOCAL + local_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = offs_n < N
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    if src == rank:
        # Own rows straight from x: no flag, so this launch never waits on the push launch of its
        # own process (which then need not be co-resident with it). Skipped after a failed check.
        if signals.failed(pad) == 0:
            # 64-bit: the gathered buffer of W * m_local rows of k elements passes 2**31 elements long
            # before any row index does.
            g_base = (rank * M_LOCAL).to(tl.int64) * K
            where = (local_rows, local_rows, offs_m, mask_m, offs_n, mask_n, src, rows_per_block, pid_n, g_base, K, SK)
            _gemm_tile(X, W, OUT, where, FMT, TILE, MATH, PROTO)
    else:
        epoch = signals.call_epoch(pad)
        code = 1 + src + WORLD * PROTO.CHANNEL
        ready = signals.wait_signal(pad + flags + first_chunk, epoch, pad, timeout, code, PROTO.USE_GLOBALTIMER)
        for c in range(first_chunk + 1, last_chunk + 1):
            ready = ready & signals.wait_signal(pad + flags + c, epoch, pad, timeout, code, PROTO.USE_GLOBALTIMER)
        if ready:
            g_local = signals.peer_ptr(data_tab_ptr, rank, x_ptr.dtype.element_ty)
            if xs_ptr is not None:
                A = (g_local, K, 1, _scale_region(data_tab_ptr, rank, s_base), SK, 1)
            else:
                A = (g_local, K, 1, None, 0, 0)
            where = (offs_m, local_rows, offs_m, mask_m, offs_n, mask_n, src, rows_per_block, pid_n, 0, K, SK)
            _gemm_tile(A, W, OUT, where, FMT, TILE, MATH, PROTO)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        # High priority: the pushes are on the GEMM's critical path.
        stream = torch.cuda.Stream(device=device, priority=-1)
        _SIDE_STREAMS[device] = stream
    return stream


def push_cols(fmt: OperandFormat, device: torch.device, k: int) -> int:
    """Payload columns per step of the push: 128 on GPU (64 in the interpreter); FP8 rows 64 where
    they are not 16-byte aligned (byte loads: 256 spilled on sm_90; with 256 columns, Triton 3.6's
    build of the block-mode push kept an 8-byte stack frame)."""
    if device.type != "cuda" or (fmt.scaled_rows and k % 16):
        return 64
    return 128


def scale_base(payload_bytes: int) -> int:
    """Offset of the scale region ``S`` in the data region, in fp32 elements (16-byte aligned)."""
    return triton.cdiv(payload_bytes, 16) * 4


def _block_s(sk: int) -> int:
    return min(triton.next_power_of_2(sk), 64)


def _push(call: runtime.FusedCall, fmt: OperandFormat, ops: Operands, chunk: int, side: torch.cuda.Stream | None):
    """Copy x (and its scale rows) chunk by chunk into row block ``r`` of every peer's gather buffer,
    flag after each chunk.

    One kernel, so the pushes are skipped on the device when the call check failed: copies queued
    by the host could not be (the host learns of a failure only later) and would overwrite the
    gather buffer of a slow but alive peer still reading its previous call. On GPU it runs on a
    high-priority side stream, queued before the GEMM: its few programs get SMs before the GEMM's
    spinning programs, and the GEMM starts on this rank's own rows at once. Returns whether it
    forked ``side`` from the current stream (the caller must then join it back).
    """
    heap, r, w = call.heap, call.rank, call.world_size
    x = ops.x
    m_local, k = x.shape
    n_chunks = triton.cdiv(m_local, chunk)
    if n_chunks == 0:
        return False
    sk = fmt.scale_cols(k)
    gpu = side is not None
    if gpu:
        side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side) if gpu else contextlib.nullcontext():
        push_kernel[((w - 1) * n_chunks,)](
            x_operand(fmt, x, ops.x_scale),
            (heap.data_ptrs, heap.sig_ptrs, scale_base(w * m_local * k * x.element_size())),
            (m_local, k, sk, chunk, n_chunks),
            r,
            PROTO=PushProto(w, signals.channel_offset(signals.CH_AG, w), signals.AG_MAX_SPLITS),
            BLOCKS=PushBlocks(32 if gpu else 16, push_cols(fmt, x.device, k), _block_s(sk)),
            num_warps=4 if gpu else 1,
        )
    return gpu


def _gemm(call: runtime.FusedCall, fmt: OperandFormat, ops: Operands, layout: tuple, out_dtype: torch.dtype):
    """Allocate the outputs and launch the GEMM of weight 0 over the gathered rows: ``(y, x_gathered,
    x_scale_gathered)`` (the last two None unless stored). ``layout = (cfg, chunk_rows, outer, store)``:
    ``outer > 1``, the rows of x are ``outer`` blocks gathered block by block (``gather_dim > 0``);
    ``store``, write the gathered rows (and scale rows)."""
    cfg, chunk, outer, store = layout
    heap, w = call.heap, call.world_size
    x = ops.x
    m_local, k = x.shape
    n = ops.weights[0].shape[0]
    sk = fmt.scale_cols(k)
    y = torch.empty((w * m_local, n), dtype=out_dtype, device=x.device)
    x_gathered = torch.empty((w * m_local, k), dtype=x.dtype, device=x.device) if store else None
    scales = torch.empty((w * m_local, sk), dtype=torch.float32, device=x.device) if store and fmt.scaled_rows else None
    # A failed call fills these with NaN (at most two outputs): an FP8 gathered payload is left as it
    # is, but its scales are NaN, so the gathered pair never dequantizes to a result.
    call.outputs = (y, scales if scales is not None else x_gathered)
    if not store:
        mode = NO_STORE
    elif fmt.kind == "plain" and outer == 1:
        mode = STORE_IN_GEMM
    else:
        mode = COPY_FIRST
    # With n == 0 the gathered outputs still need one column of programs to copy the gathered rows out.
    n_tiles = max(triton.cdiv(n, cfg.block_n), 1 if store else 0)
    grid = (w * triton.cdiv(m_local, cfg.block_m) * n_tiles,)
    if grid[0] > 0:
        _ag_gemm_kernel[grid](
            x_operand(fmt, x, ops.x_scale),
            w_operand(fmt, ops.weights[0], ops.scale_of(0), ops.offset_of(0)),
            # The kernel indexes bias with unit stride.
            (
                y,
                y.stride(0),
                y.stride(1),
                None if ops.biases[0] is None else ops.biases[0].contiguous(),
                x_gathered,
                scales,
            ),
            (
                heap.data_ptrs,
                heap.sig_ptrs,
                signals.channel_offset(signals.CH_AG, w),
                scale_base(w * m_local * k * x.element_size()),
            ),
            (m_local, n, k, sk, n_tiles, chunk),
            m_local // outer,
            call.rank,
            call.timeout_ticks,
            FMT=kernel_format(fmt, cfg),
            TILE=cfg.tile(),
            MATH=dot_math(x.dtype, x.device),
            PROTO=AllGatherProto(
                w,
                signals.CH_AG,
                signals.AG_MAX_SPLITS,
                outer > 1,
                mode,
                _block_s(sk),
                ROUNDING[fmt.kind],
                call.use_globaltimer,
            ),
            **cfg.launch(),
        )
    return y, x_gathered, scales


def run(call: GemmCall, ops: Operands) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """Fused all-gather + GEMM of every weight over the group's symmetric heap (one gather).

    ``ops.x`` as the caller passed it (any leading dims, ``m_local`` rows of ``k``, the same on every
    rank), gathered along ``call.comm_dim``: the product of x's dims before it (``outer``) row blocks
    are gathered block by block, each output row addressed as (outer block, source rank, row in
    block), no transposing copy. ``ops.x_scale`` (FP8): ``[m_local, G]`` in x's row order or 0-dim.
    Returns ``(ys, x_gathered, x_scale_gathered)``: ``ys[i]`` 2-D ``[W * m_local, n_i]`` in
    ``call.out_dtype`` (default x's dtype) in gathered row order; with ``call.return_gathered`` the
    gathered rows ``[W * m_local, k]`` (bit for bit) and, FP8, their fp32 scales ``[W * m_local, G]``
    (``G = 1`` in tensor mode: each row its rank's scalar), else None.

    Reference semantics::

        blocks_r = x_r.view(outer, m_local / outer, k)       # dequantized: FP8 scales per row
        x_gathered = cat([blocks_0, ..., blocks_W-1], dim=1).view(W * m_local, k)
        ys = [(x_gathered @ dequant(w_i).T + b_i).to(out_dtype) for each weight]

    Nothing is reduced across ranks, so every row of y is one dot product per column. Raises
    RuntimeError naming the missing peer if a wait exceeds ``COC_TIMEOUT``, and on every rank when the
    ranks' calls differ.
    """
    call = runtime.as_fused(call)
    return all_gather(call, matmul.row_operands(ops), matmul.blocks_before(ops.x, call.comm_dim), ops)


def all_gather(
    call: GemmCall, ops: Operands, outer: int, described: Operands
) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """:func:`run` on 2-D ``ops`` (x's rows) whose ``outer`` row blocks are gathered on their own;
    ``described``: the operands the call descriptor describes (the caller's shapes)."""
    fmt, x = call.fmt, ops.x
    out_dtype = call.out_dtype or x.dtype
    group = runtime.group_of(call)
    w = runtime.world_size(group)
    if w == 1:
        ys = matmul.run(replace(call, out_dtype=out_dtype), ops)
        if not call.return_gathered:
            return ys, None, None
        scales = None if ops.x_scale is None else scale_rows(fmt, ops.x_scale, x.shape[0])
        return ys, _copy(x), None if scales is None else _copy(scales)
    m_local, k = x.shape
    payload = w * m_local * k * x.element_size()
    data_bytes = payload if not fmt.scaled_rows else scale_base(payload) * 4 + w * m_local * fmt.scale_cols(k) * 4
    # The later weights multiply the gathered rows: they are stored whatever the caller asked for.
    store = call.return_gathered or len(ops.weights) > 1
    descriptor = runtime.describe(call, described)
    # The call check waits for every peer's descriptor of this epoch, which each peer publishes
    # only after its previous call's kernels finished: its gather buffer is free to overwrite.
    with runtime.fused_call(call.op, group, x.device, data_bytes, descriptor) as fc:
        n = ops.weights[0].shape[0]
        cfg: BlockConfig = block_config(fmt, x.device, m_local, k, dtype=x.dtype, op="all_gather_matmul", n=n)
        chunk = chunk_rows(x.device, m_local)
        side = _side_stream(x.device) if x.device.type == "cuda" else None
        forked = _push(fc, fmt, ops, chunk, side)
        try:
            y, x_gathered, scales = _gemm(fc, fmt, ops, (cfg, chunk, outer, store), out_dtype)
        finally:
            if forked:
                # Joined on every path, an exception included: work the caller queues next (which
                # may overwrite or free x) and the next call's check (which advances the epoch the
                # pushes read) must follow the pushes. They end about when the GEMM does, since
                # every rank's GEMM waits for every rank's push. Inside capture a join without a
                # fork would wait on an uncaptured stream.
                torch.cuda.current_stream(x.device).wait_stream(side)
    ys = [y]
    if len(ops.weights) > 1:
        gathered = Operands(x_gathered, ops.weights, ops.biases, scales, ops.w_scales, ops.w_offsets)
        ys += [matmul.gemm(fmt, gathered, i, out_dtype=out_dtype) for i in range(1, len(ops.weights))]
    if not call.return_gathered:
        return ys, None, None
    return ys, x_gathered, scales


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)
