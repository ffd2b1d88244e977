"""All-gather + GEMM for every operand format: ``y_i = all_gather(x, dim) @ dequant(weight_i).T + bias_i``.

Public functions (docs/api.md): :func:`all_gather_matmul` (plain), :func:`all_gather_scaled_matmul` (FP8),
:func:`quantized_all_gather_matmul` (int8 weights). Each takes one weight or a list of them (one gather
feeding several GEMMs: q/k/v, gate/up) and ``return_gathered``. One registered operator serves them (:data:`SPEC`)::

    coc::all_gather_matmul(Tensor x, Tensor? x_scale, Tensor[] weights, Tensor?[] w_scales, Tensor?[] w_offsets,
                           Tensor?[] biases, str call) -> (Tensor[] ys, Tensor? x_gathered, Tensor? x_scale_gathered)

with one implementation per backend. ``gather_dim`` indexes x's dims (not the last): the
rows of the flattened x are ``outer`` blocks (the product of the dims before it), each gathered on its
own, which is ``torch.cat`` along ``gather_dim``. A row travels as one unit with its scale row
(:func:`kernels.format.pack_rows`: FP8 bytes and fp32 scales in one ``uint8`` row; in tensor mode each
rank's scalar on each of its rows), so every rank's rows are dequantized with their own scales.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import comm, padding, tune
from ..format import OperandFormat, bias_of, dequantize_weight, dequantize_x, pack_rows, product, unpack_rows
from ..protocol import ImplTable, OpSpec, submit, unaliased
from .gemm import (
    GemmCall,
    Operands,
    Options,
    builder,
    dims_before,
    int8_operands,
    rows_of,
    submit_dense,
)

Result = torch.Tensor | list[torch.Tensor] | tuple[Any, ...]


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor | list[torch.Tensor],
    bias: torch.Tensor | None | list[torch.Tensor | None] = None,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    return_gathered: bool = False,
    gather_dim: int = 0,
) -> Result:
    """``y = all_gather(x, dim=gather_dim) @ weight.T + bias``.

    Reference::

        x_gathered = cat([x_of_rank_0, ..., x_of_rank_W-1], dim=gather_dim)
        y = x_gathered @ weight.T + bias
        return (y, x_gathered) if return_gathered else y

    ``gather_dim`` indexes ``x``'s dims (negative allowed; not the last, ``k``): ``x [s_local, b, k]``
    with 0 gives ``[s_local * W, b, n]``, ``x [b, s_local, k]`` with 1 (or -2) gives ``[b, s_local * W, n]``.

    Several weights, one gather: ``weight`` a list / tuple ``[w_0, w_1, ...]`` (each ``[n_i, k]``,
    ``n_i`` may differ) and ``bias`` None or a list of the same length holding tensors or None::

        ys = [x_gathered @ w_i.T + b_i for each i]
        return (ys, x_gathered) if return_gathered else ys          # ys is a list
    """
    gather = ("gather_dim", gather_dim)
    signature = ("all_gather_matmul", group, backend, parallel_num, return_gathered, gather, None)
    out = submit_dense(SPEC, "all_gather", signature, (x, weight, bias))
    return _result(out, isinstance(weight, (list, tuple)), return_gathered, scaled=False)


def all_gather_scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor | list[torch.Tensor],
    w_scale: torch.Tensor | list[torch.Tensor],
    bias: torch.Tensor | None | list[torch.Tensor | None] = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    return_gathered: bool = False,
    gather_dim: int = 0,
) -> Result:
    """FP8 ``y = all_gather(x, dim=gather_dim) @ weight.T + bias``, rounded once to ``out_dtype``.

    Reference::

        x_gathered = cat([x of rank 0, ..., x of rank W-1], dim=gather_dim)   # FP8 bytes
        x_scale_gathered = cat([x_scale of each rank])      # per row; tensor mode: each rank's scalar per row
        y = (dequant(x_gathered) @ dequant(weight).T + bias).to(out_dtype)     # fp32 inside
        return (y, x_gathered, x_scale_gathered) if return_gathered else y

    ``x [..., k]`` FP8, ``weight [n, k]`` FP8 (or a list of them with ``w_scale`` and ``bias`` lists, one
    gather for all: ``ys`` a list), scales fp32 per mode (``kernels.fp8.scales``; ``x_scale`` may also be
    ``[..., G]`` over x's leading dims), ``bias [n]`` in ``out_dtype`` or fp32. In tensor mode each rank's
    ``x_scale`` scales its own rows. The gathered scales come back one row per gathered row:
    ``[m_local * W, G]`` for ``gather_dim=0``, else ``[..., G]`` over the gathered x's leading dims.
    """
    signature = (
        "all_gather_scaled_matmul",
        group,
        backend,
        parallel_num,
        return_gathered,
        ("gather_dim", gather_dim),
        out_dtype,
    )
    out = submit_dense(SPEC, "all_gather", signature, (x, x_scale, weight, w_scale, bias))
    return _result(out, isinstance(weight, (list, tuple)), return_gathered, scaled=True)


def quantized_all_gather_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor | list[torch.Tensor],
    scale: torch.Tensor | list[torch.Tensor],
    bias: torch.Tensor | None | list[torch.Tensor | None] = None,
    *,
    group_size: int | None = None,
    offset: torch.Tensor | None | list[torch.Tensor | None] = None,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    return_gathered: bool = False,
    gather_dim: int = 0,
) -> Result:
    """w8A16 ``y = all_gather(x, dim=gather_dim) @ dequant(qweight).T + bias``.

    Reference::

        w = (qweight - offset) * scale         # per mode of scale's shape, fp32, rounded to x.dtype
        y = cat([x of rank r], dim=gather_dim) @ w.T + bias

    Arguments as :func:`kernels.quantized_matmul_all_reduce`; weights (with their scales, offsets and
    biases) and ``return_gathered`` / ``gather_dim`` as :func:`all_gather_matmul`.
    """
    options = Options(
        "quantized_all_gather_matmul",
        "all_gather",
        group,
        backend,
        parallel_num,
        return_gathered=return_gathered,
        dim=("gather_dim", gather_dim),
        x=x,
    )
    build = builder(options, lambda: int8_operands(x, qweight, scale, bias, group_size=group_size, offset=offset))
    out = submit(SPEC, options.op, group, build)
    return _result(out, isinstance(qweight, (list, tuple)), return_gathered, scaled=False)


def _result(out: tuple, listed: bool, return_gathered: object, *, scaled: bool) -> Result:
    ys, x_gathered, x_scale_gathered = out
    y = ys if listed else ys[0]
    if not return_gathered:
        return y
    if scaled:
        return y, x_gathered, x_scale_gathered
    return y, x_gathered


def gather_rows(rows: torch.Tensor, group: dist.ProcessGroup | None, world: int, outer: int = 1) -> torch.Tensor:
    """Reference::

        blocks = rows.view(outer, L, c)                        # L = m_local / outer
        gathered = cat([blocks of rank 0, ..., blocks of rank W-1], dim=1).view(outer * W * L, c)

    ``outer`` is the product of ``x``'s dims before ``gather_dim`` (1 for ``gather_dim=0``): each of the
    ``outer`` row blocks is gathered on its own, which is ``torch.cat`` along ``gather_dim`` of the
    un-flattened tensors. ``rows`` may be packed rows (:func:`kernels.format.pack_rows`).
    """
    if world == 1:
        return rows
    m_local, c = rows.shape
    buf = rows.new_empty((world * m_local, c))
    comm.all_gather(buf, rows.contiguous(), group)
    if outer == 1:
        return buf
    return buf.view(world, outer, m_local // outer, c).transpose(0, 1).reshape(world * m_local, c)


def _weights(call: GemmCall, ops: Operands, x_dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every weight and bias as the reference multiplies and adds them."""
    if call.fmt.kind == "plain":
        # Not strict: the operands hold a bias (or None) per weight by construction, and this runs on every call.
        return list(zip(ops.weights, ops.biases, strict=False))
    return [
        (dequantize_weight(call.fmt, w, ops.scale_of(i), ops.offset_of(i), x_dtype), bias_of(call.fmt, b))
        for i, (w, b) in enumerate(zip(ops.weights, ops.biases, strict=True))
    ]


Gathered = tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]


def _products(fmt: OperandFormat, rows: torch.Tensor, x2d: torch.Tensor, weights: list) -> Gathered:
    """``([dequant(x) @ w.T + b for each weight], x, x's per-row scales or None)`` of gathered packed ``rows``;
    ``x2d``: this rank's rows of x (their k and dtype unpack them)."""
    if fmt.kind == "plain":
        # Plain rows are x itself: nothing to unpack or dequantize (this runs on every call).
        return [padding.linear(rows, w, b) for w, b in weights], rows, None
    xg, xsg = unpack_rows(fmt, rows, x2d.shape[1], x2d.dtype)
    xd = dequantize_x(fmt, xg, xsg, per_row=True)
    return [product(fmt, xd, w, b) for w, b in weights], xg, xsg


def reference(call: GemmCall, ops: Operands) -> Gathered:
    """Reference::

    x_gathered, x_scale_gathered = unpack(gather_rows(pack(x, x_scale), outer))     # [W * m_local, k]
    ys = [dequant(x_gathered) @ dequant(w_i).T + b_i for each weight]
    """
    x2d = rows_of(ops.x)
    fmt = call.fmt
    if call.world == 1 and fmt.kind == "plain":
        # A group of one gathers nothing and plain rows are x itself: the products straight away (this runs on
        # every call of a single-rank model; the same products as below, without packing or looking up the group).
        return [padding.linear(x2d, w, b) for w, b in zip(ops.weights, ops.biases, strict=False)], x2d, None
    packed = pack_rows(fmt, x2d, ops.x_scale)
    outer = dims_before(ops.x, call.comm_dim) if call.world > 1 else 1
    gathered = packed if call.world == 1 else gather_rows(packed, call.group, call.world, outer)
    return _products(fmt, gathered, x2d, _weights(call, ops, x2d.dtype))


def chunked(call: GemmCall, ops: Operands) -> Gathered:
    """Same result as :func:`reference`; gathers piece by piece, comm-first, and multiplies each gathered
    piece by every weight (one gather for all of them).

    Pieces split the rows of the gathered dim: x ``[outer * L, k]`` is ``outer`` blocks of ``L`` rows, and
    piece ``i`` is rows ``[start, stop)`` of every block of every rank; each row travels packed with its
    scale row. The gathered x is kept only with ``return_gathered``.
    """
    x2d = rows_of(ops.x)
    m_local, k = x2d.shape
    world, fmt, group = call.world, call.fmt, call.group
    outer = dims_before(ops.x, call.comm_dim)
    packed = pack_rows(fmt, x2d, ops.x_scale)
    c = packed.shape[1]
    rows = m_local // outer if outer else 0
    pieces = comm.split_rows(rows, call.parallel_num)
    blocks = packed.reshape(outer, rows, c)
    bufs, works = [], []
    for start, stop in pieces:
        buf = packed.new_empty((world * outer * (stop - start), c))
        # A copy only when the piece is strided (several pieces of several blocks).
        src = blocks[:, start:stop].contiguous().view(outer * (stop - start), c)
        works.append(comm.all_gather(buf, src, group, async_op=True))
        bufs.append(buf)
    weights = _weights(call, ops, x2d.dtype)
    if len(pieces) == 1 and outer == 1:
        works[0].wait()
        return _products(fmt, bufs[0], x2d, weights)
    # Rank r's rows of piece i land at rows [start, stop) of block (o, r) of the gathered x.
    ys: list[torch.Tensor] = []
    gathered = packed.new_empty((outer, world, rows, c)) if call.return_gathered else None
    for (start, stop), buf, work in zip(pieces, bufs, works, strict=True):
        work.wait()
        shape = (world, outer, stop - start)
        parts = _products(fmt, buf, x2d, weights)[0]
        if not ys:
            ys = [part.new_empty((outer, world, rows, part.shape[1])) for part in parts]
        for y, part in zip(ys, parts, strict=True):
            y[:, :, start:stop] = part.view(shape + (part.shape[1],)).transpose(0, 1)
        if gathered is not None:
            gathered[:, :, start:stop] = buf.view(shape + (c,)).transpose(0, 1)
    out = [y.view(world * m_local, y.shape[-1]) for y in ys]
    if gathered is None:
        return out, None, None
    xg, xsg = unpack_rows(fmt, gathered.view(world * m_local, c), k, x2d.dtype)
    return out, xg, xsg


def fused(call: GemmCall, ops: Operands) -> Gathered:
    """The fused kernels (kernels/fused/all_gather.py): every rank pushes its rows (and FP8 scale rows) into
    its peers' gather buffers chunk by chunk while the GEMM starts on the rows already there; one gather
    for every weight, x's rows addressed in place for any ``gather_dim``."""
    from ..fused import all_gather

    return all_gather.run(call, ops)


def _gathered_shape(x: torch.Tensor, d: int, world: int, last: int) -> tuple[int, ...]:
    shape = list(x.shape)
    shape[d] *= world
    shape[-1] = last
    return tuple(shape)


def _finished(backend: Any) -> Any:
    """``backend(call, ops)``'s 2-D results shaped as the operator returns them (the gathered dim of x, the
    output dtype) and never aliasing an input (a group of one gathers nothing)."""

    def run(call: GemmCall, ops: Operands) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        x, x_scale = ops.x, ops.x_scale
        ys, xg, xsg = backend(call, ops)
        # A 2-D x gathers its rows: the results are already [W * m, n] (a view to the same shape costs a round trip).
        flat = x.dim() == 2
        if flat and call.out_dtype is None and not call.return_gathered:
            return ys, None, None  # the plain 2-D call, as it comes: nothing to cast, shape or return beside
        d, world = call.comm_dim, call.world
        if call.out_dtype is not None:
            ys = [y.to(call.out_dtype) for y in ys]
        if not flat:
            ys = [y.view(_gathered_shape(x, d, world, w.shape[0])) for y, w in zip(ys, ops.weights, strict=True)]
        if not call.return_gathered:
            return ys, None, None
        xg = unaliased(xg, x)
        if not flat:
            xg = xg.view(_gathered_shape(x, d, world, x.shape[-1]))
        if xsg is not None:
            xsg = unaliased(xsg, x_scale) if x_scale is not None else xsg
            if d:
                xsg = xsg.view(_gathered_shape(x, d, world, xsg.shape[-1]))
        return ys, xg, xsg

    return run


def _operands(*args: Any) -> Operands:
    """The operator's arguments ``(x, x_scale, weights, w_scales, w_offsets, biases)`` as :class:`Operands`."""
    x, x_scale, weights, w_scales, w_offsets, biases = args
    return Operands(
        x=x,
        weights=tuple(weights),
        biases=tuple(biases),
        x_scale=x_scale,
        w_scales=tuple(w_scales) if any(s is not None for s in w_scales) else (),
        w_offsets=tuple(w_offsets) if any(o is not None for o in w_offsets) else (),
    )


def _flat(ops: Operands) -> tuple:
    count = len(ops.weights)
    return (
        ops.x,
        ops.x_scale,
        list(ops.weights),
        list(ops.w_scales) if ops.w_scales else [None] * count,
        list(ops.w_offsets) if ops.w_offsets else [None] * count,
        list(ops.biases),
    )


def _fake(call: GemmCall, ops: Operands) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    x, weights = ops.x, ops.weights
    d, world = call.comm_dim, call.world
    ys = [x.new_empty(_gathered_shape(x, d, world, w.shape[0]), dtype=call.out_dtype or x.dtype) for w in weights]
    if not call.return_gathered:
        return ys, None, None
    xg = x.new_empty(_gathered_shape(x, d, world, x.shape[-1]))
    if not call.fmt.scaled_rows:
        return ys, xg, None
    cols = call.fmt.scale_cols(x.shape[-1])
    rows = x.shape[:-1].numel() * world
    xsg = x.new_empty(_gathered_shape(x, d, world, cols) if d else (rows, cols), dtype=torch.float32)
    return ys, xg, xsg


_IMPL = ImplTable(sequential=_finished(reference), chunked=_finished(chunked), fused=_finished(fused))
SPEC = OpSpec(
    name="all_gather_matmul",
    call=GemmCall,
    schema="(Tensor x, Tensor? x_scale, Tensor[] weights, Tensor?[] w_scales, Tensor?[] w_offsets, Tensor?[] biases, "
    "str call) -> (Tensor[], Tensor?, Tensor?)",
    operands=_operands,
    flat=_flat,
    impl=_IMPL,
    fake=_fake,
    tune=tune.tuner(_IMPL),
)
