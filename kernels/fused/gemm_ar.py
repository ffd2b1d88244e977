"""The old entry point of the plain fused GEMM + all-reduce (:mod:`all_reduce`); kept until the ops layer
calls :func:`all_reduce.run` (to delete)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..format import PLAIN
from . import all_reduce
from .legacy import call_of, operands


def matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    deterministic: bool,
    algorithm: str = "auto",
) -> torch.Tensor:
    """``all_reduce(x @ weight.T) + bias`` for 2-D ``x`` (``algorithm``: auto, one_shot, two_shot)."""
    call = call_of("all_reduce", PLAIN, group, flag=deterministic)
    return all_reduce.run(call, operands(x, [weight], [bias]), algorithm)
