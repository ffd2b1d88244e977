"""Reference twins: the matmul, then the torch.distributed collective, nothing overlapped.

Every other backend is tested against these, and every benchmark divides by them. Inputs are
2-D and already validated (see ``kernels/__init__.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm, soc


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    world: int,
    return_gathered: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference::

    x_gathered = all_gather_dim0(x)              # [W * m_local, k]
    y = x_gathered @ weight.T + bias             # [W * m_local, n]
    """
    if world == 1:
        x_gathered = x
    else:
        x_gathered = x.new_empty((world * x.shape[0], x.shape[1]))
        comm.all_gather(x_gathered, x.contiguous(), group)
    y = soc.linear(x_gathered, weight, bias)
    return (y, x_gathered) if return_gathered else y


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    world: int,
    deterministic: bool,
) -> torch.Tensor:
    """Reference::

    partial = x @ weight.T                       # [m, n] on every rank
    y = reduce_scatter_dim0(partial) + bias      # [m / W, n]; rank order sum if deterministic
    """
    partial = soc.linear(x, weight)
    if world > 1:
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
    deterministic: bool,
) -> torch.Tensor:
    """Reference::

    partial = x @ weight.T                       # [m, n] on every rank
    y = all_reduce(partial) + bias               # [m, n]; rank order sum if deterministic
    """
    partial = soc.linear(x, weight)
    if world > 1:
        if deterministic:
            partial = fixed_order_all_reduce(partial, group, world)
        else:
            comm.all_reduce(partial, group)
    return partial if bias is None else partial.add_(bias)
