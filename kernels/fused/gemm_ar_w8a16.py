"""The old entry points of the w8A16 (int8 weight) local GEMM and fused GEMM + all-reduce (:mod:`matmul`,
:mod:`all_reduce` with the int8 format); kept until their callers move (to delete)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import all_reduce
from .legacy import call_of, int8_format, operands
from .matmul import gemm

# The one-shot threshold these wrappers choose the algorithm by (tests lower it to force two-shot).
ONE_SHOT_MAX_BYTES = all_reduce.ONE_SHOT_MAX_BYTES


def matmul_w8a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Local ``x @ dequant(qweight).T + bias`` (the W == 1 path)."""
    return gemm(
        int8_format(scale, group_size, offset), operands(x, [qweight], [bias], w_scales=[scale], w_offsets=[offset])
    )


def matmul_all_reduce_w8a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    deterministic: bool,
) -> torch.Tensor:
    """Fused w8A16 GEMM + all-reduce of 2-D ``x`` (one-shot up to :data:`ONE_SHOT_MAX_BYTES`)."""
    fmt = int8_format(scale, group_size, offset)
    call = call_of("all_reduce", fmt, group, flag=deterministic)
    size = x.shape[0] * qweight.shape[0] * x.element_size()
    algorithm = "one_shot" if size <= ONE_SHOT_MAX_BYTES else "two_shot"
    return all_reduce.run(call, operands(x, [qweight], [bias], w_scales=[scale], w_offsets=[offset]), algorithm)
