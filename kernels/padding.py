"""``matmul_soc_friendly``: feed GEMMs operands whose k and n are tensor-core friendly.

cuBLAS picks its fastest tensor-core kernels when the leading dimensions of A, B and C are
multiples of 128 bytes (16-byte vector loads, whole MMA K-steps, no masked tail tiles): 64
elements of fp16 / bf16, 32 of fp32, always a multiple of the 16-element MMA fragment. An odd k
(e.g. a hidden size split over a TP size that leaves k = 1000) or n drops to slower kernels.
Padding with zeros restores the alignment and leaves the result unchanged: the extra k terms are
``0 * 0`` and the extra n columns are sliced off.

k is padded only within ``[k_min, k_max]`` (``configs/coc.yaml``): below, the GEMM is too small
for the copy to pay off; above, it is bandwidth-bound enough that the copy costs more than the
misalignment. The padding is a no-op on CPU (``force=True`` runs it anywhere, for tests and for
the benchmark's before/after comparison).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import get_config

ALIGN_BYTES = 128
MIN_ALIGN_ELEMENTS = 16


def alignment(dtype: torch.dtype) -> int:
    """Elements per 128 bytes (at least the 16-element MMA fragment)."""
    # itemsize, not an empty tensor's element_size(): this runs on every padded GEMM's call.
    return max(MIN_ALIGN_ELEMENTS, ALIGN_BYTES // dtype.itemsize)


def _round_up(v: int, a: int) -> int:
    return -(-v // a) * a


def padded_shape(k: int, n: int, dtype: torch.dtype, k_min: int, k_max: int) -> tuple[int, int]:
    """``(k_pad, n_pad)``: k rounded up only when ``k_min <= k <= k_max``, n always."""
    a = alignment(dtype)
    k_pad = _round_up(k, a) if k_min <= k <= k_max else k
    return k_pad, _round_up(n, a)


def _enabled(x: torch.Tensor, force: bool) -> bool:
    return force or (x.is_cuda and get_config().matmul_soc_friendly)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    force: bool = False,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., k]``, ``weight [n, k]``, with padded operands.

    Reference::

        y = x @ weight.T + bias           # [..., n], contiguous; written into ``out`` if given

    Active on CUDA when ``matmul_soc_friendly`` is set in the config (or with ``force=True``);
    otherwise exactly ``F.linear`` (or ``torch.mm(x, weight.t(), out=out)``). Drop-in for the
    ``F.linear`` / ``torch.mm(out=)`` calls of the sequential and chunked paths.
    """
    if _enabled(x, force):
        k, n = x.shape[-1], weight.shape[0]
        config = get_config()
        k_pad, n_pad = padded_shape(k, n, x.dtype, config.k_min, config.k_max)
        if (k_pad, n_pad) != (k, n):
            return _padded(x, weight, bias, out, (k_pad, n_pad))
    if out is None:
        return F.linear(x, weight, bias)
    torch.mm(x, weight.t(), out=out)
    return out if bias is None else out.add_(bias)


def _padded(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    padded: tuple[int, int],
) -> torch.Tensor:
    """:func:`linear` through zero-padded operands of ``padded = (k_pad, n_pad)``."""
    k, n = x.shape[-1], weight.shape[0]
    k_pad, n_pad = padded
    lead = x.shape[:-1]
    # Rows by count, not -1: an empty k shard (k = 0) leaves -1 ambiguous.
    x2d = x.reshape(math.prod(lead), k)
    if k_pad != k:
        x_p = x2d.new_zeros((x2d.shape[0], k_pad))
        x_p[:, :k] = x2d
    else:
        x_p = x2d
    w_p = weight.new_zeros((n_pad, k_pad))
    w_p[:n, :k] = weight
    y_p = torch.mm(x_p, w_p.t())
    if out is None:
        out = y_p[:, :n].contiguous().view(tuple(lead) + (n,))
    else:
        out.copy_(y_p[:, :n].reshape(out.shape))
    return out if bias is None else out.add_(bias)
