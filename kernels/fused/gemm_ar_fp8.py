"""The old entry point of the FP8 fused GEMM + all-reduce (:mod:`all_reduce`); kept until the ops layer
calls :func:`all_reduce.run` (to delete)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..format import fp8
from . import all_reduce
from .legacy import call_of, operands


def scaled_matmul_all_reduce(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    deterministic: bool,
    algorithm: str = "auto",
    comm_dim: int = 0,
    outer: int = 1,
) -> torch.Tensor:
    """FP8 GEMM + all-reduce of 2-D ``x`` (``comm_dim`` / ``outer``: accepted, an all-reduce has no
    communicated dim)."""
    call = call_of("all_reduce", fp8(mode), group, out_dtype=out_dtype, flag=deterministic)
    return all_reduce.run(call, operands(x, [weight], [bias], x_scale=x_scale, w_scales=[w_scale]), algorithm)
