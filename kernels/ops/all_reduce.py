"""GEMM + all-reduce for every operand format: ``y = all_reduce(dequant(x) @ dequant(weight).T) + bias``.

Public functions (docs/api.md): :func:`matmul_all_reduce` (plain), :func:`scaled_matmul_all_reduce` (FP8),
:func:`quantized_matmul_all_reduce` (int8 weights, w8A16). One registered operator serves the three::

    coc::matmul_all_reduce(Tensor x, Tensor? x_scale, Tensor weight, Tensor? w_scale, Tensor? w_offset,
                           Tensor? bias, str call) -> Tensor           # call: kernels.call.OpCall.encode()

and one implementation per backend (:data:`IMPL`): :func:`reference` (sequential), :func:`chunked`
(compute-first pieces), :func:`fused` (kernels/fused). Arithmetic per format
(:class:`kernels.format.OperandFormat`): plain and int8 partials are products in x's dtype (an int8
weight dequantized to x's dtype first), summed by the collective, bias added after; FP8 partials are
fp32 products of the dequantized operands at full fp32 precision, summed in fp32, bias added in
fp32 and rounded once to ``out_dtype``. ``deterministic=True`` sums the partials in rank order, so
repeated calls and all ranks hold the same bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm, padding
from ..call import IMPLEMENTATIONS, OpCall, Operands
from ..format import bias_of, compute, dequantize_weight, dequantize_x
from .entry import (
    define_one_weight_op,
    fp8_operands,
    fp8_values,
    int8_operands,
    plain_operands,
    request,
    rows_of,
    same_rows,
    submit,
)


def matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """``y = all_reduce(x @ weight.T) + bias``.

    Reference::

        partial = x @ weight.T                                     # [m, n] on every rank
        y = sum(partial_of_rank_r for r in range(W)) + bias        # [m, n], same on all ranks

    ``deterministic=True`` sums the partials in rank order: repeated calls give identical bits and
    all ranks hold identical bits.
    """
    req = request(
        "all_reduce",
        "matmul_all_reduce",
        x,
        group=group,
        backend=backend,
        parallel_num=parallel_num,
        deterministic=deterministic,
    )
    call, ops = submit(req, lambda: plain_operands(x, weight, bias))
    return _op(ops, call)


def scaled_matmul_all_reduce(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """FP8 ``y = all_reduce(x @ weight.T) + bias``, rounded once to ``out_dtype``.

    Reference::

        partial = dequant(x) @ dequant(weight).T                     # fp32 [m, n] on every rank
        y = (all_reduce(partial) + bias).to(out_dtype)               # [m, n], fp32 sum

    ``deterministic=True`` sums in rank order: identical bits on every call and every rank.
    """
    req = request(
        "all_reduce",
        "scaled_matmul_all_reduce",
        x,
        group=group,
        backend=backend,
        parallel_num=parallel_num,
        deterministic=deterministic,
        out_dtype=out_dtype,
    )
    call, ops = submit(req, lambda: fp8_operands(x, x_scale, weight, w_scale, bias, out_dtype=out_dtype), fp8_values)
    return _op(ops, call)


def quantized_matmul_all_reduce(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group_size: int | None = None,
    offset: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """w8A16 ``y = all_reduce(x @ dequant(qweight).T) + bias``.

    Reference::

        w = (qweight - offset) * scale         # per mode of scale's shape, fp32, rounded to x.dtype
        partial = x @ w.T                      # [m, n] on every rank
        y = sum(partial_of_rank_r for r in range(W)) + bias

    ``qweight`` int8 ``[n, k]`` and ``scale`` (``[]``, ``[n]`` or ``[n, G]``) as returned by
    :func:`kernels.quantize_weight`; ``x`` fp16 / bf16 (fp32 allowed on CPU). See ``kernels.quant`` for
    the group and offset conventions.
    """
    req = request(
        "all_reduce",
        "quantized_matmul_all_reduce",
        x,
        group=group,
        backend=backend,
        parallel_num=parallel_num,
        deterministic=deterministic,
    )
    call, ops = submit(req, lambda: int8_operands(x, qweight, scale, bias, group_size=group_size, offset=offset))
    return _op(ops, call)


def _op(ops: Operands, call: OpCall) -> torch.Tensor:
    return operator(ops.x, ops.x_scale, ops.weights[0], ops.scale_of(0), ops.offset_of(0), ops.biases[0], call.encode())


def _dequantized(call: OpCall, ops: Operands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The reference's operands: x rows, the weight and the bias as they are multiplied and added."""
    x2d = rows_of(ops.x)
    xd = dequantize_x(call.fmt, x2d, ops.x_scale, per_row=False)
    wd = dequantize_weight(call.fmt, ops.weights[0], ops.scale_of(0), ops.offset_of(0), x2d.dtype)
    return xd, wd, bias_of(call.fmt, ops.biases[0])


def fixed_order_all_reduce(partial: torch.Tensor, group: dist.ProcessGroup | None, world: int) -> torch.Tensor:
    """All-reduce summing in rank order, so all ranks hold the same bits (any row count).

    Rows are padded with zeros to a multiple of W, exchanged all-to-all, each rank sums its block
    in rank order, and the reduced blocks are all-gathered.
    """
    m, n = partial.shape
    block = -(-m // world)
    padded = comm.pad_rows(partial, block * world)
    parts = padded.new_empty((world, block, n))
    comm.all_to_all(parts, padded, group)
    reduced = comm.sum_in_rank_order(parts)
    gathered = padded.new_empty((world * block, n))
    comm.all_gather(gathered, reduced, group)
    return gathered[:m]


def reference(call: OpCall, ops: Operands, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Reference::

    partial = dequant(x) @ dequant(weight).T     # [m, n] on every rank (module docstring: dtypes)
    y = all_reduce(partial) + bias               # rank order sum if deterministic
    """
    xd, wd, bias = _dequantized(call, ops)
    with compute(call.fmt):
        partial = padding.linear(xd, wd)
    if call.world > 1:
        if call.deterministic:
            partial = fixed_order_all_reduce(partial, group, call.world)
        else:
            comm.all_reduce(partial, group)
    return partial if bias is None else partial.add_(bias)


def chunked(call: OpCall, ops: Operands, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Same result as :func:`reference`; compute-first pieces of rows: multiply piece i, launch its
    asynchronous all-reduce, go on to piece i + 1 while it is in flight."""
    xd, wd, bias = _dequantized(call, ops)
    m, n = xd.shape[0], wd.shape[0]
    out = xd.new_empty((m, n))
    if call.deterministic:
        return _fixed_order_pieces(call, xd, wd, bias, group)
    works = []
    for start, stop in comm.split_rows(m, call.parallel_num):
        piece = out[start:stop]
        with compute(call.fmt):
            padding.linear(xd[start:stop], wd, out=piece)
        works.append(comm.all_reduce(piece, group, async_op=True))
    for work in works:
        work.wait()
    return out if bias is None else out.add_(bias)


def _fixed_order_pieces(
    call: OpCall, xd: torch.Tensor, wd: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Deterministic all-reduce per piece: exchange, sum in rank order, gather.

    Each piece's rows are zero-padded to a multiple of W (zeros keep the sums exact), exchanged
    all-to-all while the next piece is multiplied, summed in rank order, and the reduced blocks
    are all-gathered while the next piece is summed.
    """
    world, n = call.world, wd.shape[0]
    out = xd.new_empty((xd.shape[0], n))
    exchanges = []
    for start, stop in comm.split_rows(xd.shape[0], call.parallel_num):
        block = -(-(stop - start) // world)
        with compute(call.fmt):
            padded = comm.pad_rows(padding.linear(xd[start:stop], wd), block * world)
        parts = padded.new_empty((world, block, n))
        work = comm.all_to_all(parts, padded, group, async_op=True)
        exchanges.append((work, start, stop, parts))
    gathers = []
    for work, start, stop, parts in exchanges:
        work.wait()
        reduced = comm.sum_in_rank_order(parts)
        gathered = reduced.new_empty((world * reduced.shape[0], n))
        work = comm.all_gather(gathered, reduced, group, async_op=True)
        gathers.append((work, start, stop, gathered))
    for work, start, stop, gathered in gathers:
        work.wait()
        out[start:stop] = gathered[: stop - start]
    return out if bias is None else out.add_(bias)


def fused(call: OpCall, ops: Operands, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The fused kernels (kernels/fused/all_reduce.py): GEMM tiles pushed into peers' slots, fixed-order reduce."""
    from ..fused import all_reduce

    return all_reduce.run(call, ops)


IMPL = IMPLEMENTATIONS["all_reduce"] = {"sequential": reference, "chunked": chunked, "fused": fused}


operator = define_one_weight_op("matmul_all_reduce", IMPL, same_rows)
