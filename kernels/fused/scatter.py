"""Fused GEMM + reduce-scatter for every operand format: ``y = reduce_scatter(x @ dequant(w).T) + bias``.

Heap region on each rank: ``slots [W, rows_own, ld]``; slot ``[src]`` of owner ``d`` receives the
partial product of owner ``d``'s rows computed by rank ``src``. The row stride ``ld`` is ``n``
rounded up to a multiple of 8 elements (:func:`slot_stride`): every slot row starts 16-byte aligned,
so peer stores and reduce loads are vector accesses for any ``n``. Columns ``[n, ld)`` carry zeros
(the GEMM's masked columns) and are never copied out. Partials travel in x's dtype (plain, int8:
each rank's partial rounded once, as the sequential reference's exchange) or in fp32 (FP8,
:attr:`kernels.format.OperandFormat.partial_fp32`: FP8 partials have no such dtype; the sum is
rounded once to ``out_dtype``).

Launch sequence on rank ``r`` for call epoch ``e``:

1. scatter GEMM (:func:`_gemm_scatter_kernel`): programs take owners in the order ``r + 1, r + 2,
   ..., r`` (own rows last, so the peers' data leaves first); a program computes its tile, waits for
   the owner's ``DONE >= e - 1`` (it no longer reads its slots of the previous call), stores the tile
   into the owner's slot ``[r]`` and release-adds 1 to the owner's counter ``RS[r]``;
2. reduce (:func:`_reduce_slots_kernel`): a program waits until every ``RS[src]`` reached this
   call's tile count, then sums slot 0, 1, ..., W-1 in that fixed order in fp32 (fp64 for fp64),
   adds bias once and stores ``y``;
3. set ``DONE[r] = e`` on every rank.

The same two kernels serve :mod:`all_reduce`: with ``BROADCAST`` the scatter GEMM sends every tile
to every rank (one-shot all-reduce) and with ``PUSH`` the reduce sends its rows to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..format import OperandFormat
from ..ops.gemm import GemmCall, Operands
from . import matmul, runtime, signals
from .blocks import BlockConfig, acc_dtype, block_config, dot_math, kernel_format, w_operand, x_operand
from .tile import FP8, grouped_tile, split_rows, tile_matmul

_FP8 = tl.constexpr(FP8)


class ScatterProto(NamedTuple):
    """``PROTO`` of the kernels that push tiles into owners' slots (:func:`scatter_tile`, :func:`push_tile`): the
    scatter GEMM, :mod:`all_reduce_norm`'s row push and :mod:`moe`'s combine push. ``BROADCAST``: every tile to
    every rank (one-shot all-reduce); ``SPLIT_BLOCKS``: x's rows are outer blocks scattered on their own (the
    scatter GEMM's ``scatter_dim > 0``; False for the others)."""

    WORLD: int
    BROADCAST: bool
    SPLIT_BLOCKS: bool
    USE_GLOBALTIMER: bool


class ReduceProto(NamedTuple):
    """``PROTO`` of :func:`_reduce_slots_kernel`: ``CHANNEL``, the phase its timeouts report (``RS``); ``PUSH``:
    send the reduced rows to every rank (two-shot all-reduce) instead of storing them."""

    WORLD: int
    CHANNEL: int
    PUSH: bool
    USE_GLOBALTIMER: bool


class SlotTile(NamedTuple):
    """``TILE`` of the kernels that sum or copy slot rows (no k loop): :func:`_reduce_slots_kernel` and
    :mod:`all_reduce`'s gather."""

    BLOCK_M: int
    BLOCK_N: int


@triton.jit
def scatter_tile(pid, rank, dims, TILE: tl.constexpr, PROTO: tl.constexpr):
    """The tile of scatter-GEMM program ``pid``: ``(owner, local_rows, offs_m, mask_m, offs_n, mask_n)``.

    Owner by owner; within an owner's ``ROWS_OWN x N`` block the tiles go in grouped order
    (:func:`tile.grouped_tile`), which changes no tile count.
    """
    M, N, _, _, ROWS_OWN = dims
    WORLD: tl.constexpr = PROTO.WORLD
    tiles_per_owner = tl.cdiv(ROWS_OWN, TILE.BLOCK_M) * tl.cdiv(N, TILE.BLOCK_N)
    if PROTO.BROADCAST:
        owner = pid * 0
    else:
        # Peers' rows first (r + 1 first), own rows last: remote stores start as early as possible.
        owner = (rank + 1 + pid // tiles_per_owner) % WORLD
    local_rows, mask_local, offs_n, mask_n = grouped_tile(pid % tiles_per_owner, ROWS_OWN, N, TILE)
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
def push_tile(values, heap, where, PROTO: tl.constexpr):
    """Store ``values`` into slot ``[rank]`` of its owner (of every rank with ``BROADCAST``), each once
    that rank's ``DONE`` shows it no longer reads its slots of the previous call, then bump its
    ``RS[rank]`` counter. ``heap = (data table, signal table, DONE offset, RS offset)``, ``where =
    (owner, local_rows, mask_m, offs_n, LD, ROWS_OWN, rank, timeout)``. Columns ``[n, LD)`` of
    ``values`` are zeros (masked weight rows)."""
    data_tab_ptr, sig_tab_ptr, done_offset, cnt_offset = heap
    owner, local_rows, mask_m, offs_n, LD, ROWS_OWN, rank, timeout = where
    WORLD: tl.constexpr = PROTO.WORLD
    USE_GLOBALTIMER: tl.constexpr = PROTO.USE_GLOBALTIMER
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    epoch = signals.call_epoch(pad)
    # This rank's counter in the receiving rank's bank of this call (the bank is the epoch's parity
    # on every rank).
    cnt = signals.counter(pad, cnt_offset, rank, WORLD)
    slot_offs, col_mask = slot_tile(rank * ROWS_OWN + local_rows, offs_n, LD)
    slot_mask = mask_m[:, None] & col_mask
    if PROTO.BROADCAST:
        for i in tl.static_range(WORLD):
            dst = (rank + 1 + i) % WORLD
            ok = signals.wait_signal(pad + done_offset + dst, epoch - 1, pad, timeout, 1 + dst, USE_GLOBALTIMER)
            if ok:
                tl.store(signals.peer_ptr(data_tab_ptr, dst, values.dtype) + slot_offs, values, mask=slot_mask)
                signals.add_signal(signals.peer_ptr(sig_tab_ptr, dst, tl.int64) + cnt, 1)
    else:
        ok = signals.wait_signal(pad + done_offset + owner, epoch - 1, pad, timeout, 1 + owner, USE_GLOBALTIMER)
        if ok:
            tl.store(signals.peer_ptr(data_tab_ptr, owner, values.dtype) + slot_offs, values, mask=slot_mask)
            signals.add_signal(signals.peer_ptr(sig_tab_ptr, owner, tl.int64) + cnt, 1)


@triton.jit(do_not_specialize=["rank", "timeout", "rows_per_block"])
def _gemm_scatter_kernel(
    X,
    W,
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
    # dims = (M, N, K, LD, ROWS_OWN); PROTO: ScatterProto.
    x_ptr, _, _, _, _, _ = X
    _, _, K, LD, ROWS_OWN = dims
    owner, local_rows, offs_m, mask_m, offs_n, mask_n = scatter_tile(tl.program_id(0), rank, dims, TILE, PROTO)
    if PROTO.SPLIT_BLOCKS:
        # scatter_dim > 0: x's rows are outer blocks of W owner blocks of rows_per_block rows each;
        # mask_m stays valid (it masks local rows >= ROWS_OWN). x's scale rows (FP8) follow its rows.
        offs_m = split_rows(local_rows, owner, rows_per_block, PROTO.WORLD)
    acc = tile_matmul(X, W, (offs_m, mask_m, offs_n, mask_n), K, None, FMT, TILE, MATH)
    if FMT.KIND == _FP8:
        # fp32 partials: the FP8 product is rounded only once, after the reduction.
        values = acc
    else:
        values = acc.to(x_ptr.dtype.element_ty)
    push_tile(values, heap, (owner, local_rows, mask_m, offs_n, LD, ROWS_OWN, rank, timeout), PROTO)


@triton.jit(do_not_specialize=["rank", "target", "timeout"])
def _reduce_slots_kernel(
    heap,
    OUT,
    dims,
    rank,
    target: tl.int64,
    timeout: tl.int64,
    TILE: tl.constexpr,
    PROTO: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    SLOT_DTYPE: tl.constexpr,
):
    # heap = (data table, signal table, RS offset, DONE offset, AR offset, pushed rows' base);
    # OUT = (out, stride_om, stride_on, bias, residual, stride_rm, stride_rn): residual (None: none) is
    # [ROWS_VALID, N], the owned rows of a term added after the reduction, as bias is;
    # dims = (ROWS_OWN, ROWS_VALID, N, LD); TILE: SlotTile; PROTO: ReduceProto. The slots hold
    # SLOT_DTYPE, the output (and pushed rows) out's dtype.
    data_tab_ptr, sig_tab_ptr, cnt_offset, done_offset, push_offset, push_base = heap
    out_ptr, stride_om, stride_on, bias_ptr, res_ptr, stride_rm, stride_rn = OUT
    ROWS_OWN, ROWS_VALID, N, LD = dims
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    WORLD: tl.constexpr = PROTO.WORLD
    USE_GLOBALTIMER: tl.constexpr = PROTO.USE_GLOBALTIMER
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_m = offs_m < ROWS_VALID
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    slots = signals.peer_ptr(data_tab_ptr, rank, SLOT_DTYPE)
    ok = True
    for src in tl.static_range(WORLD):
        ok = ok & signals.wait_signal(
            pad + signals.counter(pad, cnt_offset, src, WORLD),
            target,
            pad,
            timeout,
            1 + src + WORLD * PROTO.CHANNEL,
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
        if bias_ptr is not None:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(ACC_DTYPE)[None, :]
        if res_ptr is not None:
            res_mask = mask_m[:, None] & (offs_n < N)[None, :]
            res_offs = offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
            acc += tl.load(res_ptr + res_offs, mask=res_mask, other=0.0).to(ACC_DTYPE)
        result = acc.to(out_ptr.dtype.element_ty)
        if PROTO.PUSH:
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


@dataclass(frozen=True)
class Partials:
    """One rank's GEMM whose partial products a scatter GEMM pushes: the format, 2-D operands (x's rows,
    one weight), the tiles, and the row blocks of x scattered on their own (``outer``, ``scatter_dim > 0``)."""

    fmt: OperandFormat
    ops: Operands
    cfg: BlockConfig
    outer: int = 1
    # all-reduce epilogue: rows [m, n] added after the reduction, which then stays in fp32 (fp64 for fp64).
    residual: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype partials travel, are stored and are summed into (the reduce's output)."""
        return torch.float32 if self.fmt.partial_fp32 else self.ops.x.dtype

    @property
    def n(self) -> int:
        return self.ops.weights[0].shape[0]

    @property
    def m(self) -> int:
        return self.ops.x.shape[0]

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype of the reduced rows (:class:`kernels.fused.all_reduce.Exchange`): the slots', or with a
        residual the accumulator's."""
        if self.residual is None:
            return self.dtype
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def device(self) -> torch.device:
        return self.ops.x.device

    @property
    def bias(self) -> torch.Tensor | None:
        return self.ops.biases[0]

    def produce(self, call: runtime.FusedCall, rows_own: int, broadcast: bool) -> int:
        """:func:`scatter_partials` of these partials."""
        return scatter_partials(call, self, rows_own, broadcast)


def scatter_partials(call: runtime.FusedCall, partials: Partials, rows_own: int, broadcast: bool) -> int:
    """Launch the scatter GEMM; return the ``RS`` target (tiles per owner) every peer's counter must reach here.

    ``partials.outer > 1`` (reduce-scatter only): the rows of x are ``outer`` blocks, each scattered on
    its own; owner ``d``'s ``rows_own`` rows are its block of every outer block."""
    heap, w = call.heap, call.world_size
    fmt, ops, cfg = partials.fmt, partials.ops, partials.cfg
    x = ops.x
    m, k = x.shape
    n = partials.n
    per_owner = tiles(rows_own, n, cfg)
    grid = (per_owner * (1 if broadcast else w),)
    if grid[0] > 0:
        _gemm_scatter_kernel[grid](
            x_operand(fmt, x, ops.x_scale),
            w_operand(fmt, ops.weights[0], ops.scale_of(0), ops.offset_of(0)),
            (
                heap.data_ptrs,
                heap.sig_ptrs,
                signals.channel_offset(signals.CH_DONE, w),
                signals.channel_offset(signals.CH_RS, w),
            ),
            (m, n, k, slot_stride(n), rows_own),
            rows_own // partials.outer,
            call.rank,
            call.timeout_ticks,
            FMT=kernel_format(fmt, cfg),
            TILE=cfg.tile(),
            MATH=dot_math(x.dtype, x.device),
            PROTO=ScatterProto(w, broadcast, partials.outer > 1, call.use_globaltimer),
            **cfg.launch(),
        )
    return per_owner


def reduce_slots(
    call: runtime.FusedCall,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    rows: tuple[int, int],
    target: int,
    *,
    cfg: BlockConfig,
    push_base: int | None = None,
    residual: torch.Tensor | None = None,
    slot_dtype: torch.dtype | None = None,
) -> int:
    """Launch the fixed-order reduce of the ``W`` slots (``rows``: rows per owner, rows this rank owns)
    into ``out``; with ``push_base`` push the rows to every rank instead. ``slot_dtype``: the slots'
    (None: out's); ``residual``: the owned rows ``[rows_valid, n]`` of a term added after bias.

    Returns the ``AR`` target of the rows pushed (each owner's tile count; 0 unless pushing).
    """
    heap, w = call.heap, call.world_size
    rows_own, rows_valid = rows
    n = out.shape[1]
    grid = (tiles(rows_own, n, cfg),)
    push = push_base is not None
    if grid[0] > 0:
        _reduce_slots_kernel[grid](
            (
                heap.data_ptrs,
                heap.sig_ptrs,
                signals.channel_offset(signals.CH_RS, w),
                signals.channel_offset(signals.CH_DONE, w),
                signals.channel_offset(signals.CH_AR, w),
                push_base if push else 0,
            ),
            # The kernel indexes bias with unit stride.
            (
                out,
                out.stride(0),
                out.stride(1),
                None if bias is None else bias.contiguous(),
                residual,
                0 if residual is None else residual.stride(0),
                0 if residual is None else residual.stride(1),
            ),
            (rows_own, rows_valid, n, slot_stride(n)),
            call.rank,
            target,
            call.timeout_ticks,
            TILE=SlotTile(cfg.block_m, cfg.block_n),
            PROTO=ReduceProto(w, signals.CH_RS, push, call.use_globaltimer),
            ACC_DTYPE=acc_dtype(out.dtype),
            SLOT_DTYPE=getattr(tl, str(slot_dtype or out.dtype).removeprefix("torch.")),
            num_warps=cfg.num_warps,
        )
    return grid[0] if push else 0


def run(call: GemmCall, ops: Operands) -> torch.Tensor:
    """Fused GEMM + reduce-scatter of one weight over the group's symmetric heap: ``[m / W, n]``.

    ``ops.x`` as the caller passed it (any leading dims; ``m`` rows of ``k``, the same ``m`` on every
    rank, ``m % W == 0``), scattered along ``call.comm_dim``: the product of x's dims before it
    (``outer``) row blocks are each scattered on their own, read in place by the scatter GEMM (no
    transposing copy). Rank ``r`` gets rows ``[r * m / W, (r + 1) * m / W)`` of each block.

    Reference semantics::

        partial_src = dequant(x_src) @ dequant(w_src).T       # on every rank src; rounded to x's
                                                               # dtype (plain, int8), fp32 (FP8)
        y_r = sum(partial_src[rows of r] for src in 0..W-1)   # fp32, in rank order
        y_r = (y_r + bias).to(out_dtype)                       # bias once, after the reduction

    The sum always runs in rank order, so results are bitwise reproducible whatever
    ``deterministic`` says (it is part of the call every rank must agree on). Raises RuntimeError
    naming the missing peer if a wait exceeds ``COC_TIMEOUT``, and on every rank when the ranks'
    calls differ.
    """
    call = runtime.as_fused(call)
    return reduce_scatter(call, matmul.row_operands(ops), matmul.blocks_before(ops.x, call.comm_dim), ops)


def reduce_scatter(call: GemmCall, ops: Operands, outer: int, described: Operands) -> torch.Tensor:
    """:func:`run` on 2-D ``ops`` (x's rows) whose ``outer`` row blocks are scattered on their own;
    ``described``: the operands the call descriptor describes (the caller's shapes)."""
    x = ops.x
    out_dtype = call.out_dtype or x.dtype
    group = runtime.group_of(call)
    w = runtime.world_size(group)
    if w == 1:
        return matmul.gemm(call.fmt, ops, out_dtype=out_dtype)
    m, k = x.shape
    n = ops.weights[0].shape[0]
    rows_own = m // w
    cfg = block_config(call.fmt, x.device, rows_own, k, dtype=x.dtype, op="matmul_reduce_scatter", n=n)
    partials = Partials(call.fmt, ops, cfg, outer)
    data_bytes = w * rows_own * slot_stride(n) * partials.dtype.itemsize
    descriptor = runtime.describe(call, described, (cfg.block_m, cfg.block_n))
    with runtime.fused_call(call.op, group, x.device, data_bytes, descriptor) as fc:
        target = scatter_partials(fc, partials, rows_own, False)
        out = torch.empty((rows_own, n), dtype=partials.dtype, device=x.device)
        fc.outputs = (out,)
        reduce_slots(fc, out, ops.biases[0], (rows_own, rows_own), target, cfg=cfg)
    # FP8: the single rounding (a failed call's NaN carries over).
    return out if out.dtype == out_dtype else out.to(out_dtype)
