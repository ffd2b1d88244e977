"""The four autograd Functions of the tensor-parallel linears, one per (layer, sequence parallel).

Each takes ``(x, weight, bias, opts)``: ``opts`` is a :class:`~autopar.tp.options.LinearOptions` (process
group, sequence dim, backward switches, operand format). The operand format is a parameter, not a copy:
the same Functions run plain GEMMs (torch's and the bf16 ``kernels`` ops) or the FP8 recipe's
(:class:`~autopar.tp.fp8.Fp8Operands`: block-scaled operands, the FP8 ``kernels`` ops). Their communication
is :mod:`kernels`' registered operators and torch's functional collectives (:mod:`autopar.tp.comm`), so the
plain forward and backward trace whole under ``torch.compile(fullgraph=True)``. The backends are the
``kernels`` ones, chosen from the ``COC_*`` environment at call time (at trace time under compile).

Notation in the docstrings: ``W`` is the tensor-parallel world size, ``s`` the sequence length,
``b`` the micro-batch, ``k`` the input and ``n`` the output features, ``x_shard_s`` a tensor
sharded along ``s`` (sequence parallel), ``w_shard_n`` / ``w_shard_k`` a weight sharded along
``n`` / ``k``. ``q(.)`` is the operand format: the identity for plain operands, FP8 quantization for the
recipe (activations and gradients 1 x 128 along their last dim, weights 128 x 128; the wgrad quantizes
both operands along the tokens, docs/fp8.md). Inputs may have any number of leading dims; the sequence
dim is ``opts.seq_dim`` (0 in the shapes below) and the others are flattened into rows.
"""

from __future__ import annotations

from typing import Any

import torch

from . import comm
from .comm import rows
from .options import LinearOptions
from .wgrad import custom_bwd, custom_fwd, defer_wgrad, track_main_grad, wgrad_and_bias_grad


def _begin(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, opts: LinearOptions) -> tuple:
    """The forward bookkeeping every Function shares; returns ``(x, weight, bias)`` as the format's ops
    take them (plain: in the autocast dtype when autocast is on).

    The Function saves its tensors itself: the input it keeps is read by the weight gradient
    only, so a frozen weight (``ctx.needs_input_grad[1]`` False; a LoRA base, say) keeps none.
    """
    ctx.opts, ctx.ops = opts, opts.operands
    track_main_grad(ctx, weight, opts.wgrad)
    ctx.bias_dtype = None if bias is None else bias.dtype
    x, weight, bias = opts.operands.check(x, weight, bias)
    ctx.x_shape = x.shape
    ctx.has_bias = bias is not None
    ctx.weight_dtype = weight.dtype
    return x, weight, bias


def _saved(ctx: Any) -> tuple[torch.Tensor, Any]:
    """``(weight, the operand kept for the weight gradient)`` of a Function that saved ``*pack(kept), weight``."""
    *kept, weight = ctx.saved_tensors
    return weight, ctx.ops.unpack(tuple(kept))


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

        y_shard_n = q(x) @ q(w_shard_n).T + bias_shard_n                 # [s, b, n/W]

    - dgrad: every rank holds a partial sum over its n/W columns::

        grad_x = all_reduce(q(grad_y_shard_n) @ q(w_shard_n.T).T)        # [s, b, k]

      plain: the all-reduce runs asynchronously and overlaps the wgrad GEMM, or, with
      ``coc_in_backward``, is one ``kernels.matmul_all_reduce``; FP8: one ``kernels.scaled_matmul_all_reduce``.
      No all-reduce when ``allreduce_dgrad`` is False (Megatron's ``disable_grad_reduce``,
      explicit expert communication, W == 1).

    - wgrad (local)::

        grad_w_shard_n = q(grad_y_shard_n.T) @ q(x.T).T                  # [n/W, k]
        grad_bias_shard_n = grad_y_shard_n.sum(rows)                     # [n/W]
    """

    @staticmethod
    @custom_fwd
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, opts: LinearOptions
    ) -> torch.Tensor:
        x, weight, bias = _begin(ctx, x, weight, bias, opts)
        ops = opts.operands
        y = ops.linear(ops.input(x), ops.weight(weight), bias, out_dtype=x.dtype)
        ctx.save_for_backward(*ops.pack(ops.wgrad_input(x) if ctx.needs_input_grad[1] else None), weight)
        ctx.allreduce_dgrad = opts.allreduce_dgrad and comm.world_size(opts.group) > 1
        return y

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        weight, x_tokens = _saved(ctx)
        ops, opts = ctx.ops, ctx.opts
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_y = grad_y.contiguous()
        grad_y2d = rows(grad_y)
        grad_x = None
        reducing = False
        if need_x:
            g, w_t = ops.grad(grad_y), ops.weight_t(weight)
            if ctx.allreduce_dgrad and ops.fused_dgrad:
                grad_x = ops.linear_all_reduce(g, w_t, None, opts.comm_call(grad_y.dtype))
            else:
                grad_x = ops.linear(g, w_t, None, out_dtype=grad_y.dtype)
                if ctx.allreduce_dgrad:
                    # Waited for after the weight gradient, which it overlaps.
                    grad_x = comm.start_all_reduce(grad_x, opts.group)
                    reducing = True
        deferred = need_w and defer_wgrad(grad_y, ctx.wgrad_opts)
        grad_w, grad_b = wgrad_and_bias_grad(ctx, None if deferred else grad_y2d, x_tokens, grad_y2d)
        return _finish_dgrad(ctx, grad_x, reducing), grad_w, grad_b, None


class ColumnParallelLinearSPFunction(torch.autograd.Function):
    """Column-parallel linear with sequence parallelism, the sequence on dim ``seq_dim`` of ``x``.

    Shapes (``seq_dim=0``, Megatron): ``x_shard_s [s/W, b, k]``, ``w_shard_n [n/W, k]``,
    ``bias_shard_n [n/W]``; with ``seq_dim=1`` (Hugging Face, torchtitan) ``x_shard_s [b, s/W, k]``
    and every ``s`` below moves to dim 1 likewise.

    - forward, one ``kernels.all_gather_matmul(..., gather_dim=seq_dim)`` (FP8:
      ``kernels.all_gather_scaled_matmul``, the FP8 rows travelling with their scales)::

        x = all_gather(q(x_shard_s), dim=seq_dim)                        # [s, b, k]
        y_shard_n = x @ q(w_shard_n).T + bias_shard_n                    # [s, b, n/W]

      plain: ``recompute_all_gather=True`` keeps only ``x_shard_s`` and gathers again in the backward
      (less memory); False keeps the gathered ``x`` (the op's ``return_gathered``). FP8 keeps the
      gathered FP8 ``x`` (half the bytes of a bf16 one).

    - dgrad::

        grad_x_shard_s = reduce_scatter(q(grad_y_shard_n) @ q(w_shard_n.T).T, dim=seq_dim)   # [s/W, b, k]

      plain: the reduce-scatter runs asynchronously and overlaps the wgrad GEMM, or, with
      ``coc_in_backward``, is one ``kernels.matmul_reduce_scatter(..., scatter_dim=seq_dim)``; FP8: one
      ``kernels.scaled_matmul_reduce_scatter``. The recomputed all-gather of ``x`` is started first so it
      overlaps the dgrad GEMM.

    - wgrad (rows: every dim but the last flattened, in the same order for both operands; FP8: the
      gathered ``x`` dequantized and quantized again along the tokens)::

        grad_w_shard_n = q(rows(grad_y_shard_n).T) @ q(rows(x).T).T      # [n/W, k]
        grad_bias_shard_n = grad_y_shard_n.sum(rows)                     # [n/W]
    """

    @staticmethod
    @custom_fwd
    def forward(
        ctx: Any, x_shard_s: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, opts: LinearOptions
    ) -> torch.Tensor:
        x_shard_s, weight, bias = _begin(ctx, x_shard_s, weight, bias, opts)
        ops = opts.operands
        need_w = ctx.needs_input_grad[1]
        # The input (shard or gathered) is read by the weight gradient only: a frozen weight keeps
        # none, in particular not the W-times larger gathered input.
        keep_gathered = need_w and not ops.recompute_all_gather
        y, gathered = ops.all_gather_linear(
            ops.input(x_shard_s), ops.weight(weight), bias, opts.comm_call(x_shard_s.dtype), keep=keep_gathered
        )
        kept = gathered if keep_gathered else (x_shard_s if need_w else None)
        ctx.save_for_backward(*ops.pack(kept), weight)
        return y

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        weight, kept = _saved(ctx)
        ops, opts = ctx.ops, ctx.opts
        group, dim = opts.group, opts.seq_dim
        need_x, need_w = ctx.needs_input_grad[:2]
        world = comm.world_size(group)
        grad_y = grad_y.contiguous()
        grad_y2d = rows(grad_y)
        deferred = need_w and defer_wgrad(grad_y, ctx.wgrad_opts)
        compute_wgrad = need_w and not deferred
        regather = compute_wgrad and ops.recompute_all_gather
        if regather:
            # Started first, so the gather overlaps the dgrad GEMM.
            x_full = comm.start_gather_rows(kept, group, dim)

        grad_x = None
        scatter = False
        if need_x:
            g, w_t = ops.grad(grad_y), ops.weight_t(weight)
            if ops.fused_dgrad:
                grad_x = ops.linear_reduce_scatter(g, w_t, None, opts.comm_call(grad_y.dtype))
            else:
                grad_x = ops.linear(g, w_t, None, out_dtype=grad_y.dtype)
                if world > 1:
                    # Waited for after the weight gradient, which it overlaps.
                    grad_x = comm.start_reduce_scatter(grad_x, group, dim)
                    scatter = True
        x_tokens = None
        if compute_wgrad:
            if not regather:
                x_full = ops.dequant(kept)
            elif world > 1:
                x_full = comm.wait(x_full)
            x_tokens = ops.wgrad_input(x_full)
        grad_w, grad_b = wgrad_and_bias_grad(ctx, grad_y2d if compute_wgrad else None, x_tokens, grad_y2d)
        return _finish_dgrad(ctx, grad_x, scatter), grad_w, grad_b, None


class RowParallelLinearFunction(torch.autograd.Function):
    """Row-parallel linear, no sequence parallelism.

    Shapes: ``x_shard_k [s, b, k/W]``, ``w_shard_k [n, k/W]``, ``bias [n]`` (whole).

    - forward, one ``kernels.matmul_all_reduce`` (FP8: ``kernels.scaled_matmul_all_reduce``; bias
      added once, after the reduction)::

        y = all_reduce(q(x_shard_k) @ q(w_shard_k).T) + bias             # [s, b, n]

    - dgrad and wgrad are local (``grad_y`` is the same on every rank)::

        grad_x_shard_k = q(grad_y) @ q(w_shard_k.T).T                    # [s, b, k/W]
        grad_w_shard_k = q(grad_y.T) @ q(x_shard_k.T).T                  # [n, k/W]
        grad_bias = grad_y.sum(rows)                                     # [n]

    ``group=None`` runs it without communication (single process, explicit expert comm).
    """

    @staticmethod
    @custom_fwd
    def forward(
        ctx: Any, x_shard_k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, opts: LinearOptions
    ) -> torch.Tensor:
        x_shard_k, weight, bias = _begin(ctx, x_shard_k, weight, bias, opts)
        ops = opts.operands
        kept = ops.wgrad_input(x_shard_k) if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(*ops.pack(kept), weight)
        return ops.linear_all_reduce(ops.input(x_shard_k), ops.weight(weight), bias, opts.comm_call(x_shard_k.dtype))

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        weight, x_tokens = _saved(ctx)
        ops = ctx.ops
        grad_y = grad_y.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = ops.linear(ops.grad(grad_y), ops.weight_t(weight), None, out_dtype=grad_y.dtype)
            grad_x = grad_x.view(ctx.x_shape)
        grad_y2d = rows(grad_y)
        grad_w, grad_b = wgrad_and_bias_grad(ctx, grad_y2d, x_tokens, grad_y2d)
        return grad_x, grad_w, grad_b, None


class RowParallelLinearSPFunction(torch.autograd.Function):
    """Row-parallel linear with sequence parallelism, the sequence on dim ``seq_dim`` of the output.

    Shapes (``seq_dim=0``, Megatron): ``x_shard_k [s, b, k/W]``, ``w_shard_k [n, k/W]``,
    ``bias [n]`` (whole); with ``seq_dim=1`` every ``s`` below moves to dim 1.

    - forward, one ``kernels.matmul_reduce_scatter(..., scatter_dim=seq_dim)`` (FP8:
      ``kernels.scaled_matmul_reduce_scatter``; bias added once, after the reduction)::

        y_shard_s = reduce_scatter(q(x_shard_k) @ q(w_shard_k).T, dim=seq_dim) + bias   # [s/W, b, n]

    - dgrad, one ``kernels.all_gather_matmul(..., gather_dim=seq_dim, return_gathered=True)`` (FP8:
      ``kernels.all_gather_scaled_matmul``, the gathered FP8 gradient returned)::

        grad_y = all_gather(q(grad_y_shard_s), dim=seq_dim)              # [s, b, n]
        grad_x_shard_k = grad_y @ q(w_shard_k.T).T                       # [s, b, k/W]

    - wgrad, from the gathered ``grad_y`` the dgrad op returned (FP8: dequantized and quantized
      again along the tokens)::

        grad_w_shard_k = q(rows(grad_y).T) @ q(rows(x_shard_k).T).T      # [n, k/W]
        grad_bias = grad_y_shard_s.sum(rows)                             # [n], partial over ranks

      The bias gradient is this rank's rows only, as in Megatron, where such parameters carry
      ``sequence_parallel=True`` and the trainer all-reduces their gradients over the TP group
      (``autopar.sum_sequence_parallel_grads``; the DTensor styles do it in the backward).
    """

    @staticmethod
    @custom_fwd
    def forward(
        ctx: Any, x_shard_k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, opts: LinearOptions
    ) -> torch.Tensor:
        world, dim = comm.world_size(opts.group), opts.seq_dim
        if x_shard_k.dim() < 2 or x_shard_k.shape[dim] % world != 0:
            raise ValueError(
                f"sequence-parallel RowParallelLinear needs the sequence dim (dim {dim}) of "
                f"the input divisible by the tensor-parallel size W={world}, got input "
                f"shape {tuple(x_shard_k.shape)}"
            )
        x_shard_k, weight, bias = _begin(ctx, x_shard_k, weight, bias, opts)
        ops = opts.operands
        kept = ops.wgrad_input(x_shard_k) if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(*ops.pack(kept), weight)
        return ops.linear_reduce_scatter(
            ops.input(x_shard_k), ops.weight(weight), bias, opts.comm_call(x_shard_k.dtype)
        )

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad_y_shard_s: torch.Tensor) -> tuple:
        weight, x_tokens = _saved(ctx)
        ops, opts = ctx.ops, ctx.opts
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_y_shard_s = grad_y_shard_s.contiguous()
        grad_x = grad_y = None
        if need_x:
            grad_x, gathered = ops.all_gather_linear(
                ops.grad(grad_y_shard_s), ops.weight_t(weight), None, opts.comm_call(grad_y_shard_s.dtype), keep=need_w
            )
            grad_x = grad_x.view(ctx.x_shape)
            grad_y = ops.dequant(gathered) if need_w else None
        elif need_w:
            # No dgrad (a frozen input): only the gradient is gathered. Quantizing rows in 1 x 128 blocks
            # commutes with gathering rows, so this is the operand the FP8 dgrad op would have gathered.
            grad_y = ops.dequant(ops.grad(comm.gather_rows(grad_y_shard_s, opts.group, opts.seq_dim)))
        grad_w, grad_b = wgrad_and_bias_grad(
            ctx, rows(grad_y) if grad_y is not None else None, x_tokens, rows(grad_y_shard_s)
        )
        return grad_x, grad_w, grad_b, None


__all__ = [
    "ColumnParallelLinearFunction",
    "ColumnParallelLinearSPFunction",
    "RowParallelLinearFunction",
    "RowParallelLinearSPFunction",
]
