"""Fused expert-parallel dispatch / combine over the symmetric heap (the ``"fused"`` backend of
:mod:`kernels.ops.moe_ep`): counts exchanged through the heap, rows written straight to their final row on the
rank of their expert, and each expert output row read back by its token's owner.

Notation as :mod:`kernels.ops.moe_ep_routing`: ``W`` ranks, this rank ``r``, ``E`` experts (``E_l = E / W`` per
rank), ``S = m_local * topk`` pairs, ``cap = max_tokens`` (bounded mode). Flags: ``AG[src, 0]`` of the pad (the
all-gather's per-source epoch flags, slot 0; epoch-valued and never reset, so sharing them with the all-gather is
safe: a flag of call ``e`` can never satisfy a wait of a later call) and the ``RS[src]`` counters of the call's
bank (zeroed by each call's check, :mod:`kernels.fused.signals`).

:func:`dispatch`, on rank ``r`` for call epoch ``e``; heap regions ``COUNTS [W, E]`` int64, ``ROWS [B, k]`` of
x's dtype and ``PAIRS [B]`` int64, ``B = cap`` (bounded) or the most rows any rank receives (exact):

1. call check (:func:`runtime.begin`), as every fused op;
2. counts (:func:`_counts_kernel`, one program): store this rank's per-expert counts into row ``r`` of every
   peer's ``COUNTS``, release-store ``AG[r, 0] = e`` there; then wait for ``AG[src, 0] >= e`` of every source and
   copy the table ``[W, E]`` out. Every rank now holds the same table;
3. on the device (torch, no host read in bounded mode): the bounded overflow check (every rank judges the same
   table, so every rank raises alike, or keeps the flag for :func:`kernels.moe_check_overflow` where no host read
   is allowed; overflowing rows are dropped by the pushes, never silently: the flag is always read), and the
   placement (:func:`kernels.ops.moe.layout.layout`): the row of a pair on its expert's rank is the exclusive
   scan of the table over (local expert, source) plus the pair's rank within its (source, expert) block;
4. push (:func:`_push_rows_kernel`, ``W * CHUNKS`` programs): program ``(dst, c)`` copies piece ``c`` of the pairs
   this rank sends to ``dst`` (a contiguous block of the expert-sorted pairs) into ``ROWS`` of ``dst`` at their
   final rows, with their pair ids into ``PAIRS``, then release-adds 1 to ``RS[r]`` of ``dst``. Peers first
   (``r + 1, r + 2, ...``), this rank's own rows last, through its own heap like any other;
5. collect (:func:`_collect_kernel`): wait for ``RS[src] >= CHUNKS`` of every source, then copy ``ROWS`` and
   ``PAIRS`` below ``valid`` into the outputs (rows past it stay zero, pair ids -1); then :func:`runtime.finish`.

Exact mode reads the received totals on the host after step 2 to size ``B`` and the output (as the other backends
do). When the heap already holds ``ROWS`` and ``PAIRS`` of that ``B`` (the steady state), steps 3-5 follow in the
same call; otherwise the call ends after step 2 and steps 1 and 4-5 follow in a second call, which grows the heap
to the largest total. Every rank takes the same branch: the heap has one size on every rank and every rank holds
the same table (a heap grows by a collective every rank must enter with one size). Bounded mode is one call of
fixed size and reads nothing on the host: its launches are the same from call to call, so it can be captured in a
CUDA graph.

:func:`combine`, call epoch ``e``; heap region ``Y [B, n]`` of y's dtype:

1. call check;
2. publish (:func:`_publish_kernel`, ``CHUNKS`` programs): copy this rank's ``y`` into its own ``Y`` and
   release-add 1 to ``RS[r]`` of every rank, this one included;
3. pull and sum (:func:`_pull_kernel`, a program per tile of tokens x columns): wait for ``RS[d] >= CHUNKS`` of
   every rank ``d``, then for the slots ``s = 0, 1, ..., topk - 1`` in that order load each pair's row from the
   ``Y`` of its expert's rank (``handle.pair_dest``: rank and row, from the dispatch; zero for pairs a bounded
   overflow dropped), store it into ``returned [S, n]`` and add ``w[t, s] * row`` to an fp32 accumulator (the
   product rounded alone, ``mul.rn.f32``, never an FMA), then round once to y's dtype; then :func:`runtime.finish`.
   These are :func:`kernels.ops.moe.layout.weighted_sum`'s order and roundings (its product and its add are two
   torch kernels), so ``out`` has the other backends' bits.

A pull, not a push: a push would write into a region of the owner sized by the owner's ``S``, which ranks need not
share, while the heap size must be the same on every rank; ``Y`` is ``B`` rows on every rank.

Memory ordering (PTX model; :mod:`kernels.fused.signals` holds the primitives). Every flag a reader waits on is
written by :func:`signals.send_signal` / :func:`signals.add_signal`: a CTA barrier (every thread's stores of the
program issued before) and a release atomic at system scope; every wait ends with an acquire atomic at system
scope and a CTA barrier (every thread's loads after). So: the counts row a source stored into ``COUNTS[src]``
happens-before the reader's loads of it (release-store of ``AG[src, 0]`` / acquire-load of it); the rows and pair
ids each push program stored into ``ROWS``/``PAIRS`` happen-before the collect's loads, because the ``CHUNKS``
release-adds of one source to ``RS[src]`` form a release sequence (each read-modify-write extends it) and the
acquire that reads the final value synchronizes with every one of them; the publish programs' stores into ``Y``
happen-before a puller's loads the same way. Flow control is the call check's: a rank stores into a peer's
``COUNTS``/``ROWS``/``PAIRS``, and overwrites its own ``Y``, only after passing the check of ``e``, which needs
every peer's descriptor of ``e``, published only after that peer's stream finished call ``e - 1`` (its collect
read its rows, its pull read every ``Y``). After a failed check no program stores into a peer or signals, every
wait fails at once, and the outputs are NaN.

FP8 payloads need nothing here: the op hands :func:`dispatch` each row's payload and scale bytes packed into one
``uint8`` row (:mod:`kernels.ops.moe.payload`), which ``ROWS`` holds and the kernels copy like any row.

Not fused yet: the backward passes run the chunked movement; the caller's grouped GEMM does not start on the
experts whose rows have landed (it would wait on per-expert counters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ..protocol.call import resolve_group as resolve_group_name
from . import runtime, signals
from .tile import copy_rows

DISPATCH, COMBINE = "moe_dispatch", "moe_combine"
# Programs per (source, destination) pair of the row pushes, and of a combine's publish: the receiver's counter
# target, so the same on every rank (it depends on the device type only).
_CHUNKS = {"cpu": 2, "cuda": 16}
_COUNTS_FLAG = tl.constexpr(0)
# The interpreter has no inline PTX (and numpy never contracts a product into an FMA).
_INTERPRETED = tl.constexpr(runtime.triton_interpreted())


class CountsConfig(NamedTuple):
    """``CONFIG`` of :func:`_counts_kernel`: the all-gather flags' stride per source, ``BLOCK_E`` experts per step."""

    WORLD: int
    FLAG_STRIDE: int
    BLOCK_E: int
    USE_GLOBALTIMER: bool


class RowsConfig(NamedTuple):
    """``CONFIG`` of the kernels that move rows (push, collect, publish, pull): ``CHUNKS`` programs per (source,
    destination) pair, each a receiver's counter increment; ``BLOCK_R`` rows (the pull: tokens) and ``BLOCK_C``
    columns per step (:func:`_blocks`). ``USE_GLOBALTIMER`` serves the kernels that wait (collect, pull)."""

    WORLD: int
    CHUNKS: int
    BLOCK_R: int
    BLOCK_C: int
    USE_GLOBALTIMER: bool


def _align(nbytes: int) -> int:
    """Round a region's byte size up to 16: every region starts 16-byte aligned."""
    return -(-nbytes // 16) * 16


def _blocks(device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_C, num_warps)``: rows and columns per copy step, as the all-gather's push."""
    return (32, 128, 4) if device.type == "cuda" else (16, 64, 1)


@triton.jit(do_not_specialize=["rank", "timeout"])
def _counts_kernel(COUNTS, heap, rank, timeout: tl.int64, CONFIG: tl.constexpr):
    # COUNTS = (mine [E] int64, table [W, E] int64, E); heap = (data table, signal table, AG offset);
    # CONFIG: CountsConfig. One program: it stores before it waits, so every rank's stores precede every rank's
    # waits and no wait depends on a later program.
    mine_ptr, table_ptr, E = COUNTS
    data_tab_ptr, sig_tab_ptr, flag_offset = heap
    WORLD: tl.constexpr = CONFIG.WORLD
    BLOCK_E: tl.constexpr = CONFIG.BLOCK_E
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    epoch = signals.call_epoch(pad)
    if signals.failed(pad) == 0:
        for step in tl.static_range(1, WORLD):
            dst = (rank + step) % WORLD
            region = signals.peer_ptr(data_tab_ptr, dst, tl.int64)
            for e0 in range(0, E, BLOCK_E):
                offs = e0 + tl.arange(0, BLOCK_E).to(tl.int64)
                mask = offs < E
                tl.store(region + rank * E + offs, tl.load(mine_ptr + offs, mask=mask), mask=mask)
            # Release: the row above is visible before the flag (module docstring).
            flag = signals.peer_ptr(sig_tab_ptr, dst, tl.int64) + flag_offset + rank * CONFIG.FLAG_STRIDE + _COUNTS_FLAG
            signals.send_signal(flag, epoch)
        for e0 in range(0, E, BLOCK_E):
            offs = e0 + tl.arange(0, BLOCK_E).to(tl.int64)
            mask = offs < E
            tl.store(table_ptr + rank * E + offs, tl.load(mine_ptr + offs, mask=mask), mask=mask)
    own = signals.peer_ptr(data_tab_ptr, rank, tl.int64)
    for step in tl.static_range(1, WORLD):
        src = (rank + step) % WORLD
        flag = pad + flag_offset + src * CONFIG.FLAG_STRIDE + _COUNTS_FLAG
        # A failed wait leaves the row zero (the table was allocated zeroed): no count ever indexes past a buffer.
        if signals.wait_signal(flag, epoch, pad, timeout, 1 + src + WORLD * signals.CH_AG, CONFIG.USE_GLOBALTIMER):
            for e0 in range(0, E, BLOCK_E):
                offs = e0 + tl.arange(0, BLOCK_E).to(tl.int64)
                mask = offs < E
                tl.store(table_ptr + src * E + offs, tl.load(own + src * E + offs, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["rank"])
def _push_rows_kernel(X, ROUTE, heap, rank, CONFIG: tl.constexpr):
    # X = (x, stride_xm, stride_xk, K); ROUTE = (order, pair_dest, send_start, send_counts, topk);
    # heap = (data table, signal table, ROWS base (x elements), PAIRS base (int64 elements), RS offset);
    # CONFIG: RowsConfig (BLOCK_C: columns of x per copy step).
    x_ptr, stride_xm, stride_xk, K = X
    order_ptr, dest_ptr, start_ptr, count_ptr, topk = ROUTE
    data_tab_ptr, sig_tab_ptr, rows_base, pairs_base, rs_offset = heap
    WORLD: tl.constexpr = CONFIG.WORLD
    CHUNKS: tl.constexpr = CONFIG.CHUNKS
    BLOCK_R: tl.constexpr = CONFIG.BLOCK_R
    pid = tl.program_id(0)
    # Peers first, own rows last (read by this rank's collect only, after this whole launch).
    dst = (rank + 1 + pid // CHUNKS) % WORLD
    c = pid % CHUNKS
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    # After a failed call check nothing may be stored into any peer (its previous call may still read).
    if signals.failed(pad) == 0:
        start = tl.load(start_ptr + dst)
        count = tl.load(count_ptr + dst)
        lo = start + count * c // CHUNKS
        hi = start + count * (c + 1) // CHUNKS
        g = signals.peer_ptr(data_tab_ptr, dst, x_ptr.dtype.element_ty) + rows_base
        gp = signals.peer_ptr(data_tab_ptr, dst, tl.int64) + pairs_base
        for i0 in range(lo, hi, BLOCK_R):
            i = i0 + tl.arange(0, BLOCK_R).to(tl.int64)
            mask = i < hi
            pair = tl.load(order_ptr + i, mask=mask, other=0)
            where = tl.load(dest_ptr + pair, mask=mask, other=-1)
            # -1: dropped by a bounded overflow (reported by name; module docstring).
            keep = mask & (where >= 0)
            row = tl.where(keep, where // WORLD, 0)
            copy_rows((x_ptr, stride_xm, stride_xk, pair // topk), (g, row), keep, K, CONFIG.BLOCK_C)
            tl.store(gp + row, pair, mask=keep)
        counter = signals.peer_ptr(sig_tab_ptr, dst, tl.int64) + signals.counter(pad, rs_offset, rank, WORLD)
        signals.add_signal(counter, 1)


@triton.jit(do_not_specialize=["rank", "timeout"])
def _collect_kernel(OUT, heap, rank, timeout: tl.int64, CONFIG: tl.constexpr):
    # OUT = (rows [R, K] zeroed, pairs [R] int64 filled with -1, valid (0-d int64), R, K); heap as the push's;
    # CONFIG: RowsConfig.
    rows_ptr, pairs_ptr, valid_ptr, R, K = OUT
    data_tab_ptr, sig_tab_ptr, rows_base, pairs_base, rs_offset = heap
    WORLD: tl.constexpr = CONFIG.WORLD
    BLOCK_R: tl.constexpr = CONFIG.BLOCK_R
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    ready = True
    for src in tl.static_range(WORLD):
        # Every source's CHUNKS pushes (an empty one too) have landed: the acquire of the final count.
        flag = pad + signals.counter(pad, rs_offset, src, WORLD)
        code = 1 + src + WORLD * signals.CH_RS
        ready = ready & signals.wait_signal(flag, CONFIG.CHUNKS, pad, timeout, code, CONFIG.USE_GLOBALTIMER)
    if ready:
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        # Every row below valid was written by exactly one push (the placement is a bijection onto them).
        has = (rows < R) & (rows < tl.load(valid_ptr))
        g = signals.peer_ptr(data_tab_ptr, rank, rows_ptr.dtype.element_ty) + rows_base
        copy_rows((g, K, 1, rows), (rows_ptr, rows), has, K, CONFIG.BLOCK_C)
        gp = signals.peer_ptr(data_tab_ptr, rank, tl.int64) + pairs_base
        tl.store(pairs_ptr + rows, tl.load(gp + rows, mask=has), mask=has)


@triton.jit(do_not_specialize=["rank"])
def _publish_kernel(Y, heap, rank, CONFIG: tl.constexpr):
    # Y = (y, stride_ym, stride_yn, R, N); heap = (data table, signal table, RS offset);
    # CONFIG: RowsConfig. Program c copies row blocks c, c + CHUNKS, ... of y.
    y_ptr, stride_ym, stride_yn, R, N = Y
    data_tab_ptr, sig_tab_ptr, rs_offset = heap
    WORLD: tl.constexpr = CONFIG.WORLD
    CHUNKS: tl.constexpr = CONFIG.CHUNKS
    BLOCK_R: tl.constexpr = CONFIG.BLOCK_R
    c = tl.program_id(0)
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    # After a failed check this rank's Y may still be read by a peer's previous call: leave it.
    if signals.failed(pad) == 0:
        g = signals.peer_ptr(data_tab_ptr, rank, y_ptr.dtype.element_ty)
        for r0 in range(c * BLOCK_R, R, CHUNKS * BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
            copy_rows((y_ptr, stride_ym, stride_yn, rows), (g, rows), rows < R, N, CONFIG.BLOCK_C)
        for dst in tl.static_range(WORLD):
            signals.add_signal(
                signals.peer_ptr(sig_tab_ptr, dst, tl.int64) + signals.counter(pad, rs_offset, rank, WORLD), 1
            )


@triton.jit
def _mul_rn(a, b):
    """``a * b`` in fp32, rounded once and never contracted into an FMA with a later add: the other backends'
    ``acc += row * w`` is a product kernel then an add kernel, two roundings (the interpreter multiplies alone)."""
    if _INTERPRETED:
        p = a * b
    else:
        p = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    return p


@triton.jit
def _pull_slot(OUT, ROUTE, tile, s, CONFIG: tl.constexpr):
    """Slot ``s`` of the tile's tokens: the pair rows read from their experts' ranks (zero where dropped), stored
    into ``returned`` and returned times their weights (fp32, one rounding). ``tile = (data table, tokens, mask_m,
    cols, mask_n)``."""
    out_ptr, ret_ptr, M, N = OUT
    dest_ptr, w_ptr, stride_wm, topk = ROUTE
    data_tab_ptr, tokens, mask_m, cols, mask_n = tile
    WORLD: tl.constexpr = CONFIG.WORLD
    BLOCK_M: tl.constexpr = CONFIG.BLOCK_R
    BLOCK_N: tl.constexpr = CONFIG.BLOCK_C
    pairs = tokens * topk + s
    where = tl.load(dest_ptr + pairs, mask=mask_m, other=-1)
    row = tl.where(where >= 0, where // WORLD, 0)
    mask = mask_m[:, None] & mask_n[None, :]
    vals = tl.zeros((BLOCK_M, BLOCK_N), dtype=ret_ptr.dtype.element_ty)
    # One masked load per source rank (a lane loads from the one rank that holds its pair): scalar peer pointers.
    for d in tl.static_range(WORLD):
        g = signals.peer_ptr(data_tab_ptr, d, ret_ptr.dtype.element_ty)
        here = mask & ((where >= 0) & (where % WORLD == d))[:, None]
        vals = tl.where(here, tl.load(g + row[:, None] * N + cols[None, :], mask=here, other=0.0), vals)
    tl.store(ret_ptr + pairs[:, None] * N + cols[None, :], vals, mask=mask)
    weight = tl.load(w_ptr + tokens * stride_wm + s, mask=mask_m, other=0.0).to(tl.float32)
    return _mul_rn(vals.to(tl.float32), tl.broadcast_to(weight[:, None], (BLOCK_M, BLOCK_N)))


@triton.jit(do_not_specialize=["rank", "timeout"])
def _pull_kernel(OPERANDS, heap, rank, timeout: tl.int64, CONFIG: tl.constexpr):
    # OPERANDS = (OUT, ROUTE): OUT = (out [M, N], returned [M * topk, N], M, N); ROUTE = (pair_dest [M * topk] int64
    # (row * W + rank, -1 dropped), topk_weights, stride_wm, topk); heap = (data table, signal table, RS offset);
    # CONFIG: RowsConfig, a tile of BLOCK_R tokens x BLOCK_C columns per program.
    OUT, ROUTE = OPERANDS
    out_ptr, _, M, N = OUT
    _, _, _, topk = ROUTE
    data_tab_ptr, sig_tab_ptr, rs_offset = heap
    WORLD: tl.constexpr = CONFIG.WORLD
    BLOCK_M: tl.constexpr = CONFIG.BLOCK_R
    BLOCK_N: tl.constexpr = CONFIG.BLOCK_C
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tokens = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_m = tokens < M
    mask_n = cols < N
    tile = (data_tab_ptr, tokens, mask_m, cols, mask_n)
    pad = signals.peer_ptr(sig_tab_ptr, rank, tl.int64)
    ready = True
    # Own rows last: its own publish ran before this launch, the peers' flags arrive meanwhile.
    for step in tl.static_range(1, WORLD + 1):
        d = (rank + step) % WORLD
        flag = pad + signals.counter(pad, rs_offset, d, WORLD)
        code = 1 + d + WORLD * signals.CH_RS
        ready = ready & signals.wait_signal(flag, CONFIG.CHUNKS, pad, timeout, code, CONFIG.USE_GLOBALTIMER)
    if ready:
        # Slot order, one product and one add per slot in fp32, rounded once: weighted_sum's order and roundings.
        acc = _pull_slot(OUT, ROUTE, tile, 0, CONFIG)
        for s in range(1, topk):
            acc = acc + _pull_slot(OUT, ROUTE, tile, s, CONFIG)
        mask = mask_m[:, None] & mask_n[None, :]
        tl.store(out_ptr + tokens[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _exchange_counts(call: runtime.FusedCall, mine: torch.Tensor) -> torch.Tensor:
    """Launch the counts kernel: ``table [W, E]`` int64, every rank's per-expert send counts."""
    heap, w = call.heap, call.world_size
    num_e = mine.numel()
    table = torch.zeros((w, num_e), dtype=torch.int64, device=mine.device)
    _counts_kernel[(1,)](
        (mine.contiguous(), table, num_e),
        (heap.data_ptrs, heap.sig_ptrs, signals.channel_offset(signals.CH_AG, w)),
        call.rank,
        call.timeout_ticks,
        CONFIG=CountsConfig(
            w, signals.AG_MAX_SPLITS, min(triton.next_power_of_2(max(num_e, 1)), 1024), call.use_globaltimer
        ),
        num_warps=1,
    )
    return table


def _move_rows(call: runtime.FusedCall, x: torch.Tensor, plan: tuple, regions: tuple[int, int, int]) -> tuple:
    """Launch the push and the collect: ``(rows [R, k], pair ids [R] int64, -1 past valid)``.
    ``plan = (order, lay, topk)``; ``regions = (ROWS byte offset, PAIRS byte offset, R)``."""
    order, lay, topk = plan
    rows_at, pairs_at, out_rows = regions
    heap, w = call.heap, call.world_size
    k = x.shape[1]
    chunks = _CHUNKS[x.device.type]
    block_r, block_c, warps = _blocks(x.device)
    send_start = torch.cumsum(lay.send_counts, 0) - lay.send_counts
    rs = signals.channel_offset(signals.CH_RS, w)
    bases = (heap.data_ptrs, heap.sig_ptrs, rows_at // x.element_size(), pairs_at // 8, rs)
    # The push and the collect split the rows alike: one config for both launches.
    config = RowsConfig(w, chunks, block_r, block_c, call.use_globaltimer)
    _push_rows_kernel[(w * chunks,)](
        (x, x.stride(0), x.stride(1), k),
        (order, lay.pair_dest, send_start, lay.send_counts, topk),
        bases,
        call.rank,
        CONFIG=config,
        num_warps=warps,
    )
    rows = torch.zeros((out_rows, k), dtype=x.dtype, device=x.device)
    pairs = torch.full((out_rows,), -1, dtype=torch.int64, device=x.device)
    call.outputs = (rows,)
    _collect_kernel[(max(triton.cdiv(out_rows, block_r), 1),)](
        (rows, pairs, lay.valid, out_rows, k),
        bases,
        call.rank,
        call.timeout_ticks,
        CONFIG=config,
        num_warps=warps,
    )
    return rows, pairs


def dispatch(
    x: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, int],
    ep: Any,
    *,
    plan: Callable[[torch.Tensor], Any],
    check_table: Callable[[torch.Tensor], None],
    descriptor: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(rows [R, k], pair ids [R], layout)``: :func:`kernels.moe_dispatch`'s rows over the
    heap (module docstring), W > 1. ``x``: the rows as they move (an FP8 dispatch's packed ``uint8`` rows);
    ``routing = (order, counts, topk)``: this rank's pairs sorted by expert (stable)
    and its per-expert counts ``[E]`` (:func:`kernels.ops.moe.layout.expert_counts`); ``ep``: the
    :class:`~kernels.ops.moe.layout.EpCall`; ``plan(table)``: the layout from the count table (its
    ``pair_dest``, ``send_counts``, ``valid``, ``rows_bound``, ``rows`` are used here); ``check_table(table)``:
    the bounded overflow check (raises, or keeps the flag, reading nothing on the host where none is allowed);
    ``descriptor``: this rank's call, checked against every peer's before any data moves."""
    group = runtime.resolve_group(resolve_group_name(ep.group_name))
    order, mine, topk = routing
    x = x.contiguous()
    w, k, item = ep.world, x.shape[1], x.element_size()
    counts_bytes = _align(w * ep.num_experts * 8)
    if ep.bounded:
        cap = ep.max_tokens
        pairs_at = _align(counts_bytes + cap * k * item)
        with runtime.fused_call(DISPATCH, group, x.device, pairs_at + cap * 8, descriptor) as call:
            table = _exchange_counts(call, mine)
            # Before any row moves: a raise here leaves the call done on every rank alike (the same table).
            check_table(table)
            lay = plan(table)
            rows, pairs = _move_rows(call, x, (order, lay, topk), (counts_bytes, pairs_at, cap))
        return rows, pairs, lay
    with runtime.fused_call(DISPATCH, group, x.device, counts_bytes, descriptor) as call:
        table = _exchange_counts(call, mine)
        lay = plan(table)  # exact mode: reads the received total on the host (the output's rows)
        bound = int(lay.rows_bound)
        pairs_at = _align(counts_bytes + bound * k * item)
        # Every rank's heap has the same size and every rank holds the same table, so every rank takes the same
        # branch: rows in this call when they fit (the steady state), else in a second call that grows the heap.
        if call.heap.data_bytes >= pairs_at + bound * 8:
            rows, pairs = _move_rows(call, x, (order, lay, topk), (counts_bytes, pairs_at, lay.rows))
            return rows, pairs, lay
    # The same regions as above (COUNTS kept in front, unused here), so that the grown heap fits the next call.
    with runtime.fused_call(DISPATCH, group, x.device, pairs_at + bound * 8, descriptor) as call:
        rows, pairs = _move_rows(call, x, (order, lay, topk), (counts_bytes, pairs_at, lay.rows))
    return rows, pairs, lay


def combine(
    y: torch.Tensor,
    topk_weights: torch.Tensor,
    pair_dest: torch.Tensor,
    bound: int,
    *,
    group_name: str,
    descriptor: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [m, n], returned [S, n])``: each pair's row read from its expert's rank (zero for pairs a bounded
    overflow dropped) and each token's top-k weighted sum (module docstring). ``topk_weights [m, topk]`` (any
    floating dtype, read as fp32); ``pair_dest [S]``: ``row * W + rank`` of each pair (-1: dropped); ``bound``:
    the rows of ``Y`` (the same on every rank: max_tokens, or the most rows any rank received)."""
    group = runtime.resolve_group(resolve_group_name(group_name))
    w = runtime.world_size(group)
    y = y.contiguous()
    tw = topk_weights.contiguous()
    m, topk = tw.shape
    n = y.shape[1]
    chunks = _CHUNKS[y.device.type]
    block_r, block_c, warps = _blocks(y.device)
    returned = torch.empty((m * topk, n), dtype=y.dtype, device=y.device)
    out = torch.empty((m, n), dtype=y.dtype, device=y.device)
    region = max(_align(bound * n * y.element_size()), 16)
    with runtime.fused_call(COMBINE, group, y.device, region, descriptor) as call:
        call.outputs = (out, returned)
        heap = call.heap
        bases = (heap.data_ptrs, heap.sig_ptrs, signals.channel_offset(signals.CH_RS, w))
        # The publish and the pull split the rows alike: one config for both launches.
        config = RowsConfig(w, chunks, block_r, block_c, call.use_globaltimer)
        _publish_kernel[(chunks,)](
            (y, y.stride(0), y.stride(1), y.shape[0], n),
            bases,
            call.rank,
            CONFIG=config,
            num_warps=warps,
        )
        tiles = triton.cdiv(m, block_r) * max(triton.cdiv(n, block_c), 1)
        _pull_kernel[(max(tiles, 1),)](
            ((out, returned, m, n), (pair_dest.contiguous(), tw, tw.stride(0), topk)),
            bases,
            call.rank,
            call.timeout_ticks,
            CONFIG=config,
            num_warps=warps,
        )
    return out, returned
