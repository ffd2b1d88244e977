"""Scripted overlap: rows split into ``parallel_num`` pieces, collectives overlapped with matmuls.

Works on any torch.distributed backend, so it is also the path across nodes.

* all-reduce / reduce-scatter are compute-first: multiply piece i, launch its asynchronous
  collective, go on to piece i + 1 while it is in flight.
* all-gather is comm-first: every piece's gather is launched up front (in piece order, so the
  first piece is ready first); piece i is multiplied as soon as its gather lands while the later
  ones are still on the wire.

Pieces follow :func:`split_rows`: any row count works, pieces may be uneven, and results land in
natural row order (the caller never sees the chunking). On CUDA the collectives are issued on a
dedicated communication stream that waits for the compute event of its piece, and every buffer
the collective touches is ``record_stream``-ed onto it so the caching allocator cannot hand the
memory to another tensor before the collective is done. On CPU, gloo runs async work on its own
threads, which gives real overlap with the matmul in the calling thread.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from . import comm, soc

_COMM_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


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


class _StreamWork:
    """Local work queued on a CUDA stream; ``wait`` orders the caller's current stream after it,
    as the ``wait`` of NCCL work does."""

    def __init__(self, stream: "torch.cuda.Stream"):
        self.event = torch.cuda.Event()
        self.event.record(stream)
        self.device = stream.device

    def wait(self) -> bool:
        torch.cuda.current_stream(self.device).wait_event(self.event)
        return True


class _CommIssuer:
    """Launches async collectives on a side stream (CUDA) or directly (CPU / gloo)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            stream = _COMM_STREAMS.get(device)
            if stream is None:
                stream = torch.cuda.Stream(device=device, priority=-1)
                _COMM_STREAMS[device] = stream
            self.stream = stream

    def launch(self, collective: Callable[[], dist.Work], *buffers: torch.Tensor) -> dist.Work:
        if not self.cuda:
            return collective()
        # The collective reads what the compute stream produced: order it after that work.
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            work = collective()
            if isinstance(work, comm._Done):
                # A group of one copies on this stream instead of communicating, and _Done.wait()
                # does nothing: without the event the caller would read the copy's output early.
                work = _StreamWork(self.stream)
        for buf in buffers:
            buf.record_stream(self.stream)
        return work


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      group: Optional[dist.ProcessGroup], world: int, return_gathered: bool,
                      parallel_num: int) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Same result as ``sequential.all_gather_matmul``; gathers piece by piece, comm-first."""
    m_local, k = x.shape
    n = weight.shape[0]
    pieces = split_rows(m_local, parallel_num)
    issuer = _CommIssuer(x.device)
    x = x.contiguous()
    bufs, works = [], []
    for start, stop in pieces:
        buf = x.new_empty((world * (stop - start), k))
        src = x[start:stop]
        works.append(issuer.launch(lambda b=buf, s=src: comm.all_gather(b, s, group, async_op=True),
                                   buf, src))
        bufs.append(buf)
    if len(pieces) == 1:
        works[0].wait()
        y = soc.linear(bufs[0], weight, bias)
        return (y, bufs[0]) if return_gathered else y
    # Piece i holds rows [start, stop) of every rank: rank r's rows land at r * m_local + start.
    y = x.new_empty((world, m_local, n))
    x_gathered = x.new_empty((world, m_local, k)) if return_gathered else None
    for (start, stop), buf, work in zip(pieces, bufs, works):
        work.wait()
        y[:, start:stop] = soc.linear(buf, weight, bias).view(world, stop - start, n)
        if x_gathered is not None:
            x_gathered[:, start:stop] = buf.view(world, stop - start, k)
    y = y.view(world * m_local, n)
    return (y, x_gathered.view(world * m_local, k)) if x_gathered is not None else y


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          group: Optional[dist.ProcessGroup], world: int, deterministic: bool,
                          parallel_num: int) -> torch.Tensor:
    """Same result as ``sequential.matmul_reduce_scatter``; compute-first pieces.

    Piece i covers rows [start, stop) of every rank's output block, so each piece is itself a
    reduce-scatter whose result lands directly in ``out[start:stop]``.
    """
    m, k = x.shape
    n = weight.shape[0]
    rows = m // world
    x_blocks = x.reshape(world, rows, k)
    out = x.new_empty((rows, n))
    issuer = _CommIssuer(x.device)
    pending = []
    for start, stop in split_rows(rows, parallel_num):
        partial = soc.linear(x_blocks[:, start:stop], weight).view(world * (stop - start), n)
        if deterministic:
            parts = partial.new_empty((world, stop - start, n))
            work = issuer.launch(lambda o=parts, p=partial: comm.all_to_all(o, p, group, async_op=True),
                                 parts, partial)
            pending.append((work, start, stop, parts))
        else:
            dst = out[start:stop]
            work = issuer.launch(lambda o=dst, p=partial: comm.reduce_scatter(o, p, group, async_op=True),
                                 partial, dst)
            pending.append((work, start, stop, None))
    for work, start, stop, parts in pending:
        work.wait()
        if parts is not None:
            out[start:stop] = comm.sum_in_rank_order(parts)
    return out if bias is None else out.add_(bias)


def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      group: Optional[dist.ProcessGroup], world: int, deterministic: bool,
                      parallel_num: int) -> torch.Tensor:
    """Same result as ``sequential.matmul_all_reduce``; compute-first pieces of rows."""
    m = x.shape[0]
    n = weight.shape[0]
    out = x.new_empty((m, n))
    issuer = _CommIssuer(x.device)
    if deterministic:
        return _fixed_order_all_reduce_pieces(x, weight, bias, group, world, parallel_num, out, issuer)
    works = []
    for start, stop in split_rows(m, parallel_num):
        piece = out[start:stop]
        soc.linear(x[start:stop], weight, out=piece)
        works.append(issuer.launch(lambda p=piece: comm.all_reduce(p, group, async_op=True), piece))
    for work in works:
        work.wait()
    return out if bias is None else out.add_(bias)


def _fixed_order_all_reduce_pieces(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                   group: Optional[dist.ProcessGroup], world: int, parallel_num: int,
                                   out: torch.Tensor, issuer: _CommIssuer) -> torch.Tensor:
    """Deterministic all-reduce per piece: exchange, sum in rank order, gather.

    Each piece's rows are zero-padded to a multiple of W (zeros keep the sums exact), exchanged
    all-to-all while the next piece is multiplied, summed in rank order, and the reduced blocks
    are all-gathered while the next piece is summed.
    """
    n = weight.shape[0]
    exchanges = []
    for start, stop in split_rows(x.shape[0], parallel_num):
        block = -(-(stop - start) // world)
        padded = comm.pad_rows(soc.linear(x[start:stop], weight), block * world)
        parts = padded.new_empty((world, block, n))
        work = issuer.launch(lambda o=parts, p=padded: comm.all_to_all(o, p, group, async_op=True),
                             parts, padded)
        exchanges.append((work, start, stop, parts))
    gathers = []
    for work, start, stop, parts in exchanges:
        work.wait()
        reduced = comm.sum_in_rank_order(parts)
        gathered = reduced.new_empty((world * reduced.shape[0], n))
        work = issuer.launch(lambda o=gathered, r=reduced: comm.all_gather(o, r, group, async_op=True),
                             gathered, reduced)
        gathers.append((work, start, stop, gathered))
    for work, start, stop, gathered in gathers:
        work.wait()
        out[start:stop] = gathered[: stop - start]
    return out if bias is None else out.add_(bias)
