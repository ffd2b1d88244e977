"""The RMSNorm epilogue shared by ``all_reduce_rmsnorm`` and the GEMM + all-reduce ops' ``residual=`` form.

Both reduce into ``h`` (fp32, fp64 for fp64; the residual added before any rounding) and end here::

    residual_out = h.to(residual.dtype)
    rstd = rsqrt(mean(h * h, over n) + eps)
    quant None:  out = (h * rstd).to(x.dtype) * weight                      # HF's / vLLM's RMSNorm
    quant mode:  out, scale = quantize_fp8(h * rstd * weight, quant)        # fp32 product, one rounding

:func:`finish` runs the norm as torch ops (the scripted backends) or as the fused backend's Triton kernel
(``kernels.fused.all_reduce_norm.rmsnorm``); the FP8 quantization is :func:`kernels.fp8.quantize.quantize_fp8`
after the torch norm and after the kernel's ``"tensor"`` mode, and inside the kernel for ``"row"`` and ``"block"``
(the same arithmetic, so the same bits: tested against each other).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..fp8.quantize import quantize_fp8
from ..fp8.scales import FP8_DTYPES, ceil_div

QUANT_MODES = (None, "tensor", "row", "block")


class NormOutputs(NamedTuple):
    """``out`` (x's dtype, or the FP8 payload), ``residual`` (the updated residual stream) and ``scale`` (the
    FP8 scales of ``out``: ``[]``, ``[..., 1]`` or ``[..., ceil(n / 128)]``; None without ``quant``)."""

    out: torch.Tensor
    residual: torch.Tensor
    scale: torch.Tensor | None


class EpilogueArgs(NamedTuple):
    """The epilogue's arguments as the caller gave them (not yet checked: :func:`check_epilogue`)."""

    residual: object
    weight: object
    eps: object
    quant: object


def check_epilogue(
    given: EpilogueArgs, *, shape: tuple[int, ...], dtype: torch.dtype, names: tuple[str, str, str]
) -> None:
    """``residual`` of ``shape`` and ``dtype``, ``weight`` a floating ``[n]``, ``eps`` finite and >= 0, ``quant``
    one of :data:`QUANT_MODES`; ``names``: (the op, the residual's and the weight's argument names)."""
    residual, weight, eps, quant = given
    op, residual_name, weight_name = names
    for name, t in ((residual_name, residual), (weight_name, weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    assert isinstance(residual, torch.Tensor) and isinstance(weight, torch.Tensor)
    if tuple(residual.shape) != tuple(shape) or residual.dtype != dtype:
        raise ValueError(
            f"{op}: {residual_name} must be {list(shape)} {dtype} (the output's shape and dtype), got "
            f"{list(residual.shape)} {residual.dtype}"
        )
    n = shape[-1]
    if weight.shape != (n,) or not weight.is_floating_point():
        raise ValueError(
            f"{op}: {weight_name} must be a floating [n] = [{n}] (the output's last dim), got "
            f"{list(weight.shape)} {weight.dtype}"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    if quant not in QUANT_MODES:
        raise ValueError(f"{op}: quant={quant!r} is not one of {QUANT_MODES}")


def check_fp8_dtype(fp8_dtype: object, op: str) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"{op}: fp8_dtype={fp8_dtype!r} is not one of {FP8_DTYPES}")


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``h`` is reduced into for an x of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cast_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A same-dtype ``.to`` returns ``t`` but still costs a dispatcher round trip: the decode path's
    # calls are host-bound, and the fp32 tail makes up to five of them per call.
    return t if t.dtype == dtype else t.to(dtype)


class NormSpec(NamedTuple):
    """How :func:`finish` turns ``h`` into the outputs, fixed by the call and its operands: ``eps``, ``dtypes =
    (x's, the residual's)``, ``quant = (mode or None, FP8 dtype)``, ``fused`` (the Triton kernel, else torch) and
    the outputs' ``shape``."""

    eps: float
    dtypes: tuple[torch.dtype, torch.dtype]
    quant: tuple[str | None, torch.dtype]
    fused: bool
    shape: tuple[int, ...]


Finisher = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def torch_finisher(spec: NormSpec, weight_dtype: torch.dtype, h_dtype: torch.dtype, device: torch.device) -> Finisher:
    """:func:`finish` on the scripted backends (torch ops) with every choice that ``spec``, the weight's and ``h``'s
    dtypes and the device fix made once: ``run(h, weight)``. A resolved signature binds it once and calls it on
    every call (the decode path's calls are host-bound); :func:`finish` binds it per call."""
    mode, fp8_dtype = spec.quant
    x_dtype, residual_dtype = spec.dtypes
    eps = spec.eps
    cast_weight = weight_dtype != h_dtype
    # HF's / vLLM's order without quantization: the normalized rows are rounded to x's dtype before the weight
    # multiplies them, and the product once more; the FP8 path quantizes the fp32 product instead.
    round_to_x = mode is None and x_dtype != h_dtype
    cast_residual = residual_dtype != h_dtype
    shape = tuple(spec.shape)
    # h holds [m, n] rows: a 2-D output has h's shape, any other is a view of it.
    view = None if len(shape) == 2 else shape
    scale_view = None if view is None or mode is None else scale_shape(shape, mode)
    no_scale = _no_scale(device)

    def run(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        w = weight.to(h_dtype) if cast_weight else weight
        if round_to_x:
            y = (normed.to(x_dtype).to(h_dtype) * w).to(x_dtype)
        else:
            y = normed * w
        residual_out = h.to(residual_dtype) if cast_residual else h
        scale = no_scale
        if mode is not None:
            y, scale = quantize_fp8(y, mode, dtype=fp8_dtype)
            if scale_view is not None:
                scale = scale.view(scale_view)
        if view is not None:
            y, residual_out = y.view(view), residual_out.view(view)
        return y, residual_out, scale

    return run


def finish(h: torch.Tensor, weight: torch.Tensor, spec: NormSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, residual_out, scale)`` of the module docstring from ``h [m, n]``, shaped ``spec.shape``; ``scale`` is
    an empty fp32 tensor without quantization (a registered operator returns tensors only)."""
    if not spec.fused:
        return torch_finisher(spec, weight.dtype, h.dtype, h.device)(h, weight)
    from ..fused import all_reduce_norm

    mode, fp8_dtype = spec.quant
    shape = spec.shape
    y, residual_out, scale = all_reduce_norm.rmsnorm(
        h, weight.contiguous(), eps=spec.eps, dtypes=spec.dtypes, quant=spec.quant
    )
    if mode is not None and scale is None:
        y, scale = quantize_fp8(y, mode, dtype=fp8_dtype)
    if h.shape != shape:  # torch.Size compares with a tuple as one
        y, residual_out = y.view(shape), residual_out.view(shape)
        scale = scale.view(scale_shape(shape, mode)) if scale is not None else None
    if mode is None:
        return y, residual_out, _no_scale(h.device)
    assert scale is not None
    return y, residual_out, scale


# device -> the empty fp32 tensor an unquantized call returns as its scale. Shared by every call: it has no element
# anyone could write or read, and a new one per call would cost an allocation on every decode step.
_NO_SCALE: dict[torch.device, torch.Tensor] = {}


def _no_scale(device: torch.device) -> torch.Tensor:
    scale = _NO_SCALE.get(device)
    if scale is None:
        scale = _NO_SCALE[device] = torch.empty((0,), dtype=torch.float32, device=device)
    return scale


def scale_shape(shape: tuple[int, ...], quant: str | None) -> tuple[int, ...]:
    """The shape of ``finish``'s ``scale`` for an output of ``shape`` (the registered operators' fakes)."""
    if quant == "tensor":
        return ()
    if quant == "row":
        return shape[:-1] + (1,)
    if quant == "block":
        return shape[:-1] + (ceil_div(shape[-1], 128),)
    return (0,)
