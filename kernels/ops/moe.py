"""Tensor-parallel mixture-of-experts: all-gather + grouped GEMM, and grouped GEMM + top-k combine + reduce-scatter.

Public functions (docs/api.md, "Tensor-parallel MoE"): :func:`all_gather_grouped_matmul` and
:func:`grouped_matmul_reduce_scatter`, with their twins :func:`all_gather_grouped_matmul_reference` and
:func:`grouped_matmul_reduce_scatter_reference` (the sequential backend called directly; their docstrings
state the semantics). The expert weights are sharded as in a dense Megatron MLP: the first op's column shard
of every expert ``[E, n_local, k]`` (each rank computes its ``n_local`` of the intermediate for every
token), the second's row shard ``[E, k_out, n_local]`` (each rank's partial sum, reduced over ranks).
Registered operators::

    coc::all_gather_grouped_matmul(Tensor x, Tensor topk_ids, Tensor weight, str call, Tensor? x_scale=None,
                                   Tensor? w_scale=None)
        -> (Tensor y, Tensor expert_offsets, Tensor token_index, Tensor slot)
    coc::grouped_matmul_reduce_scatter(Tensor h, Tensor weight, Tensor[] routing, Tensor topk_weights, str call,
                                       Tensor? x_scale=None, Tensor? w_scale=None)
        -> Tensor                                       # call: kernels.ops.moe_routing.MoeCall.encode()

Formats (:mod:`kernels.format`, carried by the call): plain (fp16 / bf16 / fp32) and FP8 (e4m3 / e5m2 payloads
with fp32 scales in :func:`kernels.grouped_matmul`'s layouts, its per-expert ``w_scale``; forward-only, as the
dense FP8 ops). An FP8 row of x travels with its scales (:func:`kernels.format.pack_rows`: one ``uint8`` row; a
tensorwise scale is its rank's scalar on each of its rows), the gathered scales go with their rows into the
grouped GEMM; the reducing op's partials stay fp32 and the output is rounded once to ``out_dtype``.

Backends: ``sequential`` (the reference, through torch.distributed and a per-expert ``torch.mm`` loop),
``chunked`` (the rows split in ``parallel_num`` pieces, the collective of one piece in flight while another
computes, with the grouped GEMM kernel of :mod:`kernels.fused.grouped` where it runs: CUDA, or the CPU under
``TRITON_INTERPRET=1``) and ``fused`` (:mod:`kernels.fused.moe`: the exchanges over the symmetric heap, checked
across ranks by the heap's call check; the gather is gather-then-GEMM for now). A fused request where the fused
kernels cannot run (:func:`kernels.fused.unavailable_reason`) warns once per reason and runs ``chunked``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import callcheck, checks, comm
from ..call import resolve_group
from ..format import OperandFormat, pack_rows, row_scales, unpack_rows
from ..op_registration import define_op
from .all_gather import gather_rows
from .moe_routing import (
    MoeCall,
    MoeRouting,
    check_gather,
    check_id_values,
    check_routing_values,
    check_scale_values,
    check_scatter,
    describe,
    expert_of_rows,
    grouped_mm,
    grouped_mm_loop,
    piece_rows,
    piece_tokens,
    resolve,
    route,
    row_of_pair,
    wanted,
    x_scale_of,
)

_GATHER, _SCATTER = "all_gather_grouped_matmul", "grouped_matmul_reduce_scatter"


def all_gather_grouped_matmul(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    num_experts: int | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
) -> tuple[torch.Tensor, MoeRouting]:
    """``(y [m_local * W * topk, n_local], routing)``: every rank's tokens, each times its top-k experts' column
    shard, the rows grouped by expert. Semantics: :func:`all_gather_grouped_matmul_reference`.

    ``x [m_local, k]`` (fp16 / bf16 / fp32) this rank's tokens; ``topk_ids [m_local, topk]`` (int32 / int64,
    values in ``[0, E)``) their experts; ``weight [E, n_local, k]`` (x's dtype); ``num_experts``: E, checked
    against ``weight.shape[0]`` when given; ``backend`` / ``parallel_num`` as the dense ops. Differentiable in
    ``x`` and ``weight`` (:class:`kernels.ops.moe_autograd.AllGatherGroupedMatmulFunction`).

    FP8 (forward-only): ``x`` and ``weight`` FP8 payloads, ``x_scale`` this rank's (``[m_local, ceil(k / 128)]``
    block, ``[m_local, 1]`` row, ``[]`` tensor: its rows'), ``w_scale`` per expert as :func:`kernels.
    grouped_matmul`'s (``[E, ceil(n_local / 128), ceil(k / 128)]``, ``[E, n_local, 1]``, ``[E]``); ``y`` in
    ``out_dtype`` (default bf16), ``dequant(xg[t]) @ dequant(weight[e]).T`` in fp32 rounded once.
    """
    options = {"x_scale": x_scale, "w_scale": w_scale, "out_dtype": out_dtype}
    request = (backend, parallel_num)
    call = _admit_gather(_GATHER, (x, topk_ids, weight), num_experts, group=group, request=request, options=options)
    return _gather_apply(x, topk_ids, weight, call, (x_scale, w_scale))


def all_gather_grouped_matmul_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    num_experts: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, MoeRouting]:
    """The semantics of :func:`all_gather_grouped_matmul`, in torch (validated and rank-checked the same way)::

        xg = cat([x of rank 0, ..., x of rank W-1])                 # [M, k], M = m_local * W
        ids = cat([topk_ids of rank 0, ..., rank W-1]).long()       # [M, topk]
        order = argsort(ids.flatten(), stable=True)                 # grouped by expert, ties in (token, slot) order
        token_index, slot = order // topk, order % topk
        expert_offsets[e] = count(ids <= e)                         # cumulative ends, last = M * topk
        y = empty(M * topk, n_local, dtype=x.dtype)
        for e in range(E):                                          # rows [expert_offsets[e-1], expert_offsets[e])
            rows = the rows of e
            y[rows] = torch.mm(xg[token_index[rows]], weight[e].T)  # fp32 accumulation, one rounding
        return y, MoeRouting(expert_offsets, token_index, slot)     # int64

    Rank ``r``'s local token ``i`` is gathered token ``r * m_local + i``. FP8: each rank's rows gathered with
    their scale rows (a tensorwise scale on each of its rank's rows), ``y[rows] = (dequant(xg[token_index[rows]])
    @ dequant(weight[e]).T).to(out_dtype)`` with fp32 products and sums (:func:`kernels.dequantize_fp8`).
    """
    options = {"x_scale": x_scale, "w_scale": w_scale, "out_dtype": out_dtype}
    op, request = f"{_GATHER}_reference", ("sequential", None)
    call = _admit_gather(op, (x, topk_ids, weight), num_experts, group=group, request=request, options=options)
    return _gather_apply(x, topk_ids, weight, call, (x_scale, w_scale))


def grouped_matmul_reduce_scatter(
    h: torch.Tensor,
    weight: torch.Tensor,
    routing: MoeRouting,
    topk_weights: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
) -> torch.Tensor:
    """``out [m_local, k_out]``: each row of ``h`` times its expert's row shard, the top-k weighted combine per
    token, then the reduce-scatter over ranks. Semantics: :func:`grouped_matmul_reduce_scatter_reference`.

    ``h [M * topk, n_local]``: rows in ``routing``'s order (:func:`all_gather_grouped_matmul`'s output after
    the activation); ``weight [E, k_out, n_local]`` (h's dtype); ``routing``: the :class:`MoeRouting` that call
    returned; ``topk_weights [M, topk]`` (any floating dtype, used in fp32): the weights of the *gathered*
    tokens, ``M = m_local * W`` in rank order (every rank combines every token before the reduce-scatter).
    Rank ``r`` gets tokens ``[r * m_local, (r + 1) * m_local)``. Differentiable in ``h``, ``weight`` and
    ``topk_weights``, whose gradient is the whole one on every rank (it is replicated):
    :class:`kernels.ops.moe_autograd.GroupedMatmulReduceScatterFunction`.

    FP8 (forward-only): ``h`` and ``weight [E, k_out, n_local]`` FP8 payloads, ``x_scale`` h's scales
    (``[M * topk, ceil(n_local / 128)]``, ``[M * topk, 1]`` or ``[]``), ``w_scale`` per expert as
    :func:`kernels.grouped_matmul`'s; the partials, combine and rank-order sum in fp32 as for plain, ``out``
    rounded once to ``out_dtype`` (default bf16).
    """
    options = {"x_scale": x_scale, "w_scale": w_scale, "out_dtype": out_dtype}
    tensors, request = (h, weight, routing, topk_weights), (backend, parallel_num)
    call = _admit_scatter(_SCATTER, tensors, group=group, request=request, options=options)
    return _scatter_apply(tensors, call, (x_scale, w_scale))


def grouped_matmul_reduce_scatter_reference(
    h: torch.Tensor,
    weight: torch.Tensor,
    routing: MoeRouting,
    topk_weights: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The semantics of :func:`grouped_matmul_reduce_scatter`, in torch::

    partial = empty(M * topk, k_out, dtype=float32)
    for e in range(E):
        rows = the rows of e (routing.expert_offsets)
        partial[rows] = torch.mm(h[rows].float(), weight[e].float().T)    # fp32, not rounded to h's dtype
    row = inverse of (routing.token_index, routing.slot)                  # row[t, s]: the row of pair (t, s)
    combined[t] = topk_weights[t, 0].float() * partial[row[t, 0]]         # [M, k_out] fp32,
    for s in range(1, topk):                                              # slot order
        combined[t] += topk_weights[t, s].float() * partial[row[t, s]]
    out = sum over ranks r in rank order of combined_of_rank_r[rank * m_local:(rank + 1) * m_local]   # fp32
    return out.to(h.dtype)                                                # [m_local, k_out], one rounding

    FP8: ``h[rows]`` and ``weight[e]`` dequantized (:func:`kernels.dequantize_fp8`; h's scales per its rows),
    the partials' products and sums in full fp32, and ``out.to(out_dtype)``.
    """
    options = {"x_scale": x_scale, "w_scale": w_scale, "out_dtype": out_dtype}
    tensors, request = (h, weight, routing, topk_weights), ("sequential", None)
    call = _admit_scatter(f"{_SCATTER}_reference", tensors, group=group, request=request, options=options)
    return _scatter_apply(tensors, call, (x_scale, w_scale))


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _gather_apply(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call: MoeCall, scales: tuple) -> tuple:
    """The operator, through its autograd Function (:mod:`kernels.ops.moe_autograd`) where a gradient is needed
    (never for FP8: the admission refused that)."""
    if _needs_grad(x, weight):
        from .moe_autograd import AllGatherGroupedMatmulFunction

        y, offsets, token_index, slot = AllGatherGroupedMatmulFunction.apply(x, topk_ids, weight, call.encode())
    else:
        y, offsets, token_index, slot = gather_operator(x, topk_ids, weight, call.encode(), *scales)
    return y, MoeRouting(offsets, token_index, slot)


def _scatter_apply(tensors: tuple, call: MoeCall, scales: tuple) -> torch.Tensor:
    h, weight, routing, topk_weights = tensors
    if _needs_grad(h, weight, topk_weights):
        from .moe_autograd import GroupedMatmulReduceScatterFunction

        return GroupedMatmulReduceScatterFunction.apply(h, weight, topk_weights, (tuple(routing), call.encode()))
    return scatter_operator(h, weight, list(routing), topk_weights, call.encode(), *scales)


def _format_of(fmt: OperandFormat, out_dtype: torch.dtype) -> tuple:
    """What the call carries: ``(format, out_dtype)``, out_dtype None for plain (the output in x's dtype)."""
    return (fmt, out_dtype if fmt.kind == "fp8" else None)


def _admit_gather(
    op: str, tensors: tuple, num_experts: object, *, group: object, request: tuple, options: dict
) -> MoeCall:
    """Validate, compare with the peers (:func:`kernels.callcheck.admit`: a rank's error reaches every rank,
    before any communication) and resolve the backend."""
    x, topk_ids, weight = tensors
    world = checks.world_of(group)
    device = x.device if isinstance(x, torch.Tensor) else None

    formats = []

    def validate() -> tuple[int, ...]:
        num_e, fmt, out_dtype = check_gather(x, topk_ids, weight, num_experts, options)
        formats.append(_format_of(fmt, out_dtype))
        checks.check_options(request[0], request[1], "deterministic", True)
        shape = (x.shape[0], x.shape[1], weight.shape[1])
        fp8 = (fmt, weight.dtype, out_dtype)
        return describe(_GATHER, shape, x.dtype, request=request, moe=(num_e, topk_ids.shape[1]), fp8=fp8)

    def values() -> None:
        if wanted(x.device):
            check_id_values(topk_ids, weight.shape[0])
            check_scale_values(options)

    callcheck.admit(op, group, world, device, validate, values=values, backend=request[0])  # type: ignore[arg-type]
    shape = (x.shape[0], x.shape[1], weight.shape[1])
    return resolve(op, request, shape, group, device=x.device, fmt=formats[0])  # type: ignore[arg-type]


def _admit_scatter(op: str, tensors: tuple, *, group: object, request: tuple, options: dict) -> MoeCall:
    h, weight, routing, topk_weights = tensors
    world = checks.world_of(group)
    device = h.device if isinstance(h, torch.Tensor) else None
    formats = []

    def validate() -> tuple[int, ...]:
        num_e, topk, fmt, out_dtype = check_scatter(tensors, world, options)
        formats.append(_format_of(fmt, out_dtype))
        checks.check_options(request[0], request[1], "deterministic", True)
        shape = (topk_weights.shape[0], h.shape[1], weight.shape[1])
        fp8 = (fmt, weight.dtype, out_dtype)
        return describe(_SCATTER, shape, h.dtype, request=request, moe=(num_e, topk), fp8=fp8)

    def values() -> None:
        if wanted(h.device):
            check_routing_values(routing, topk_weights.shape[1])
            check_scale_values(options)

    callcheck.admit(op, group, world, device, validate, values=values, backend=request[0])  # type: ignore[arg-type]
    shape = (topk_weights.shape[0], h.shape[1], weight.shape[1])
    return resolve(op, request, shape, group, device=h.device, fmt=formats[0])  # type: ignore[arg-type]


def _fp8_of(call: MoeCall, x_scale_rows: torch.Tensor | None, w_scale: torch.Tensor | None) -> tuple | None:
    """The grouped GEMMs' ``fp8`` argument (:func:`kernels.ops.moe_routing.grouped_mm`): None for plain."""
    return (call.fmt, x_scale_rows, w_scale) if call.scaled else None


def _gather_sequential(
    x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call: MoeCall, *, scales: tuple
) -> tuple:
    group, (x_scale, w_scale) = resolve_group(call.group_name), scales
    # FP8: payload and scales in one uint8 row (gloo cannot move float8), so every row keeps its rank's scales.
    packed = gather_rows(pack_rows(call.fmt, x.contiguous(), x_scale_of(call, x, x_scale)), group, call.world)
    ids = gather_rows(topk_ids.to(torch.int64).contiguous(), group, call.world)
    routing = route(ids, weight.shape[0])
    xr, xsr = unpack_rows(call.fmt, packed[routing.token_index], x.shape[1], x.dtype)
    fp8 = _fp8_of(call, xsr, w_scale)
    y = grouped_mm_loop(xr, weight, routing.expert_offsets, call.out_dtype or x.dtype, fp8=fp8)
    return (y, *routing)


def _gather_chunked(
    x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call: MoeCall, *, scales: tuple
) -> tuple:
    """Same result as :func:`_gather_sequential` (within the GEMMs' rounding); comm-first pieces.

    The ids (a few bytes per token) are gathered first, and the routing is computed while the pieces of x
    are in flight; piece i holds rows ``[start, stop)`` of every rank (FP8: packed with their scales), and its
    pairs' output rows, taken in output order, are grouped by expert as the whole output is: one grouped GEMM
    per piece, its rows written to their final place.
    """
    group, world, (x_scale, w_scale) = resolve_group(call.group_name), call.world, scales
    m_local, k = x.shape
    packed = pack_rows(call.fmt, x.contiguous(), x_scale_of(call, x, x_scale))
    ids = topk_ids.to(torch.int64).contiguous()
    ids_gathered = ids.new_empty((world * m_local, ids.shape[1]))
    ids_work = comm.all_gather(ids_gathered, ids, group, async_op=True)
    pieces = comm.split_rows(m_local, call.parallel_num)
    bufs, works = [], []
    for start, stop in pieces:
        buf = packed.new_empty((world * (stop - start), packed.shape[1]))
        works.append(comm.all_gather(buf, packed[start:stop], group, async_op=True))
        bufs.append(buf)
    ids_work.wait()
    num_e, topk = weight.shape[0], ids.shape[1]
    routing = route(ids_gathered, num_e)
    pair_rows, expert_of_row = row_of_pair(routing, topk), expert_of_rows(routing)
    y = x.new_empty((world * m_local * topk, weight.shape[1]), dtype=call.out_dtype or x.dtype)
    for (start, stop), buf, work in zip(pieces, bufs, works, strict=True):
        work.wait()
        p = stop - start
        tokens = piece_tokens(world, m_local, start, stop, x.device)
        rows, offsets, _ = piece_rows(pair_rows[tokens], expert_of_row, num_e)
        # Gathered token t sits at row (t // m_local) * p + t % m_local - start of this piece's buffer.
        t = routing.token_index[rows]
        xr, xsr = unpack_rows(call.fmt, buf[(t // m_local) * p + t % m_local - start], k, x.dtype)
        y[rows] = grouped_mm(xr, weight, offsets, y.dtype, fp8=_fp8_of(call, xsr, w_scale))
    return (y, *routing)


def _combine(partial: torch.Tensor, rows: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``combined[t] = sum over s, in slot order, of w[t, s] * partial[rows[t, s]]`` in fp32: an explicit loop
    (not ``sum(dim)``) so that every backend adds in the same order."""
    w = topk_weights.to(torch.float32)
    acc = partial[rows[:, 0]] * w[:, 0:1]
    for s in range(1, rows.shape[1]):
        acc += partial[rows[:, s]] * w[:, s : s + 1]
    return acc


def _h_fp8(call: MoeCall, h: torch.Tensor, scales: tuple) -> tuple | None:
    """The reducing op's ``fp8`` argument for h's rows (a tensorwise scale on each row), None for plain."""
    if not call.scaled:
        return None
    return _fp8_of(call, row_scales(call.fmt, x_scale_of(call, h, scales[0]), h.shape[0]), scales[1])


def _scatter_sequential(
    h: torch.Tensor, weight: torch.Tensor, routing: tuple, topk_weights: torch.Tensor, call: MoeCall, *, scales: tuple
) -> torch.Tensor:
    routing = MoeRouting(*routing)
    group, world = resolve_group(call.group_name), call.world
    tokens, topk = topk_weights.shape
    partial = grouped_mm_loop(h, weight, routing.expert_offsets, torch.float32, fp8=_h_fp8(call, h, scales))
    combined = _combine(partial, row_of_pair(routing, topk), topk_weights)
    out_dtype = call.out_dtype or h.dtype
    if world == 1:
        return combined.to(out_dtype)
    # All-to-all, then the sum in rank order: the same bits on every rank and backend for the same partials.
    parts = combined.new_empty((world, tokens // world, combined.shape[1]))
    comm.all_to_all(parts, combined, group)
    return comm.sum_in_rank_order(parts).to(out_dtype)


def _scatter_chunked(
    h: torch.Tensor, weight: torch.Tensor, routing: tuple, topk_weights: torch.Tensor, call: MoeCall, *, scales: tuple
) -> torch.Tensor:
    """Same result as :func:`_scatter_sequential` (within the GEMMs' rounding); compute-first pieces.

    Piece i covers tokens ``[start, stop)`` of every owner's ``m_local``: its pairs' rows (in output order,
    so grouped by expert) go through one grouped GEMM and the combine, and the piece's all-to-all runs while
    the next piece computes; each owner sums its rows of every piece in rank order.
    """
    routing = MoeRouting(*routing)
    group, world = resolve_group(call.group_name), call.world
    tokens_total, topk = topk_weights.shape
    m_local, num_e, k_out = tokens_total // world, weight.shape[0], weight.shape[1]
    pair_rows, expert_of_row = row_of_pair(routing, topk), expert_of_rows(routing)
    fp8 = _h_fp8(call, h, scales)
    out = h.new_empty((m_local, k_out), dtype=torch.float32)
    pending = []
    for start, stop in comm.split_rows(m_local, call.parallel_num):
        tokens = piece_tokens(world, m_local, start, stop, h.device)
        rows, offsets, order = piece_rows(pair_rows[tokens], expert_of_row, num_e)
        piece_fp8 = None if fp8 is None else (fp8[0], fp8[1][rows], fp8[2])
        partial = grouped_mm(h[rows], weight, offsets, torch.float32, fp8=piece_fp8)
        local = torch.empty_like(order)
        local[order] = torch.arange(order.numel(), device=order.device)
        combined = _combine(partial, local.view(-1, topk), topk_weights[tokens])
        parts = combined.new_empty((world, stop - start, k_out))
        pending.append((comm.all_to_all(parts, combined, group, async_op=True), start, stop, parts))
    for work, start, stop, parts in pending:
        work.wait()
        out[start:stop] = comm.sum_in_rank_order(parts)
    return out.to(call.out_dtype or h.dtype)


def _gather_fused(
    x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call: MoeCall, *, scales: tuple
) -> tuple:
    """:func:`_gather_sequential`'s result over the symmetric heap (:func:`kernels.fused.moe.gather`)."""
    from ..fused import moe as fused_moe

    shape = (x.shape[0], x.shape[1], weight.shape[1])
    moe = (weight.shape[0], topk_ids.shape[1])
    fp8 = (call.fmt, weight.dtype, call.out_dtype)
    descriptor = describe(_GATHER, shape, x.dtype, request=("fused", None), moe=moe, fp8=fp8)
    group = resolve_group(call.group_name)
    scaled = (call.fmt, x_scale_of(call, x, scales[0]), scales[1], call.out_dtype) if call.scaled else None
    return fused_moe.gather(x, topk_ids, weight, route=route, group=group, descriptor=descriptor, fp8=scaled)


def _scatter_fused(
    h: torch.Tensor, weight: torch.Tensor, routing: tuple, topk_weights: torch.Tensor, call: MoeCall, *, scales: tuple
) -> torch.Tensor:
    """:func:`_scatter_sequential`'s result over the symmetric heap (:func:`kernels.fused.moe.reduce_scatter`):
    the same combine and rank-order sum, the grouped GEMM's fp32 partials summed in the kernel's order."""
    from ..fused import moe as fused_moe

    routing = MoeRouting(*routing)
    cfg = fused_moe.tile_config(h.device)
    shape = (topk_weights.shape[0], h.shape[1], weight.shape[1])
    moe = (weight.shape[0], topk_weights.shape[1])
    tiles = (cfg.block_m, cfg.block_n)
    fp8 = (call.fmt, weight.dtype, call.out_dtype)
    descriptor = describe(_SCATTER, shape, h.dtype, request=("fused", None), moe=moe, tiles=tiles, fp8=fp8)
    h_fp8 = _h_fp8(call, h, scales)
    return fused_moe.reduce_scatter(
        h,
        weight,
        tuple(routing),
        topk_weights,
        pair_rows=row_of_pair(routing, topk_weights.shape[1]),
        group=resolve_group(call.group_name),
        descriptor=descriptor,
        fp8=None if h_fp8 is None else (*h_fp8, call.out_dtype),
    )


GATHER_IMPL = {"sequential": _gather_sequential, "chunked": _gather_chunked, "fused": _gather_fused}
SCATTER_IMPL = {"sequential": _scatter_sequential, "chunked": _scatter_chunked, "fused": _scatter_fused}


def _gather_run(
    x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call_text: str, *scales: object
) -> tuple:
    """The operator's body; ``scales = (x_scale, w_scale)`` as the schema orders them (None for plain)."""
    call = MoeCall.decode(call_text)
    return GATHER_IMPL[call.backend](x, topk_ids, weight, call, scales=scales or (None, None))


def _gather_fake(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call_text: str, *_: object) -> tuple:
    call = MoeCall.decode(call_text)
    rows = x.shape[0] * call.world * topk_ids.shape[1]
    index = x.new_empty((rows,), dtype=torch.int64)
    offsets = x.new_empty((weight.shape[0],), dtype=torch.int64)
    y = x.new_empty((rows, weight.shape[1]), dtype=call.out_dtype or x.dtype)
    return y, offsets, index, torch.empty_like(index)


def _scatter_run(
    h: torch.Tensor, weight: torch.Tensor, routing: list[torch.Tensor], topk_weights: torch.Tensor, *rest: object
) -> torch.Tensor:
    """The operator's body; ``rest = (call, x_scale, w_scale)`` as the schema orders them."""
    call_text, *scales = rest
    assert isinstance(call_text, str)
    call = MoeCall.decode(call_text)
    return SCATTER_IMPL[call.backend](
        h, weight, tuple(routing), topk_weights, call, scales=tuple(scales) or (None, None)
    )


def _scatter_fake(
    h: torch.Tensor, weight: torch.Tensor, routing: list[torch.Tensor], topk_weights: torch.Tensor, *rest: object
) -> torch.Tensor:
    call = MoeCall.decode(str(rest[0]))
    return h.new_empty((topk_weights.shape[0] // call.world, weight.shape[1]), dtype=call.out_dtype or h.dtype)


gather_operator = define_op(
    "all_gather_grouped_matmul(Tensor x, Tensor topk_ids, Tensor weight, str call, Tensor? x_scale=None, "
    "Tensor? w_scale=None) -> (Tensor, Tensor, Tensor, Tensor)",
    _gather_run,
    _gather_fake,
)
scatter_operator = define_op(
    "grouped_matmul_reduce_scatter(Tensor h, Tensor weight, Tensor[] routing, Tensor topk_weights, str call, "
    "Tensor? x_scale=None, Tensor? w_scale=None) -> Tensor",
    _scatter_run,
    _scatter_fake,
)
