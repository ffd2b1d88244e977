"""Tensor-parallel mixture-of-experts: all-gather + grouped GEMM, and grouped GEMM + top-k combine + reduce-scatter.

Public functions (docs/api.md, "Tensor-parallel MoE"): :func:`all_gather_grouped_matmul` and
:func:`grouped_matmul_reduce_scatter` (their docstrings state the semantics: the sequential backend). The expert
weights are sharded as in a dense Megatron MLP: the first op's column shard
of every expert ``[E, n_local, k]`` (each rank computes its ``n_local`` of the intermediate for every
token), the second's row shard ``[E, k_out, n_local]`` (each rank's partial sum, reduced over ranks).
Registered operators::

    coc::all_gather_grouped_matmul(Tensor x, Tensor topk_ids, Tensor weight, Tensor? x_scale, Tensor? w_scale,
                                   str call) -> (Tensor y, Tensor expert_offsets, Tensor token_index, Tensor slot)
    coc::grouped_matmul_reduce_scatter(Tensor h, Tensor weight, Tensor[] routing, Tensor topk_weights,
                                       Tensor? x_scale, Tensor? w_scale, str call) -> Tensor    # call: MoeCall

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

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ... import checks, comm
from ...format import OperandFormat, pack_rows, row_scales, unpack_rows
from ...protocol import Built, OpSpec, admitted, group_name, submit
from ..all_gather import gather_rows
from .routing import (
    GATHER,
    SCATTER,
    MoeCall,
    MoeRouting,
    check_gather,
    check_id_values,
    check_routing_values,
    check_scale_values,
    check_scatter,
    expert_of_rows,
    grouped_mm,
    grouped_mm_loop,
    needs_grad,
    piece_rows,
    piece_tokens,
    route,
    row_of_pair,
    wanted,
    x_scale_of,
)

_GATHER, _SCATTER = GATHER, SCATTER


@dataclass(frozen=True)
class GatherOperands:
    x: torch.Tensor
    topk_ids: torch.Tensor
    weight: torch.Tensor
    x_scale: torch.Tensor | None = None
    w_scale: torch.Tensor | None = None

    def flat(self) -> tuple:
        return (self.x, self.topk_ids, self.weight, self.x_scale, self.w_scale)


@dataclass(frozen=True)
class ScatterOperands:
    h: torch.Tensor
    weight: torch.Tensor
    routing: MoeRouting
    topk_weights: torch.Tensor
    x_scale: torch.Tensor | None = None
    w_scale: torch.Tensor | None = None

    def flat(self) -> tuple:
        return (self.h, self.weight, list(self.routing), self.topk_weights, self.x_scale, self.w_scale)

    @staticmethod
    def of(*args: Any) -> ScatterOperands:
        """The operator's arguments ``(h, weight, routing tensors, topk_weights, x_scale, w_scale)``."""
        h, weight, routing, topk_weights, x_scale, w_scale = args
        return ScatterOperands(h, weight, MoeRouting(*routing), topk_weights, x_scale, w_scale)


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
    shard, the rows grouped by expert. Semantics (the ``sequential`` backend)::

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

    ``x [m_local, k]`` (fp16 / bf16 / fp32) this rank's tokens; ``topk_ids [m_local, topk]`` (int32 / int64,
    values in ``[0, E)``) their experts; ``weight [E, n_local, k]`` (x's dtype); ``num_experts``: E, checked
    against ``weight.shape[0]`` when given; ``backend`` / ``parallel_num`` as the dense ops. Rank ``r``'s local
    token ``i`` is gathered token ``r * m_local + i``. Differentiable in ``x`` and ``weight``
    (:class:`kernels.ops.moe.autograd.AllGatherGroupedMatmulFunction`).

    FP8 (forward-only): ``x`` and ``weight`` FP8 payloads, ``x_scale`` this rank's (``[m_local, ceil(k / 128)]``
    block, ``[m_local, 1]`` row, ``[]`` tensor: its rows'), ``w_scale`` per expert as :func:`kernels.
    grouped_matmul`'s (``[E, ceil(n_local / 128), ceil(k / 128)]``, ``[E, n_local, 1]``, ``[E]``); ``y`` in
    ``out_dtype`` (default bf16): each rank's rows gathered with their scale rows, ``y[rows] =
    (dequant(xg[token_index[rows]]) @ dequant(weight[e]).T).to(out_dtype)`` with fp32 products and sums.
    """
    options = {"x_scale": x_scale, "w_scale": w_scale, "out_dtype": out_dtype}

    def build(world: int) -> Built:
        num_e, fmt, out = check_gather(x, topk_ids, weight, num_experts, options)
        checks.check_backend(backend)
        checks.check_parallel_num(parallel_num)
        if wanted(x.device):
            check_id_values(topk_ids, weight.shape[0])
            check_scale_values(options)
        call = _moe_call(_GATHER, (num_e, topk_ids.shape[1], fmt, out), group, world, (backend, parallel_num))
        shape = (x.shape[0], x.shape[1], weight.shape[1])
        return Built(call, GatherOperands(x, topk_ids, weight, x_scale, w_scale), x.device, shape)

    if needs_grad(x, weight):
        y, offsets, token_index, slot = _differentiable(GATHER_SPEC, group, build)
    else:
        y, offsets, token_index, slot = submit(GATHER_SPEC, _GATHER, group, build)
    return y, MoeRouting(offsets, token_index, slot)


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
    token, then the reduce-scatter over ranks. Semantics (the ``sequential`` backend)::

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

    ``h [M * topk, n_local]``: rows in ``routing``'s order (:func:`all_gather_grouped_matmul`'s output after
    the activation); ``weight [E, k_out, n_local]`` (h's dtype); ``routing``: the :class:`MoeRouting` that call
    returned; ``topk_weights [M, topk]`` (any floating dtype, used in fp32): the weights of the *gathered*
    tokens, ``M = m_local * W`` in rank order (every rank combines every token before the reduce-scatter).
    Rank ``r`` gets tokens ``[r * m_local, (r + 1) * m_local)``. Differentiable in ``h``, ``weight`` and
    ``topk_weights``, whose gradient is the whole one on every rank (it is replicated):
    :class:`kernels.ops.moe.autograd.GroupedMatmulReduceScatterFunction`.

    FP8 (forward-only): ``h`` and ``weight [E, k_out, n_local]`` FP8 payloads, ``x_scale`` h's scales
    (``[M * topk, ceil(n_local / 128)]``, ``[M * topk, 1]`` or ``[]``), ``w_scale`` per expert as
    :func:`kernels.grouped_matmul`'s; ``h[rows]`` and ``weight[e]`` dequantized, the partials, combine and
    rank-order sum in fp32 as for plain, ``out`` rounded once to ``out_dtype`` (default bf16).
    """
    options = {"x_scale": x_scale, "w_scale": w_scale, "out_dtype": out_dtype}
    tensors = (h, weight, routing, topk_weights)

    def build(world: int) -> Built:
        num_e, topk, fmt, out = check_scatter(tensors, world, options)
        checks.check_backend(backend)
        checks.check_parallel_num(parallel_num)
        if wanted(h.device):
            check_routing_values(routing, topk_weights.shape[1])
            check_scale_values(options)
        call = _moe_call(_SCATTER, (num_e, topk, fmt, out), group, world, (backend, parallel_num))
        shape = (topk_weights.shape[0], h.shape[1], weight.shape[1])
        ops = ScatterOperands(h, weight, routing, topk_weights, x_scale, w_scale)
        return Built(call, ops, h.device, shape)

    if needs_grad(h, weight, topk_weights):
        return _differentiable(SCATTER_SPEC, group, build)
    return submit(SCATTER_SPEC, _SCATTER, group, build)


def _moe_call(
    op: str,
    checked: tuple[int, int, OperandFormat, torch.dtype],
    group: dist.ProcessGroup | None,
    world: int,
    knobs: tuple[str | None, int | None],
) -> MoeCall:
    """The call value of either op: ``checked = (E, topk, format, output dtype)`` from its metadata checks (the
    output dtype kept for FP8 only: a plain call's output is in x's dtype), ``knobs = (backend, parallel_num)``."""
    num_e, topk, fmt, out = checked
    backend, parallel_num = knobs
    return MoeCall(
        op=op,
        group_name=group_name(group),
        world=world,
        backend=backend,
        parallel_num=parallel_num,
        fmt=fmt,
        out_dtype=out if fmt.kind == "fp8" else None,
        num_experts=num_e,
        topk=topk,
    )


def _differentiable(spec: OpSpec, group: dist.ProcessGroup | None, build: object) -> object:
    """The call through its autograd Function (:mod:`kernels.ops.moe.autograd`): admitted and decided as any
    call, the Function's forward then runs it (never FP8: the validation refuses an FP8 operand that needs a
    gradient)."""
    from .autograd import AllGatherGroupedMatmulFunction, GroupedMatmulReduceScatterFunction

    built, call, text = admitted(spec, spec.name, group, build)
    ops, text = built.operands, text or call.encode()
    if spec is GATHER_SPEC:
        return AllGatherGroupedMatmulFunction.apply(ops.x, ops.topk_ids, ops.weight, text)
    routing = (tuple(ops.routing), text)
    return GroupedMatmulReduceScatterFunction.apply(ops.h, ops.weight, ops.topk_weights, routing)


def _fp8_of(call: MoeCall, x_scale_rows: torch.Tensor | None, w_scale: torch.Tensor | None) -> tuple | None:
    """The grouped GEMMs' ``fp8`` argument (:func:`kernels.ops.moe.routing.grouped_mm`): None for plain."""
    return (call.fmt, x_scale_rows, w_scale) if call.fmt.kind == "fp8" else None


def _gather_sequential(call: MoeCall, ops: GatherOperands) -> tuple:
    x, topk_ids, weight, x_scale, w_scale = ops.x, ops.topk_ids, ops.weight, ops.x_scale, ops.w_scale
    group = call.group
    # FP8: payload and scales in one uint8 row (gloo cannot move float8), so every row keeps its rank's scales.
    packed = gather_rows(pack_rows(call.fmt, x.contiguous(), x_scale_of(call.fmt, x, x_scale)), group, call.world)
    ids = gather_rows(topk_ids.to(torch.int64).contiguous(), group, call.world)
    routing = route(ids, weight.shape[0])
    xr, xsr = unpack_rows(call.fmt, packed[routing.token_index], x.shape[1], x.dtype)
    fp8 = _fp8_of(call, xsr, w_scale)
    y = grouped_mm_loop(xr, weight, routing.expert_offsets, call.out_dtype or x.dtype, fp8=fp8)
    return (y, *routing)


def _gather_chunked(call: MoeCall, ops: GatherOperands) -> tuple:
    """Same result as :func:`_gather_sequential` (within the GEMMs' rounding); comm-first pieces.

    The ids (a few bytes per token) are gathered first, and the routing is computed while the pieces of x
    are in flight; piece i holds rows ``[start, stop)`` of every rank (FP8: packed with their scales), and its
    pairs' output rows, taken in output order, are grouped by expert as the whole output is: one grouped GEMM
    per piece, its rows written to their final place.
    """
    x, topk_ids, weight, x_scale, w_scale = ops.x, ops.topk_ids, ops.weight, ops.x_scale, ops.w_scale
    group, world = call.group, call.world
    m_local, k = x.shape
    packed = pack_rows(call.fmt, x.contiguous(), x_scale_of(call.fmt, x, x_scale))
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


def _h_fp8(call: MoeCall, ops: ScatterOperands) -> tuple | None:
    """The reducing op's ``fp8`` argument for h's rows (a tensorwise scale on each row), None for plain."""
    if call.fmt.kind != "fp8":
        return None
    h = ops.h
    return _fp8_of(call, row_scales(call.fmt, x_scale_of(call.fmt, h, ops.x_scale), h.shape[0]), ops.w_scale)


def _scatter_sequential(call: MoeCall, ops: ScatterOperands) -> torch.Tensor:
    h, weight, routing, topk_weights = ops.h, ops.weight, ops.routing, ops.topk_weights
    group, world = call.group, call.world
    tokens, topk = topk_weights.shape
    partial = grouped_mm_loop(h, weight, routing.expert_offsets, torch.float32, fp8=_h_fp8(call, ops))
    combined = _combine(partial, row_of_pair(routing, topk), topk_weights)
    out_dtype = call.out_dtype or h.dtype
    if world == 1:
        return combined.to(out_dtype)
    # All-to-all, then the sum in rank order: the same bits on every rank and backend for the same partials.
    parts = combined.new_empty((world, tokens // world, combined.shape[1]))
    comm.all_to_all(parts, combined, group)
    return comm.sum_in_rank_order(parts).to(out_dtype)


def _scatter_chunked(call: MoeCall, ops: ScatterOperands) -> torch.Tensor:
    """Same result as :func:`_scatter_sequential` (within the GEMMs' rounding); compute-first pieces.

    Piece i covers tokens ``[start, stop)`` of every owner's ``m_local``: its pairs' rows (in output order,
    so grouped by expert) go through one grouped GEMM and the combine, and the piece's all-to-all runs while
    the next piece computes; each owner sums its rows of every piece in rank order.
    """
    h, weight, routing, topk_weights = ops.h, ops.weight, ops.routing, ops.topk_weights
    group, world = call.group, call.world
    tokens_total, topk = topk_weights.shape
    m_local, num_e, k_out = tokens_total // world, weight.shape[0], weight.shape[1]
    pair_rows, expert_of_row = row_of_pair(routing, topk), expert_of_rows(routing)
    fp8 = _h_fp8(call, ops)
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


def _gather_fused(call: MoeCall, ops: GatherOperands) -> tuple:
    """:func:`_gather_sequential`'s result over the symmetric heap (:func:`kernels.fused.moe.gather`)."""
    from ...fused import moe as fused_moe
    from ...fused import runtime

    x, topk_ids, weight = ops.x, ops.topk_ids, ops.weight
    descriptor = runtime.describe(call, ops)
    group = call.group
    fp8 = call.fmt.kind == "fp8"
    scaled = (call.fmt, x_scale_of(call.fmt, x, ops.x_scale), ops.w_scale, call.out_dtype) if fp8 else None
    return fused_moe.gather(x, topk_ids, weight, route=route, group=group, descriptor=descriptor, fp8=scaled)


def _scatter_fused(call: MoeCall, ops: ScatterOperands) -> torch.Tensor:
    """:func:`_scatter_sequential`'s result over the symmetric heap (:func:`kernels.fused.moe.reduce_scatter`):
    the same combine and rank-order sum, the grouped GEMM's fp32 partials summed in the kernel's order."""
    from ...fused import moe as fused_moe
    from ...fused import runtime

    h, weight, routing, topk_weights = ops.h, ops.weight, ops.routing, ops.topk_weights
    cfg = fused_moe.tile_config(h.device)
    descriptor = runtime.describe(call, ops, (cfg.block_m, cfg.block_n))
    h_fp8 = _h_fp8(call, ops)
    return fused_moe.reduce_scatter(
        h,
        weight,
        tuple(routing),
        topk_weights,
        pair_rows=row_of_pair(routing, topk_weights.shape[1]),
        group=call.group,
        descriptor=descriptor,
        fp8=None if h_fp8 is None else (*h_fp8, call.out_dtype),
    )


def _gather_fake(call: MoeCall, ops: GatherOperands) -> tuple:
    x, topk_ids, weight = ops.x, ops.topk_ids, ops.weight
    rows = x.shape[0] * call.world * topk_ids.shape[1]
    index = x.new_empty((rows,), dtype=torch.int64)
    offsets = x.new_empty((weight.shape[0],), dtype=torch.int64)
    y = x.new_empty((rows, weight.shape[1]), dtype=call.out_dtype or x.dtype)
    return y, offsets, index, torch.empty_like(index)


def _scatter_fake(call: MoeCall, ops: ScatterOperands) -> torch.Tensor:
    h, topk_weights = ops.h, ops.topk_weights
    return h.new_empty((topk_weights.shape[0] // call.world, ops.weight.shape[1]), dtype=call.out_dtype or h.dtype)


GATHER_SPEC = OpSpec(
    name=_GATHER,
    call=MoeCall,
    schema="(Tensor x, Tensor topk_ids, Tensor weight, Tensor? x_scale, Tensor? w_scale, str call) -> (Tensor, "
    "Tensor, Tensor, Tensor)",
    operands=GatherOperands,
    flat=GatherOperands.flat,
    impl={"sequential": _gather_sequential, "chunked": _gather_chunked, "fused": _gather_fused},
    fake=_gather_fake,
)
SCATTER_SPEC = OpSpec(
    name=_SCATTER,
    call=MoeCall,
    schema="(Tensor h, Tensor weight, Tensor[] routing, Tensor topk_weights, Tensor? x_scale, Tensor? w_scale, "
    "str call) -> Tensor",
    operands=ScatterOperands.of,
    flat=ScatterOperands.flat,
    impl={"sequential": _scatter_sequential, "chunked": _scatter_chunked, "fused": _scatter_fused},
    fake=_scatter_fake,
)
