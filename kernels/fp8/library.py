"""The FP8 ops as registered torch operators (namespace ``coc``), with fake implementations::

    coc::all_gather_scaled_matmul(Tensor x, Tensor x_scale, Tensor weight, Tensor w_scale, Tensor? bias,
                                  str mode, ScalarType out_dtype, str group_name, int world, str backend,
                                  int parallel_num, int comm_dim, int outer) -> Tensor
    coc::all_gather_scaled_matmul_gathered(... same ...) -> (Tensor y, Tensor x_gathered, Tensor x_scale_gathered)
                                  (x_scale_gathered: [W * m_local, G] per row; G = 1 in tensor mode)
    coc::scaled_matmul_reduce_scatter(... same ..., bool deterministic) -> Tensor
    coc::scaled_matmul_all_reduce(... same ..., bool deterministic) -> Tensor
    coc::scaled_matmul(Tensor x, Tensor x_scale, Tensor weight, Tensor w_scale, Tensor? bias, str mode,
                       ScalarType out_dtype, str backend) -> Tensor               (local, no communication)

``x`` is 2-D (the public functions flatten and restore leading dims, and move a ``gather_dim`` /
``scatter_dim`` to dim 0: ``comm_dim`` and ``outer``, the product of the dims before it, say which
for the call check); ``mode`` is the validated
scaling mode; the group travels by name, the backend and split count are decided before the call
(constants of a compiled graph), exactly as for the bf16 operators in :mod:`kernels.library`.
Outputs never alias inputs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import backends
from ..library import resolve_group
from ..op_registration import define_op, unaliased
from . import chunked, sequential

_ARGS = "Tensor x, Tensor x_scale, Tensor weight, Tensor w_scale, Tensor? bias, str mode, ScalarType out_dtype"
# comm_dim / outer: the caller's gather_dim / scatter_dim and the product of x's dims before it, for
# the call check only (x arrives with that dim moved to dim 0).
_COMM = "str group_name, int world, str backend, int parallel_num, int comm_dim, int outer"

# The fused FP8 kernels, one module per op (kernels/fused/*_fp8.py).
FUSED_MODULES = {
    "all_gather_scaled_matmul": "ag_gemm_fp8",
    "scaled_matmul_reduce_scatter": "gemm_rs_fp8",
    "scaled_matmul_all_reduce": "gemm_ar_fp8",
}


def fused_function(op: str) -> Any:
    """The fused FP8 function of ``op``; ``ImportError`` when this build does not have it."""
    import importlib

    fused = backends.fused_module()
    module = importlib.import_module(f"{fused.__name__}.{FUSED_MODULES[op]}")
    return getattr(module, op)


def _run(
    op: str,
    backend: str,
    parallel_num: int,
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    world: int,
    flag: bool,
    comm_dim: int,
    outer: int,
) -> Any:
    if backend == "fused":
        fn = fused_function(op)
        return fn(x, x_scale, weight, w_scale, bias, mode, out_dtype, group, flag, comm_dim=comm_dim, outer=outer)
    name = "return_gathered" if op == "all_gather_scaled_matmul" else "deterministic"
    if backend == "chunked":
        return getattr(chunked, op)(
            x, x_scale, weight, w_scale, bias, mode, out_dtype, group, world, parallel_num, **{name: flag}
        )
    return getattr(sequential, op)(x, x_scale, weight, w_scale, bias, mode, out_dtype, group, world, **{name: flag})


def _comm_op(op: str, gathered: bool = False) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(implementation, fake)`` of the communicating operator of ``op`` (the all-gather one returning
    the gathered x and its scales too where ``gathered``): the four share one argument list, and
    ``deterministic`` is absent from the all-gather schemas."""

    def impl(
        x: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        w_scale: torch.Tensor,
        bias: torch.Tensor | None,
        mode: str,
        out_dtype: torch.dtype,
        group_name: str,
        world: int,
        backend: str,
        num: int,
        comm_dim: int,
        outer: int,
        deterministic: bool = False,
    ) -> Any:
        group = resolve_group(group_name)
        flag = gathered or deterministic
        out = _run(
            op, backend, num, x, x_scale, weight, w_scale, bias, mode, out_dtype, group, world, flag, comm_dim, outer
        )
        if not gathered:
            return out
        y, xg, xsg = out
        return y, unaliased(xg, x), unaliased(xsg, x_scale)

    def fake(
        x: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        w_scale: torch.Tensor,
        bias: torch.Tensor | None,
        mode: str,
        out_dtype: torch.dtype,
        group_name: str,
        world: int,
        *_: Any,
    ) -> Any:
        rows = {"all_gather_scaled_matmul": x.shape[0] * world, "scaled_matmul_reduce_scatter": x.shape[0] // world}
        y = x.new_empty((rows.get(op, x.shape[0]), weight.shape[0]), dtype=out_dtype)
        if not gathered:
            return y
        rows_gathered = x.shape[0] * world
        scale = x_scale.new_empty((rows_gathered, 1 if mode == "tensor" else x_scale.shape[1]))
        return y, x.new_empty((rows_gathered, x.shape[1])), scale

    return impl, fake


_warned: set[str] = set()


def _scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    if backend == "fused":
        try:
            from ..fused.gemm_fp8 import scaled_matmul
        except ImportError as e:
            if "scaled_matmul" not in _warned:
                _warned.add("scaled_matmul")
                warnings.warn(
                    f"scaled_matmul: the fused FP8 GEMM is not available ({e}); using the sequential path "
                    "instead (shown once)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        else:
            return scaled_matmul(x, x_scale, weight, w_scale, bias, mode, out_dtype)
    return sequential.scaled_matmul(x, x_scale, weight, w_scale, bias, mode, out_dtype)


def _scaled_matmul_fake(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    *_: Any,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


all_gather_scaled_matmul = define_op(
    f"all_gather_scaled_matmul({_ARGS}, {_COMM}) -> Tensor", *_comm_op("all_gather_scaled_matmul")
)
all_gather_scaled_matmul_gathered = define_op(
    f"all_gather_scaled_matmul_gathered({_ARGS}, {_COMM}) -> (Tensor, Tensor, Tensor)",
    *_comm_op("all_gather_scaled_matmul", gathered=True),
)
scaled_matmul_reduce_scatter = define_op(
    f"scaled_matmul_reduce_scatter({_ARGS}, {_COMM}, bool deterministic) -> Tensor",
    *_comm_op("scaled_matmul_reduce_scatter"),
)
scaled_matmul_all_reduce = define_op(
    f"scaled_matmul_all_reduce({_ARGS}, {_COMM}, bool deterministic) -> Tensor", *_comm_op("scaled_matmul_all_reduce")
)
scaled_matmul = define_op(f"scaled_matmul({_ARGS}, str backend) -> Tensor", _scaled_matmul, _scaled_matmul_fake)
