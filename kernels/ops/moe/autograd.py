"""Autograd of the MoE ops: one ``torch.autograd.Function`` each, for the tensor-parallel pair
(:mod:`kernels.ops.moe.tp`) and the expert-parallel dispatch, combine and dispatch + GEMM
(:mod:`kernels.ops.moe.ep`, :mod:`kernels.ops.moe.ep_gemm`). Each forward runs its op's admitted call (the public
function admitted and decided it) through the registered operator; each backward's ops are part of that call.

Tensor-parallel notation: ``W`` ranks, ``m`` = ``m_local`` tokens per rank, ``M = W m`` gathered tokens, ``topk``
slots per token, ``E`` experts; row ``j`` of the grouped output is the pair ``(t, s) = (token_index[j], slot[j])`` of
expert ``e(j)``, ``row(t, s)`` its inverse (:func:`kernels.ops.moe.routing.row_of_pair`); ``rows_e`` the rows of
expert ``e`` (``expert_offsets``). The expert weights are sharded as a dense Megatron MLP's: the first op's
column shard ``w1_shard_n [E, n/W, k]``, the second's row shard ``w2_shard_n [E, k_out, n/W]``.

Replicated inputs follow the column-parallel convention (Megatron's ``f``): ``topk_weights`` holds every rank's
tokens on every rank, and its gradient is the whole one (summed over the ranks) on every rank, so a router that
runs replicated trains as in one process. The weight gradients are per-expert ``torch.mm`` products in fp32
(a host read of the offsets: not for CUDA-graph capture), exact to fp32 accumulation.

Backends: each Function's forward is the registered operator with the call's backend (``"fused"``: the kernels of
:mod:`kernels.fused.moe`); the backward's dgrad of ``x`` is the reducing operator on that same backend, every
other exchange of the backward goes through torch.distributed whatever the backend.

Expert-parallel notation: this rank's tokens ``x [m, k]``, pairs ``p = (t, s)``, ``w = topk_weights [m, topk]``;
``rows [R, k]`` the dispatched rows (row ``j`` is pair ``(src_token[j], src_slot[j])`` of rank ``src_rank[j]``),
``y [R, n]`` the experts' outputs in that order, ``y_ts`` the row of pair ``(t, s)`` once returned to its token's
rank. Both directions are the same two movements (:func:`kernels.ops.moe.layout.to_experts` / ``to_sources``),
so each op's gradient is the other op: no new communication pattern.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ... import comm
from ...protocol import call_operator, resolve_group
from ..all_gather import gather_rows
from ..grouped_matmul import grouped_matmul_grads
from .layout import EpCall, to_experts, to_sources, weighted_sum
from .routing import SCATTER, MoeCall, grouped_mm


def _per_expert_wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[e] = a[rows_e].T @ b[rows_e]`` (``[E, a.shape[1], b.shape[1]]``, zeros for an expert with no rows),
    each product summed in fp32 and rounded once to ``dtype``."""
    out = torch.zeros((offsets.numel(), a.shape[1], b.shape[1]), dtype=dtype, device=a.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[e] = torch.mm(a[start:end].float().T, b[start:end].float()).to(dtype)
        start = end
    return out


class AllGatherGroupedMatmulFunction(torch.autograd.Function):
    """``y, routing = all_gather_grouped_matmul(x_shard_m, topk_ids, w1_shard_n)``.

    Shapes: ``x_shard_m [m, k]`` (this rank's tokens), ``topk_ids [m, topk]``, ``w1_shard_n [E, n/W, k]``.

    - forward, one ``coc::all_gather_grouped_matmul``::

        xg = all_gather(x_shard_m)                                           # [M, k]
        y[j] = xg[token_index[j]] @ w1_shard_n[e(j)].T                       # [M topk, n/W], grouped by expert

    - dgrad, one ``coc::grouped_matmul_reduce_scatter`` with the weight transposed and unit top-k weights (the
      rows scattered back to their (token, slot) and summed over the slots, then over the ranks: each rank
      holds the partial sum over its n/W columns)::

        grad_xg[t] = sum_s grad_y[row(t, s)] @ w1_shard_n[e(t, s)]           # [M, k], partial over n
        grad_x_shard_m = reduce_scatter(grad_xg)                             # [m, k]

    - wgrad (local, per expert; ``x`` gathered again, started before the dgrad so that it overlaps it)::

        grad_w1_shard_n[e] = grad_y[rows_e].T @ xg[token_index[rows_e]]      # [n/W, k]
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor, call_text: str) -> tuple:
        y, offsets, token_index, slot = call_operator(
            torch.ops.coc.all_gather_grouped_matmul.default, x, topk_ids, weight, None, None, call_text
        )
        ctx.mark_non_differentiable(offsets, token_index, slot)
        ctx.call_text, ctx.topk = call_text, topk_ids.shape[1]
        ctx.save_for_backward(x if ctx.needs_input_grad[2] else None, weight, offsets, token_index, slot)
        return y, offsets, token_index, slot

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor, *_: Any) -> tuple:
        x, weight, offsets, token_index, slot = ctx.saved_tensors
        group, world = _group_of(ctx.call_text)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        grad_y = grad_y.contiguous()
        if need_w:
            xg = x.new_empty((world * x.shape[0], x.shape[1]))
            work = comm.all_gather(xg, x.contiguous(), group, async_op=True)
        grad_x = grad_w = None
        if need_x:
            ones = torch.ones((token_index.numel() // ctx.topk, ctx.topk), dtype=torch.float32, device=grad_y.device)
            w_t = weight.transpose(1, 2).contiguous()  # [E, k, n/W]: the reducing op's [E, k_out, n_local]
            routing = [offsets, token_index, slot]
            # The gather's call, as the reducing op's (the same group, backend and format).
            text = replace(MoeCall.decode(ctx.call_text), op=SCATTER).encode()
            op = torch.ops.coc.grouped_matmul_reduce_scatter.default
            grad_x = call_operator(op, grad_y, w_t, routing, ones, None, None, text)
        if need_w:
            work.wait()
            grad_w = _per_expert_wgrad(grad_y, xg[token_index], offsets, weight.dtype)
        return grad_x, None, grad_w, None


class GroupedMatmulReduceScatterFunction(torch.autograd.Function):
    """``out_shard_m = grouped_matmul_reduce_scatter(h, w2_shard_n, routing, topk_weights)``.

    Shapes: ``h [M topk, n/W]`` (rows in the routing's order), ``w2_shard_n [E, k_out, n/W]``, ``topk_weights
    [M, topk]`` (every rank's tokens, replicated), ``out_shard_m [m, k_out]``.

    - forward, one ``coc::grouped_matmul_reduce_scatter``::

        partial[j] = h[j] @ w2_shard_n[e(j)].T                               # [M topk, k_out], fp32
        out_shard_m = reduce_scatter(sum_s topk_weights[t, s] partial[row(t, s)])   # [m, k_out]

    - dgrad of ``h`` (the gradient gathered, then one grouped GEMM with the weight transposed, in fp32)::

        grad_out = all_gather(grad_out_shard_m)                              # [M, k_out]
        p[j] = grad_out[token_index[j]] @ w2_shard_n[e(j)]                   # [M topk, n/W], fp32
        grad_h[j] = topk_weights[token_index[j], slot[j]] p[j]

    - dgrad of ``topk_weights`` (the router is trained): each rank's dot over its n/W columns, summed over the
      ranks in rank order (the same bits on every rank)::

        grad_topk_weights[t, s] = all_reduce(sum_n p[row(t, s)] h[row(t, s)])          # [M, topk]

    - wgrad (local, per expert)::

        grad_w2_shard_n[e] = (topk_weights[t, s] grad_out[t])[rows_e].T @ h[rows_e]   # [k_out, n/W]
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, topk_weights: torch.Tensor, how: tuple) -> Any:
        """``how = (routing, call_text)``: the routing tensors (not differentiable) and the encoded call."""
        routing, call_text = how
        op = torch.ops.coc.grouped_matmul_reduce_scatter.default
        out = call_operator(op, h, weight, list(routing), topk_weights, None, None, call_text)
        ctx.call_text = call_text
        ctx.save_for_backward(h, weight, *routing, topk_weights)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        h, weight, offsets, token_index, slot, topk_weights = ctx.saved_tensors
        group, world = _group_of(ctx.call_text)
        need_h, need_w, need_tw = ctx.needs_input_grad[:3]
        grad_g = gather_rows(grad_out.contiguous(), group, world)[token_index]  # [M topk, k_out]
        w_rows = topk_weights.float()[token_index, slot][:, None]
        grad_h = grad_w = grad_tw = None
        if need_h or need_tw:
            p = grouped_mm(grad_g, weight.transpose(1, 2).contiguous(), offsets, torch.float32)
            if need_h:
                grad_h = (p * w_rows).to(h.dtype)
            if need_tw:
                grad_tw = _replicated_grad(p, h, (token_index, slot), topk_weights, (group, world))
        if need_w:
            grad_w = _per_expert_wgrad(grad_g.float() * w_rows, h, offsets, weight.dtype)
        return grad_h, grad_w, grad_tw, None


def _replicated_grad(
    p: torch.Tensor, h: torch.Tensor, pairs: tuple, topk_weights: torch.Tensor, where: tuple
) -> torch.Tensor:
    """The top-k weights' gradient: this rank's dots, gathered and summed in rank order; ``where = (group, W)``."""
    token_index, slot = pairs
    group, world = where
    local = torch.zeros(topk_weights.shape, dtype=torch.float32, device=p.device)
    local[token_index, slot] = (p * h.float()).sum(-1)
    if world > 1:
        parts = local.new_empty((world, *local.shape))
        comm.all_gather(parts.view(-1, local.shape[1]), local, group)
        local = comm.sum_in_rank_order(parts)
    return local.to(topk_weights.dtype)


def _group_of(call_text: str) -> tuple:
    """``(group, W)`` of a tensor-parallel MoE call's string."""
    call = MoeCall.decode(call_text)
    return resolve_group(call.group_name), call.world


class MoeDispatchFunction(torch.autograd.Function):
    """``rows, handle = moe_dispatch(x, topk_ids, ...)`` for plain x (an FP8 dispatch is not differentiable).

    - forward, one ``coc::moe_dispatch``::

        rows[j] = x_of_rank_src_rank[j][src_token[j]]                    # [R, k], all-to-all of the pairs' rows

    - dgrad, combine without weights (the all-to-all back, then the sum over each token's slots in fp32,
      slot order, rounded once to x's dtype; bounded mode's padding rows carry no gradient)::

        grad_x[t] = sum_s grad_rows_ts                                   # [m, k]
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_ids: torch.Tensor, call_text: str) -> tuple:
        out = call_operator(torch.ops.coc.moe_dispatch.default, x, None, topk_ids, call_text)
        ctx.mark_non_differentiable(*out[1:])
        ctx.call_text, ctx.shape = call_text, tuple(topk_ids.shape)
        # recv_to_row, send_index, send_counts, recv_counts (after rows, rows_scale and four of the handle's)
        ctx.save_for_backward(*out[6:10])
        return out

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor, *_: Any) -> tuple:
        if grad_rows is None:
            return None, None, None
        return _dispatch_grad(grad_rows, list(ctx.saved_tensors), ctx.shape, ctx.call_text), None, None


def _dispatch_grad(grad_rows: torch.Tensor, movement: list[torch.Tensor], shape: tuple, call_text: str) -> torch.Tensor:
    """The dispatch's dgrad (:class:`MoeDispatchFunction`): ``movement`` its four handle tensors, ``shape``
    topk_ids'."""
    pairs = to_sources(grad_rows.contiguous(), movement, shape[0] * shape[1], EpCall.decode(call_text))
    ones = torch.ones(shape, dtype=torch.float32, device=grad_rows.device)
    return weighted_sum(pairs, ones, grad_rows.dtype)


class MoeDispatchGroupedMatmulFunction(torch.autograd.Function):
    """``y, handle = moe_dispatch_grouped_matmul(x, topk_ids, ..., weight)`` (:mod:`kernels.ops.moe.ep_gemm`),
    differentiable in plain ``x`` and ``weight [E_l, n, k]``: the dispatch's gradient composed with the grouped
    GEMM's.

    - forward, one ``coc::moe_dispatch_grouped_matmul`` (rows saved)::

        rows[j] = x_of_rank_src_rank[j][src_token[j]]                    # [R, k]
        y[rows of e] = rows[rows of e] @ weight[e].T                     # [R, n]

    - dgrad: the grouped GEMM on the transposed weights, then the dispatch's dgrad (combine without weights)::

        grad_rows[rows of e] = grad_y[rows of e] @ weight[e]
        grad_x[t] = sum_s grad_rows_ts                                   # fp32, slot order, one rounding

    - wgrad, one ``torch.mm`` per expert (the offsets read on the host: the exact-mode dispatch read its counts
      there already; bounded mode's padding rows are zeros and add nothing)::

        grad_w[e] = grad_y[rows of e].T @ rows[rows of e]                # zeros for an expert with no rows
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, topk_ids: torch.Tensor, call_text: str) -> tuple:
        out = call_operator(torch.ops.coc.moe_dispatch_grouped_matmul.default, x, topk_ids, weight, call_text)
        ctx.mark_non_differentiable(*out[1:])
        ctx.call_text, ctx.shape = call_text, tuple(topk_ids.shape)
        # rows, weight, expert_offsets, then recv_to_row, send_index, send_counts, recv_counts
        ctx.save_for_backward(out[1], weight, out[2], *out[6:10])
        return out

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor, *_: Any) -> tuple:

        rows, weight, offsets, *movement = ctx.saved_tensors
        if grad_y is None:
            return None, None, None, None
        needs = tuple(ctx.needs_input_grad[:2])
        grad_rows, grad_w = grouped_matmul_grads(grad_y, rows, weight, offsets, needs=needs)
        grad_x = _dispatch_grad(grad_rows, movement, ctx.shape, ctx.call_text) if grad_rows is not None else None
        return grad_x, grad_w, None, None


class MoeCombineFunction(torch.autograd.Function):
    """``out = moe_combine(y, handle)``, differentiable in ``y`` and ``w = handle.topk_weights``.

    - forward, one ``coc::moe_combine``::

        y_ts = all-to-all back of y                                      # [m, topk, n], saved
        out[t] = sum_s w[t, s] y_ts                                      # fp32, slot order, rounded once

    - dgrad, the dispatch of the weighted gradient (rows never sent in bounded mode get zero)::

        grad_y[row(t, s)] = w[t, s] grad_out[t]                         # fp32 product, rounded to y's dtype

    - d topk_weights (local)::

        grad_w[t, s] = <grad_out[t], y_ts>                               # fp32 dot, in w's dtype
    """

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, topk_weights: torch.Tensor, handle: tuple, call_text: str) -> torch.Tensor:
        out, returned = call_operator(torch.ops.coc.moe_combine.default, y, topk_weights, list(handle), call_text)
        ctx.call_text, ctx.rows = call_text, y.shape[0]
        ctx.save_for_backward(returned, topk_weights, *handle)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        returned, topk_weights, *handle = ctx.saved_tensors
        call = EpCall.decode(ctx.call_text)
        m, topk = topk_weights.shape
        g = grad_out.to(torch.float32)
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            weighted = (topk_weights.to(torch.float32)[:, :, None] * g[:, None, :]).to(returned.dtype)
            # The all-to-all movement's four handle tensors (the fused pull's two are not needed here).
            grad_y = to_experts(weighted.reshape(m * topk, returned.shape[1]), handle[:4], ctx.rows, call)
        if ctx.needs_input_grad[1]:
            dots = (returned.view(m, topk, returned.shape[1]).to(torch.float32) * g[:, None, :]).sum(-1)
            grad_w = dots.to(topk_weights.dtype)
        return grad_y, grad_w, None, None
