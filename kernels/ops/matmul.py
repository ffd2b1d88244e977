"""The local scaled GEMM (no communication): the FP8 linears' non-communicating GEMMs.

Public function: :func:`scaled_matmul` (docs/api.md). Registered operator::

    coc::matmul(Tensor x, Tensor? x_scale, Tensor weight, Tensor? w_scale, Tensor? w_offset, Tensor? bias,
                str call) -> Tensor

Reference: ``(dequant(x) @ dequant(weight).T + bias).to(out_dtype)`` with the arithmetic of the format
(:mod:`kernels.format`); the fused backend runs the Triton GEMM core on CUDA tensors.
"""

from __future__ import annotations

import torch

from .. import checks, padding
from ..call import IMPLEMENTATIONS, OpCall, Operands
from ..config import get_config
from ..format import bias_of, compute, dequantize_weight, dequantize_x
from .entry import define_one_weight_op, fp8_operands, fp8_values, rows_of, same_rows


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
    """The Triton GEMM core on this device (kernels/fused/matmul.py)."""
    from ..fused import matmul

    return matmul.run(call, ops)[0]


IMPL = IMPLEMENTATIONS["matmul"] = {"sequential": reference, "fused": fused}


operator = define_one_weight_op("matmul", IMPL, same_rows)
