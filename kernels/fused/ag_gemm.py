"""The old entry points of the plain fused all-gather + GEMM (:mod:`all_gather`); kept until the ops
layer calls :func:`all_gather.run` (to delete)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..format import PLAIN
from . import all_gather
from .legacy import call_of, described, operands


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
    """``all_gather(x) @ weight.T + bias`` (and the gathered x) for 2-D ``x`` whose ``outer`` row blocks
    are gathered on their own (``comm_dim``: the caller's gather_dim)."""
    ys, x_gathered = all_gather_matmul_multi(
        x, [weight], [bias], group, return_gathered=return_gathered, outer=outer, comm_dim=comm_dim
    )
    return (ys[0], x_gathered) if return_gathered else ys[0]


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
    """Several weights, one gather: ``(ys, x_gathered or None)``."""
    call = call_of("all_gather", PLAIN, group, flag=return_gathered, comm_dim=comm_dim)
    ys, x_gathered, _ = all_gather.run(call, operands(described(x, comm_dim, outer), weights, biases))
    return ys, x_gathered
