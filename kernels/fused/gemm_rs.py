"""The old entry point of the plain fused GEMM + reduce-scatter (:mod:`scatter`); kept until the ops
layer calls :func:`scatter.run` (to delete)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..format import PLAIN
from . import scatter
from .legacy import call_of, described, operands


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    deterministic: bool = False,
    *,
    outer: int = 1,
    comm_dim: int = 0,
) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T) + bias`` for 2-D ``x`` whose ``outer`` row blocks are scattered on
    their own (``comm_dim``: the caller's scatter_dim)."""
    call = call_of("reduce_scatter", PLAIN, group, flag=deterministic, comm_dim=comm_dim)
    return scatter.run(call, operands(described(x, comm_dim, outer), [weight], [bias]))
