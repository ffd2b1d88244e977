"""Process groups and the communication of the tensor-parallel linears.

``group=None`` means a single process: no communication. The overlapped ops go through
:mod:`kernels` (registered torch operators); the plain collectives the Functions' backward overlaps
with GEMMs are torch's functional collectives, which run asynchronously in eager mode (the result
is waited for where it is first needed) and trace into a graph under ``torch.compile``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import kernels

Group = dist.ProcessGroup | None

# Renamed in newer torch releases (the old names warn); same arguments.
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter_single = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def megatron_module(name: str) -> Any:
    """A Megatron module if the program already imported it, else None.

    Megatron state (parallel_state groups, the CUDA RNG tracker) can only be set up by a program
    that imported Megatron, so looking in ``sys.modules`` answers the question without paying
    for (or requiring) the import.
    """
    return sys.modules.get(name)


def resolve_tp_group(tp_group: Group, is_expert: bool = False) -> Group:
    """The group a linear communicates over.

    An explicit ``tp_group`` wins; else Megatron's (expert) tensor-parallel group when
    ``megatron.core.parallel_state`` is initialized; else the default group; ``None`` when
    torch.distributed is not initialized (single process: no communication).
    """
    if tp_group is not None:
        if not isinstance(tp_group, dist.ProcessGroup):
            raise TypeError(f"tp_group must be a torch.distributed ProcessGroup or None, got {type(tp_group).__name__}")
        return tp_group
    if not (dist.is_available() and dist.is_initialized()):
        # A layer built before init_process_group under a multi-process launcher would hold the full
        # weight on every rank and never communicate: refused by name.
        kernels.checks.check_launched_alone()
        return None
    ps = megatron_module("megatron.core.parallel_state")
    if ps is not None and ps.is_initialized():
        if is_expert:
            return ps.get_expert_tensor_parallel_group()
        return ps.get_tensor_model_parallel_group()
    return dist.group.WORLD


def world_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank_of(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def start_gather_rows(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """``all_gather(x, dim)``, started: read it through :func:`wait` (eager mode runs other work
    meanwhile; a compiled graph holds the collective and its wait)."""
    if world_size(group) == 1:
        return x
    return _all_gather_single(x.contiguous(), dim, group)


def gather_rows(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """``all_gather(x, dim)``, finished."""
    if world_size(group) == 1:
        return x
    return wait(start_gather_rows(x, group, dim))


def start_all_reduce(t: torch.Tensor, group: Group) -> torch.Tensor:
    """``all_reduce(t)`` (sum), started: read it through :func:`wait`."""
    return funcol.all_reduce(t, "sum", group)


def start_reduce_scatter(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """``reduce_scatter(t, dim)`` (sum), started: read it through :func:`wait`."""
    return _reduce_scatter_single(t.contiguous(), "sum", dim, group)


def wait(t: torch.Tensor) -> torch.Tensor:
    """The finished result of a ``start_*`` collective, as a plain tensor (autograd must not be
    handed eager mode's lazily waited wrapper)."""
    return funcol.wait_tensor(t)


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its leading dims flattened: ``[..., h] -> [rows, h]``."""
    return t.reshape(-1, t.shape[-1])


def _gather_last_dim(t: torch.Tensor, group: Group) -> torch.Tensor:
    world = world_size(group)
    if world == 1:
        return t
    gathered = gather_rows(rows(t.contiguous()), group)
    full = torch.cat(gathered.chunk(world, dim=0), dim=-1)
    return full.view(*t.shape[:-1], t.shape[-1] * world)


def _split_last_dim(t: torch.Tensor, group: Group) -> torch.Tensor:
    world = world_size(group)
    if world == 1:
        return t
    if t.shape[-1] % world != 0:
        raise ValueError(
            f"the last dim of the input ({t.shape[-1]}, shape {tuple(t.shape)}) must be "
            f"divisible by the tensor-parallel size W={world} to scatter it"
        )
    return t.chunk(world, dim=-1)[rank_of(group)].contiguous()


class ScatterToTensorParallelRegion(torch.autograd.Function):
    """Scatter along the last dim (row linear with ``input_is_parallel=False``).

    - forward (local slice)::

        x_shard_k = x[..., rank * k/W : (rank + 1) * k/W]               # [s, b, k] -> [s, b, k/W]

    - backward::

        grad_x = all_gather_last_dim(grad_x_shard_k)                     # [s, b, k/W] -> [s, b, k]
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather_last_dim(grad, ctx.group), None


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """Gather along the last dim (column linear with ``gather_output``).

    - forward::

        y = all_gather_last_dim(y_shard_n)                               # [s, b, n/W] -> [s, b, n]

    - backward (local slice)::

        grad_y_shard_n = grad_y[..., rank * n/W : (rank + 1) * n/W]      # [s, b, n] -> [s, b, n/W]
    """

    @staticmethod
    def forward(ctx: Any, y_shard: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _gather_last_dim(y_shard, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _split_last_dim(grad, ctx.group), None
