"""Scripted overlap of the FP8 ops: rows split into ``parallel_num`` pieces as in :mod:`kernels.chunked`.

* all-gather, comm-first: each piece's FP8 rows travel packed with their fp32 scale rows (in tensor
  mode each rank's scalar on each of its rows; one uint8 all-gather per piece,
  :func:`kernels.fp8.sequential.pack_rows`), all launched up front; piece i is dequantized and
  multiplied (fp32) as soon as it lands, while later pieces are on the wire.
* reduce-scatter / all-reduce, compute-first: the operands are dequantized to fp32 once and the
  float pieces of :mod:`kernels.chunked` run on them, so the partials are summed in fp32 and the
  result is rounded once to ``out_dtype``, as in the reference.

Same results as :mod:`kernels.fp8.sequential` within the fp32 summation-order bound
(``kernels.fp8.numerics``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import chunked, comm
from .sequential import (
    bias_fp32,
    dequantize_w,
    dequantize_x,
    fp32_matmuls,
    gathered_mode,
    linear_fp32,
    pack_rows,
    scale_cols,
    unpack_rows,
)


def all_gather_scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    world: int,
    parallel_num: int,
    *,
    return_gathered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same result as ``sequential.all_gather_scaled_matmul``; gathers piece by piece, comm-first."""
    m_local, k = x.shape
    n = weight.shape[0]
    cols = scale_cols(mode, x_scale)
    packed = pack_rows(x, x_scale, mode)
    wd = dequantize_w(weight, w_scale, mode)
    b32 = bias_fp32(bias)
    pieces = chunked.split_rows(m_local, parallel_num)
    works, bufs = [], []
    for start, stop in pieces:
        buf = packed.new_empty((world * (stop - start), packed.shape[1]))
        works.append(comm.all_gather(buf, packed[start:stop], group, async_op=True))
        bufs.append(buf)
    # Rank r's rows of piece i land at rows [start, stop) of block r of the gathered x.
    y = torch.empty((world, m_local, n), dtype=out_dtype, device=x.device)
    xg = torch.empty((world, m_local, k), dtype=x.dtype, device=x.device) if return_gathered else None
    xsg = x_scale.new_empty((world, m_local, cols)) if return_gathered else None
    for (start, stop), buf, work in zip(pieces, bufs, works, strict=True):
        work.wait()
        piece, piece_scale = unpack_rows(buf, k, x.dtype)
        shape = (world, stop - start)
        xd = dequantize_x(piece, piece_scale, gathered_mode(mode))
        y[:, start:stop] = linear_fp32(xd, wd, b32).view(shape + (n,))
        if xg is not None and xsg is not None:
            xg[:, start:stop] = piece.view(shape + (k,))
            xsg[:, start:stop] = piece_scale.view(shape + (cols,))
    y = y.view(world * m_local, n)
    if xg is None or xsg is None:
        return y
    return y, xg.view(world * m_local, k), xsg.view(world * m_local, cols)


def scaled_matmul_reduce_scatter(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    world: int,
    parallel_num: int,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """Same result as ``sequential.scaled_matmul_reduce_scatter``; compute-first fp32 pieces."""
    xd, wd = dequantize_x(x, x_scale, mode), dequantize_w(weight, w_scale, mode)
    with fp32_matmuls():
        out = chunked.matmul_reduce_scatter(
            xd, wd, bias_fp32(bias), group, world, parallel_num, deterministic=deterministic
        )
    return out.to(out_dtype)


def scaled_matmul_all_reduce(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    world: int,
    parallel_num: int,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """Same result as ``sequential.scaled_matmul_all_reduce``; compute-first fp32 pieces."""
    xd, wd = dequantize_x(x, x_scale, mode), dequantize_w(weight, w_scale, mode)
    with fp32_matmuls():
        out = chunked.matmul_all_reduce(
            xd, wd, bias_fp32(bias), group, world, parallel_num, deterministic=deterministic
        )
    return out.to(out_dtype)
