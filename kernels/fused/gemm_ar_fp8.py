"""Fused FP8 scaled GEMM + all-reduce: ``y = all_reduce(dequant(x) @ dequant(weight).T) + bias``.

The exchange of :mod:`gemm_ar` (one-shot for small outputs, else reduce-scatter then push of the
reduced rows) around the scaled scatter GEMM of :mod:`gemm_rs_fp8`. Partial products, the fixed
rank-order sum, bias and the pushed reduced rows are fp32; every rank rounds the same fp32 bits
once to ``out_dtype``, so all ranks hold bitwise identical outputs and repeated calls are
bitwise identical (``deterministic=True`` costs nothing extra).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .gemm_ar import ALGORITHMS, ONE_SHOT_MAX_BYTES, all_reduce_partials, tile_rows
from .gemm_fp8 import fp8_block_config, scaled_matmul
from .gemm_rs import group_and_size
from .gemm_rs_fp8 import describe, scatter_scaled_partials

OP = "scaled_matmul_all_reduce"


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
    """Fused FP8 scaled GEMM + all-reduce over the group's symmetric heap.

    Shapes: x FP8 ``[m, k_local]`` (any ``m``, same on every rank), weight FP8 ``[n, k_local]``,
    scales for ``mode`` (validated by the caller), bias ``[n]`` -> y ``[m, n]`` ``out_dtype``, the
    same bits on every rank.

    Reference semantics::

        partial_src = dequant(x_src) @ dequant(weight_src).T     # fp32 on every rank src, not rounded
        y = sum(partial_src for src in 0..W-1)                  # fp32, in rank order
        y = (y + bias).to(out_dtype)                             # bias once, one rounding

    ``comm_dim`` / ``outer`` are accepted for a uniform signature and ignored (an all-reduce has no
    communicated dim). ``algorithm``: ``"auto"`` (one-shot when the fp32 output is at most ``ONE_SHOT_MAX_BYTES``),
    ``"one_shot"`` or ``"two_shot"``.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: {algorithm!r} is not one of {ALGORITHMS}")
    group, w = group_and_size(group)
    if w == 1:
        return scaled_matmul(x, x_scale, weight, w_scale, bias, mode, out_dtype)
    m, k = x.shape
    n = weight.shape[0]
    if algorithm == "auto":
        # m and n are in the checked descriptor: every rank picks the same algorithm.
        algorithm = "one_shot" if m * n * 4 <= ONE_SHOT_MAX_BYTES else "two_shot"
    cfg = fp8_block_config(x.device, tile_rows(algorithm, m, w), k)
    descriptor = describe(OP, x, weight, bias, mode, out_dtype, deterministic)
    # all_reduce_partials takes its row count, slot dtype (fp32 here) and device from its ``x``
    # argument: an empty fp32 [m, 0] stands in for the FP8 input, which only the scatter reads.
    slots_like = torch.empty((m, 0), dtype=torch.float32, device=x.device)
    out = all_reduce_partials(
        OP,
        group,
        slots_like,
        n,
        bias,
        algorithm,
        cfg,
        descriptor,
        lambda call, rows_own, broadcast: scatter_scaled_partials(
            call, x, x_scale, weight, w_scale, mode, rows_own, broadcast, cfg
        ),
    )
    # The single rounding; every rank rounds the same fp32 bits.
    return out if out_dtype == torch.float32 else out.to(out_dtype)
