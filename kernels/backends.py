"""Run an op on an already chosen backend: the piece that the dispatcher, the tuner and the
registered operators share.

It sits below all three (``dispatch`` decides, ``tune`` measures, ``library`` registers), so none
of them imports another to reach the backends and there is no import cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    *,
    comm_dim: int = 0,
    **options: Any,
) -> Any:
    """Run ``op`` on 2-D ``x`` with the backend's keyword ``options``: ``return_gathered`` and
    ``outer`` for ``all_gather_matmul``, ``deterministic`` and ``outer`` for
    ``matmul_reduce_scatter``, ``deterministic`` for ``matmul_all_reduce``.

    ``outer`` is the number of row blocks of ``x`` gathered / scattered on their own (the product
    of the dims before ``gather_dim`` / ``scatter_dim``; 1 for dim 0). ``comm_dim``, that dim, goes
    into the fused call's descriptor (the other paths compare it under ``COC_CHECK=1`` before)."""
    if backend == "fused":
        if op != "matmul_all_reduce":
            options["comm_dim"] = comm_dim
        return getattr(fused_module(), op)(x, weight, bias, group, **options)
    if backend == "chunked":
        return getattr(chunked, op)(x, weight, bias, group, world, parallel_num, **options)
    return getattr(sequential, op)(x, weight, bias, group, world, **options)


def run_all_gather_multi(
    backend: str,
    parallel_num: int,
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    group: dist.ProcessGroup | None,
    world: int,
    *,
    return_gathered: bool,
    outer: int,
    comm_dim: int = 0,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """``all_gather_matmul`` of 2-D ``x`` with several weights, one gather: ``(ys, x_gathered)``;
    ``x_gathered`` may be None unless ``return_gathered``."""
    if backend == "fused":
        return fused_module().all_gather_matmul_multi(
            x, weights, biases, group, return_gathered=return_gathered, outer=outer, comm_dim=comm_dim
        )
    if backend == "chunked":
        return chunked.all_gather_matmul_multi(
            x, weights, biases, group, world, parallel_num, return_gathered=return_gathered, outer=outer
        )
    return sequential.all_gather_matmul_multi(x, weights, biases, group, world, outer=outer)
