"""One all-gather for several column-parallel linears that read the same sequence-sharded input.

Attention's q / k / v projections and the MLP's gate / up projections each take the same hidden
states. Under sequence parallelism each would all-gather them on its own; :func:`share_input_gather`
links such sibling modules (already parallelized with :class:`~autopar.tp.styles.CocColwiseParallel`)
so that the first of them to run gathers once for all of them with ``kernels.all_gather_matmul`` and a
list of weights, and the others take their outputs. ``parallelize_hf`` links q/k/v and gate/up of the
models whose attention and MLP read one input (Llama, Qwen2 and the like) when sequence parallelism is
on. Parameters are untouched: each module keeps its own DTensor weight and bias.

The outputs wait keyed on the input *object*. A member called while outputs of another input wait
computes its own output alone; a model that skips a linked member keeps one output waiting and runs
unshared from then on (correct, not faster). Under ``torch.compile`` sharing is off (the Inductor pass
merges gathers in compiled graphs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard

from . import comm
from .comm import Group, rows


class SharedGatherColumnSPFunction(torch.autograd.Function):
    """Column-parallel linears ``i = 0 .. L-1`` on one sequence-sharded input, the sequence on ``seq_dim``.

    Shapes (``seq_dim=1``, Hugging Face): ``x_shard_s [b, s/W, k]``, ``w_i [n_i/W, k]``, ``b_i [n_i/W]``.

    - forward, one ``kernels.all_gather_matmul(x_shard_s, [w_0, ..], [b_0, ..], gather_dim=seq_dim)``::

        x = all_gather(x_shard_s, dim=seq_dim)                           # [b, s, k]
        y_i = x @ w_i.T + b_i                                            # [b, s, n_i/W]

      ``recompute_all_gather=True`` keeps ``x_shard_s`` and gathers again in the backward.

    - dgrad, one reduce-scatter of the summed products, overlapping the weight gradients::

        grad_x_shard_s = reduce_scatter(sum_i grad_y_i @ w_i, dim=seq_dim)   # [b, s/W, k]

    - wgrad::

        grad_w_i = rows(grad_y_i).T @ rows(x)                            # [n_i/W, k]
        grad_b_i = grad_y_i.sum(rows)                                    # [n_i/W]
    """

    @staticmethod
    def forward(
        ctx: Any, x_shard_s: torch.Tensor, group: Group, seq_dim: int, recompute: bool, count: int, *params: Any
    ) -> tuple[torch.Tensor, ...]:
        weights, biases = list(params[:count]), list(params[count:])
        ys, x_full = comm.all_gather_matmul(x_shard_s, weights, biases, group, True, seq_dim)
        ctx.save_for_backward(x_shard_s if recompute else x_full, *weights)
        ctx.group, ctx.seq_dim, ctx.recompute, ctx.count = group, seq_dim, recompute, count
        ctx.has_bias = [b is not None for b in biases]
        ctx.x_shape = x_shard_s.shape
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *grad_ys: torch.Tensor) -> tuple:
        saved_x, *weights = ctx.saved_tensors
        group, dim, count = ctx.group, ctx.seq_dim, ctx.count
        need_x = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[5 : 5 + count]
        need_b = ctx.needs_input_grad[5 + count :]
        grads = [g.contiguous() for g in grad_ys]
        x_full = saved_x
        if any(need_w) and ctx.recompute:
            # Started first, so the gather overlaps the dgrad GEMMs.
            x_full = comm.start_gather_rows(saved_x, group, dim)
        grad_x = None
        in_flight = False
        if need_x:
            grad_x = sum(g.matmul(w) for g, w in zip(grads, weights, strict=True))
            if comm.world_size(group) > 1:
                grad_x = comm.start_reduce_scatter(grad_x, group, dim)
                in_flight = True
        if any(need_w) and ctx.recompute and comm.world_size(group) > 1:
            x_full = comm.wait(x_full)
        x2d = rows(x_full) if any(need_w) else None
        grad_ws = [rows(g).t().matmul(x2d) if need else None for g, need in zip(grads, need_w, strict=True)]
        grad_bs = [
            rows(g).sum(0) if need and has else None for g, need, has in zip(grads, need_b, ctx.has_bias, strict=True)
        ]
        if in_flight:
            grad_x = comm.wait(grad_x)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return (grad_x, None, None, None, None, *grad_ws, *grad_bs)


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
        weights: list[torch.Tensor],
        biases: list[torch.Tensor | None],
        group: Group,
        seq_dim: int,
        recompute: bool,
    ) -> torch.Tensor:
        """Every member's output from one gather of ``x_local``; ``module``'s is returned, the others wait."""
        ys = SharedGatherColumnSPFunction.apply(x_local, group, seq_dim, recompute, len(weights), *weights, *biases)
        self._source = x
        self._waiting = {id(m): y for m, y in zip(self.members, ys, strict=True) if m is not module}
        return ys[self.members.index(module)]


def share_input_gather(modules: list[nn.Module]) -> SharedGather:
    """Link column-parallel ``modules`` that always read the same input so that, with a sequence-sharded
    input, they share one all-gather. Each must have been parallelized with ``CocColwiseParallel`` with
    the same layouts (output sharded on the features, not packed)."""
    from .styles import CocColwiseParallel

    if len(modules) < 2:
        raise ValueError(f"share_input_gather links two or more modules, got {len(modules)}")
    styles = [getattr(m, "_coc_style", None) for m in modules]
    if not all(isinstance(s, CocColwiseParallel) for s in styles):
        raise ValueError("share_input_gather: every module must be parallelized with CocColwiseParallel first")
    first = styles[0]
    for s in styles:
        if s.packed != 1 or repr(s) != repr(first):
            raise ValueError(f"share_input_gather: the modules' styles differ or are packed: {s!r} vs {first!r}")
    out = first.output_layouts[0]
    if not (isinstance(out, Shard) and out.dim == -1):
        raise ValueError(f"share_input_gather: the outputs must stay sharded on the features (Shard(-1)), got {out}")
    link = SharedGather(list(modules))
    for m in modules:
        m._coc_shared_gather = link
    return link


def sharing_applies(module: nn.Module) -> SharedGather | None:
    """The module's link, unless compiling (dynamo would trace the Python-side waiting outputs)."""
    link = getattr(module, "_coc_shared_gather", None)
    if link is None or torch.compiler.is_compiling():
        return None
    return link
