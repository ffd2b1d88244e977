"""Autograd of the expert-parallel ops (:mod:`kernels.ops.moe_ep`, :mod:`kernels.ops.moe_ep_gemm`): one
``torch.autograd.Function`` each.

Notation: this rank's tokens ``x [m, k]``, pairs ``p = (t, s)``, ``w = topk_weights [m, topk]``; ``rows [R, k]``
the dispatched rows (row ``j`` is pair ``(src_token[j], src_slot[j])`` of rank ``src_rank[j]``), ``y [R, n]``
the experts' outputs in that order, ``y_ts`` the row of pair ``(t, s)`` once returned to its token's rank.
Both directions are the same two movements (:func:`kernels.ops.moe_ep_routing.to_experts` / ``to_sources``), so each
op's gradient is the other op: no new communication pattern.
"""

from __future__ import annotations

from typing import Any

import torch

from .moe_ep_routing import EpCall, to_experts, to_sources, weighted_sum


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
        out = torch.ops.coc.moe_dispatch(x, None, topk_ids, call_text)
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
    """``y, handle = moe_dispatch_grouped_matmul(x, topk_ids, ..., weight)`` (:mod:`kernels.ops.moe_ep_gemm`),
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
        out = torch.ops.coc.moe_dispatch_grouped_matmul(x, topk_ids, weight, call_text)
        ctx.mark_non_differentiable(*out[1:])
        ctx.call_text, ctx.shape = call_text, tuple(topk_ids.shape)
        # rows, weight, expert_offsets, then recv_to_row, send_index, send_counts, recv_counts
        ctx.save_for_backward(out[1], weight, out[2], *out[6:10])
        return out

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor, *_: Any) -> tuple:
        from .grouped_matmul import grouped_matmul_grads

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
        out, returned = torch.ops.coc.moe_combine(y, topk_weights, list(handle), call_text)
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
