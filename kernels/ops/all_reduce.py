"""GEMM + all-reduce for every operand format: ``y = all_reduce(dequant(x) @ dequant(weight).T) + bias``.

Public functions (docs/api.md): :func:`matmul_all_reduce` (plain), :func:`scaled_matmul_all_reduce` (FP8),
:func:`quantized_matmul_all_reduce` (int8 weights, w8A16). One registered operator serves the three::

    coc::matmul_all_reduce(Tensor x, Tensor? x_scale, Tensor weight, Tensor? w_scale, Tensor? w_offset,
                           Tensor? bias, str call) -> Tensor           # call: kernels.ops.gemm.GemmCall

and one implementation per backend (:data:`SPEC`): :func:`reference` (sequential), :func:`chunked`
(compute-first pieces), :func:`fused` (kernels/fused). Arithmetic per format
(:class:`kernels.format.OperandFormat`): plain and int8 partials are products in x's dtype (an int8
weight dequantized to x's dtype first), summed by the collective, bias added after; FP8 partials are
fp32 products of the dequantized operands at full fp32 precision, summed in fp32, bias added in
fp32 and rounded once to ``out_dtype``. ``deterministic=True`` sums the partials in rank order, so
repeated calls and all ranks hold the same bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import comm, tune
from ..format import OperandFormat, product
from ..protocol import ImplTable, OpSpec, submit
from .gemm import (
    ONE_WEIGHT_ARGS,
    GemmCall,
    Operands,
    Options,
    builder,
    dequantized,
    fp8_operands,
    int8_operands,
    one_weight_operands,
    plain_operands,
    rows_of,
    submit_dense,
)
from .norm import EpilogueArgs, NormOutputs, NormSpec, accumulator, cast_to, check_epilogue, finish, scale_shape


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
    if residual is None and norm_weight is None and quant is None:
        signature = ("matmul_all_reduce", group, backend, parallel_num, deterministic, None, None)
        return submit_dense(SPEC, "all_reduce", signature, (x, weight, bias))
    epilogue = _epilogue_name(residual, norm_weight, quant, "matmul_all_reduce")
    options = Options(
        "matmul_all_reduce",
        "all_reduce",
        group,
        backend,
        parallel_num,
        deterministic=deterministic,
        epilogue=epilogue,
        eps=_eps(eps, epilogue),
    )
    norm = (residual, norm_weight, eps, quant)
    return _submit(options, lambda: plain_operands(x, weight, bias), norm)


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
    epilogue = _epilogue_name(residual, norm_weight, quant, "scaled_matmul_all_reduce")
    options = Options(
        "scaled_matmul_all_reduce",
        "all_reduce",
        group,
        backend,
        parallel_num,
        deterministic=deterministic,
        out_dtype=out_dtype,
        epilogue=epilogue,
        eps=_eps(eps, epilogue),
    )
    norm = (residual, norm_weight, eps, quant)
    return _submit(options, lambda: fp8_operands(x, x_scale, weight, w_scale, bias, out_dtype=out_dtype), norm)


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
    epilogue = _epilogue_name(residual, norm_weight, quant, "quantized_matmul_all_reduce")
    options = Options(
        "quantized_matmul_all_reduce",
        "all_reduce",
        group,
        backend,
        parallel_num,
        deterministic=deterministic,
        epilogue=epilogue,
        eps=_eps(eps, epilogue),
    )
    norm = (residual, norm_weight, eps, quant)
    build = lambda: int8_operands(x, qweight, scale, bias, group_size=group_size, offset=offset)  # noqa: E731
    return _submit(options, build, norm)


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


def _eps(eps: object, epilogue: str) -> float:
    """The epilogue's eps as the call carries it (0.0 without an epilogue; a bad value is checked by the build)."""
    if not epilogue or isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return 0.0
    return float(eps)


def _submit(options: Options, operands: Any, norm: tuple) -> torch.Tensor | NormOutputs:
    """The call through :data:`SPEC`, or with the RMSNorm epilogue through :data:`NORM_SPEC` (its tensors checked
    against the output: its rows, ``n`` and dtype)."""
    if not options.epilogue:
        return submit(SPEC, options.op, options.group, builder(options, operands))
    residual, norm_weight, eps, quant = norm

    def also(ops: Operands) -> None:
        shape = tuple(ops.x.shape[:-1]) + (ops.weights[0].shape[0],)
        dtype = options.out_dtype or ops.x.dtype
        names = (options.op, "residual", "norm_weight")
        check_epilogue(EpilogueArgs(*norm), shape=shape, dtype=dtype, names=names)

    out, residual_out, scale = submit(
        NORM_SPEC,
        options.op,
        options.group,
        builder(options, lambda: _with_norm(operands(), residual, norm_weight), also),
    )
    return NormOutputs(out, residual_out, scale if quant is not None else None)


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


def reference(call: GemmCall, ops: Operands) -> torch.Tensor:
    """Reference::

    partial = dequant(x) @ dequant(weight).T     # [m, n] on every rank (module docstring: dtypes)
    y = all_reduce(partial) + bias               # rank order sum if deterministic
    """
    xd, wd, bias = dequantized(call, ops)
    partial = product(call.fmt, xd, wd)
    if call.world > 1:
        if call.deterministic:
            partial = fixed_order_all_reduce(partial, call.group, call.world)
        else:
            comm.all_reduce(partial, call.group)
    return partial if bias is None else partial.add_(bias)


def chunked(call: GemmCall, ops: Operands) -> torch.Tensor:
    """Same result as :func:`reference`; compute-first pieces of rows: multiply piece i, launch its
    asynchronous all-reduce, go on to piece i + 1 while it is in flight."""
    xd, wd, bias = dequantized(call, ops)
    m, n = xd.shape[0], wd.shape[0]
    out = xd.new_empty((m, n))
    group = call.group
    if call.deterministic:
        return _fixed_order_pieces(call, xd, wd, bias)
    works = []
    for start, stop in comm.split_rows(m, call.parallel_num):
        piece = out[start:stop]
        product(call.fmt, xd[start:stop], wd, out=piece)
        works.append(comm.all_reduce(piece, group, async_op=True))
    for work in works:
        work.wait()
    return out if bias is None else out.add_(bias)


def _fixed_order_pieces(
    call: GemmCall, xd: torch.Tensor, wd: torch.Tensor, bias: torch.Tensor | None, acc: torch.dtype | None = None
) -> torch.Tensor:
    """Deterministic all-reduce per piece: exchange, sum in rank order, gather; ``acc``: the dtype the partials
    travel and sum in (None: the product's).

    Each piece's rows are zero-padded to a multiple of W (zeros keep the sums exact), exchanged
    all-to-all while the next piece is multiplied, summed in rank order, and the reduced blocks
    are all-gathered while the next piece is summed.
    """
    world, n, group = call.world, wd.shape[0], call.group
    out = xd.new_empty((xd.shape[0], n), dtype=acc)
    exchanges = []
    for start, stop in comm.split_rows(xd.shape[0], call.parallel_num):
        block = -(-(stop - start) // world)
        partial = product(call.fmt, xd[start:stop], wd)
        padded = comm.pad_rows(partial if acc is None else cast_to(partial, acc), block * world)
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


def fused(call: GemmCall, ops: Operands) -> torch.Tensor:
    """The fused kernels (kernels/fused/all_reduce.py): GEMM tiles pushed into peers' slots, fixed-order reduce."""
    from ..fused import all_reduce

    return all_reduce.run(call, ops)


def _finished(backend: Any) -> Any:
    """``backend(call, ops)``'s 2-D result in the output dtype, shaped as x's rows with the last dim ``n``."""

    def run(call: GemmCall, ops: Operands) -> torch.Tensor:
        out = backend(call, ops)
        out = out.to(call.out_dtype) if call.out_dtype is not None else out
        # The rows of a 2-D x are x: its result is already [m, n] (a view to the same shape costs a round trip).
        return out if ops.x.dim() == 2 else out.view(tuple(ops.x.shape[:-1]) + (ops.weights[0].shape[0],))

    return run


def _fake(call: GemmCall, ops: Operands) -> torch.Tensor:
    x = ops.x
    return x.new_empty(tuple(x.shape[:-1]) + (ops.weights[0].shape[0],), dtype=call.out_dtype or x.dtype)


_IMPL = ImplTable(sequential=_finished(reference), chunked=_finished(chunked), fused=_finished(fused))
SPEC = OpSpec(
    name="matmul_all_reduce",
    call=GemmCall,
    schema=f"({ONE_WEIGHT_ARGS}, str call) -> Tensor",
    operands=one_weight_operands,
    flat=Operands.one_weight,
    impl=_IMPL,
    fake=_fake,
    tune=tune.tuner(_IMPL),
)


def reduced_reference(call: GemmCall, ops: Operands, residual: torch.Tensor) -> torch.Tensor:
    """``h = sum(partial_r in the accumulator, rank order) + bias + residual`` (fp32, fp64 for fp64): the
    epilogue's input on the sequential backend."""
    xd, wd, bias = dequantized(call, ops)
    partial = product(call.fmt, xd, wd)
    acc = accumulator(partial.dtype)
    # The partials travel in the accumulator, so the rank-order sum is the fused reduce's, operation by operation.
    h = cast_to(partial, acc)
    if call.world > 1:
        h = fixed_order_all_reduce(h, call.group, call.world)
    if bias is not None:
        h = h + cast_to(bias, acc)
    return h + cast_to(residual, acc)


def reduced_chunked(call: GemmCall, ops: Operands, residual: torch.Tensor) -> torch.Tensor:
    """:func:`reduced_reference` in compute-first pieces: each piece's partials (in the accumulator) exchanged while
    the next piece is multiplied, and summed in rank order: the same sums, element by element."""
    xd, wd, bias = dequantized(call, ops)
    acc = accumulator(xd.dtype)
    h = _fixed_order_pieces(call, xd, wd, None if bias is None else cast_to(bias, acc), acc)
    return h + cast_to(residual, acc)


def reduced_fused(call: GemmCall, ops: Operands, residual: torch.Tensor) -> torch.Tensor:
    """:func:`reduced_reference` on the fused backend: the residual added in the reduce kernel."""
    from ..fused import all_reduce

    return all_reduce.run(call, ops, residual=residual)


@dataclass(slots=True)
class NormOperands(Operands):
    """:class:`Operands` of one weight with the epilogue's ``residual`` and ``norm_weight``."""

    residual: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None

    def flat(self) -> tuple:
        return (*self.one_weight(), self.residual, self.norm_weight)


def _with_norm(built: tuple[OperandFormat, Operands], residual: Any, norm_weight: Any) -> tuple:
    fmt, ops = built
    fields = {f.name: getattr(ops, f.name) for f in dataclasses.fields(ops)}
    return fmt, NormOperands(**fields, residual=residual, norm_weight=norm_weight)


def _norm_operands(*args: Any) -> NormOperands:
    return _with_norm((None, one_weight_operands(*args[:6])), args[6], args[7])[1]  # type: ignore[arg-type]


def _norm_finished(reduced: Any) -> Any:
    """``(out, residual_out, scale)`` of the epilogue (:mod:`kernels.ops.norm`) after ``reduced``, the fp32 ``h``."""

    def run(call: GemmCall, ops: NormOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        residual = ops.residual
        assert residual is not None and ops.norm_weight is not None
        h = reduced(call, ops, rows_of(residual))
        mode = call.epilogue.partition(":")[2] or None
        dtypes = (residual.dtype, residual.dtype)
        quant = (mode, torch.float8_e4m3fn)
        spec = NormSpec(call.eps, dtypes, quant, call.backend == "fused", tuple(residual.shape))
        return finish(h, ops.norm_weight, spec)

    return run


def _norm_fake(call: GemmCall, ops: NormOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    residual = ops.residual
    assert residual is not None
    mode = call.epilogue.partition(":")[2] or None
    out = residual.new_empty(residual.shape, dtype=torch.float8_e4m3fn if mode else residual.dtype)
    scale = residual.new_empty(scale_shape(tuple(residual.shape), mode), dtype=torch.float32)
    return out, residual.new_empty(residual.shape), scale


NORM_SPEC = OpSpec(
    name="matmul_all_reduce_rmsnorm",
    call=GemmCall,
    schema=f"({ONE_WEIGHT_ARGS}, Tensor residual, Tensor norm_weight, str call) -> (Tensor, Tensor, Tensor)",
    operands=_norm_operands,
    flat=NormOperands.flat,
    impl={
        "sequential": _norm_finished(reduced_reference),
        "chunked": _norm_finished(reduced_chunked),
        "fused": _norm_finished(reduced_fused),
    },
    fake=_norm_fake,
)
