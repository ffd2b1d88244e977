"""One all-gather for several column-parallel linears that read the same sequence-sharded input.

Attention's q / k / v projections and the MLP's gate / up projections each take the same hidden
states. Under sequence parallelism each would all-gather them on its own; ``share_input_gather`` (in
:mod:`autopar.tp.styles`) links such sibling modules (already parallelized with ``CocColwiseParallel``)
so that the first of them to run gathers once for all of them with ``kernels.all_gather_matmul`` and a
list of weights (FP8: ``kernels.all_gather_scaled_matmul`` with the lists of FP8 weights and scales), and
the others take their outputs. ``parallelize_hf`` links q/k/v and gate/up of the models whose attention
and MLP read one input (Llama, Qwen2 and the like) when sequence parallelism is on. Parameters are
untouched: each module keeps its own DTensor weight and bias.

The outputs wait keyed on the input *object*. A member called while outputs of another input wait
computes its own output alone; a model that skips a linked member keeps one output waiting and runs
unshared from then on (correct, not faster). Under ``torch.compile`` sharing is off (the Inductor pass
merges gathers in compiled graphs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import comm
from .comm import rows
from .options import LinearOptions


class SharedGatherColumnSPFunction(torch.autograd.Function):
    """Column-parallel linears ``i = 0 .. L-1`` on one sequence-sharded input, the sequence on ``seq_dim``.

    Shapes (``seq_dim=1``, Hugging Face): ``x_shard_s [b, s/W, k]``, ``w_i [n_i/W, k]``, ``b_i [n_i/W]``.
    ``members[i]`` is linear ``i``'s :class:`~autopar.tp.options.LinearOptions` (the same group, sequence
    dim, switches and recipe; its own FP8 weight cache); ``q(.)`` its operand format
    (:mod:`autopar.tp.functions`).

    - forward, one ``kernels.all_gather_matmul(x_shard_s, [w_0, ..], [b_0, ..], gather_dim=seq_dim)``
      (FP8: ``kernels.all_gather_scaled_matmul`` with the lists of FP8 weights and scales)::

        x = all_gather(q(x_shard_s), dim=seq_dim)                        # [b, s, k]
        y_i = x @ q(w_i).T + b_i                                         # [b, s, n_i/W]

      plain: ``recompute_all_gather=True`` keeps ``x_shard_s`` and gathers again in the backward.

    - dgrad, one reduce-scatter of the summed products (FP8: fp32 partials, rounded once after the
      reduction, as inside the FP8 ops), overlapping the weight gradients::

        grad_x_shard_s = reduce_scatter(sum_i q(grad_y_i) @ q(w_i.T).T, dim=seq_dim)   # [b, s/W, k]

    - wgrad (FP8: the gathered ``x`` dequantized and quantized along the tokens once for all ``i``)::

        grad_w_i = q(rows(grad_y_i).T) @ q(rows(x).T).T                  # [n_i/W, k]
        grad_b_i = grad_y_i.sum(rows)                                    # [n_i/W]
    """

    @staticmethod
    def forward(
        ctx: Any, x_shard_s: torch.Tensor, members: tuple[LinearOptions, ...], *params: Any
    ) -> tuple[torch.Tensor, ...]:
        count = len(members)
        first = members[0]
        ops = first.operands
        x = x_shard_s
        weights, biases = [], []
        for opts, w, b in zip(members, params[:count], params[count:], strict=True):
            x, w, b = opts.operands.check(x_shard_s, w, b)
            weights.append(w)
            biases.append(b)
        ys, gathered = ops.all_gather_linears(
            ops.input(x),
            [opts.operands.weight(w) for opts, w in zip(members, weights, strict=True)],
            biases,
            first.comm_call(x.dtype),
        )
        need_w = any(ctx.needs_input_grad[2 : 2 + count])
        kept = (x if ops.recompute_all_gather else gathered) if need_w else None
        ctx.save_for_backward(*weights, *ops.pack(kept))
        ctx.members = members
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtypes = [None if b is None else b.dtype for b in params[count:]]
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *grad_ys: torch.Tensor) -> tuple:
        members = ctx.members
        count, first = len(members), members[0]
        ops, group, dim = first.operands, first.group, first.seq_dim
        weights, kept = ctx.saved_tensors[:count], ops.unpack(ctx.saved_tensors[count:])
        need_x = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[2 : 2 + count]
        need_b = ctx.needs_input_grad[2 + count :]
        grads = [g.contiguous() for g in grad_ys]
        regather = any(need_w) and ops.recompute_all_gather
        if regather:
            # Started first, so the gather overlaps the dgrad GEMMs.
            x_full = comm.start_gather_rows(kept, group, dim)
        grad_x = None
        in_flight = False
        if need_x:
            dtype = ops.partial_dtype(grads[0].dtype)
            grad_x = sum(
                opts.operands.linear(opts.operands.grad(g), opts.operands.weight_t(w), None, out_dtype=dtype)
                for opts, g, w in zip(members, grads, weights, strict=True)
            )
            if comm.world_size(group) > 1:
                grad_x = comm.start_reduce_scatter(grad_x, group, dim)
                in_flight = True
        x_tokens = None
        if any(need_w):
            if not regather:
                x_full = ops.dequant(kept)
            elif comm.world_size(group) > 1:
                x_full = comm.wait(x_full)
            x_tokens = ops.wgrad_input(x_full)
        grad_ws = [
            opts.operands.wgrad_gemm(rows(g), x_tokens, w.dtype) if need else None
            for opts, g, w, need in zip(members, grads, weights, need_w, strict=True)
        ]
        grad_bs = [
            rows(g).sum(0).to(dtype) if need and dtype is not None else None
            for g, need, dtype in zip(grads, need_b, ctx.bias_dtypes, strict=True)
        ]
        if in_flight:
            grad_x = comm.wait(grad_x)
        if grad_x is not None:
            grad_x = grad_x.to(ctx.x_dtype).view(ctx.x_shape)
        return (grad_x, None, *grad_ws, *grad_bs)


class SharedGather:
    """The link between sibling column-parallel modules (see the module docstring)."""

    def __init__(self, members: list[nn.Module]) -> None:
        self.members = members
        self._source: Any = None  # the input object the waiting outputs were computed from
        self._waiting: dict[int, torch.Tensor] = {}

    def take(self, module: nn.Module, x: Any) -> torch.Tensor | None:
        """The output computed for ``module`` from this very ``x`` by a sibling's call, if one waits."""
        if self._source is not x or id(module) not in self._waiting:
            return None
        y = self._waiting.pop(id(module))
        if not self._waiting:
            self._source = None
        return y

    @property
    def idle(self) -> bool:
        """No outputs wait: a call may start a round for every member. While some wait, a member
        called with another input computes its own output alone."""
        return not self._waiting

    def compute(
        self,
        module: nn.Module,
        x: Any,
        x_local: torch.Tensor,
        params: list[torch.Tensor | None],
        members: tuple[LinearOptions, ...],
    ) -> torch.Tensor:
        """Every member's output from one gather of ``x_local``; ``module``'s is returned, the others wait.
        ``params``: the members' weights, then their biases; ``members``: their options, in member order."""
        ys = SharedGatherColumnSPFunction.apply(x_local, members, *params)
        self._source = x
        self._waiting = {id(m): y for m, y in zip(self.members, ys, strict=True) if m is not module}
        return ys[self.members.index(module)]


def sharing_applies(module: nn.Module) -> SharedGather | None:
    """The module's link, unless compiling (dynamo would trace the Python-side waiting outputs)."""
    link = getattr(module, "_coc_shared_gather", None)
    if link is None or torch.compiler.is_compiling():
        return None
    return link


__all__ = ["SharedGather", "SharedGatherColumnSPFunction", "sharing_applies"]
