"""Autograd of the tensor-parallel MoE ops (:mod:`kernels.ops.moe`): one ``torch.autograd.Function`` each.

Notation: ``W`` ranks, ``m`` = ``m_local`` tokens per rank, ``M = W m`` gathered tokens, ``topk`` slots per
token, ``E`` experts; row ``j`` of the grouped output is the pair ``(t, s) = (token_index[j], slot[j])`` of
expert ``e(j)``, ``row(t, s)`` its inverse (:func:`kernels.ops.moe_routing.row_of_pair`); ``rows_e`` the rows of
expert ``e`` (``expert_offsets``). The expert weights are sharded as a dense Megatron MLP's: the first op's
column shard ``w1_shard_n [E, n/W, k]``, the second's row shard ``w2_shard_n [E, k_out, n/W]``.

Replicated inputs follow the column-parallel convention (Megatron's ``f``): ``topk_weights`` holds every rank's
tokens on every rank, and its gradient is the whole one (summed over the ranks) on every rank, so a router that
runs replicated trains as in one process. The weight gradients are per-expert ``torch.mm`` products in fp32
(a host read of the offsets: not for CUDA-graph capture), exact to fp32 accumulation.

Backends: each Function's forward is the registered operator with the call's backend (``"fused"``: the kernels of
:mod:`kernels.fused.moe`); the backward's dgrad of ``x`` is the reducing operator on that same backend, every
other exchange of the backward goes through torch.distributed whatever the backend.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm
from ..call import resolve_group
from .all_gather import gather_rows
from .moe_routing import MoeCall, grouped_mm


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
        y, offsets, token_index, slot = torch.ops.coc.all_gather_grouped_matmul(x, topk_ids, weight, call_text)
        ctx.mark_non_differentiable(offsets, token_index, slot)
        ctx.call_text, ctx.topk = call_text, topk_ids.shape[1]
        ctx.save_for_backward(x if ctx.needs_input_grad[2] else None, weight, offsets, token_index, slot)
        return y, offsets, token_index, slot

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor, *_: Any) -> tuple:
        x, weight, offsets, token_index, slot = ctx.saved_tensors
        call = MoeCall.decode(ctx.call_text)
        group = resolve_group(call.group_name)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        grad_y = grad_y.contiguous()
        if need_w:
            xg = x.new_empty((call.world * x.shape[0], x.shape[1]))
            work = comm.all_gather(xg, x.contiguous(), group, async_op=True)
        grad_x = grad_w = None
        if need_x:
            ones = torch.ones((token_index.numel() // ctx.topk, ctx.topk), dtype=torch.float32, device=grad_y.device)
            w_t = weight.transpose(1, 2).contiguous()  # [E, k, n/W]: the reducing op's [E, k_out, n_local]
            routing = [offsets, token_index, slot]
            grad_x = torch.ops.coc.grouped_matmul_reduce_scatter(grad_y, w_t, routing, ones, ctx.call_text)
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
        out = torch.ops.coc.grouped_matmul_reduce_scatter(h, weight, list(routing), topk_weights, call_text)
        ctx.call_text = call_text
        ctx.save_for_backward(h, weight, *routing, topk_weights)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        h, weight, offsets, token_index, slot, topk_weights = ctx.saved_tensors
        call = MoeCall.decode(ctx.call_text)
        group = resolve_group(call.group_name)
        need_h, need_w, need_tw = ctx.needs_input_grad[:3]
        grad_g = gather_rows(grad_out.contiguous(), group, call.world)[token_index]  # [M topk, k_out]
        w_rows = topk_weights.float()[token_index, slot][:, None]
        grad_h = grad_w = grad_tw = None
        if need_h or need_tw:
            p = grouped_mm(grad_g, weight.transpose(1, 2).contiguous(), offsets, torch.float32)
            if need_h:
                grad_h = (p * w_rows).to(h.dtype)
            if need_tw:
                grad_tw = _replicated_grad(p, h, (token_index, slot), topk_weights, call)
        if need_w:
            grad_w = _per_expert_wgrad(grad_g.float() * w_rows, h, offsets, weight.dtype)
        return grad_h, grad_w, grad_tw, None


def _replicated_grad(p: torch.Tensor, h: torch.Tensor, pairs: tuple, topk_weights: torch.Tensor, call: MoeCall):
    """The top-k weights' gradient: this rank's dots, gathered and summed in rank order."""
    token_index, slot = pairs
    local = torch.zeros(topk_weights.shape, dtype=torch.float32, device=p.device)
    local[token_index, slot] = (p * h.float()).sum(-1)
    if call.world > 1:
        parts = local.new_empty((call.world, *local.shape))
        comm.all_gather(parts.view(-1, local.shape[1]), local, resolve_group(call.group_name))
        local = comm.sum_in_rank_order(parts)
    return local.to(topk_weights.dtype)
