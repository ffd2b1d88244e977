"""The old entry points of the w8A16 (int8 weight) local GEMM and fused GEMM + all-reduce: :func:`matmul.gemm`
and :func:`all_reduce.run` with the int8 format. Kept only while tests/kernels/test_quant.py imports them
(their tests are tests/kernels/fused/test_formats.py's now); to delete."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..call import OpCall, Operands, group_name
from ..format import OperandFormat, int8
from . import all_reduce, runtime
from .matmul import gemm

# The one-shot threshold matmul_all_reduce_w8a16 chooses the algorithm by (tests lower it to force two-shot).
ONE_SHOT_MAX_BYTES = all_reduce.ONE_SHOT_MAX_BYTES


def _format(scale: torch.Tensor, group_size: int, offset: torch.Tensor | None) -> OperandFormat:
    """The int8 format of a validated ``scale`` (its dims name the layout)."""
    return int8(("per_tensor", "per_channel", "per_group")[scale.dim()], group_size, offset is not None)


def matmul_w8a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Local ``x @ dequant(qweight).T + bias`` (the W == 1 path)."""
    ops = Operands(x, (qweight,), (bias,), None, (scale,), (offset,))
    return gemm(_format(scale, group_size, offset), ops)


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
    call = OpCall(
        pattern="all_reduce",
        fmt=_format(scale, group_size, offset),
        deterministic=deterministic,
        group_name=group_name(group),
        world=runtime.world_size(runtime.resolve_group(group)),
        backend="fused",
    )
    size = x.shape[0] * qweight.shape[0] * x.element_size()
    algorithm = "one_shot" if size <= ONE_SHOT_MAX_BYTES else "two_shot"
    return all_reduce.run(call, Operands(x, (qweight,), (bias,), None, (scale,), (offset,)), algorithm)
