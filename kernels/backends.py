"""Run an op on an already chosen backend: the piece that the dispatcher, the tuner and the
registered operators share.

It sits below all three (``dispatch`` decides, ``tune`` measures, ``library`` registers), so none
of them imports another to reach the backends and there is no import cycle.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import chunked, sequential


def fused_module() -> Any:
    """``kernels.fused``, imported on first use (it needs Triton)."""
    try:
        from . import fused
    except ImportError as e:
        raise NotImplementedError(f"the fused backend is not available in this build ({e})") from e
    return fused


def fused_unavailable(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """None when the fused kernels can run on ``group`` and ``device``, else why not."""
    return fused_module().unavailable_reason(group, device)


def run(
    op: str,
    backend: str,
    parallel_num: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    world: int,
    flag: bool,
) -> Any:
    """Run ``op`` on 2-D ``x``; ``flag`` is ``return_gathered`` for the all-gather op and
    ``deterministic`` for the reducing ops."""
    if backend == "fused":
        return getattr(fused_module(), op)(x, weight, bias, group, flag)
    if backend == "chunked":
        return getattr(chunked, op)(x, weight, bias, group, world, flag, parallel_num)
    return getattr(sequential, op)(x, weight, bias, group, world, flag)
