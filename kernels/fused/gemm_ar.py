"""Fused GEMM + all-reduce: ``y = all_reduce(x @ weight.T) + bias``, one-shot or two-shot.

* one-shot (small outputs): the scatter GEMM of :mod:`gemm_rs` in ``BROADCAST`` mode pushes every
  tile of the partial product into slot ``[r]`` of every rank (heap ``slots [W, m, ld]``), then every
  rank sums the ``W`` slots itself. One exchange step, ``(W - 1) * m * n`` elements sent per rank.
* two-shot: reduce-scatter onto owners of ``rows_own = ceil(m / W)`` rows each (the last owners may
  hold fewer or none), then each owner pushes its reduced rows into region ``O [W * rows_own, ld]``
  of every rank (counter ``AR[owner]``), and a gather kernel copies ``O`` to ``y`` as the rows'
  owners' counters complete. About ``2 (W - 1) / W * m * n`` elements sent per rank.

Both sum the ``W`` partials in rank order in fp32 and every rank adds bias to the same fp32 sum (or
receives the owner's rounded result), so repeated calls are bitwise identical and all ranks hold
bitwise identical outputs: that is the default, ``deterministic=True`` costs nothing extra.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from . import runtime, signals
from .gemm import BlockConfig, block_config, matmul
from .gemm_rs import group_and_size, reduce_slots, scatter_partials, slot_stride, slot_tile

# Outputs up to this many bytes use one-shot: latency (one exchange, no second kernel round) wins
# over the ~W/2 times larger traffic while messages are small.
ONE_SHOT_MAX_BYTES = 256 * 1024
ALGORITHMS = ("auto", "one_shot", "two_shot")


@triton.jit(do_not_specialize=["rank", "target", "timeout"])
def _gather_rows_kernel(
    data_tab_ptr,
    sig_tab_ptr,
    out_ptr,
    M,
    N,
    LD,
    ROWS_OWN,
    stride_om,
    stride_on,
    rank,
    target: tl.int64,
    timeout: tl.int64,
    o_base,
    ar_offset,
    WORLD: tl.constexpr,
    CHANNEL: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
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
        1 + owner + WORLD * CHANNEL,
        USE_GLOBALTIMER,
    )
    if ok:
        # o_base is W * ROWS_OWN * LD elements, a multiple of 8 (LD is).
        o_local = signals.peer_ptr(data_tab_ptr, rank, out_ptr.dtype.element_ty) + tl.multiple_of(o_base, 8)
        o_offs, col_mask = slot_tile(offs_m, offs_n, LD)
        rows = tl.load(o_local + o_offs, mask=mask_m[:, None] & col_mask)
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
            rows,
            mask=mask_m[:, None] & (offs_n < N)[None, :],
        )


def matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    deterministic: bool,
    algorithm: str = "auto",
) -> torch.Tensor:
    """Fused GEMM + all-reduce over the group's symmetric heap.

    Shapes: x ``[m, k_local]`` (any ``m``, same on every rank), weight ``[n, k_local]``, bias ``[n]``
    -> y ``[m, n]``, the same bits on every rank.

    Reference semantics::

        partial_src = x_src @ weight_src.T                 # on every rank src, rounded to x.dtype
        y = sum(partial_src for src in 0..W-1)           # fp32, in rank order
        y = y + bias                                       # once, after the reduction

    ``algorithm``: ``"auto"`` (one-shot when ``m * n * itemsize <= ONE_SHOT_MAX_BYTES``),
    ``"one_shot"`` or ``"two_shot"``. Always deterministic (``deterministic`` is accepted for the
    API and costs nothing). Raises RuntimeError naming the missing peer if a wait exceeds
    ``COC_TIMEOUT``.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: {algorithm!r} is not one of {ALGORITHMS}")
    group, w = group_and_size(group)
    if w == 1:
        return matmul(x, weight, bias)
    m = x.shape[0]
    n = weight.shape[0]
    size = x.element_size()
    if algorithm == "auto":
        algorithm = "one_shot" if m * n * size <= ONE_SHOT_MAX_BYTES else "two_shot"
    cfg = block_config(x.device, tile_rows(algorithm, m, w), x.shape[1], x.dtype, op="matmul_all_reduce", n=n)
    # ``deterministic`` changes nothing here but is part of the call every rank must agree on.
    descriptor = runtime.describe(
        "matmul_all_reduce",
        m,
        x.shape[1],
        n,
        x.dtype,
        bias is not None,
        deterministic,
        tiles=(cfg.block_m, cfg.block_n),
    )
    return all_reduce_partials(
        "matmul_all_reduce",
        group,
        x,
        n,
        bias,
        algorithm,
        cfg,
        descriptor,
        lambda call, rows_own, broadcast: scatter_partials(call, x, weight, rows_own, broadcast, cfg),
    )


def tile_rows(algorithm: str, m: int, world_size: int) -> int:
    """Rows per tile owner of the scatter GEMM: all ``m`` one-shot, ``ceil(m / W)`` two-shot."""
    return m if algorithm == "one_shot" else triton.cdiv(m, world_size)


def all_reduce_partials(
    op: str,
    group: dist.ProcessGroup,
    x: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    algorithm: str,
    cfg: BlockConfig,
    descriptor: tuple[int, ...],
    scatter: Callable[[runtime.FusedCall, int, bool], int],
) -> torch.Tensor:
    """The exchange of a fused GEMM + all-reduce, ``algorithm`` "one_shot" or "two_shot", around a
    scatter GEMM.

    ``scatter(call, rows_own, broadcast)`` launches the GEMM that pushes the partial-product tiles
    of ``x`` (as :func:`gemm_rs.scatter_partials`) and returns the ``RS`` target; the
    plain and the w8A16 ops differ only there. ``descriptor`` is this rank's call descriptor
    (:func:`runtime.describe`), checked against every peer's before any data moves. Returns ``y [m, n]`` in ``x.dtype``.
    """
    w = runtime.world_size(group)
    m = x.shape[0]
    size = x.element_size()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if algorithm == "one_shot":
        with runtime.fused_call(op, group, x.device, w * m * slot_stride(n) * size, descriptor) as call:
            call.outputs = (out,)
            target = scatter(call, m, True)
            reduce_slots(call, out, bias, m, m, n, target, None, cfg)
        return out
    rows_own = triton.cdiv(m, w)
    slots = w * rows_own * slot_stride(n)
    with runtime.fused_call(op, group, x.device, 2 * slots * size, descriptor) as call:
        call.outputs = (out,)
        target = scatter(call, rows_own, False)
        rows_valid = min(rows_own, max(0, m - call.rank * rows_own))
        # ``out`` is only a dtype/stride carrier here: the reduced rows go to every rank's O region.
        ar_target = reduce_slots(call, out, bias, rows_own, rows_valid, n, target, slots, cfg)
        heap = call.heap
        grid = (w * triton.cdiv(rows_own, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        if grid[0] > 0:
            _gather_rows_kernel[grid](
                heap.data_ptrs,
                heap.sig_ptrs,
                out,
                m,
                n,
                slot_stride(n),
                rows_own,
                out.stride(0),
                out.stride(1),
                call.rank,
                ar_target,
                call.timeout_ticks,
                slots,
                signals.channel_offset(signals.CH_AR, w),
                WORLD=w,
                CHANNEL=signals.CH_AR,
                USE_GLOBALTIMER=call.use_globaltimer,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                num_warps=cfg.num_warps,
            )
    return out
