"""Scripted overlap: rows split into ``parallel_num`` pieces, collectives overlapped with matmuls.

Works on any torch.distributed backend, so it is also the path across nodes.

* all-reduce / reduce-scatter are compute-first: multiply piece i, launch its asynchronous
  collective, go on to piece i + 1 while it is in flight.
* all-gather is comm-first: every piece's gather is launched up front (in piece order, so the
  first piece is ready first); piece i is multiplied as soon as its gather lands while the later
  ones are still on the wire.

Pieces follow :func:`split_rows`: any row count works, pieces may be uneven, and results land in
natural row order (the caller never sees the chunking). Collectives are issued from the caller's
current stream with ``async_op=True``: ProcessGroupNCCL (and gloo's CUDA path) then runs each on
its own internal stream, ordered after the piece's compute already queued, keeps the tensors it
touches alive until the work is done, and ``wait`` orders the current stream after it. A side
stream of our own added nothing to that: its priority never reached NCCL's internal stream (set
``ProcessGroupNCCL.Options.is_high_priority_stream`` when creating the group for that),
``record_stream`` repeated what ProcessGroupNCCL already does, and a forked stream is one more
thing a CUDA-graph capture must see joined. On CPU, gloo runs async work on its own threads,
which gives real overlap with the matmul in the calling thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import comm, padding


def split_rows(rows: int, parallel_num: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of up to ``parallel_num`` non-empty pieces covering ``rows``.

    Sizes differ by at most one row (the first pieces take the remainder), so an uneven row
    count costs one slightly larger piece, not a padded tail.
    """
    pieces = min(parallel_num, rows) if rows > 0 else 1
    base, extra = divmod(rows, pieces)
    bounds, start = [], 0
    for i in range(pieces):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def all_gather_matmul_multi(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    group: dist.ProcessGroup | None,
    world: int,
    parallel_num: int,
    *,
    return_gathered: bool = False,
    outer: int = 1,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Same result as ``sequential.all_gather_matmul_multi``; gathers piece by piece, comm-first,
    and multiplies each gathered piece by every weight (one gather for all of them).

    Pieces split the rows of the gathered dim: ``x [outer * L, k]`` is ``outer`` blocks of ``L``
    rows, and piece ``i`` is rows ``[start, stop)`` of every block of every rank. The gathered x is
    returned only with ``return_gathered`` (else None).
    """
    m_local, k = x.shape
    rows = m_local // outer if outer else 0
    pieces = split_rows(rows, parallel_num)
    blocks = x.reshape(outer, rows, k)
    bufs, works = [], []
    for start, stop in pieces:
        buf = x.new_empty((world * outer * (stop - start), k))
        # A copy only when the piece is strided (several pieces of several blocks).
        src = blocks[:, start:stop].contiguous().view(outer * (stop - start), k)
        works.append(comm.all_gather(buf, src, group, async_op=True))
        bufs.append(buf)
    if len(pieces) == 1 and outer == 1:
        works[0].wait()
        ys = [padding.linear(bufs[0], w, b) for w, b in zip(weights, biases, strict=True)]
        return ys, bufs[0] if return_gathered else None
    # Rank r's rows of piece i land at rows [start, stop) of block (o, r) of the gathered x.
    ys = [x.new_empty((outer, world, rows, w.shape[0])) for w in weights]
    x_gathered = x.new_empty((outer, world, rows, k)) if return_gathered else None
    for (start, stop), buf, work in zip(pieces, bufs, works, strict=True):
        work.wait()
        shape = (world, outer, stop - start)
        for y, w, b in zip(ys, weights, biases, strict=True):
            y[:, :, start:stop] = padding.linear(buf, w, b).view(shape + (w.shape[0],)).transpose(0, 1)
        if x_gathered is not None:
            x_gathered[:, :, start:stop] = buf.view(shape + (k,)).transpose(0, 1)
    ys = [y.view(world * m_local, y.shape[-1]) for y in ys]
    return ys, x_gathered.view(world * m_local, k) if x_gathered is not None else None


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    world: int,
    parallel_num: int,
    *,
    return_gathered: bool = False,
    outer: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same result as ``sequential.all_gather_matmul``; gathers piece by piece, comm-first."""
    ys, x_gathered = all_gather_matmul_multi(
        x, [weight], [bias], group, world, parallel_num, return_gathered=return_gathered, outer=outer
    )
    return (ys[0], x_gathered) if return_gathered else ys[0]


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    world: int,
    parallel_num: int,
    *,
    deterministic: bool = False,
    outer: int = 1,
) -> torch.Tensor:
    """Same result as ``sequential.matmul_reduce_scatter``; compute-first pieces.

    ``x [outer * W * R, k]`` is ``outer`` blocks, each of W owner blocks of ``R`` rows. Piece i
    covers rows [start, stop) of every owner block of every outer block, so each piece is itself a
    reduce-scatter whose result lands in rows [start, stop) of every outer block of ``out``.
    """
    m, k = x.shape
    n = weight.shape[0]
    rows = m // (world * outer) if outer else 0
    x_blocks = x.reshape(outer, world, rows, k)
    out = x.new_empty((outer, rows, n))
    pending = []
    for start, stop in split_rows(rows, parallel_num):
        p = stop - start
        # [W, outer, p, n]: owner-major, the order a dim-0 reduce-scatter hands out.
        partial = padding.linear(x_blocks[:, :, start:stop].transpose(0, 1), weight).reshape(world * outer * p, n)
        if deterministic:
            parts = partial.new_empty((world, outer * p, n))
            work = comm.all_to_all(parts, partial, group, async_op=True)
            pending.append((work, start, stop, parts))
        else:
            # Rows of one piece are contiguous in out only with one outer block.
            dst = out[0, start:stop] if outer == 1 else partial.new_empty((outer * p, n))
            work = comm.reduce_scatter(dst, partial, group, async_op=True)
            pending.append((work, start, stop, None if outer == 1 else dst))
    for work, start, stop, parts in pending:
        work.wait()
        if parts is None:
            continue
        reduced = comm.sum_in_rank_order(parts) if deterministic else parts
        out[:, start:stop] = reduced.view(outer, stop - start, n)
    out = out.view(outer * rows, n)
    return out if bias is None else out.add_(bias)


def matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    world: int,
    parallel_num: int,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """Same result as ``sequential.matmul_all_reduce``; compute-first pieces of rows."""
    m = x.shape[0]
    n = weight.shape[0]
    out = x.new_empty((m, n))
    if deterministic:
        return _fixed_order_all_reduce_pieces(x, weight, bias, group, world, parallel_num, out)
    works = []
    for start, stop in split_rows(m, parallel_num):
        piece = out[start:stop]
        padding.linear(x[start:stop], weight, out=piece)
        works.append(comm.all_reduce(piece, group, async_op=True))
    for work in works:
        work.wait()
    return out if bias is None else out.add_(bias)


def _fixed_order_all_reduce_pieces(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    world: int,
    parallel_num: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Deterministic all-reduce per piece: exchange, sum in rank order, gather.

    Each piece's rows are zero-padded to a multiple of W (zeros keep the sums exact), exchanged
    all-to-all while the next piece is multiplied, summed in rank order, and the reduced blocks
    are all-gathered while the next piece is summed.
    """
    n = weight.shape[0]
    exchanges = []
    for start, stop in split_rows(x.shape[0], parallel_num):
        block = -(-(stop - start) // world)
        padded = comm.pad_rows(padding.linear(x[start:stop], weight), block * world)
        parts = padded.new_empty((world, block, n))
        work = comm.all_to_all(parts, padded, group, async_op=True)
        exchanges.append((work, start, stop, parts))
    gathers = []
    for work, start, stop, parts in exchanges:
        work.wait()
        reduced = comm.sum_in_rank_order(parts)
        gathered = reduced.new_empty((world * reduced.shape[0], n))
        work = comm.all_gather(gathered, reduced, group, async_op=True)
        gathers.append((work, start, stop, gathered))
    for work, start, stop, gathered in gathers:
        work.wait()
        out[start:stop] = gathered[: stop - start]
    return out if bias is None else out.add_(bias)
