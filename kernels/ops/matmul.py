"""The local scaled GEMM (no communication): the FP8 linears' non-communicating GEMMs.

Public function: :func:`scaled_matmul` (docs/api.md). Registered operator::

    coc::matmul(Tensor x, Tensor? x_scale, Tensor weight, Tensor? w_scale, Tensor? w_offset, Tensor? bias,
                str call) -> Tensor

Reference: ``(dequant(x) @ dequant(weight).T + bias).to(out_dtype)`` with the arithmetic of the format
(:mod:`kernels.format`); the fused backend runs the Triton GEMM core on CUDA tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import checks, padding
from ..call import IMPLEMENTATIONS, OpCall, Operands, decode
from ..config import get_config
from ..format import bias_of, compute, dequantize_weight, dequantize_x
from ..op_registration import define_op
from .entry import fp8_operands, fp8_values, rows_of


def scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
) -> torch.Tensor:
    """The local FP8 GEMM (no communication; the FP8 linears' non-communicating GEMMs).

    Reference: ``(dequant(x) @ dequant(weight).T + bias).to(out_dtype)`` with fp32 inside. Runs the
    fused Triton FP8 GEMM when the backend resolves to ``"fused"`` on a CUDA tensor, else the reference.
    """
    fmt, ops = fp8_operands(x, x_scale, weight, w_scale, bias, out_dtype=out_dtype)
    checks.check_backend(backend)
    fp8_values(ops)
    use_fused = backend == "fused" or (backend is None and get_config().use_fused)
    name = "fused" if use_fused and x.is_cuda else "sequential"
    call = OpCall(pattern="matmul", fmt=fmt, out_dtype=out_dtype, backend=name)
    return operator(ops.x, ops.x_scale, weight, ops.scale_of(0), None, bias, call.encode())


def reference(call: OpCall, ops: Operands, group: object = None) -> torch.Tensor:
    """Reference: ``dequant(x) @ dequant(weight).T + bias`` in the format's arithmetic."""
    x2d = rows_of(ops.x)
    xd = dequantize_x(call.fmt, x2d, ops.x_scale, per_row=False)
    wd = dequantize_weight(call.fmt, ops.weights[0], ops.scale_of(0), ops.offset_of(0), x2d.dtype)
    with compute(call.fmt):
        return padding.linear(xd, wd, bias_of(call.fmt, ops.biases[0]))


def fused(call: OpCall, ops: Operands, group: object = None) -> torch.Tensor:
    """The Triton GEMM core on this device."""
    from ..fused.gemm_fp8 import scaled_matmul as fused_fp8

    x2d = rows_of(ops.x)
    return fused_fp8(x2d, ops.x_scale, ops.weights[0], ops.scale_of(0), ops.biases[0], call.fmt.mode, call.out_dtype)


IMPL = IMPLEMENTATIONS["matmul"] = {"sequential": reference, "fused": fused}


def _impl(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    w_scale: torch.Tensor | None,
    w_offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    call_text: str,
) -> torch.Tensor:
    call = decode(call_text)
    ops = Operands(
        x=x,
        weights=(weight,),
        biases=(bias,),
        x_scale=x_scale,
        w_scales=() if w_scale is None else (w_scale,),
        w_offsets=() if w_offset is None else (w_offset,),
    )
    out = IMPL[call.backend](call, ops)
    out = out.to(call.out_dtype) if call.out_dtype is not None else out
    return out.view(tuple(x.shape[:-1]) + (weight.shape[0],))


def _fake(x: torch.Tensor, x_scale: Any, weight: torch.Tensor, *args: Any) -> torch.Tensor:
    call = decode(args[-1])
    return x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],), dtype=call.out_dtype or x.dtype)


operator = define_op(
    "matmul(Tensor x, Tensor? x_scale, Tensor weight, Tensor? w_scale, Tensor? w_offset, Tensor? bias, "
    "str call) -> Tensor",
    _impl,
    _fake,
)
