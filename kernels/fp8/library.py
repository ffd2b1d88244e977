"""The FP8 ops as registered torch operators (namespace ``coc``), with fake implementations::

    coc::all_gather_scaled_matmul(Tensor x, Tensor x_scale, Tensor weight, Tensor w_scale, Tensor? bias,
                                  str mode, ScalarType out_dtype, str group_name, int world, str backend,
                                  int parallel_num) -> Tensor
    coc::all_gather_scaled_matmul_gathered(... same ...) -> (Tensor y, Tensor x_gathered, Tensor x_scale_gathered)
    coc::scaled_matmul_reduce_scatter(... same ..., bool deterministic) -> Tensor
    coc::scaled_matmul_all_reduce(... same ..., bool deterministic) -> Tensor
    coc::scaled_matmul(Tensor x, Tensor x_scale, Tensor weight, Tensor w_scale, Tensor? bias, str mode,
                       ScalarType out_dtype, str backend) -> Tensor               (local, no communication)

``x`` is 2-D (the public functions flatten and restore leading dims); ``mode`` is the validated
scaling mode; the group travels by name, the backend and split count are decided before the call
(constants of a compiled graph), exactly as for the bf16 operators in :mod:`kernels.library`.
Outputs never alias inputs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from .. import backends
from ..library import resolve_group
from . import chunked, sequential

_LIB = torch.library.Library("coc", "FRAGMENT")

_ARGS = "Tensor x, Tensor x_scale, Tensor weight, Tensor w_scale, Tensor? bias, str mode, ScalarType out_dtype"
_COMM = "str group_name, int world, str backend, int parallel_num"
_LIB.define(f"all_gather_scaled_matmul({_ARGS}, {_COMM}) -> Tensor")
_LIB.define(f"all_gather_scaled_matmul_gathered({_ARGS}, {_COMM}) -> (Tensor, Tensor, Tensor)")
_LIB.define(f"scaled_matmul_reduce_scatter({_ARGS}, {_COMM}, bool deterministic) -> Tensor")
_LIB.define(f"scaled_matmul_all_reduce({_ARGS}, {_COMM}, bool deterministic) -> Tensor")
_LIB.define(f"scaled_matmul({_ARGS}, str backend) -> Tensor")

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
) -> Any:
    if backend == "fused":
        return fused_function(op)(x, x_scale, weight, w_scale, bias, mode, out_dtype, group, flag)
    name = "return_gathered" if op == "all_gather_scaled_matmul" else "deterministic"
    if backend == "chunked":
        return getattr(chunked, op)(
            x, x_scale, weight, w_scale, bias, mode, out_dtype, group, world, parallel_num, **{name: flag}
        )
    return getattr(sequential, op)(x, x_scale, weight, w_scale, bias, mode, out_dtype, group, world, **{name: flag})


def _fresh(t: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    # A group of one gathers nothing: an operator's output must not alias its input.
    ptr = t.untyped_storage().data_ptr()
    if any(ptr == i.untyped_storage().data_ptr() for i in inputs):
        return t.clone()
    return t


def _all_gather_scaled_matmul(
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
) -> torch.Tensor:
    group = resolve_group(group_name)
    return _run(
        "all_gather_scaled_matmul",
        backend,
        num,
        x,
        x_scale,
        weight,
        w_scale,
        bias,
        mode,
        out_dtype,
        group,
        world,
        False,
    )


def _all_gather_scaled_matmul_gathered(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group = resolve_group(group_name)
    y, xg, xsg = _run(
        "all_gather_scaled_matmul", backend, num, x, x_scale, weight, w_scale, bias, mode, out_dtype, group, world, True
    )
    return y, _fresh(xg, x), _fresh(xsg, x_scale)


def _scaled_matmul_reduce_scatter(
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
    deterministic: bool,
) -> torch.Tensor:
    group = resolve_group(group_name)
    return _run(
        "scaled_matmul_reduce_scatter",
        backend,
        num,
        x,
        x_scale,
        weight,
        w_scale,
        bias,
        mode,
        out_dtype,
        group,
        world,
        deterministic,
    )


def _scaled_matmul_all_reduce(
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
    deterministic: bool,
) -> torch.Tensor:
    group = resolve_group(group_name)
    return _run(
        "scaled_matmul_all_reduce",
        backend,
        num,
        x,
        x_scale,
        weight,
        w_scale,
        bias,
        mode,
        out_dtype,
        group,
        world,
        deterministic,
    )


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


for _name, _impl in {
    "all_gather_scaled_matmul": _all_gather_scaled_matmul,
    "all_gather_scaled_matmul_gathered": _all_gather_scaled_matmul_gathered,
    "scaled_matmul_reduce_scatter": _scaled_matmul_reduce_scatter,
    "scaled_matmul_all_reduce": _scaled_matmul_all_reduce,
    "scaled_matmul": _scaled_matmul,
}.items():
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")


@torch.library.register_fake("coc::all_gather_scaled_matmul", lib=_LIB)
def _ag_fake(
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
) -> torch.Tensor:
    return x.new_empty((x.shape[0] * world, weight.shape[0]), dtype=out_dtype)


@torch.library.register_fake("coc::all_gather_scaled_matmul_gathered", lib=_LIB)
def _ag_gathered_fake(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = x_scale.new_empty(()) if mode == "tensor" else x_scale.new_empty((x.shape[0] * world, x_scale.shape[1]))
    return (
        x.new_empty((x.shape[0] * world, weight.shape[0]), dtype=out_dtype),
        x.new_empty((x.shape[0] * world, x.shape[1])),
        scale,
    )


@torch.library.register_fake("coc::scaled_matmul_reduce_scatter", lib=_LIB)
def _rs_fake(
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
    deterministic: bool,
) -> torch.Tensor:
    return x.new_empty((x.shape[0] // world, weight.shape[0]), dtype=out_dtype)


@torch.library.register_fake("coc::scaled_matmul_all_reduce", lib=_LIB)
def _ar_fake(
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
    deterministic: bool,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


@torch.library.register_fake("coc::scaled_matmul", lib=_LIB)
def _mm_fake(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


all_gather_scaled_matmul = torch.ops.coc.all_gather_scaled_matmul.default
all_gather_scaled_matmul_gathered = torch.ops.coc.all_gather_scaled_matmul_gathered.default
scaled_matmul_reduce_scatter = torch.ops.coc.scaled_matmul_reduce_scatter.default
scaled_matmul_all_reduce = torch.ops.coc.scaled_matmul_all_reduce.default
scaled_matmul = torch.ops.coc.scaled_matmul.default
