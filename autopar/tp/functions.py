"""The four autograd Functions of the tensor-parallel linears, one per (layer, sequence parallel).

Their communication is :mod:`kernels`' registered operators and torch's functional collectives
(:mod:`autopar.tp.comm`), so the forward and the backward trace whole under
``torch.compile(fullgraph=True)``. The backends are the ``kernels`` ones, chosen from the ``COC_*``
environment at call time (at trace time under compile).

Notation in the docstrings: ``W`` is the tensor-parallel world size, ``s`` the sequence length,
``b`` the micro-batch, ``k`` the input and ``n`` the output features, ``x_shard_s`` a tensor
sharded along ``s`` (sequence parallel), ``w_shard_n`` / ``w_shard_k`` a weight sharded along
``n`` / ``k``. Inputs may have any number of leading dims; dim 0 is the sequence dim and the
others are flattened into rows.
"""

from __future__ import annotations

from typing import Any

import torch

from . import comm
from .comm import Group, rows
from .wgrad import WgradOptions, custom_bwd, custom_fwd, defer_wgrad, save_for_wgrad, wgrad_and_bias_grad


def _finish_dgrad(ctx: Any, grad_x: torch.Tensor | None, in_flight: bool) -> torch.Tensor | None:
    """The input gradient in the input's shape, its collective waited for if ``in_flight``: the
    column Functions start it before the weight gradient and finish it after, to overlap the two."""
    if in_flight:
        grad_x = comm.wait(grad_x)
    return None if grad_x is None else grad_x.view(ctx.x_shape)


class ColumnParallelLinearFunction(torch.autograd.Function):
    """Column-parallel linear, no sequence parallelism.

    Shapes: ``x [s, b, k]`` (replicated), ``w_shard_n [n/W, k]``, ``bias_shard_n [n/W]``.

    - forward (input copied to the TP region: identity)::

        y_shard_n = x @ w_shard_n.T + bias_shard_n                     # [s, b, n/W]

    - dgrad: every rank holds a partial sum over its n/W columns::

        grad_x = all_reduce(grad_y_shard_n @ w_shard_n)                 # [s, b, k]

      the all-reduce runs asynchronously and overlaps the wgrad GEMM, or, with
      ``enable_coc_in_column_backward``, is one ``kernels.matmul_all_reduce``.
      No all-reduce when ``allreduce_dgrad`` is False (Megatron's ``disable_grad_reduce``,
      explicit expert communication, W == 1).

    - wgrad (local)::

        grad_w_shard_n = grad_y_shard_n.T @ x                           # [n/W, k]
        grad_bias_shard_n = grad_y_shard_n.sum(rows)                    # [n/W]
    """

    @staticmethod
    @custom_fwd
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group,
        allreduce_dgrad: bool,
        coc_in_backward: bool,
        wgrad_opts: WgradOptions,
    ) -> torch.Tensor:
        x, weight, bias = save_for_wgrad(ctx, x, weight, bias, wgrad_opts)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.group = group
        ctx.allreduce_dgrad = allreduce_dgrad and comm.world_size(group) > 1
        ctx.coc_in_backward = coc_in_backward
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_y2d = rows(grad_y.contiguous())
        grad_x = None
        reducing = False
        if need_x:
            if ctx.allreduce_dgrad and ctx.coc_in_backward:
                grad_x = comm.matmul_all_reduce(grad_y2d, weight.t(), None, ctx.group)
            else:
                grad_x = grad_y2d.matmul(weight)
                if ctx.allreduce_dgrad:
                    # Waited for after the weight gradient, which it overlaps.
                    grad_x = comm.start_all_reduce(grad_x, ctx.group)
                    reducing = True
        deferred = need_w and defer_wgrad(grad_y, ctx.wgrad_opts)
        grad_w, grad_b = wgrad_and_bias_grad(ctx, None if deferred else grad_y2d, rows(x) if need_w else None, grad_y2d)
        return _finish_dgrad(ctx, grad_x, reducing), grad_w, grad_b, None, None, None, None


class ColumnParallelLinearSPFunction(torch.autograd.Function):
    """Column-parallel linear with sequence parallelism, the sequence on dim ``seq_dim`` of ``x``.

    Shapes (``seq_dim=0``, Megatron): ``x_shard_s [s/W, b, k]``, ``w_shard_n [n/W, k]``,
    ``bias_shard_n [n/W]``; with ``seq_dim=1`` (Hugging Face, torchtitan) ``x_shard_s [b, s/W, k]``
    and every ``s`` below moves to dim 1 likewise.

    - forward, one ``kernels.all_gather_matmul(..., gather_dim=seq_dim)``::

        x = all_gather(x_shard_s, dim=seq_dim)                           # [s, b, k]
        y_shard_n = x @ w_shard_n.T + bias_shard_n                       # [s, b, n/W]

      ``recompute_all_gather=True`` keeps only ``x_shard_s`` and gathers again in the backward
      (less memory); False keeps the gathered ``x`` (the op's ``return_gathered``).

    - dgrad::

        grad_x_shard_s = reduce_scatter(grad_y_shard_n @ w_shard_n, dim=seq_dim)   # [s/W, b, k]

      the reduce-scatter runs asynchronously and overlaps the wgrad GEMM, or, with
      ``enable_coc_in_column_backward``, is one ``kernels.matmul_reduce_scatter(..., scatter_dim=seq_dim)``.
      The recomputed all-gather of ``x`` is started first so it overlaps the dgrad GEMM.

    - wgrad (rows: every dim but the last flattened, in the same order for both operands)::

        grad_w_shard_n = rows(grad_y_shard_n).T @ rows(x)                # [n/W, k]
        grad_bias_shard_n = grad_y_shard_n.sum(rows)                     # [n/W]
    """

    @staticmethod
    @custom_fwd
    def forward(
        ctx: Any,
        x_shard_s: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group,
        recompute_all_gather: bool,
        coc_in_backward: bool,
        wgrad_opts: WgradOptions,
        seq_dim: int = 0,
    ) -> torch.Tensor:
        x_shard_s, weight, bias = save_for_wgrad(ctx, x_shard_s, weight, bias, wgrad_opts)
        need_w = ctx.needs_input_grad[1]
        if recompute_all_gather or not need_w:
            # The input (shard or gathered) is read by the weight gradient only: a frozen weight
            # keeps none, in particular not the W-times larger gathered input.
            y = comm.all_gather_matmul(x_shard_s, weight, bias, group, False, seq_dim)
            ctx.save_for_backward(x_shard_s if need_w else None, weight)
        else:
            y, x_full = comm.all_gather_matmul(x_shard_s, weight, bias, group, True, seq_dim)
            ctx.save_for_backward(x_full, weight)
        ctx.group = group
        ctx.seq_dim = seq_dim
        ctx.recompute_all_gather = recompute_all_gather
        ctx.coc_in_backward = coc_in_backward
        return y

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        saved_x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        group, dim = ctx.group, ctx.seq_dim
        world = comm.world_size(group)
        grad_y = grad_y.contiguous()
        grad_y2d = rows(grad_y)
        deferred = need_w and defer_wgrad(grad_y, ctx.wgrad_opts)
        compute_wgrad = need_w and not deferred
        x_full = saved_x
        if compute_wgrad and ctx.recompute_all_gather:
            # Started first, so the gather overlaps the dgrad GEMM.
            x_full = comm.start_gather_rows(saved_x, group, dim)

        grad_x = None
        scatter = False
        if need_x:
            if ctx.coc_in_backward:
                grad_x = comm.matmul_reduce_scatter(grad_y, weight.t(), None, group, dim)
            else:
                grad_x = grad_y.matmul(weight)
                if world > 1:
                    # Waited for after the weight gradient, which it overlaps.
                    grad_x = comm.start_reduce_scatter(grad_x, group, dim)
                    scatter = True
        if compute_wgrad and ctx.recompute_all_gather and world > 1:
            x_full = comm.wait(x_full)
        x_full2d = rows(x_full) if x_full is not None else None
        grad_w, grad_b = wgrad_and_bias_grad(ctx, grad_y2d if compute_wgrad else None, x_full2d, grad_y2d)
        return _finish_dgrad(ctx, grad_x, scatter), grad_w, grad_b, None, None, None, None, None


class RowParallelLinearFunction(torch.autograd.Function):
    """Row-parallel linear, no sequence parallelism.

    Shapes: ``x_shard_k [s, b, k/W]``, ``w_shard_k [n, k/W]``, ``bias [n]`` (whole).

    - forward, one ``kernels.matmul_all_reduce`` (bias added once, after the reduction)::

        y = all_reduce(x_shard_k @ w_shard_k.T) + bias                   # [s, b, n]

    - dgrad and wgrad are local (``grad_y`` is the same on every rank)::

        grad_x_shard_k = grad_y @ w_shard_k                              # [s, b, k/W]
        grad_w_shard_k = grad_y.T @ x_shard_k                            # [n, k/W]
        grad_bias = grad_y.sum(rows)                                     # [n]

    ``group=None`` runs it without communication (single process, explicit expert comm).
    """

    @staticmethod
    @custom_fwd
    def forward(
        ctx: Any,
        x_shard_k: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group,
        wgrad_opts: WgradOptions,
    ) -> torch.Tensor:
        x_shard_k, weight, bias = save_for_wgrad(ctx, x_shard_k, weight, bias, wgrad_opts)
        ctx.save_for_backward(x_shard_k if ctx.needs_input_grad[1] else None, weight)
        y2d = comm.matmul_all_reduce(rows(x_shard_k), weight, bias, group)
        return y2d.view(*x_shard_k.shape[:-1], weight.shape[0])

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x_shard_k, weight = ctx.saved_tensors
        grad_y2d = rows(grad_y.contiguous())
        grad_x = grad_y2d.matmul(weight).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_w, grad_b = wgrad_and_bias_grad(
            ctx, grad_y2d, rows(x_shard_k) if x_shard_k is not None else None, grad_y2d
        )
        return grad_x, grad_w, grad_b, None, None


class RowParallelLinearSPFunction(torch.autograd.Function):
    """Row-parallel linear with sequence parallelism, the sequence on dim ``seq_dim`` of the output.

    Shapes (``seq_dim=0``, Megatron): ``x_shard_k [s, b, k/W]``, ``w_shard_k [n, k/W]``,
    ``bias [n]`` (whole); with ``seq_dim=1`` every ``s`` below moves to dim 1.

    - forward, one ``kernels.matmul_reduce_scatter(..., scatter_dim=seq_dim)`` (bias added once,
      after the reduction)::

        y_shard_s = reduce_scatter(x_shard_k @ w_shard_k.T, dim=seq_dim) + bias   # [s/W, b, n]

    - dgrad, one ``kernels.all_gather_matmul(..., gather_dim=seq_dim, return_gathered=True)``::

        grad_y = all_gather(grad_y_shard_s, dim=seq_dim)                 # [s, b, n]
        grad_x_shard_k = grad_y @ w_shard_k                              # [s, b, k/W]

    - wgrad, from the gathered ``grad_y`` the dgrad op returned::

        grad_w_shard_k = rows(grad_y).T @ rows(x_shard_k)                # [n, k/W]
        grad_bias = grad_y_shard_s.sum(rows)                             # [n], partial over ranks

      The bias gradient is this rank's rows only, as in Megatron, where such parameters carry
      ``sequence_parallel=True`` and the trainer all-reduces their gradients over the TP group
      (``autopar.sum_sequence_parallel_grads``; the DTensor styles do it in the backward).
    """

    @staticmethod
    @custom_fwd
    def forward(
        ctx: Any,
        x_shard_k: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group,
        wgrad_opts: WgradOptions,
        seq_dim: int = 0,
    ) -> torch.Tensor:
        world = comm.world_size(group)
        if x_shard_k.dim() < 2 or x_shard_k.shape[seq_dim] % world != 0:
            raise ValueError(
                f"sequence-parallel RowParallelLinear needs the sequence dim (dim {seq_dim}) of "
                f"the input divisible by the tensor-parallel size W={world}, got input "
                f"shape {tuple(x_shard_k.shape)}"
            )
        x_shard_k, weight, bias = save_for_wgrad(ctx, x_shard_k, weight, bias, wgrad_opts)
        ctx.save_for_backward(x_shard_k if ctx.needs_input_grad[1] else None, weight)
        ctx.group = group
        ctx.seq_dim = seq_dim
        return comm.matmul_reduce_scatter(x_shard_k, weight, bias, group, seq_dim)

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad_y_shard_s: torch.Tensor) -> tuple:
        x_shard_k, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_y_shard_s = grad_y_shard_s.contiguous()
        grad_x = grad_y = None
        if need_x:
            grad_x, grad_y = comm.all_gather_matmul(grad_y_shard_s, weight.t(), None, ctx.group, True, ctx.seq_dim)
            grad_x = grad_x.view(ctx.x_shape)
        elif need_w:
            grad_y = comm.gather_rows(grad_y_shard_s, ctx.group, ctx.seq_dim)
        grad_w, grad_b = wgrad_and_bias_grad(
            ctx,
            rows(grad_y) if grad_y is not None else None,
            rows(x_shard_k) if need_w else None,
            rows(grad_y_shard_s),
        )
        return grad_x, grad_w, grad_b, None, None, None
