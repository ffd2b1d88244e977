"""GEMM + reduce-scatter for every operand format: ``y = reduce_scatter(dequant(x) @ dequant(weight).T, dim) + bias``.

Public functions (docs/api.md): :func:`matmul_reduce_scatter` (plain), :func:`scaled_matmul_reduce_scatter`
(FP8), :func:`quantized_matmul_reduce_scatter` (int8 weights). One registered operator serves the three::

    coc::matmul_reduce_scatter(Tensor x, Tensor? x_scale, Tensor weight, Tensor? w_scale, Tensor? w_offset,
                               Tensor? bias, str call) -> Tensor       # call: kernels.ops.gemm.GemmCall

and one implementation per backend (:data:`SPEC`). ``scatter_dim`` indexes x's dims (not the last);
``x.shape[scatter_dim]`` must divide by W. The rows of the flattened x are ``outer`` blocks (the
product of the dims before ``scatter_dim``), each of W owner blocks: rank r gets block r of every
outer block, read in place (no transposing copy). Arithmetic per format as in :mod:`kernels.ops.all_reduce`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import comm, tune
from ..format import product
from ..protocol import ImplTable, OpSpec, submit
from .gemm import (
    ONE_WEIGHT_ARGS,
    GemmCall,
    Operands,
    Options,
    builder,
    dequantized,
    dims_before,
    int8_operands,
    one_weight_operands,
    submit_dense,
)


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    deterministic: bool = False,
    scatter_dim: int = 0,
) -> torch.Tensor:
    """``y = reduce_scatter(x @ weight.T, dim=scatter_dim) + bias``; bias is added once, after the reduction.

    Reference::

        partial = x @ weight.T                                   # [..., n] on every rank
        y = chunk(sum(partial_of_rank_r for r in range(W)), W, dim=scatter_dim)[rank] + bias

    ``scatter_dim`` indexes ``x``'s dims (negative allowed; not the last, ``k``) and
    ``x.shape[scatter_dim]`` must divide by W: ``x [s, b, k]`` with 0 gives ``[s / W, b, n]``,
    ``x [b, s, k]`` with 1 (or -2) gives ``[b, s / W, n]``. ``deterministic=True`` sums the
    partials in rank order, so repeated calls give identical bits.
    """
    scatter = ("scatter_dim", scatter_dim)
    signature = ("matmul_reduce_scatter", group, backend, parallel_num, deterministic, scatter, None)
    return submit_dense(SPEC, "reduce_scatter", signature, (x, weight, bias))


def scaled_matmul_reduce_scatter(
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
    scatter_dim: int = 0,
) -> torch.Tensor:
    """FP8 ``y = reduce_scatter(x @ weight.T, dim=scatter_dim) + bias``, rounded once to ``out_dtype``.

    Reference::

        partial = dequant(x) @ dequant(weight).T                     # fp32 [..., n] on every rank
        y = (reduce_scatter(partial, scatter_dim) + bias).to(out_dtype)   # fp32 sum

    ``x [..., k_local]`` FP8 with ``x_scale`` per row (``[..., G]`` over x's leading dims or ``[m, G]`` in
    x's row order) or tensorwise; an empty ``k_local`` shard contributes zeros, as in the bf16 op.
    ``deterministic=True`` sums the partials in rank order: repeated calls give identical bits.
    """
    signature = (
        "scaled_matmul_reduce_scatter",
        group,
        backend,
        parallel_num,
        deterministic,
        ("scatter_dim", scatter_dim),
        out_dtype,
    )
    return submit_dense(SPEC, "reduce_scatter", signature, (x, x_scale, weight, w_scale, bias))


def quantized_matmul_reduce_scatter(
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
    scatter_dim: int = 0,
) -> torch.Tensor:
    """w8A16 ``y = reduce_scatter(x @ dequant(qweight).T, dim=scatter_dim) + bias``.

    Reference::

        w = (qweight - offset) * scale         # per mode of scale's shape, fp32, rounded to x.dtype
        y = chunk(sum(x_of_rank_r @ w_of_rank_r.T), W, dim=scatter_dim)[rank] + bias

    Arguments as :func:`quantized_matmul_all_reduce` and ``scatter_dim`` as :func:`matmul_reduce_scatter`.
    """
    options = Options(
        "quantized_matmul_reduce_scatter",
        "reduce_scatter",
        group,
        backend,
        parallel_num,
        deterministic=deterministic,
        dim=("scatter_dim", scatter_dim),
        x=x,
    )
    return submit(
        SPEC,
        options.op,
        group,
        builder(options, lambda: int8_operands(x, qweight, scale, bias, group_size=group_size, offset=offset)),
    )


def owner_major(partial: torch.Tensor, world: int, outer: int) -> torch.Tensor:
    """``partial [outer * W * R, n]`` reordered to ``[W * outer * R, n]`` (owner blocks first), the
    order a dim-0 reduce-scatter hands out: owner ``r`` gets row block ``r`` of every outer block."""
    if outer == 1:
        return partial
    m, n = partial.shape
    return partial.view(outer, world, m // (outer * world), n).transpose(0, 1).reshape(m, n)


def reference(call: GemmCall, ops: Operands) -> torch.Tensor:
    """Reference::

    partial = dequant(x) @ dequant(weight).T     # [m, n] on every rank (module docstring: dtypes)
    y = reduce_scatter_dim0(owner_major(partial)) + bias      # [m / W, n]; rank order sum if deterministic
    """
    xd, wd, bias = dequantized(call, ops)
    world = call.world
    partial = product(call.fmt, xd, wd)
    if world > 1:
        group = call.group
        partial = owner_major(partial, world, dims_before(ops.x, call.comm_dim))
        rows = partial.shape[0] // world
        if call.deterministic:
            parts = partial.new_empty((world, rows, partial.shape[1]))
            comm.all_to_all(parts, partial, group)
            partial = comm.sum_in_rank_order(parts)
        else:
            out = partial.new_empty((rows, partial.shape[1]))
            comm.reduce_scatter(out, partial, group)
            partial = out
    return partial if bias is None else partial.add_(bias)


def chunked(call: GemmCall, ops: Operands) -> torch.Tensor:
    """Same result as :func:`reference`; compute-first pieces.

    ``x [outer * W * R, k]`` is ``outer`` blocks, each of W owner blocks of ``R`` rows. Piece i
    covers rows [start, stop) of every owner block of every outer block, so each piece is itself a
    reduce-scatter whose result lands in rows [start, stop) of every outer block of the output.
    """
    xd, wd, bias = dequantized(call, ops)
    world, group, outer = call.world, call.group, dims_before(ops.x, call.comm_dim)
    m, k = xd.shape
    n = wd.shape[0]
    rows = m // (world * outer) if outer else 0
    x_blocks = xd.reshape(outer, world, rows, k)
    out = xd.new_empty((outer, rows, n))
    pending = []
    for start, stop in comm.split_rows(rows, call.parallel_num):
        p = stop - start
        # [W, outer, p, n]: owner-major, the order a dim-0 reduce-scatter hands out.
        partial = product(call.fmt, x_blocks[:, :, start:stop].transpose(0, 1), wd).reshape(world * outer * p, n)
        if call.deterministic:
            parts = partial.new_empty((world, outer * p, n))
            work = comm.all_to_all(parts, partial, group, async_op=True)
            pending.append((work, start, stop, parts))
        else:
            # Rows of one piece are contiguous in out only with one outer block.
            dst = out[0, start:stop] if outer == 1 else partial.new_empty((outer * p, n))
            work = comm.reduce_scatter(dst, partial, group, async_op=True)
            pending.append((work, start, stop, None if outer == 1 else dst))
    for work, start, stop, parts in pending:
        work.wait()
        if parts is None:
            continue
        reduced = comm.sum_in_rank_order(parts) if call.deterministic else parts
        out[:, start:stop] = reduced.view(outer, stop - start, n)
    out = out.view(outer * rows, n)
    return out if bias is None else out.add_(bias)


def fused(call: GemmCall, ops: Operands) -> torch.Tensor:
    """The fused kernels (kernels/fused/scatter.py): GEMM tiles pushed into their owners' slots, fixed-order
    reduce; x's rows read in place for any ``scatter_dim``."""
    from ..fused import scatter

    return scatter.run(call, ops)


def _scattered(x: torch.Tensor, call: GemmCall, n: int) -> tuple[int, ...]:
    """x's shape with ``scatter_dim`` divided by W and the last dim ``n``."""
    shape = list(x.shape)
    shape[call.comm_dim] //= call.world
    shape[-1] = n
    return tuple(shape)


def _finished(backend: Any) -> Any:
    """``backend(call, ops)``'s 2-D result in the output dtype, shaped as x with ``scatter_dim`` divided by W."""

    def run(call: GemmCall, ops: Operands) -> torch.Tensor:
        out = backend(call, ops)
        out = out.to(call.out_dtype) if call.out_dtype is not None else out
        # A 2-D x scatters its rows: the result is already [m / W, n].
        return out if ops.x.dim() == 2 else out.view(_scattered(ops.x, call, ops.weights[0].shape[0]))

    return run


def _fake(call: GemmCall, ops: Operands) -> torch.Tensor:
    x = ops.x
    return x.new_empty(_scattered(x, call, ops.weights[0].shape[0]), dtype=call.out_dtype or x.dtype)


_IMPL = ImplTable(sequential=_finished(reference), chunked=_finished(chunked), fused=_finished(fused))
SPEC = OpSpec(
    name="matmul_reduce_scatter",
    call=GemmCall,
    schema=f"({ONE_WEIGHT_ARGS}, str call) -> Tensor",
    operands=one_weight_operands,
    flat=Operands.one_weight,
    impl=_IMPL,
    fake=_fake,
    tune=tune.tuner(_IMPL),
)
