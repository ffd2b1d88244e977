"""Fused tensor-parallel MoE over the symmetric heap: all-gather + grouped GEMM, grouped GEMM + top-k combine +
reduce-scatter (the ``"fused"`` backend of :mod:`kernels.ops.moe.tp`).

Both reuse the dense fused ops' protocol and kernels: the call check of :func:`runtime.fused_call`, the grouped
GEMM of :mod:`grouped`, the all-gather's push kernel and flags (:mod:`all_gather`), the reduce-scatter's slot
pushes and fixed-order reduce (:mod:`scatter`), the all-reduce-norm's fixed push / reduce tile.

:func:`gather` (``all_gather_grouped_matmul``), launch sequence on rank ``r`` for call epoch ``e``, heap region
``G [W * m_local, k]`` of x's dtype then ``I [W * m_local, topk]`` fp32 (16-byte aligned after it). FP8 rows travel
as the other backends move them: packed with their scales (:func:`kernels.format.pack_rows`), ``G`` then holds
``uint8`` rows of ``k + 4 * scale columns`` bytes, unpacked after the collect for the grouped GEMM's FP8 path:

1. call check (:func:`runtime.begin`), as every fused op;
2. push: :mod:`all_gather`'s push kernel copies x's rows into ``G`` and the expert ids into ``I`` of every peer,
   chunk by chunk, one flag ``AG[r, c] = e`` per chunk covering both (the ids travel as the FP8 ops' scale rows
   do: as fp32, exact for ids below 2^24);
3. collect (:func:`_collect_kernel`): one program per (source, chunk), own rows first from x and the ids, then
   every peer's chunk once its flag is ``>= e``, copied into ``x_gathered [M, k]`` and ``ids [M, topk]`` int64;
4. the routing (the caller's :func:`kernels.ops.moe.routing.route`: a stable sort and a sorted search on the
   device, no host read) and the grouped GEMM (:func:`grouped.launch`) on the gathered rows taken in routing
   order; then :func:`runtime.finish` (``DONE``, or NaN in ``y`` after a failure).

This first fused version gathers, then multiplies: every rank's pushes run at once (one launch, waiting on nothing
but the check), but the grouped GEMM starts once every row is here. Overlap by pieces, as the chunked backend does,
is left out on purpose: a piece holds a share of every expert's rows, so with many experts its tiles are mostly
partial (Qwen3-30B-A3B's E = 128 and top-8 with 4096 tokens at W = 8, one piece per source rank: 32 rows per
expert and piece, against 128-row tiles).
The fused form that overlaps without that cost is a grouped GEMM whose tiles load their rows by token index from
the heap and wait on those rows' chunk flags; it is not built.

:func:`reduce_scatter` (``grouped_matmul_reduce_scatter``), heap region ``slots [W, m_local, ld]`` fp32:

1. the grouped GEMM (:func:`grouped.launch`) of ``h`` into fp32 partials ``[M * topk, k_out]`` (not rounded),
   then the call check;
2. combine + push (:func:`_combine_push_kernel`): a program takes a tile of one owner's tokens (owners
   ``r + 1, ..., r``, own last, as the dense scatter GEMM), sums ``topk_weights[t, s] * partial[row(t, s)]`` over
   the slots ``s = 0, 1, ...`` in that order in fp32, and pushes the tile into slot ``[r]`` of the owner
   (:func:`scatter.push_tile`: ``DONE >= e - 1`` wait, store, release-add ``RS[r]``);
3. reduce (:func:`scatter.reduce_slots`): the owner sums its ``W`` slots in rank order in fp32 and rounds once to
   h's dtype (FP8: stores fp32, and torch rounds once to ``out_dtype``, to nearest even); then
   :func:`runtime.finish`.

The combine and the rank-order sum are the sequential reference's, in the same order, so the result is bitwise
the same on repeated calls; it differs from the reference only by the grouped GEMM's summation order (fp32) and,
on a GPU, by FMA contraction of the combine (each product-add rounded once instead of twice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..format import PLAIN, pack_rows, unpack_rows
from . import grouped, runtime, signals
from .all_gather import PushBlocks, PushProto, push_kernel, scale_base
from .all_reduce_norm import block_config
from .blocks import BlockConfig, chunk_rows
from .scatter import ScatterProto, push_tile, reduce_slots, scatter_tile, slot_stride, tiles
from .tile import Tile, copy_rows, grouped_tile

# Columns per copy step of the collect kernel (the push kernel's, :func:`all_gather.push_cols`).
_COPY_COLS = {"cpu": 64, "cuda": 128}


class CombineConfig(NamedTuple):
    """``CONFIG`` of :func:`_combine_push_kernel`: its tile and the scatter GEMM's protocol (one constexpr: a kernel
    takes five parameters at most)."""

    TILE: Tile
    PROTO: ScatterProto


class CollectConfig(NamedTuple):
    """``CONFIG`` of :func:`_collect_kernel`: the all-gather flags' stride per source, ``BLOCK_R`` rows per copy
    step and ``BLOCK_K`` / ``BLOCK_S`` columns of x / of the ids per step."""

    WORLD: int
    FLAG_STRIDE: int
    BLOCK_R: int
    BLOCK_K: int
    BLOCK_S: int
    USE_GLOBALTIMER: bool


@triton.jit
def _combine_tile(P, ROUTE, tile, TILE: tl.constexpr):
    """``sum over s = 0, 1, ..., topk - 1 of w[t, s] * partial[row(t, s), n]`` for the tile's tokens and columns,
    fp32; columns ``n >= N`` are zeros.

    ``P = (partial, stride_pm, rows, N)``; ``ROUTE = (pair_rows, stride_rm, weights, stride_wm, topk)``; ``tile =
    (offs_m, mask_m, offs_n)``. A row index outside ``[0, rows)`` (routing whose values no host check read, on a
    GPU) is clamped: wrong values, never an access outside the partials.
    """
    p_ptr, stride_pm, rows, N = P
    rows_ptr, stride_rm, w_ptr, stride_wm, topk = ROUTE
    offs_m, mask_m, offs_n = tile
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Slot order, one product-add per slot, in fp32: the reference's order (kernels.ops.moe.tp: the combine).
    for s in range(topk):
        row = tl.load(rows_ptr + offs_m * stride_rm + s, mask=mask_m, other=0).to(tl.int64)
        row = tl.minimum(tl.maximum(row, 0), rows - 1)
        weight = tl.load(w_ptr + offs_m * stride_wm + s, mask=mask_m, other=0.0).to(tl.float32)
        part = tl.load(p_ptr + row[:, None] * stride_pm + offs_n[None, :], mask=mask, other=0.0)
        acc += part * weight[:, None]
    # Zeros past N whatever the weights hold (a NaN weight times a masked zero is NaN).
    return tl.where(mask, acc, 0.0)


@triton.jit(do_not_specialize=["rank", "timeout"])
def _combine_push_kernel(OPERANDS, heap, rank, timeout: tl.int64, CONFIG: tl.constexpr):
    # OPERANDS = (P, ROUTE, dims) with dims = (M, N, 0, LD, ROWS_OWN) as the scatter GEMM's; heap = (data table,
    # signal table, DONE offset, RS offset); CONFIG: CombineConfig.
    P, ROUTE, dims = OPERANDS
    _, _, _, LD, ROWS_OWN = dims
    # Bound to constexpr locals before they are passed on: Triton 3.6 reads a nested named tuple's field as a
    # plain tuple, which a function call cannot take.
    TILE: tl.constexpr = CONFIG.TILE
    PROTO: tl.constexpr = CONFIG.PROTO
    owner, local_rows, offs_m, mask_m, offs_n, mask_n = scatter_tile(tl.program_id(0), rank, dims, TILE, PROTO)
    # offs_n runs to the slot row's padding [N, LD): those columns are zeros (the reduce never copies them out).
    values = _combine_tile(P, ROUTE, (offs_m, mask_m, offs_n), TILE)
    push_tile(values, heap, (owner, local_rows, mask_m, offs_n, LD, ROWS_OWN, rank, timeout), PROTO)


@triton.jit
def _combine_kernel(P, ROUTE, OUT, TILE: tl.constexpr):
    # W = 1: the combine stored in out's dtype (one rounding). OUT = (out, stride_om, M).
    out_ptr, stride_om, M = OUT
    _, _, _, N = P
    offs_m, mask_m, offs_n, mask_n = grouped_tile(tl.program_id(0), M, N, TILE)
    acc = _combine_tile(P, ROUTE, (offs_m, mask_m, offs_n), TILE)
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rank", "timeout"])
def _collect_kernel(ROWS, heap, rank, timeout: tl.int64, CONFIG: tl.constexpr):
    # ROWS = (x, stride_xm, stride_xk, ids, stride_im, stride_ik, x_gathered, ids_gathered, dims), dims = (M_LOCAL,
    # K, TOPK, chunk_rows, n_chunks); heap = (data table, signal table, AG offset, I base); CONFIG: CollectConfig.
    x_ptr, stride_xm, stride_xk, ids_ptr, stride_im, stride_ik, xg_ptr, idg_ptr, dims = ROWS
    data_tab_ptr, sig_tab_ptr, flag_offset, i_base = heap
    M_LOCAL, K, TOPK, chunk, n_chunks = dims
    WORLD: tl.constexpr = CONFIG.WORLD
    BLOCK_R: tl.constexpr = CONFIG.BLOCK_R
    pid = tl.program_id(0)
    # Own rows first (already here), then the ring r + 1, r + 2, ...: roughly the order the peers' flags arrive.
    src = (rank + pid // n_chunks) % WORLD
    c = pid % n_chunks
    end = tl.minimum(c * chunk + chunk, M_LOCAL)
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    if src == rank:
        # No flag to wait for; skipped after a failed check (the call's outputs are then NaN).
        if signals.failed(pad) == 0:
            for r0 in range(c * chunk, end, BLOCK_R):
                rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
                mask_r = rows < end
                g_rows = rank * M_LOCAL + rows
                copy_rows((x_ptr, stride_xm, stride_xk, rows), (xg_ptr, g_rows), mask_r, K, CONFIG.BLOCK_K)
                copy_rows((ids_ptr, stride_im, stride_ik, rows), (idg_ptr, g_rows), mask_r, TOPK, CONFIG.BLOCK_S)
    else:
        epoch = signals.call_epoch(pad)
        flag = pad + flag_offset + src * CONFIG.FLAG_STRIDE + c
        # The acquire in wait_signal orders the loads below after the peer's chunk (its release-store of the flag).
        if signals.wait_signal(flag, epoch, pad, timeout, 1 + src + WORLD * signals.CH_AG, CONFIG.USE_GLOBALTIMER):
            g = signals.peer_ptr(data_tab_ptr, rank, xg_ptr.dtype.element_ty)
            # i_base: fp32 elements, a multiple of 4 (all_gather.scale_base): 16-byte aligned.
            ids_region = signals.peer_ptr(data_tab_ptr, rank, tl.float32) + tl.multiple_of(i_base, 4)
            for r0 in range(c * chunk, end, BLOCK_R):
                rows = src * M_LOCAL + r0 + tl.arange(0, BLOCK_R).to(tl.int64)
                mask_r = rows < src * M_LOCAL + end
                copy_rows((g, K, 1, rows), (xg_ptr, rows), mask_r, K, CONFIG.BLOCK_K)
                # fp32 ids stored into int64: exact (the pushed values are integers below 2^24).
                copy_rows((ids_region, TOPK, 1, rows), (idg_ptr, rows), mask_r, TOPK, CONFIG.BLOCK_S)


def _grouped(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, scaled: tuple | None = None
) -> torch.Tensor:
    """The grouped GEMM into ``out``; ``scaled = (format, x_scale rows, w_scale)`` for FP8 (None: plain)."""
    if scaled is None:
        return grouped.launch(PLAIN, x.contiguous(), weight.contiguous(), offsets, out)
    fmt, xs, ws = scaled
    return grouped.launch(
        fmt, x.contiguous(), weight.contiguous(), offsets, out, x_scale=xs.contiguous(), w_scale=ws.contiguous()
    )


def _multiply(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, fp8: tuple) -> None:
    """``out = rows @ weight`` per expert for gathered ``rows`` in routing order, unpacked first where they are
    FP8 rows packed with their scales; ``fp8 = (format, k, x dtype, w_scale)``."""
    fmt, k, dtype, w_scale = fp8
    x, x_scale = unpack_rows(fmt, rows, k, dtype)
    _grouped(x, weight, offsets, out, None if x_scale is None else (fmt, x_scale, w_scale))


def _collect(call: runtime.FusedCall, x: torch.Tensor, ids: torch.Tensor, i_base: int) -> tuple:
    """Launch the push and the collect: ``(x_gathered [M, k], ids [M, topk] int64)``."""
    heap, w, rank = call.heap, call.world_size, call.rank
    m_local, k = x.shape
    topk = ids.shape[1]
    chunk = chunk_rows(x.device, m_local)
    n_chunks = triton.cdiv(m_local, chunk)
    gpu = x.device.type == "cuda"
    cols = _COPY_COLS[x.device.type]
    block_s = min(triton.next_power_of_2(topk), 64)
    x_gathered = torch.empty((w * m_local, k), dtype=x.dtype, device=x.device)
    # Zeros, not empty: after a failed check the collect copies nothing, and the routing must still see ids the
    # grouped GEMM can address (its outputs are then NaN).
    ids_gathered = torch.zeros((w * m_local, topk), dtype=torch.int64, device=x.device)
    if n_chunks == 0:
        return x_gathered, ids_gathered
    ids_f32 = ids.to(torch.float32)
    # The push kernel of all_gather_matmul, the ids as its fp32 "scale rows": pushed before the collect, in
    # stream order; it waits for nothing but the call check, so no peer's collect can keep it from finishing.
    push_kernel[((w - 1) * n_chunks,)](
        (x, x.stride(0), x.stride(1), ids_f32, ids_f32.stride(0), ids_f32.stride(1)),
        (heap.data_ptrs, heap.sig_ptrs, i_base),
        (m_local, k, topk, chunk, n_chunks),
        rank,
        PROTO=PushProto(w, signals.channel_offset(signals.CH_AG, w), signals.AG_MAX_SPLITS),
        BLOCKS=PushBlocks(32 if gpu else 16, cols, block_s),
        num_warps=4 if gpu else 1,
    )
    _collect_kernel[(w * n_chunks,)](
        (
            x,
            x.stride(0),
            x.stride(1),
            ids,
            ids.stride(0),
            ids.stride(1),
            x_gathered,
            ids_gathered,
            (m_local, k, topk, chunk, n_chunks),
        ),
        (heap.data_ptrs, heap.sig_ptrs, signals.channel_offset(signals.CH_AG, w), i_base),
        rank,
        call.timeout_ticks,
        CONFIG=CollectConfig(w, signals.AG_MAX_SPLITS, 32 if gpu else 16, cols, block_s, call.use_globaltimer),
        num_warps=4 if gpu else 1,
    )
    return x_gathered, ids_gathered


def gather(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    route: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    group: object,
    descriptor: tuple[int, ...],
    fp8: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y [M * topk, n_local], expert_offsets, token_index, slot)``: :func:`kernels.all_gather_grouped_matmul`'s
    result over the heap (module docstring). ``x [m_local, k]`` and
    ``weight [E, n_local, k]`` of one dtype, ``topk_ids [m_local, topk]`` int32 / int64 (validated by the caller);
    ``route(ids [M, topk] int64, E)``: the routing (:func:`kernels.ops.moe.routing.route`, the ops layer's, so
    every backend groups the rows alike; it must read nothing on the host); ``descriptor``: this rank's call,
    checked against every peer's before any data moves. ``fp8 = (format, x_scale, w_scale, out_dtype)`` for FP8
    operands (``x_scale`` in the kernels' layout, 0-dim when tensorwise): each row is pushed packed with its
    scales (:func:`kernels.format.pack_rows`, one ``uint8`` row of ``k + 4 * G`` bytes; the push and collect
    kernels copy bytes as they copy elements) and unpacked for the grouped GEMM."""
    group = runtime.resolve_group(group)
    w = runtime.world_size(group)
    num_experts, n_local, k = weight.shape
    fmt, x_scale, w_scale, out_dtype = fp8 if fp8 is not None else (PLAIN, None, None, x.dtype)
    rows = pack_rows(fmt, x.contiguous(), x_scale)
    how = (fmt, k, x.dtype, w_scale)
    ids = topk_ids.contiguous()
    if w == 1:
        offsets, token_index, slot = route(ids.to(torch.int64), num_experts)
        y = torch.empty((token_index.numel(), n_local), dtype=out_dtype, device=x.device)
        _multiply(rows[token_index], weight, offsets, y, how)
        return y, offsets, token_index, slot
    m_local, width = rows.shape
    topk = ids.shape[1]
    payload = w * m_local * width * rows.element_size()
    i_base = scale_base(payload)
    data_bytes = i_base * 4 + w * m_local * topk * 4
    with runtime.fused_call("all_gather_grouped_matmul", group, x.device, data_bytes, descriptor) as call:
        rows_gathered, ids_gathered = _collect(call, rows, ids, i_base)
        offsets, token_index, slot = route(ids_gathered, num_experts)
        y = torch.empty((token_index.numel(), n_local), dtype=out_dtype, device=x.device)
        call.outputs = (y,)
        _multiply(rows_gathered[token_index], weight, offsets, y, how)
    return y, offsets, token_index, slot


def tile_config(device: torch.device) -> BlockConfig:
    """The combine / push / reduce tile: fixed per device type, so every rank counts the same tiles (signal
    targets); the call descriptor carries it all the same."""
    return block_config(device)


def reduce_scatter(
    h: torch.Tensor,
    weight: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor,
    *,
    pair_rows: torch.Tensor,
    group: object,
    descriptor: tuple[int, ...],
    fp8: tuple | None = None,
) -> torch.Tensor:
    """``out [m_local, k_out]`` in h's dtype: :func:`kernels.grouped_matmul_reduce_scatter`'s
    result over the heap (module docstring). ``routing = (expert_offsets, token_index, slot)``; ``pair_rows
    [M, topk]``: the output row of each (token, slot) pair (:func:`kernels.ops.moe.routing.row_of_pair`);
    ``topk_weights [M, topk]`` (any floating dtype, read as fp32); ``descriptor`` as :func:`gather`'s; ``fp8 =
    (format, x_scale rows [rows of h, G], w_scale, out_dtype)`` for FP8 h and weight: fp32 partials as for
    plain, the result rounded once to ``out_dtype``."""
    group = runtime.resolve_group(group)
    w = runtime.world_size(group)
    offsets = routing[0]
    tokens, topk = topk_weights.shape
    k_out = weight.shape[1]
    m_local = tokens // w
    partial = torch.empty((h.shape[0], k_out), dtype=torch.float32, device=h.device)
    pair_rows = pair_rows.contiguous()
    tw = topk_weights.contiguous()
    cfg = tile_config(h.device)
    P = (partial, partial.stride(0), max(partial.shape[0], 1), k_out)
    ROUTE = (pair_rows, pair_rows.stride(0), tw, tw.stride(0), topk)
    out_dtype = h.dtype if fp8 is None else fp8[3]
    out = torch.empty((m_local, k_out), dtype=out_dtype, device=h.device)
    scaled = None if fp8 is None else fp8[:3]
    if w == 1:
        _grouped(h, weight, offsets, partial, scaled)
        grid = (tiles(m_local, k_out, cfg),)
        if grid[0] > 0:
            _combine_kernel[grid](P, ROUTE, (out, out.stride(0), m_local), TILE=cfg.tile(), num_warps=cfg.num_warps)
        return out
    # Before the call check: the partials need no peer, and on a GPU the GEMM then hides the check's wait for
    # late peers (stream order keeps it before the combine).
    _grouped(h, weight, offsets, partial, scaled)
    ld = slot_stride(k_out)
    if fp8 is not None:
        # FP8: reduced into fp32 and rounded once by torch, to nearest even as the dense FP8 ops round.
        out = torch.empty((m_local, k_out), dtype=torch.float32, device=h.device)
    with runtime.fused_call("grouped_matmul_reduce_scatter", group, h.device, w * m_local * ld * 4, descriptor) as call:
        call.outputs = (out,)
        heap = call.heap
        per_owner = tiles(m_local, k_out, cfg)
        if per_owner > 0:
            _combine_push_kernel[(per_owner * w,)](
                (P, ROUTE, (tokens, k_out, 0, ld, m_local)),
                (
                    heap.data_ptrs,
                    heap.sig_ptrs,
                    signals.channel_offset(signals.CH_DONE, w),
                    signals.channel_offset(signals.CH_RS, w),
                ),
                call.rank,
                call.timeout_ticks,
                CONFIG=CombineConfig(cfg.tile(), ScatterProto(w, False, False, call.use_globaltimer)),
                num_warps=cfg.num_warps,
            )
        reduce_slots(call, out, None, (m_local, m_local), per_owner, cfg=cfg, slot_dtype=torch.float32)
    return out if out.dtype == out_dtype else out.to(out_dtype)
