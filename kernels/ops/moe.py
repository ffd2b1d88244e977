"""Tensor-parallel mixture-of-experts: all-gather + grouped GEMM, and grouped GEMM + top-k combine + reduce-scatter.

Public functions (docs/api.md, "Tensor-parallel MoE"): :func:`all_gather_grouped_matmul` and
:func:`grouped_matmul_reduce_scatter`, with their twins :func:`all_gather_grouped_matmul_reference` and
:func:`grouped_matmul_reduce_scatter_reference` (the sequential backend called directly; their docstrings
state the semantics). The expert weights are sharded as in a dense Megatron MLP: the first op's column shard
of every expert ``[E, n_local, k]`` (each rank computes its ``n_local`` of the intermediate for every
token), the second's row shard ``[E, k_out, n_local]`` (each rank's partial sum, reduced over ranks).
Registered operators::

    coc::all_gather_grouped_matmul(Tensor x, Tensor topk_ids, Tensor weight, str call)
        -> (Tensor y, Tensor expert_offsets, Tensor token_index, Tensor slot)
    coc::grouped_matmul_reduce_scatter(Tensor h, Tensor weight, Tensor[] routing, Tensor topk_weights, str call)
        -> Tensor                                       # call: kernels.ops.moe_routing.MoeCall.encode()

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
from ..op_registration import define_op
from .all_gather import gather_rows
from .moe_routing import (
    MoeCall,
    MoeRouting,
    check_gather,
    check_id_values,
    check_routing_values,
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
)

_GATHER, _SCATTER = "all_gather_grouped_matmul", "grouped_matmul_reduce_scatter"


def all_gather_grouped_matmul(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    weight: torch.Tensor,
    *,
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
    """
    call = _admit_gather(_GATHER, (x, topk_ids, weight), num_experts, group=group, request=(backend, parallel_num))
    return _gather_apply(x, topk_ids, weight, call)


def all_gather_grouped_matmul_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    weight: torch.Tensor,
    *,
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

    Rank ``r``'s local token ``i`` is gathered token ``r * m_local + i``.
    """
    call = _admit_gather(
        f"{_GATHER}_reference", (x, topk_ids, weight), num_experts, group=group, request=("sequential", None)
    )
    return _gather_apply(x, topk_ids, weight, call)


def grouped_matmul_reduce_scatter(
    h: torch.Tensor,
    weight: torch.Tensor,
    routing: MoeRouting,
    topk_weights: torch.Tensor,
    *,
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
    """
    call = _admit_scatter(_SCATTER, (h, weight, routing, topk_weights), group=group, request=(backend, parallel_num))
    return _scatter_apply(h, weight, routing, topk_weights, call)


def grouped_matmul_reduce_scatter_reference(
    h: torch.Tensor,
    weight: torch.Tensor,
    routing: MoeRouting,
    topk_weights: torch.Tensor,
    *,
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
    """
    request = ("sequential", None)
    call = _admit_scatter(f"{_SCATTER}_reference", (h, weight, routing, topk_weights), group=group, request=request)
    return _scatter_apply(h, weight, routing, topk_weights, call)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _gather_apply(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call: MoeCall) -> tuple:
    """The operator, through its autograd Function (:mod:`kernels.ops.moe_autograd`) where a gradient is needed."""
    if _needs_grad(x, weight):
        from .moe_autograd import AllGatherGroupedMatmulFunction

        y, offsets, token_index, slot = AllGatherGroupedMatmulFunction.apply(x, topk_ids, weight, call.encode())
    else:
        y, offsets, token_index, slot = gather_operator(x, topk_ids, weight, call.encode())
    return y, MoeRouting(offsets, token_index, slot)


def _scatter_apply(
    h: torch.Tensor, weight: torch.Tensor, routing: MoeRouting, topk_weights: torch.Tensor, call: MoeCall
) -> torch.Tensor:
    if _needs_grad(h, weight, topk_weights):
        from .moe_autograd import GroupedMatmulReduceScatterFunction

        return GroupedMatmulReduceScatterFunction.apply(h, weight, topk_weights, (tuple(routing), call.encode()))
    return scatter_operator(h, weight, list(routing), topk_weights, call.encode())


def _admit_gather(op: str, tensors: tuple, num_experts: object, *, group: object, request: tuple) -> MoeCall:
    """Validate, compare with the peers (:func:`kernels.callcheck.admit`: a rank's error reaches every rank,
    before any communication) and resolve the backend."""
    x, topk_ids, weight = tensors
    world = checks.world_of(group)
    device = x.device if isinstance(x, torch.Tensor) else None

    def validate() -> tuple[int, ...]:
        num_e = check_gather(x, topk_ids, weight, num_experts)
        checks.check_options(request[0], request[1], "deterministic", True)
        shape = (x.shape[0], x.shape[1], weight.shape[1])
        return describe(_GATHER, shape, x.dtype, request=request, moe=(num_e, topk_ids.shape[1]))

    def values() -> None:
        if wanted(x.device):
            check_id_values(topk_ids, weight.shape[0])

    callcheck.admit(op, group, world, device, validate, values=values, backend=request[0])  # type: ignore[arg-type]
    shape = (x.shape[0], x.shape[1], weight.shape[1])
    return resolve(op, request, shape, group, device=x.device)  # type: ignore[arg-type]


def _admit_scatter(op: str, tensors: tuple, *, group: object, request: tuple) -> MoeCall:
    h, weight, routing, topk_weights = tensors
    world = checks.world_of(group)
    device = h.device if isinstance(h, torch.Tensor) else None

    def validate() -> tuple[int, ...]:
        num_e, topk = check_scatter(h, weight, routing, topk_weights, world)
        checks.check_options(request[0], request[1], "deterministic", True)
        shape = (topk_weights.shape[0], h.shape[1], weight.shape[1])
        return describe(_SCATTER, shape, h.dtype, request=request, moe=(num_e, topk))

    def values() -> None:
        if wanted(h.device):
            check_routing_values(routing, topk_weights.shape[1])

    callcheck.admit(op, group, world, device, validate, values=values, backend=request[0])  # type: ignore[arg-type]
    shape = (topk_weights.shape[0], h.shape[1], weight.shape[1])
    return resolve(op, request, shape, group, device=h.device)  # type: ignore[arg-type]


def _gather_sequential(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call: MoeCall) -> tuple:
    group = resolve_group(call.group_name)
    xg = gather_rows(x.contiguous(), group, call.world)
    ids = gather_rows(topk_ids.to(torch.int64).contiguous(), group, call.world)
    routing = route(ids, weight.shape[0])
    y = grouped_mm_loop(xg[routing.token_index], weight, routing.expert_offsets, x.dtype)
    return (y, *routing)


def _gather_chunked(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call: MoeCall) -> tuple:
    """Same result as :func:`_gather_sequential` (within the GEMMs' rounding); comm-first pieces.

    The ids (a few bytes per token) are gathered first, and the routing is computed while the pieces of x
    are in flight; piece i holds rows ``[start, stop)`` of every rank, and its pairs' output rows, taken in
    output order, are grouped by expert as the whole output is: one grouped GEMM per piece, its rows
    written to their final place.
    """
    group, world = resolve_group(call.group_name), call.world
    m_local, k = x.shape
    x = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    ids_gathered = ids.new_empty((world * m_local, ids.shape[1]))
    ids_work = comm.all_gather(ids_gathered, ids, group, async_op=True)
    pieces = comm.split_rows(m_local, call.parallel_num)
    bufs, works = [], []
    for start, stop in pieces:
        buf = x.new_empty((world * (stop - start), k))
        works.append(comm.all_gather(buf, x[start:stop], group, async_op=True))
        bufs.append(buf)
    ids_work.wait()
    num_e, topk = weight.shape[0], ids.shape[1]
    routing = route(ids_gathered, num_e)
    pair_rows, expert_of_row = row_of_pair(routing, topk), expert_of_rows(routing)
    y = x.new_empty((world * m_local * topk, weight.shape[1]))
    for (start, stop), buf, work in zip(pieces, bufs, works, strict=True):
        work.wait()
        p = stop - start
        tokens = piece_tokens(world, m_local, start, stop, x.device)
        rows, offsets, _ = piece_rows(pair_rows[tokens], expert_of_row, num_e)
        # Gathered token t sits at row (t // m_local) * p + t % m_local - start of this piece's buffer.
        t = routing.token_index[rows]
        y[rows] = grouped_mm(buf[(t // m_local) * p + t % m_local - start], weight, offsets, x.dtype)
    return (y, *routing)


def _combine(partial: torch.Tensor, rows: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``combined[t] = sum over s, in slot order, of w[t, s] * partial[rows[t, s]]`` in fp32: an explicit loop
    (not ``sum(dim)``) so that every backend adds in the same order."""
    w = topk_weights.to(torch.float32)
    acc = partial[rows[:, 0]] * w[:, 0:1]
    for s in range(1, rows.shape[1]):
        acc += partial[rows[:, s]] * w[:, s : s + 1]
    return acc


def _scatter_sequential(
    h: torch.Tensor, weight: torch.Tensor, routing: tuple, topk_weights: torch.Tensor, call: MoeCall
) -> torch.Tensor:
    routing = MoeRouting(*routing)
    group, world = resolve_group(call.group_name), call.world
    tokens, topk = topk_weights.shape
    partial = grouped_mm_loop(h, weight, routing.expert_offsets, torch.float32)
    combined = _combine(partial, row_of_pair(routing, topk), topk_weights)
    if world == 1:
        return combined.to(h.dtype)
    # All-to-all, then the sum in rank order: the same bits on every rank and backend for the same partials.
    parts = combined.new_empty((world, tokens // world, combined.shape[1]))
    comm.all_to_all(parts, combined, group)
    return comm.sum_in_rank_order(parts).to(h.dtype)


def _scatter_chunked(
    h: torch.Tensor, weight: torch.Tensor, routing: tuple, topk_weights: torch.Tensor, call: MoeCall
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
    out = h.new_empty((m_local, k_out), dtype=torch.float32)
    pending = []
    for start, stop in comm.split_rows(m_local, call.parallel_num):
        tokens = piece_tokens(world, m_local, start, stop, h.device)
        rows, offsets, order = piece_rows(pair_rows[tokens], expert_of_row, num_e)
        partial = grouped_mm(h[rows], weight, offsets, torch.float32)
        local = torch.empty_like(order)
        local[order] = torch.arange(order.numel(), device=order.device)
        combined = _combine(partial, local.view(-1, topk), topk_weights[tokens])
        parts = combined.new_empty((world, stop - start, k_out))
        pending.append((comm.all_to_all(parts, combined, group, async_op=True), start, stop, parts))
    for work, start, stop, parts in pending:
        work.wait()
        out[start:stop] = comm.sum_in_rank_order(parts)
    return out.to(h.dtype)


def _gather_fused(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call: MoeCall) -> tuple:
    """:func:`_gather_sequential`'s result over the symmetric heap (:func:`kernels.fused.moe.gather`)."""
    from ..fused import moe as fused_moe

    shape = (x.shape[0], x.shape[1], weight.shape[1])
    moe = (weight.shape[0], topk_ids.shape[1])
    descriptor = describe(_GATHER, shape, x.dtype, request=("fused", None), moe=moe)
    group = resolve_group(call.group_name)
    return fused_moe.gather(x, topk_ids, weight, route=route, group=group, descriptor=descriptor)


def _scatter_fused(
    h: torch.Tensor, weight: torch.Tensor, routing: tuple, topk_weights: torch.Tensor, call: MoeCall
) -> torch.Tensor:
    """:func:`_scatter_sequential`'s result over the symmetric heap (:func:`kernels.fused.moe.reduce_scatter`):
    the same combine and rank-order sum, the grouped GEMM's fp32 partials summed in the kernel's order."""
    from ..fused import moe as fused_moe

    routing = MoeRouting(*routing)
    cfg = fused_moe.tile_config(h.device)
    shape = (topk_weights.shape[0], h.shape[1], weight.shape[1])
    moe = (weight.shape[0], topk_weights.shape[1])
    tiles = (cfg.block_m, cfg.block_n)
    descriptor = describe(_SCATTER, shape, h.dtype, request=("fused", None), moe=moe, tiles=tiles)
    return fused_moe.reduce_scatter(
        h,
        weight,
        tuple(routing),
        topk_weights,
        pair_rows=row_of_pair(routing, topk_weights.shape[1]),
        group=resolve_group(call.group_name),
        descriptor=descriptor,
    )


GATHER_IMPL = {"sequential": _gather_sequential, "chunked": _gather_chunked, "fused": _gather_fused}
SCATTER_IMPL = {"sequential": _scatter_sequential, "chunked": _scatter_chunked, "fused": _scatter_fused}


def _gather_run(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call_text: str) -> tuple:
    call = MoeCall.decode(call_text)
    return GATHER_IMPL[call.backend](x, topk_ids, weight, call)


def _gather_fake(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call_text: str) -> tuple:
    world = MoeCall.decode(call_text).world
    rows = x.shape[0] * world * topk_ids.shape[1]
    index = x.new_empty((rows,), dtype=torch.int64)
    offsets = x.new_empty((weight.shape[0],), dtype=torch.int64)
    return x.new_empty((rows, weight.shape[1])), offsets, index, torch.empty_like(index)


def _scatter_run(
    h: torch.Tensor, weight: torch.Tensor, routing: list[torch.Tensor], topk_weights: torch.Tensor, call_text: str
) -> torch.Tensor:
    call = MoeCall.decode(call_text)
    return SCATTER_IMPL[call.backend](h, weight, tuple(routing), topk_weights, call)


def _scatter_fake(
    h: torch.Tensor, weight: torch.Tensor, routing: list[torch.Tensor], topk_weights: torch.Tensor, call_text: str
) -> torch.Tensor:
    world = MoeCall.decode(call_text).world
    return h.new_empty((topk_weights.shape[0] // world, weight.shape[1]))


gather_operator = define_op(
    "all_gather_grouped_matmul(Tensor x, Tensor topk_ids, Tensor weight, str call) -> (Tensor, Tensor, Tensor, Tensor)",
    _gather_run,
    _gather_fake,
)
scatter_operator = define_op(
    "grouped_matmul_reduce_scatter(Tensor h, Tensor weight, Tensor[] routing, Tensor topk_weights, str call) -> Tensor",
    _scatter_run,
    _scatter_fake,
)
