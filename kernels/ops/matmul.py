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

from ..format import product
from ..protocol import OpSpec, submit
from .gemm import ONE_WEIGHT_ARGS, GemmCall, Operands, Options, builder, dequantized, fp8_operands, one_weight_operands


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

    Reference: ``(dequant(x) @ dequant(weight).T + bias).to(out_dtype)`` with fp32 inside. ``backend``: None
    runs the fused Triton FP8 GEMM on CUDA tensors when ``USE_COC_FUSED_KERNEL=1``, else the reference;
    ``"fused"`` the kernel (``ValueError`` where it cannot run), ``"sequential"`` the reference.
    """
    options = Options("scaled_matmul", "matmul", None, backend, out_dtype=out_dtype)
    build = builder(options, lambda: fp8_operands(x, x_scale, weight, w_scale, bias, out_dtype=out_dtype))
    return submit(SPEC, options.op, None, build)


def reference(call: GemmCall, ops: Operands) -> torch.Tensor:
    """Reference: ``dequant(x) @ dequant(weight).T + bias`` in the format's arithmetic."""
    return product(call.fmt, *dequantized(call, ops))


def fused(call: GemmCall, ops: Operands) -> torch.Tensor:
    """The Triton GEMM core on this device (kernels/fused/matmul.py)."""
    from ..fused import matmul

    return matmul.run(call, ops)[0]


def _finished(backend: Any) -> Any:
    def run(call: GemmCall, ops: Operands) -> torch.Tensor:
        out = backend(call, ops)
        out = out.to(call.out_dtype) if call.out_dtype is not None else out
        return out.view(tuple(ops.x.shape[:-1]) + (ops.weights[0].shape[0],))

    return run


def _fake(call: GemmCall, ops: Operands) -> torch.Tensor:
    x = ops.x
    return x.new_empty(tuple(x.shape[:-1]) + (ops.weights[0].shape[0],), dtype=call.out_dtype or x.dtype)


SPEC = OpSpec(
    name="matmul",
    call=GemmCall,
    schema=f"({ONE_WEIGHT_ARGS}, str call) -> Tensor",
    operands=one_weight_operands,
    flat=Operands.one_weight,
    impl={"sequential": _finished(reference), "fused": _finished(fused)},
    fake=_fake,
    local="cuda",
)
