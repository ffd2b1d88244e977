"""Reference twins of the FP8 ops: gather the FP8 bytes with their scale rows, dequantize in fp32,
multiply in fp32, reduce in fp32, round once to ``out_dtype``. Every other backend is checked
against these (and they against an fp64 product of the dequantized inputs, ``kernels.fp8.numerics``).

Inputs are 2-D and validated by :mod:`kernels.fp8.ops`; scales are fp32 in the layouts of
:mod:`kernels.fp8.scales`. gloo cannot all-gather float8 tensors, so FP8 payloads travel as uint8
(the same bytes), packed with their fp32 scale rows into one buffer per row (:func:`pack_rows`). Every fp32
matmul runs at full precision (:func:`fp32_matmuls`), whatever ``torch.set_float32_matmul_precision`` says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .. import comm, sequential
from .quantize import dequantize_fp8

_WEIGHT_MODE = {"tensor": "tensor", "row": "row", "block": "block2d"}


def dequantize_x(x: torch.Tensor, x_scale: torch.Tensor, mode: str) -> torch.Tensor:
    """fp32 ``x [m, k]`` of the op's activation: per mode, 1 x 128 blocks in ``"block"``."""
    return dequantize_fp8(x, x_scale, mode)


def dequantize_w(weight: torch.Tensor, w_scale: torch.Tensor, mode: str) -> torch.Tensor:
    """fp32 ``weight [n, k]`` of the op: per mode, 128 x 128 blocks in ``"block"``."""
    return dequantize_fp8(weight, w_scale, _WEIGHT_MODE[mode])


def bias_fp32(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float()


def scale_cols(mode: str, x_scale: torch.Tensor) -> int:
    """fp32 scale columns that travel with each row of x: ``G`` in block mode, one otherwise (a tensorwise
    scale is the scale of its rank's rows, so each row carries it: ranks may quantize on their own)."""
    return 1 if mode == "tensor" else x_scale.shape[1]


def row_scales(x_scale: torch.Tensor, mode: str, rows: int) -> torch.Tensor:
    """``x_scale`` as one row of scales per row of x (``[rows, 1]`` for a tensorwise scale)."""
    return x_scale.reshape(1, 1).expand(rows, 1) if mode == "tensor" else x_scale


def gathered_mode(mode: str) -> str:
    """The dequantization mode of gathered rows: their scales are per row in tensor mode (each rank's own)."""
    return "row" if mode == "tensor" else mode


@contextlib.contextmanager
def fp32_matmuls() -> Iterator[None]:
    """fp32 matmuls at full precision whatever ``torch.set_float32_matmul_precision`` says: "high" and
    "medium" let them run on TF32 (GPUs) or bf16 passes (CPUs), and the FP8 results promise fp32
    products and sums (the bounds of ``kernels.fp8.numerics``)."""
    saved = torch.get_float32_matmul_precision()
    if saved == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` on fp32 operands at full fp32 precision (:func:`fp32_matmuls`)."""
    with fp32_matmuls():
        return torch.nn.functional.linear(x, weight, bias)


def pack_rows(x: torch.Tensor, x_scale: torch.Tensor, mode: str) -> torch.Tensor:
    """``uint8 [m, k + 4 * cols]``: each row's FP8 bytes followed by the bytes of its fp32 scales
    (:func:`scale_cols` of them)."""
    cols = scale_cols(mode, x_scale)
    scales = row_scales(x_scale, mode, x.shape[0]).contiguous()
    return torch.cat([x.view(torch.uint8), scales.view(torch.uint8).view(x.shape[0], 4 * cols)], dim=1)


def unpack_rows(buf: torch.Tensor, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_rows` for gathered rows: ``(x fp8 [rows, k], scales fp32 [rows, cols])``, contiguous."""
    return buf[:, :k].contiguous().view(dtype), buf[:, k:].contiguous().view(torch.float32)


def gather_fp8(
    x: torch.Tensor, x_scale: torch.Tensor, mode: str, group: dist.ProcessGroup | None, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference::

    x_gathered = cat([x of rank 0, ..., x of rank W-1])                  # FP8 bytes
    x_scale_gathered = cat([row_scales(x_scale) of rank 0, ...])         # [W * m_local, cols]
    """
    if world == 1:
        return x.clone(), row_scales(x_scale, mode, x.shape[0]).clone()
    packed = pack_rows(x, x_scale, mode)
    buf = packed.new_empty((world * packed.shape[0], packed.shape[1]))
    comm.all_gather(buf, packed, group)
    return unpack_rows(buf, x.shape[1], x.dtype)


def all_gather_scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    world: int,
    *,
    return_gathered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference::

    x_gathered, x_scale_gathered = gather_fp8(x, x_scale)                   # [W * m_local, k], scales per row
    y = (dequant(x_gathered) @ dequant(weight).T + bias).to(out_dtype)      # fp32, rounded once
    return (y, x_gathered, x_scale_gathered) if return_gathered else y
    """
    xg, xsg = gather_fp8(x, x_scale, mode, group, world)
    y = linear_fp32(dequantize_x(xg, xsg, gathered_mode(mode)), dequantize_w(weight, w_scale, mode), bias_fp32(bias))
    y = y.to(out_dtype)
    return (y, xg, xsg) if return_gathered else y


def scaled_matmul_reduce_scatter(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    world: int,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """Reference::

    partial = dequant(x) @ dequant(weight).T                     # fp32 [m, n] on every rank
    y = (reduce_scatter_dim0(partial) + bias).to(out_dtype)      # fp32 sum (rank order if deterministic)
    """
    xd, wd = dequantize_x(x, x_scale, mode), dequantize_w(weight, w_scale, mode)
    with fp32_matmuls():
        out = sequential.matmul_reduce_scatter(xd, wd, bias_fp32(bias), group, world, deterministic=deterministic)
    return out.to(out_dtype)


def scaled_matmul_all_reduce(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    world: int,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """Reference::

    partial = dequant(x) @ dequant(weight).T                     # fp32 [m, n] on every rank
    y = (all_reduce(partial) + bias).to(out_dtype)               # fp32 sum (rank order if deterministic)
    """
    xd, wd = dequantize_x(x, x_scale, mode), dequantize_w(weight, w_scale, mode)
    with fp32_matmuls():
        out = sequential.matmul_all_reduce(xd, wd, bias_fp32(bias), group, world, deterministic=deterministic)
    return out.to(out_dtype)


def scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Reference, no communication: ``(dequant(x) @ dequant(weight).T + bias).to(out_dtype)``."""
    y = linear_fp32(dequantize_x(x, x_scale, mode), dequantize_w(weight, w_scale, mode), bias_fp32(bias))
    return y.to(out_dtype)
