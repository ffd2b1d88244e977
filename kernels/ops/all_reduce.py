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
from ..call import IMPLEMENTATIONS, OpCall, Operands, decode, resolve_group
from ..format import OperandFormat, bias_of, compute, dequantize_weight, dequantize_x
from ..op_registration import define_op
from .entry import (
    Request,
    define_one_weight_op,
    fp8_operands,
    fp8_values,
    int8_operands,
    one_weight_operands,
    plain_operands,
    request,
    rows_of,
    same_rows,
    submit,
)
from .norm import NormOutputs, accumulator, cast_to, check_epilogue, finish, scale_shape


def matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    deterministic: bool = False,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    quant: str | None = None,
) -> torch.Tensor | NormOutputs:
    """``y = all_reduce(x @ weight.T) + bias``.

    Reference::

        partial = x @ weight.T                                     # [m, n] on every rank
        y = sum(partial_of_rank_r for r in range(W)) + bias        # [m, n], same on all ranks

    ``deterministic=True`` sums the partials in rank order: repeated calls give identical bits and
    all ranks hold identical bits.

    With ``residual`` and ``norm_weight`` (the decode path's layer end; :mod:`kernels.ops.norm`): returns
    ``NormOutputs(out, residual, scale)`` of ``h = sum(partial_r, fp32, rank order) + bias + residual``, the
    RMSNorm of ``h`` times ``norm_weight`` (FP8 e4m3 with its scales when ``quant`` is ``"tensor"`` / ``"row"``
    / ``"block"``) and ``h`` rounded to the residual's dtype.
    """
    req = request(
        "all_reduce",
        "matmul_all_reduce",
        x,
        group=group,
        backend=backend,
        parallel_num=parallel_num,
        deterministic=deterministic,
        epilogue=_epilogue_name(residual, norm_weight, quant, "matmul_all_reduce"),
    )
    norm = (residual, norm_weight, eps, quant)
    call, ops = submit(req, lambda: _checked(plain_operands(x, weight, bias), norm, req))
    return _op(ops, call, norm)


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
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    quant: str | None = None,
) -> torch.Tensor | NormOutputs:
    """FP8 ``y = all_reduce(x @ weight.T) + bias``, rounded once to ``out_dtype``.

    Reference::

        partial = dequant(x) @ dequant(weight).T                     # fp32 [m, n] on every rank
        y = (all_reduce(partial) + bias).to(out_dtype)               # [m, n], fp32 sum

    ``deterministic=True`` sums in rank order: identical bits on every call and every rank. ``residual``,
    ``norm_weight``, ``eps``, ``quant``: the RMSNorm epilogue of :func:`matmul_all_reduce` (``residual`` in
    ``out_dtype``).
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
        epilogue=_epilogue_name(residual, norm_weight, quant, "scaled_matmul_all_reduce"),
    )
    norm = (residual, norm_weight, eps, quant)
    call, ops = submit(
        req,
        lambda: _checked(fp8_operands(x, x_scale, weight, w_scale, bias, out_dtype=out_dtype), norm, req),
        fp8_values,
    )
    return _op(ops, call, norm)


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
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    quant: str | None = None,
) -> torch.Tensor | NormOutputs:
    """w8A16 ``y = all_reduce(x @ dequant(qweight).T) + bias``.

    Reference::

        w = (qweight - offset) * scale         # per mode of scale's shape, fp32, rounded to x.dtype
        partial = x @ w.T                      # [m, n] on every rank
        y = sum(partial_of_rank_r for r in range(W)) + bias

    ``qweight`` int8 ``[n, k]`` and ``scale`` (``[]``, ``[n]`` or ``[n, G]``) as returned by
    :func:`kernels.quantize_weight`; ``x`` fp16 / bf16 (fp32 allowed on CPU). See ``kernels.quant`` for
    the group and offset conventions. ``residual``, ``norm_weight``, ``eps``, ``quant``: the RMSNorm epilogue
    of :func:`matmul_all_reduce`.
    """
    req = request(
        "all_reduce",
        "quantized_matmul_all_reduce",
        x,
        group=group,
        backend=backend,
        parallel_num=parallel_num,
        deterministic=deterministic,
        epilogue=_epilogue_name(residual, norm_weight, quant, "quantized_matmul_all_reduce"),
    )
    norm = (residual, norm_weight, eps, quant)
    call, ops = submit(
        req, lambda: _checked(int8_operands(x, qweight, scale, bias, group_size=group_size, offset=offset), norm, req)
    )
    return _op(ops, call, norm)


def _epilogue_name(residual: object, norm_weight: object, quant: object, op: str) -> str:
    """The call's epilogue (kernels.agree.EPILOGUES; ``""``: none) from the arguments that ask for one."""
    if residual is None and norm_weight is None:
        if quant is not None:
            raise ValueError(f"{op}: quant={quant!r} quantizes the RMSNorm epilogue; pass residual and norm_weight")
        return ""
    if residual is None or norm_weight is None:
        missing = "residual" if residual is None else "norm_weight"
        raise ValueError(f"{op}: the RMSNorm epilogue needs both residual and norm_weight; {missing} is None")
    return "rmsnorm" if quant is None else f"rmsnorm:{quant}"


def _checked(built: tuple[OperandFormat, Operands], norm: tuple, req: Request) -> tuple[OperandFormat, Operands]:
    """``built``, after checking the epilogue's tensors against the output (its rows, ``n`` and dtype)."""
    fmt, ops = built
    if req.epilogue:
        residual, norm_weight, eps, quant = norm
        shape = tuple(ops.x.shape[:-1]) + (ops.weights[0].shape[0],)
        dtype = req.out_dtype or ops.x.dtype
        check_epilogue(
            residual, norm_weight, eps, quant, shape=shape, dtype=dtype, names=(req.op_name, "residual", "norm_weight")
        )
    return fmt, ops


def _op(ops: Operands, call: OpCall, norm: tuple) -> torch.Tensor | NormOutputs:
    operands = (ops.x, ops.x_scale, ops.weights[0], ops.scale_of(0), ops.offset_of(0), ops.biases[0])
    if not call.epilogue:
        return operator(*operands, call.encode())
    residual, norm_weight, eps, quant = norm
    out, residual_out, scale = norm_operator(*operands, residual, norm_weight, float(eps), call.encode())
    return NormOutputs(out, residual_out, scale if quant is not None else None)


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


def reduced_reference(
    call: OpCall, ops: Operands, group: dist.ProcessGroup | None, residual: torch.Tensor
) -> torch.Tensor:
    """``h = sum(partial_r in the accumulator, rank order) + bias + residual`` (fp32, fp64 for fp64): the
    epilogue's input on the sequential and chunked backends (no pieces: the epilogue serves decode sizes)."""
    xd, wd, bias = _dequantized(call, ops)
    with compute(call.fmt):
        partial = padding.linear(xd, wd)
    acc = accumulator(partial.dtype)
    # The partials travel in the accumulator, so the rank-order sum is the fused reduce's, operation by operation.
    h = cast_to(partial, acc)
    if call.world > 1:
        h = fixed_order_all_reduce(h, group, call.world)
    if bias is not None:
        h = h + cast_to(bias, acc)
    return h + cast_to(residual, acc)


def reduced_fused(call: OpCall, ops: Operands, group: dist.ProcessGroup | None, residual: torch.Tensor) -> torch.Tensor:
    """:func:`reduced_reference` on the fused backend: the residual added in the reduce kernel."""
    from ..fused import all_reduce

    return all_reduce.run(call, ops, residual=residual)


REDUCED = {"sequential": reduced_reference, "chunked": reduced_reference, "fused": reduced_fused}


def _run_norm(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    w_scale: torch.Tensor | None,
    w_offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    call_text: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = decode(call_text)
    ops = one_weight_operands(x, weight, x_scale=x_scale, w_scale=w_scale, w_offset=w_offset, bias=bias)
    h = REDUCED[call.backend](call, ops, resolve_group(call.group_name), rows_of(residual))
    mode = call.epilogue.partition(":")[2] or None
    dtypes = (residual.dtype, residual.dtype)
    shape = tuple(residual.shape)
    fused_norm = call.backend == "fused"
    return finish(h, norm_weight, eps, dtypes=dtypes, quant=(mode, torch.float8_e4m3fn), fused=fused_norm, shape=shape)


def _fake_norm(
    x: torch.Tensor, x_scale: object, weight: torch.Tensor, *args: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    residual = args[3]
    assert isinstance(residual, torch.Tensor)
    mode = decode(str(args[-1])).epilogue.partition(":")[2] or None
    out = residual.new_empty(residual.shape, dtype=torch.float8_e4m3fn if mode else residual.dtype)
    scale = residual.new_empty(scale_shape(tuple(residual.shape), mode), dtype=torch.float32)
    return out, residual.new_empty(residual.shape), scale


norm_operator = define_op(
    "matmul_all_reduce_rmsnorm(Tensor x, Tensor? x_scale, Tensor weight, Tensor? w_scale, Tensor? w_offset, "
    "Tensor? bias, Tensor residual, Tensor norm_weight, float eps, str call) -> (Tensor, Tensor, Tensor)",
    _run_norm,
    _fake_norm,
)
