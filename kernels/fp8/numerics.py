"""Error bounds of the FP8 ops and of FP8 quantization, stated once and checked by the tests.

Op error (against the fp64 product of the *dequantized* inputs). Per output element, with
``S = sum_i |xd_i| * |wd_i|`` summed over k and over the W ranks, ``u = 2**-24`` (fp32) and
``u_out`` the unit roundoff of ``out_dtype`` (0 for fp32, whose fp32 result is not rounded again)::

    |y - y_ref| <= u_out * |y_ref| + (1 + u_out) * E * (S + |bias|)

    fp32 accumulation (sequential, chunked; any mode):
        E = gamma(k + W + 2, u)            k - 1 sums + 2 dequant roundings + W - 1 partial sums + bias
    promoted accumulation (fused, every mode; 128-deep FP8 products summed at u_acc, then added to an
    fp32 accumulator; block mode scales each 128-block partial, row / tensor scale once at the end):
        E = gamma(min(k, 128), u_acc) + gamma(ceil(k / 128) + W + 3, u)
    unpromoted accumulation (a kernel chaining the tensor-core sum over all of k; for comparison):
        E = gamma(k, u_acc) + gamma(W + 4, u)

with ``gamma(n, u) = n * u / (1 - n * u)`` (Higham's bound for n roundings, any summation order).
FP8 products are exact in fp32 (two 4-bit significands make an 8-bit product), so only sums and
scale multiplications round. ``u_acc`` is the accumulator precision of the tensor-core FP8 sums:
2**-24 in the Triton interpreter and wherever the sums are fp32; about 2**-13 on Hopper, whose
FP8 wgmma keeps about 14 bits (DeepSeek-V3, section 3.3.2): the reason the fused kernels' promotion
every 128 k matters there (the first term is bounded by 128 terms, not k).

Quantization error (against the unquantized input; ``kernels.quantize_fp8``). With ``p`` mantissa
bits (3 for e4m3fn, 2 for e5m2), unit roundoff ``u8 = 2**-(p+1)`` and smallest normal ``2**emin``::

    |t - dequant(quant(t))| <= (u8 + 3u) * |t| + (2**(emin - p - 1) + FP8_MAX * 2u) * scale

(relative rounding in the normal range; half a subnormal step below it; the division and the
dequantizing product round in fp32; the clamp of a value an ulp past FP8_MAX). For a GEMM of
quantized operands this gives, per output, at most ``(2 u8 + u8**2) * sum |x||w|`` plus the
subnormal terms: 12.9 % of ``sum |x||w|`` in the worst case for e4m3fn, typically far less
since the rounding errors of the k terms have random signs (the training check measures it).
"""

from __future__ import annotations

import torch

from .scales import BLOCK, FP8_MAX, ceil_div

U32 = 2.0**-24
_UNIT_ROUNDOFF = {
    torch.float32: 0.0,  # the fp32 result is not rounded again
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}
# (mantissa bits, smallest normal exponent)
FORMATS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
HOPPER_FP8_ACCUMULATOR = 2.0**-13
ACCUMULATIONS = ("fp32", "promoted", "unpromoted")


def gamma(n: int, u: float) -> float:
    nu = n * u
    if nu >= 1:
        raise ValueError(f"gamma({n}, {u}): n * u >= 1, no bound")
    return nu / (1 - nu)


def accumulation_of(backend: str, mode: str) -> str:
    """The accumulation model of a backend in ``mode`` (module docstring; the fused kernels promote in every mode)."""
    if backend in ("sequential", "chunked"):
        return "fp32"
    return "promoted"


def relative_bound(k: int, world: int, accumulation: str, u_acc: float = U32) -> float:
    """``E`` of the module docstring: the bound on ``|y32 - y_ref| / (S + |bias|)`` before rounding to ``out_dtype``."""
    if accumulation == "fp32":
        return gamma(k + world + 2, U32)
    if accumulation == "promoted":
        return gamma(min(k, BLOCK), u_acc) + gamma(ceil_div(k, BLOCK) + world + 3, U32)
    if accumulation == "unpromoted":
        return gamma(k, u_acc) + gamma(world + 4, U32)
    raise ValueError(f"accumulation={accumulation!r} is not accepted; use one of {ACCUMULATIONS}")


def op_error_bound(
    y_ref: torch.Tensor,
    abs_sum: torch.Tensor,
    k: int,
    world: int,
    *,
    out_dtype: torch.dtype,
    accumulation: str,
    u_acc: float = U32,
) -> torch.Tensor:
    """Per-element bound on ``|y - y_ref|`` (module docstring); ``abs_sum`` is ``S + |bias|`` (fp64)."""
    u_out = _UNIT_ROUNDOFF[out_dtype]
    e = relative_bound(k, world, accumulation, u_acc)
    bound = u_out * y_ref.abs() + (1 + u_out) * e * abs_sum
    if out_dtype != torch.float32:
        # Results below the smallest normal of out_dtype round with an absolute half-step.
        bound = bound + torch.finfo(out_dtype).smallest_normal * u_out
    return bound


def quantization_error_bound(t: torch.Tensor, scale_expanded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on ``|t - dequant(quant(t))|`` (module docstring); ``scale_expanded`` broadcasts to ``t``."""
    p, emin = FORMATS[dtype]
    u8 = 2.0 ** -(p + 1)
    t64 = t.double().abs()
    s64 = scale_expanded.double()
    return (u8 + 3 * U32) * t64 + (2.0 ** (emin - p - 1) + FP8_MAX[dtype] * 2 * U32) * s64


def worst_case_gemm_quantization(dtype: torch.dtype) -> float:
    """``2 u8 + u8**2``: relative worst case of a product of two quantized operands (normal range)."""
    p, _ = FORMATS[dtype]
    u8 = 2.0 ** -(p + 1)
    return 2 * u8 + u8 * u8


def table_row(k: int, world: int, accumulation: str, u_acc: float = U32) -> str:
    """One docs line: ``E`` in units of fp32's unit roundoff."""
    return f"k={k} W={world} {accumulation}: E = {relative_bound(k, world, accumulation, u_acc) / U32:.1f} u"


__all__ = [
    "ACCUMULATIONS",
    "FORMATS",
    "HOPPER_FP8_ACCUMULATOR",
    "U32",
    "accumulation_of",
    "gamma",
    "op_error_bound",
    "quantization_error_bound",
    "relative_bound",
    "worst_case_gemm_quantization",
]
