"""Fused GEMM + all-reduce for every operand format: ``y = all_reduce(x @ dequant(w).T) + bias``.

* one-shot (small outputs): the scatter GEMM of :mod:`scatter` in ``BROADCAST`` mode pushes every
  tile of the partial product into slot ``[r]`` of every rank (heap ``slots [W, m, ld]``), then every
  rank sums the ``W`` slots itself. One exchange step, ``(W - 1) * m * n`` elements sent per rank.
* two-shot: reduce-scatter onto owners of ``rows_own = ceil(m / W)`` rows each (the last owners may
  hold fewer or none), then each owner pushes its reduced rows into region ``O [W * rows_own, ld]``
  of every rank (counter ``AR[owner]``), and a gather kernel copies ``O`` to ``y`` as the rows'
  owners' counters complete. About ``2 (W - 1) / W * m * n`` elements sent per rank.

Both sum the ``W`` partials in rank order in fp32 (fp64 for fp64) and every rank adds bias to the
same sum (or receives the owner's rounded result), so repeated calls are bitwise identical and all
ranks hold bitwise identical outputs: that is the default, ``deterministic=True`` costs nothing
extra. Partials, slots and the pushed rows are in the format's partial dtype (x's, or fp32 for FP8,
which every rank then rounds once to ``out_dtype``: the same fp32 bits, the same output).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple, Protocol

import torch
import triton
import triton.language as tl

from ..ops.gemm import GemmCall, Operands
from . import matmul, runtime, signals
from .blocks import BlockConfig, block_config
from .scatter import Partials, SlotTile, reduce_slots, slot_stride, slot_tile

# Outputs (in the partial dtype) up to this many bytes use one-shot: latency (one exchange, no second
# kernel round) wins over the ~W/2 times larger traffic while messages are small.
ONE_SHOT_MAX_BYTES = 256 * 1024
ALGORITHMS = ("auto", "one_shot", "two_shot")


class GatherRowsProto(NamedTuple):
    """``PROTO`` of :func:`_gather_rows_kernel`: ``CHANNEL``, the phase its timeouts report (``AR``)."""

    WORLD: int
    CHANNEL: int
    USE_GLOBALTIMER: bool


@triton.jit(do_not_specialize=["rank", "target", "timeout"])
def _gather_rows_kernel(
    heap, OUT, dims, rank, target: tl.int64, timeout: tl.int64, TILE: tl.constexpr, PROTO: tl.constexpr
):
    # heap = (data table, signal table, O region's base, AR offset); OUT = (out, stride_om, stride_on, residual,
    # stride_rm, stride_rn): residual None, or this rank's rows added to the reduced ones (fp32 or fp64 out);
    # dims = (M, N, LD, ROWS_OWN); TILE: scatter.SlotTile; PROTO: GatherRowsProto.
    data_tab_ptr, sig_tab_ptr, o_base, ar_offset = heap
    out_ptr, stride_om, stride_on, res_ptr, stride_rm, stride_rn = OUT
    M, N, LD, ROWS_OWN = dims
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    WORLD: tl.constexpr = PROTO.WORLD
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_owner = tl.cdiv(ROWS_OWN, BLOCK_M) * n_tiles
    # Own rows first: they were reduced locally and are the first to be complete.
    owner = (rank + pid // tiles_per_owner) % WORLD
    rem = pid % tiles_per_owner
    local_rows = (rem // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_m = owner * ROWS_OWN + local_rows
    offs_n = (rem % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_m = (local_rows < ROWS_OWN) & (offs_m < M)
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    ok = signals.wait_signal(
        pad + signals.counter(pad, ar_offset, owner, WORLD),
        target,
        pad,
        timeout,
        1 + owner + WORLD * PROTO.CHANNEL,
        PROTO.USE_GLOBALTIMER,
    )
    if ok:
        # o_base is W * ROWS_OWN * LD elements, a multiple of 8 (LD is).
        o_local = signals.peer_ptr(data_tab_ptr, rank, out_ptr.dtype.element_ty) + tl.multiple_of(o_base, 8)
        o_offs, col_mask = slot_tile(offs_m, offs_n, LD)
        rows = tl.load(o_local + o_offs, mask=mask_m[:, None] & col_mask)
        if res_ptr is not None:
            # The add the one-shot reduce makes after the rank-order sum and bias: the same bits, with this rank's
            # own residual (as one-shot and the sequential reference add it).
            res_offs = offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
            res_mask = mask_m[:, None] & (offs_n < N)[None, :]
            rows += tl.load(res_ptr + res_offs, mask=res_mask, other=0.0).to(rows.dtype)
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
            rows,
            mask=mask_m[:, None] & (offs_n < N)[None, :],
        )


def tile_rows(algorithm: str, m: int, world_size: int) -> int:
    """Rows per tile owner of the scatter GEMM: all ``m`` one-shot, ``ceil(m / W)`` two-shot."""
    return m if algorithm == "one_shot" else triton.cdiv(m, world_size)


def run(
    call: GemmCall, ops: Operands, algorithm: str = "auto", *, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Fused GEMM + all-reduce of one weight over the group's symmetric heap: ``[m, n]``, the same bits
    on every rank.

    ``ops.x``: any leading dims (``m`` rows of ``k_local``, the same ``m`` on every rank), weight
    ``[n, k_local]`` with its scales, bias ``[n]``.

    Reference semantics::

        partial_src = dequant(x_src) @ dequant(w_src).T   # on every rank src; rounded to x's dtype
                                                           # (plain, int8), fp32 (FP8)
        y = sum(partial_src for src in 0..W-1)             # fp32, in rank order
        y = (y + bias).to(out_dtype)                       # once, after the reduction

    ``algorithm``: ``"auto"`` (one-shot when ``m * n`` partials take at most ``ONE_SHOT_MAX_BYTES``),
    ``"one_shot"`` or ``"two_shot"``. Always deterministic (``deterministic`` is compared across
    ranks and costs nothing). Raises RuntimeError naming the missing peer if a wait exceeds
    ``COC_TIMEOUT``, and on every rank when the ranks' calls differ.

    ``residual`` (rows ``[m, n]``, the epilogue of ``kernels.ops.norm``): returns ``h = y + residual`` in fp32
    (fp64 for fp64) instead, the residual added in the reduce after bias, before any rounding.
    """
    call = runtime.as_fused(call)
    return all_reduce(call, matmul.row_operands(ops), algorithm, ops, residual=residual)


def all_reduce(
    call: GemmCall, ops: Operands, algorithm: str, described: Operands, *, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`run` on 2-D ``ops`` (x's rows); ``described``: the operands the call descriptor describes."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: {algorithm!r} is not one of {ALGORITHMS}")
    x = ops.x
    out_dtype = call.out_dtype or x.dtype
    group = runtime.group_of(call)
    w = runtime.world_size(group)
    if w == 1:
        if residual is None:
            return matmul.gemm(call.fmt, ops, out_dtype=out_dtype)
        # The partial in its exchange dtype, then bias and residual in the accumulator, as the reduce adds them.
        partial_dtype = torch.float32 if call.fmt.partial_fp32 else x.dtype
        partial = matmul.gemm(call.fmt, replace(ops, biases=(None,)), out_dtype=partial_dtype)
        acc = torch.float64 if partial.dtype == torch.float64 else torch.float32
        h = partial.to(acc)
        if ops.biases[0] is not None:
            h = h + ops.biases[0].to(acc)
        return h + residual.to(acc)
    m, k = x.shape
    n = ops.weights[0].shape[0]
    size = torch.float32.itemsize if call.fmt.partial_fp32 else x.element_size()
    if algorithm == "auto":
        # m and n are in the checked descriptor: every rank picks the same algorithm.
        algorithm = "one_shot" if m * n * size <= ONE_SHOT_MAX_BYTES else "two_shot"
    cfg = block_config(call.fmt, x.device, tile_rows(algorithm, m, w), k, dtype=x.dtype, op="matmul_all_reduce", n=n)
    descriptor = runtime.describe(call, described, (cfg.block_m, cfg.block_n))
    out = all_reduce_partials(call.op, group, Partials(call.fmt, ops, cfg, residual=residual), algorithm, descriptor)
    if residual is not None:
        return out
    # FP8: the single rounding; every rank rounds the same fp32 bits.
    return out if out.dtype == out_dtype else out.to(out_dtype)


class Exchange(Protocol):
    """What the all-reduce exchange reduces: :class:`kernels.fused.scatter.Partials` (a GEMM's partial
    products) or :class:`kernels.fused.all_reduce_norm.Rows` (a tensor's rows). ``produce`` launches the
    pushes of ``rows_own`` rows per owner into slot ``[rank]`` of the owner (of every rank with
    ``broadcast``) and returns the ``RS`` target; the reduce sums the slots (``dtype``) in rank order, adds
    ``bias`` then the owned rows of ``residual`` and stores ``out_dtype``."""

    cfg: BlockConfig
    residual: torch.Tensor | None

    @property
    def m(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def out_dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def bias(self) -> torch.Tensor | None: ...
    def produce(self, call: runtime.FusedCall, rows_own: int, broadcast: bool) -> int: ...


def all_reduce_partials(
    op: str, group: object, partials: Exchange, algorithm: str, descriptor: tuple[int, ...]
) -> torch.Tensor:
    """The exchange of a fused all-reduce, ``algorithm`` "one_shot" or "two_shot", around the pushes of
    ``partials``; ``descriptor`` is this rank's call descriptor, checked against every peer's before any
    data moves. Returns ``y [m, n]`` in ``partials.out_dtype``."""
    w = runtime.world_size(group)
    cfg, bias, residual = partials.cfg, partials.bias, partials.residual
    m, n = partials.m, partials.n
    size = max(partials.dtype.itemsize, partials.out_dtype.itemsize)
    out = torch.empty((m, n), dtype=partials.out_dtype, device=partials.device)
    reduce = functools.partial(reduce_slots, cfg=cfg, slot_dtype=partials.dtype)
    if algorithm == "one_shot":
        with runtime.fused_call(op, group, partials.device, w * m * slot_stride(n) * size, descriptor) as call:
            call.outputs = (out,)
            target = partials.produce(call, m, True)
            reduce(call, out, bias, (m, m), target, residual=residual)
        return out
    rows_own = triton.cdiv(m, w)
    # The slots hold dtype, the pushed rows out_dtype: both regions are sized in the wider one, so
    # ``slots`` elements of out_dtype lie past the slot region and start 16-byte aligned.
    slots = w * rows_own * slot_stride(n)
    with runtime.fused_call(op, group, partials.device, 2 * slots * size, descriptor) as call:
        call.outputs = (out,)
        target = partials.produce(call, rows_own, False)
        first = min(m, call.rank * rows_own)
        rows_valid = min(rows_own, m - first)
        # ``out`` is only a dtype/stride carrier here: the reduced rows go to every rank's O region. The owner
        # adds no residual: each rank adds its own as it gathers the rows, as one-shot and the sequential reference
        # do, so a residual that differs between ranks gives the same result whichever algorithm the size picks.
        ar_target = reduce(call, out, bias, (rows_own, rows_valid), target, push_base=slots)
        heap = call.heap
        grid = (w * triton.cdiv(rows_own, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        if grid[0] > 0:
            _gather_rows_kernel[grid](
                (heap.data_ptrs, heap.sig_ptrs, slots, signals.channel_offset(signals.CH_AR, w)),
                (
                    out,
                    out.stride(0),
                    out.stride(1),
                    residual,
                    0 if residual is None else residual.stride(0),
                    0 if residual is None else residual.stride(1),
                ),
                (m, n, slot_stride(n), rows_own),
                call.rank,
                ar_target,
                call.timeout_ticks,
                TILE=SlotTile(cfg.block_m, cfg.block_n),
                PROTO=GatherRowsProto(w, signals.CH_AR, call.use_globaltimer),
                num_warps=cfg.num_warps,
            )
    return out
