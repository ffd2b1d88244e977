"""Autograd of the expert-parallel ops (:mod:`kernels.ops.moe_ep`): one ``torch.autograd.Function`` each.

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
        call = EpCall.decode(ctx.call_text)
        pairs = to_sources(grad_rows.contiguous(), list(ctx.saved_tensors), ctx.shape[0] * ctx.shape[1], call)
        ones = torch.ones(ctx.shape, dtype=torch.float32, device=grad_rows.device)
        return weighted_sum(pairs, ones, grad_rows.dtype), None, None


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
            grad_y = to_experts(weighted.reshape(m * topk, -1), handle[:4], ctx.rows, call)
        if ctx.needs_input_grad[1]:
            dots = (returned.view(m, topk, returned.shape[1]).to(torch.float32) * g[:, None, :]).sum(-1)
            grad_w = dots.to(topk_weights.dtype)
        return grad_y, grad_w, None, None
