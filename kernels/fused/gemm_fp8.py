"""The old entry point of the FP8 local GEMM (:func:`matmul.gemm` with the FP8 format); kept until its
callers move (to delete)."""

from __future__ import annotations

import torch

from ..format import fp8
from .blocks import BlockConfig
from .legacy import operands
from .matmul import gemm


def scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    cfg: BlockConfig | None = None,
) -> torch.Tensor:
    """``dequant(x) @ dequant(weight).T + bias`` rounded once to ``out_dtype`` for 2-D FP8 operands."""
    return gemm(
        fp8(mode), operands(x, [weight], [bias], x_scale=x_scale, w_scales=[w_scale]), out_dtype=out_dtype, cfg=cfg
    )
