"""Fused all-gather + GEMM: ``y = all_gather_dim0(x) @ weight.T + bias``, optionally returning the gathered x.

Launch sequence on rank ``r`` for call epoch ``e`` (W ranks, heap region ``G [W * m_local, k]``):

1. call check (:func:`runtime.begin`): publish this call's descriptor to every peer and wait for
   theirs of epoch ``e``. A peer publishes only after its kernels of call ``e - 1`` finished, so
   once the check passes no peer still reads its ``G`` of the previous call;
2. push kernel (GPU: on a high-priority side stream): copy ``x`` into rows
   ``[r * m_local, (r + 1) * m_local)`` of every peer's ``G`` chunk by chunk (chunks of whole
   untuned row tiles, the same on every rank), peers in the order ``r - 1, r - 2, ...`` (the order in which they need
   shard ``r``), setting flag ``AG[r, c] = e`` on the receiving rank after chunk ``c``; skipped
   entirely if the check failed;
3. GEMM kernel: programs walk this rank's rows first (read straight from ``x``, no wait), then
   the ring ``r + 1, r + 2, ...``; a program waits for ``AG[src, c] >= e`` of every chunk its rows
   overlap (one unless its tuned tile is taller than the untuned one) before loading them from the
   local ``G``; with ``return_gathered`` the ``n``-tile-0 programs also write the rows they load to
   ``x_gathered``;
4. finish kernel: set ``DONE[r] = e`` on every rank, or fill the outputs with NaN after a failure.

Each rank only reads its own ``G`` and only peers write it, so step 1 is the whole flow control.
Under the interpreter the GEMM of step 3 waits only on other ranks' step 2, never on a later program
of its own launch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from . import runtime, signals
from .gemm import BlockConfig, acc_dtype, block_config, dot_precision, matmul, tile_matmul


@triton.jit
def _store_y(
    acc,
    bias_ptr,
    y_ptr,
    offs_m,
    mask_m,
    offs_n,
    mask_n,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(ACC_DTYPE)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _copy_rows(src_ptr, stride_sm, stride_sk, src_rows, dst_ptr, dst_rows, mask_m, K, BLOCK_K: tl.constexpr):
    """``dst[dst_rows, :] = src[src_rows, :]`` for the rows in ``mask_m`` (``dst`` rows contiguous, ``K`` wide)."""
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        mask = mask_m[:, None] & (offs_k < K)[None, :]
        tile = tl.load(src_ptr + src_rows[:, None] * stride_sm + offs_k[None, :] * stride_sk, mask=mask)
        tl.store(dst_ptr + dst_rows[:, None] * K + offs_k[None, :], tile, mask=mask)


@triton.jit
def _output_rows(local_rows, offs_m, src, rows_per_block, WORLD: tl.constexpr, SPLIT_BLOCKS: tl.constexpr):
    """Rows of y (and x_gathered) that shard ``src``'s local rows go to.

    ``SPLIT_BLOCKS`` (gather_dim > 0): x's rows are outer blocks of ``rows_per_block`` (L) rows,
    gathered block by block, so local row i of shard src is row ``(i // L) * W * L + src * L + i % L``:
    strided output rows instead of a transposing copy. Else the gather-buffer row ``offs_m``.
    Called where the rows are used, after the GEMM loop, so they are never live next to it.
    """
    if SPLIT_BLOCKS:
        # int32 division: an int64 one is a long subroutine whose registers, next to the live
        # accumulator, spilled. Local rows are below M_LOCAL, an int32 launch argument.
        rows32 = local_rows.to(tl.int32)
        block = (rows32 // rows_per_block).to(tl.int64)
        inner = (rows32 % rows_per_block).to(tl.int64)
        rows = block * (WORLD * rows_per_block) + src * rows_per_block + inner
    else:
        rows = offs_m
    return rows


@triton.jit(do_not_specialize=["rank", "timeout", "rows_per_block"])
def _ag_gemm_kernel(
    x_ptr,
    data_tab_ptr,
    sig_tab_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    g_ptr,
    M_LOCAL,
    N,
    K,
    n_tiles,
    chunk_rows,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    rows_per_block,
    rank,
    timeout: tl.int64,
    flag_offset,
    WORLD: tl.constexpr,
    CHANNEL: tl.constexpr,
    FLAG_STRIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_A: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
    STORE_IN_GEMM: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
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
    flags = flag_offset + src * FLAG_STRIDE
    first_chunk = first_row // chunk_rows
    last_chunk = (tl.minimum(first_row + BLOCK_M, M_LOCAL) - 1) // chunk_rows
    local_rows = first_row + tl.arange(0, BLOCK_M).to(tl.int64)
    mask_m = local_rows < M_LOCAL
    # Rows of the gather buffer G (source-major: shard src at rows [src * M_LOCAL, ...)).
    offs_m = src * M_LOCAL + local_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = offs_n < N
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    # Only the n-tile-0 programs write x_gathered (the interpreter cannot broadcast a scalar
    # predicate into a mask, hence the vector form).
    store_mask = mask_m & ((offs_m * 0 + pid_n) == 0)
    if src == rank:
        # Own rows straight from x: no flag, so this launch never waits on the push launch of its
        # own process (which then need not be co-resident with it). Skipped after a failed check.
        if signals.failed(pad) == 0:
            if STORE_A and SPLIT_BLOCKS:
                # Before the GEMM (nothing of it live yet): the GEMM core stores A rows only at the
                # rows it loads them from.
                if pid_n == 0:
                    g_rows = _output_rows(local_rows, offs_m, src, rows_per_block, WORLD, SPLIT_BLOCKS)
                    _copy_rows(x_ptr, stride_xm, stride_xk, local_rows, g_ptr, g_rows, mask_m, K, BLOCK_K)
            acc = tile_matmul(
                x_ptr,
                stride_xm,
                stride_xk,
                w_ptr,
                stride_wn,
                stride_wk,
                local_rows,
                mask_m,
                offs_n,
                mask_n,
                K,
                # 64-bit: the gathered buffer of W * m_local rows of k elements passes 2**31 elements long
                # before any row index does.
                g_ptr + (rank * M_LOCAL).to(tl.int64) * K,
                K,
                store_mask,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                STORE_IN_GEMM,
                ACC_DTYPE,
                DOT_PRECISION,
            )
            offs_y = _output_rows(local_rows, offs_m, src, rows_per_block, WORLD, SPLIT_BLOCKS)
            _store_y(acc, bias_ptr, y_ptr, offs_y, mask_m, offs_n, mask_n, stride_ym, stride_yn, HAS_BIAS, ACC_DTYPE)

    else:
        epoch = signals.call_epoch(pad)
        code = 1 + src + WORLD * CHANNEL
        ready = signals.wait_signal(pad + flags + first_chunk, epoch, pad, timeout, code, USE_GLOBALTIMER)
        for c in range(first_chunk + 1, last_chunk + 1):
            ready = ready & signals.wait_signal(pad + flags + c, epoch, pad, timeout, code, USE_GLOBALTIMER)
        if ready:
            g_local = signals.peer_ptr(data_tab_ptr, rank, y_ptr.dtype.element_ty)
            if STORE_A and SPLIT_BLOCKS:
                if pid_n == 0:
                    g_rows = _output_rows(local_rows, offs_m, src, rows_per_block, WORLD, SPLIT_BLOCKS)
                    _copy_rows(g_local, K, 1, offs_m, g_ptr, g_rows, mask_m, K, BLOCK_K)
            acc = tile_matmul(
                g_local,
                K,
                1,
                w_ptr,
                stride_wn,
                stride_wk,
                offs_m,
                mask_m,
                offs_n,
                mask_n,
                K,
                g_ptr,
                K,
                store_mask,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                STORE_IN_GEMM,
                ACC_DTYPE,
                DOT_PRECISION,
            )
            offs_y = _output_rows(local_rows, offs_m, src, rows_per_block, WORLD, SPLIT_BLOCKS)
            _store_y(acc, bias_ptr, y_ptr, offs_y, mask_m, offs_n, mask_n, stride_ym, stride_yn, HAS_BIAS, ACC_DTYPE)


@triton.jit(do_not_specialize=["rank"])
def _push_shard_kernel(
    x_ptr,
    data_tab_ptr,
    sig_tab_ptr,
    M_LOCAL,
    K,
    stride_xm,
    stride_xk,
    chunk_rows,
    n_chunks,
    rank,
    WORLD: tl.constexpr,
    FLAG_OFFSET: tl.constexpr,
    FLAG_STRIDE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program (step, c) copies chunk c of x into row block ``rank`` of rank (rank - 1 - step)'s
    # gather buffer and then raises that rank's flag AG[rank, c]. Rank d's GEMM reads its own rows
    # (from its x) first and shard d + 1 next, so rank - 1 is served first, then rank - 2, ...
    pid = tl.program_id(0)
    step = pid // n_chunks
    c = pid % n_chunks
    dst = (rank - 1 - step + WORLD) % WORLD
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    # The call check of this epoch ran before this kernel: if it failed (a peer missing, or a peer
    # described another call), nothing may be written into any peer.
    if signals.failed(pad) == 0:
        g = signals.peer_ptr(data_tab_ptr, dst, x_ptr.dtype.element_ty)
        end = tl.minimum(c * chunk_rows + chunk_rows, M_LOCAL)
        for r0 in range(c * chunk_rows, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
            mask_r = rows < end
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
                mask = mask_r[:, None] & (ks < K)[None, :]
                tile = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk, mask=mask)
                tl.store(g + (rank * M_LOCAL + rows)[:, None] * K + ks[None, :], tile, mask=mask)
        signals.send_signal(
            signals.peer_ptr(sig_tab_ptr, dst, tl.int64) + FLAG_OFFSET + rank * FLAG_STRIDE + c, signals.call_epoch(pad)
        )


def _chunk_rows(device: torch.device, m_local: int) -> int:
    """Rows per pushed chunk of a shard: a peer flags each chunk and the GEMM here waits on those flags,
    so every rank must count the same chunks. They follow ``m_local`` (in the checked descriptor) and
    the untuned tile height for it, never the tuned tiles, which each rank looks up by its own ``n``
    (ranks may differ in ``n``); a tile of another height waits for every chunk it overlaps."""
    base = block_config(device, m_local)
    return max(1, triton.cdiv(triton.cdiv(m_local, base.ag_splits), base.block_m)) * base.block_m


def _push_shard(call: runtime.FusedCall, x: torch.Tensor, chunk_rows: int, side: torch.cuda.Stream | None) -> bool:
    """Copy ``x`` chunk by chunk into row block ``r`` of every peer's gather buffer, flag after each chunk.

    One kernel, so the pushes are skipped on the device when the call check failed: copies queued
    by the host could not be (the host learns of a failure only later) and would overwrite the
    gather buffer of a slow but alive peer still reading its previous call. On GPU it runs on a
    high-priority side stream, queued before the GEMM: its few programs get SMs before the GEMM's
    spinning programs, and the GEMM starts on this rank's own rows at once. Returns whether it
    forked ``side`` from the current stream (the caller must then join it back).
    """
    heap, r, w = call.heap, call.rank, call.world_size
    m_local, k = x.shape
    n_chunks = triton.cdiv(m_local, chunk_rows)
    if n_chunks == 0:
        return False
    gpu = side is not None
    if gpu:
        side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side) if gpu else contextlib.nullcontext():
        _push_shard_kernel[((w - 1) * n_chunks,)](
            x,
            heap.data_ptrs,
            heap.sig_ptrs,
            m_local,
            k,
            x.stride(0),
            x.stride(1),
            chunk_rows,
            n_chunks,
            r,
            WORLD=w,
            FLAG_OFFSET=signals.channel_offset(signals.CH_AG, w),
            FLAG_STRIDE=signals.AG_MAX_SPLITS,
            BLOCK_R=32 if gpu else 16,
            BLOCK_K=128 if gpu else 64,
            num_warps=4 if gpu else 1,
        )
    return gpu


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        # High priority: the pushes are on the GEMM's critical path.
        stream = torch.cuda.Stream(device=device, priority=-1)
        _SIDE_STREAMS[device] = stream
    return stream


def _gemm(
    call: runtime.FusedCall,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    return_gathered: bool,
    cfg: BlockConfig,
    chunk_rows: int,
    outer: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the outputs and launch the GEMM over the gathered rows; ``(y, x_gathered or y)``.

    ``outer > 1``: the rows of ``x`` are ``outer`` blocks gathered block by block (``gather_dim > 0``)."""
    heap, w = call.heap, call.world_size
    m_local, k = x.shape
    n = weight.shape[0]
    y = torch.empty((w * m_local, n), dtype=x.dtype, device=x.device)
    x_gathered = torch.empty((w * m_local, k), dtype=x.dtype, device=x.device) if return_gathered else y
    call.outputs = (y, x_gathered) if return_gathered else (y,)
    # With n == 0 the V2 op still needs one column of programs to copy the gathered rows out.
    n_tiles = max(triton.cdiv(n, cfg.block_n), 1 if return_gathered else 0)
    grid = (w * triton.cdiv(m_local, cfg.block_m) * n_tiles,)
    if grid[0] > 0:
        _ag_gemm_kernel[grid](
            x,
            heap.data_ptrs,
            heap.sig_ptrs,
            weight,
            bias if bias is not None else y,
            y,
            x_gathered,
            m_local,
            n,
            k,
            n_tiles,
            chunk_rows,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            y.stride(0),
            y.stride(1),
            m_local // outer,
            call.rank,
            call.timeout_ticks,
            signals.channel_offset(signals.CH_AG, w),
            WORLD=w,
            CHANNEL=signals.CH_AG,
            FLAG_STRIDE=signals.AG_MAX_SPLITS,
            HAS_BIAS=bias is not None,
            STORE_A=return_gathered,
            SPLIT_BLOCKS=outer > 1,
            # The GEMM core stores the A rows at the rows it loads them from; strided rows are
            # copied by the kernel after the GEMM.
            STORE_IN_GEMM=return_gathered and outer == 1,
            USE_GLOBALTIMER=call.use_globaltimer,
            ACC_DTYPE=acc_dtype(x.dtype),
            DOT_PRECISION=dot_precision(x.dtype, x.device),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return y, x_gathered


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    return_gathered: bool = False,
    *,
    outer: int = 1,
    comm_dim: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused all-gather + GEMM over the group's symmetric heap.

    Shapes: x ``[m_local, k]`` (same ``m_local`` on every rank), weight ``[n, k]``, bias ``[n]`` ->
    y ``[W * m_local, n]`` (and x_gathered ``[W * m_local, k]`` if ``return_gathered``).

    Reference semantics::

        blocks_r = x_from_rank_r.view(outer, m_local / outer, k)
        x_gathered = cat([blocks_0, ..., blocks_W-1], dim=1).view(W * m_local, k)
        y = x_gathered @ weight.T + bias
        return (y, x_gathered) if return_gathered else y

    ``outer`` (the product of the dims before ``gather_dim``; 1 for dim 0, the plain
    ``cat(dim=0)``) changes only where the kernel stores rows: the gather buffer stays source-major
    and each output row is addressed as (outer block, source rank, row in block), no transposing
    copy. ``comm_dim`` (the normalized gather_dim) goes into the call descriptor.

    Nothing is reduced across ranks, so every row of y is one dot product per column (fp32 accumulate).
    Raises RuntimeError naming the missing peer if a wait exceeds ``COC_TIMEOUT``.
    """
    group = runtime.resolve_group(group)
    w = runtime.world_size(group)
    if w == 1:
        y = matmul(x, weight, bias)
        return (y, x.clone(memory_format=torch.contiguous_format)) if return_gathered else y
    y, x_gathered = _all_gather_matmul(x, weight, bias, group, return_gathered, return_gathered, outer, comm_dim)
    return (y, x_gathered) if return_gathered else y


def all_gather_matmul_multi(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    group: dist.ProcessGroup | None,
    *,
    return_gathered: bool = False,
    outer: int = 1,
    comm_dim: int = 0,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """All-gather + GEMM with several weights, one gather: ``(ys, x_gathered or None)``.

    Reference semantics::

        x_gathered = (as all_gather_matmul)
        ys = [x_gathered @ w.T + b for w, b in zip(weights, biases)]

    The fused kernel runs for ``weights[0]`` and writes the gathered rows as it loads them; the other
    weights multiply that gathered x with the local GEMM core (no second exchange).
    """
    group = runtime.resolve_group(group)
    if runtime.world_size(group) == 1:
        ys = [matmul(x, w, b) for w, b in zip(weights, biases, strict=True)]
        return ys, x.clone(memory_format=torch.contiguous_format) if return_gathered else None
    store = return_gathered or len(weights) > 1
    y0, x_gathered = _all_gather_matmul(x, weights[0], biases[0], group, return_gathered, store, outer, comm_dim)
    ys = [y0] + [matmul(x_gathered, w, b) for w, b in zip(weights[1:], biases[1:], strict=True)]
    return ys, x_gathered if return_gathered else None


def _all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup,
    return_gathered: bool,
    store_gathered: bool,
    outer: int,
    comm_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, x_gathered)`` (``x_gathered`` is ``y`` unless ``store_gathered``). ``return_gathered``
    is what the caller asked for and goes into the call descriptor; ``store_gathered`` also writes
    the gathered x for later GEMMs of the same call (a rank-local choice)."""
    w = runtime.world_size(group)
    m_local, k = x.shape
    n = weight.shape[0]
    # The kernel indexes bias with unit stride.
    bias = bias.contiguous() if bias is not None else None
    data_bytes = w * m_local * k * x.element_size()
    descriptor = runtime.describe(
        "all_gather_matmul", m_local, k, n, x.dtype, bias is not None, return_gathered, comm_dim=comm_dim, outer=outer
    )
    # The call check waits for every peer's descriptor of this epoch, which each peer publishes
    # only after its previous call's kernels finished: its gather buffer is free to overwrite.
    with runtime.fused_call("all_gather_matmul", group, x.device, data_bytes, descriptor) as call:
        cfg = block_config(x.device, m_local, k, x.dtype, op="all_gather_matmul", n=n)
        chunk_rows = _chunk_rows(x.device, m_local)
        side = _side_stream(x.device) if x.device.type == "cuda" else None
        forked = _push_shard(call, x, chunk_rows, side)
        try:
            y, x_gathered = _gemm(call, x, weight, bias, store_gathered, cfg, chunk_rows, outer)
        finally:
            if forked:
                # Joined on every path, an exception included: work the caller queues next (which
                # may overwrite or free x) and the next call's check (which advances the epoch the
                # pushes read) must follow the pushes. They end about when the GEMM does, since
                # every rank's GEMM waits for every rank's push. Inside capture a join without a
                # fork would wait on an uncaptured stream.
                torch.cuda.current_stream(x.device).wait_stream(side)
    return y, x_gathered
