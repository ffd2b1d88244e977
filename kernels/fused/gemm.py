"""The old entry point of the plain local GEMM (:func:`matmul.linear`); kept until its callers move (to delete)."""

from __future__ import annotations

import torch

from .gemm_configs import GemmConfig
from .matmul import linear


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemmConfig | None = None,
    fallback: bool = True,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for plain 2-D operands: :func:`matmul.linear`."""
    return linear(x, weight, bias, config=config, fallback=fallback)
