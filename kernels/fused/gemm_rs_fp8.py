"""The old entry point of the FP8 fused GEMM + reduce-scatter (:mod:`scatter`); kept until the ops layer
calls :func:`scatter.run` (to delete)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..format import fp8
from . import scatter
from .legacy import call_of, described, operands


def scaled_matmul_reduce_scatter(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    deterministic: bool,
    comm_dim: int = 0,
    outer: int = 1,
) -> torch.Tensor:
    """FP8 GEMM + reduce-scatter of 2-D rows in scattered order (the caller moved ``comm_dim`` to dim 0;
    ``comm_dim`` / ``outer`` describe the call only)."""
    call = call_of("reduce_scatter", fp8(mode), group, out_dtype=out_dtype, flag=deterministic, comm_dim=comm_dim)
    ops = operands(x, [weight], [bias], x_scale=x_scale, w_scales=[w_scale])
    shapes = operands(described(x, comm_dim, outer), [weight], [bias], x_scale=x_scale, w_scales=[w_scale])
    return scatter.reduce_scatter(call, ops, 1, shapes)
