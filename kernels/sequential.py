"""Reference twins: the matmul, then the torch.distributed collective, nothing overlapped.

Every other backend is tested against these, and every benchmark divides by them. Inputs are
2-D and already validated (see ``kernels/__init__.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import comm, padding


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None, world: int, outer: int = 1) -> torch.Tensor:
    """Reference::

        blocks = x.view(outer, L, k)                          # L = m_local / outer
        x_gathered = cat([blocks of rank 0, ..., blocks of rank W-1], dim=1).view(outer * W * L, k)

    ``outer`` is the product of ``x``'s dims before ``gather_dim`` (1 for ``gather_dim=0``): each
    of the ``outer`` row blocks is gathered on its own, which is ``torch.cat`` along ``gather_dim``
    of the un-flattened tensors.
    """
    if world == 1:
        return x
    m_local, k = x.shape
    buf = x.new_empty((world * m_local, k))
    comm.all_gather(buf, x.contiguous(), group)
    if outer == 1:
        return buf
    return buf.view(world, outer, m_local // outer, k).transpose(0, 1).reshape(world * m_local, k)


def all_gather_matmul_multi(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    group: dist.ProcessGroup | None,
    world: int,
    *,
    outer: int = 1,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Reference::

    x_gathered = gather_rows(x, outer)           # [W * m_local, k], one gather
    ys = [x_gathered @ w.T + b for w, b in zip(weights, biases)]
    return ys, x_gathered
    """
    x_gathered = gather_rows(x, group, world, outer)
    return [padding.linear(x_gathered, w, b) for w, b in zip(weights, biases, strict=True)], x_gathered


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    world: int,
    *,
    return_gathered: bool = False,
    outer: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference::

    x_gathered = gather_rows(x, outer)           # [W * m_local, k]; all_gather_dim0(x) for outer == 1
    y = x_gathered @ weight.T + bias             # [W * m_local, n]
    """
    ys, x_gathered = all_gather_matmul_multi(x, [weight], [bias], group, world, outer=outer)
    return (ys[0], x_gathered) if return_gathered else ys[0]


def owner_major(partial: torch.Tensor, world: int, outer: int) -> torch.Tensor:
    """``partial [outer * W * R, n]`` reordered to ``[W * outer * R, n]`` (owner blocks first), the
    order a dim-0 reduce-scatter hands out: owner ``r`` gets row block ``r`` of every outer block."""
    if outer == 1:
        return partial
    m, n = partial.shape
    return partial.view(outer, world, m // (outer * world), n).transpose(0, 1).reshape(m, n)


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    world: int,
    *,
    deterministic: bool = False,
    outer: int = 1,
) -> torch.Tensor:
    """Reference::

    partial = x @ weight.T                       # [m, n] on every rank
    y = reduce_scatter_dim0(partial) + bias      # [m / W, n]; rank order sum if deterministic

    With ``outer > 1`` (``scatter_dim`` after ``outer`` rows of leading dims) each of the ``outer``
    row blocks of ``partial`` is scattered on its own: rank ``r`` gets block ``r`` of each.
    """
    partial = padding.linear(x, weight)
    if world > 1:
        partial = owner_major(partial, world, outer)
        rows = partial.shape[0] // world
        if deterministic:
            parts = partial.new_empty((world, rows, partial.shape[1]))
            comm.all_to_all(parts, partial, group)
            partial = comm.sum_in_rank_order(parts)
        else:
            out = partial.new_empty((rows, partial.shape[1]))
            comm.reduce_scatter(out, partial, group)
            partial = out
    return partial if bias is None else partial.add_(bias)


def fixed_order_all_reduce(partial: torch.Tensor, group: dist.ProcessGroup | None, world: int) -> torch.Tensor:
    """All-reduce summing in rank order, so all ranks hold the same bits (any row count).

    Rows are padded with zeros to a multiple of W, exchanged all-to-all, each rank sums its block
    in rank order, and the reduced blocks are all-gathered.
    """
    m, n = partial.shape
    block = -(-m // world)
    padded = comm.pad_rows(partial, block * world)
    parts = padded.new_empty((world, block, n))
    comm.all_to_all(parts, padded, group)
    reduced = comm.sum_in_rank_order(parts)
    gathered = padded.new_empty((world * block, n))
    comm.all_gather(gathered, reduced, group)
    return gathered[:m]


def matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    world: int,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """Reference::

    partial = x @ weight.T                       # [m, n] on every rank
    y = all_reduce(partial) + bias               # [m, n]; rank order sum if deterministic
    """
    partial = padding.linear(x, weight)
    if world > 1:
        if deterministic:
            partial = fixed_order_all_reduce(partial, group, world)
        else:
            comm.all_reduce(partial, group)
    return partial if bias is None else partial.add_(bias)
