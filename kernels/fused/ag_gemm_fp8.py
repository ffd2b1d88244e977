"""The old entry point of the FP8 fused all-gather + GEMM (:mod:`all_gather`); kept until the ops layer
calls :func:`all_gather.run` (to delete)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..format import fp8
from . import all_gather
from .legacy import call_of, described, operands


def all_gather_scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    return_gathered: bool,
    comm_dim: int = 0,
    outer: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 all-gather + GEMM of 2-D rows already in gathered order (the caller moved ``comm_dim`` to dim
    0; ``comm_dim`` / ``outer`` describe the call only)."""
    call = call_of("all_gather", fp8(mode), group, out_dtype=out_dtype, flag=return_gathered, comm_dim=comm_dim)
    ops = operands(x, [weight], [bias], x_scale=x_scale, w_scales=[w_scale])
    shapes = operands(described(x, comm_dim, outer), [weight], [bias], x_scale=x_scale, w_scales=[w_scale])
    ys, x_gathered, scales = all_gather.all_gather(call, ops, 1, shapes)
    return (ys[0], x_gathered, scales) if return_gathered else ys[0]
