"""Drop-in tensor-parallel linears with Megatron-core's signatures, on the overlapped ops.

``ColumnParallelLinear`` (weight split along the output dim) and ``RowParallelLinear`` (weight split
along the input dim) take the constructor and forward arguments of
``megatron.core.tensor_parallel`` and return ``(output, output_bias)`` as Megatron does. Their
forward and backward are four autograd Functions, one per (layer, sequence parallel) case, whose
communication runs through :mod:`kernels` (``all_gather_matmul``, ``matmul_reduce_scatter``,
``matmul_all_reduce``), so the backend (sequential, chunked, fused) follows the ``COC_*``
environment at call time.

Notation in the docstrings: ``W`` is the tensor-parallel world size, ``s`` the sequence length,
``b`` the micro-batch, ``k`` the input and ``n`` the output features, ``x_shard_s`` a tensor
sharded along ``s`` (sequence parallel), ``w_shard_n`` / ``w_shard_k`` a weight sharded along
``n`` / ``k``. Inputs may have any number of leading dims; dim 0 is the sequence dim and the
others are flattened into rows.

The module-level functions :func:`column_parallel_forward` and :func:`row_parallel_forward` read
only attributes that Megatron's own modules also have, which is what lets
:func:`autopar.patch_megatron` route Megatron modules (already built ones included) through them.
"""

from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.parameter import Parameter

import kernels
from kernels import checks, comm
from kernels.config import get_config

try:  # Apex's fused wgrad GEMM; Megatron uses it for gradient_accumulation_fusion on CUDA.
    import fused_weight_gradient_mlp_cuda  # type: ignore[import-not-found]
except ImportError:
    fused_weight_gradient_mlp_cuda = None

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ColumnParallelLinearFunction",
    "ColumnParallelLinearSPFunction",
    "RowParallelLinearFunction",
    "RowParallelLinearSPFunction",
    "column_parallel_forward",
    "row_parallel_forward",
    "resolve_tp_group",
]

Group = Optional[dist.ProcessGroup]

# As Megatron: the backward runs under the autocast state of the forward.
_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type="cuda")
_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="cuda")


# --------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------

def _megatron_module(name: str) -> Any:
    """A Megatron module if the program already imported it, else None.

    Megatron state (parallel_state groups, the CUDA RNG tracker) can only be set up by a program
    that imported Megatron, so looking in ``sys.modules`` answers the question without paying
    for (or requiring) the import.
    """
    return sys.modules.get(name)


def resolve_tp_group(tp_group: Group, is_expert: bool = False) -> Group:
    """The group a linear communicates over.

    An explicit ``tp_group`` wins; else Megatron's (expert) tensor-parallel group when
    ``megatron.core.parallel_state`` is initialized; else the default group; ``None`` when
    torch.distributed is not initialized (single process: no communication).
    """
    if tp_group is not None:
        if not isinstance(tp_group, dist.ProcessGroup):
            raise TypeError(f"tp_group must be a torch.distributed ProcessGroup or None, "
                            f"got {type(tp_group).__name__}")
        return tp_group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ps = _megatron_module("megatron.core.parallel_state")
    if ps is not None and ps.is_initialized():
        if is_expert:
            return ps.get_expert_tensor_parallel_group()
        return ps.get_tensor_model_parallel_group()
    return dist.group.WORLD


def _world(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


# --------------------------------------------------------------------------------------------
# Ops, with ``group=None`` meaning a single process (no communication)
# --------------------------------------------------------------------------------------------

def _all_gather_matmul(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       group: Group, return_gathered: bool) -> Any:
    if group is None:
        y = torch.nn.functional.linear(x2d, weight, bias)
        return (y, x2d) if return_gathered else y
    return kernels.all_gather_matmul(x2d, weight, bias, group=group, return_gathered=return_gathered)


def _matmul_reduce_scatter(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           group: Group) -> torch.Tensor:
    if group is None:
        return torch.nn.functional.linear(x2d, weight, bias)
    return kernels.matmul_reduce_scatter(x2d, weight, bias, group=group)


def _matmul_all_reduce(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       group: Group) -> torch.Tensor:
    if group is None:
        return torch.nn.functional.linear(x2d, weight, bias)
    return kernels.matmul_all_reduce(x2d, weight, bias, group=group)


def _gather_rows(x2d: torch.Tensor, group: Group, async_op: bool
                 ) -> tuple[torch.Tensor, Optional[dist.Work]]:
    world = _world(group)
    if world == 1:
        return x2d, None
    out = x2d.new_empty((world * x2d.shape[0], x2d.shape[1]))
    return out, comm.all_gather(out, x2d.contiguous(), group, async_op=async_op)


# --------------------------------------------------------------------------------------------
# Weight gradient, shared by the four Functions
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _WgradOptions:
    """How the weight gradient is delivered (Megatron's semantics)."""

    gradient_accumulation_fusion: bool = False
    grad_output_buffer: Optional[list] = None
    wgrad_deferral_limit: int = 0


def _main_grad_for(weight: torch.Tensor, opts: _WgradOptions) -> Optional[torch.Tensor]:
    if not opts.gradient_accumulation_fusion:
        return None
    return getattr(weight, "main_grad", None)


def _defer_wgrad(grad_y: torch.Tensor, opts: _WgradOptions) -> bool:
    """Megatron's deferred embedding wgrad: stash grad_y for the caller, skip the GEMM here."""
    buf = opts.grad_output_buffer
    if buf is None:
        return False
    if opts.wgrad_deferral_limit == 0 or len(buf) < opts.wgrad_deferral_limit:
        buf.append(grad_y)
        return True
    return False


def _weight_grad(weight: torch.Tensor, main_grad: Optional[torch.Tensor], opts: _WgradOptions,
                 grad_y2d: Optional[torch.Tensor], x2d: Optional[torch.Tensor]
                 ) -> Optional[torch.Tensor]:
    """``grad_w = grad_y2d.T @ x2d`` returned, or added into ``weight.main_grad``.

    ``grad_y2d`` is None when the GEMM was deferred (the caller computes it later).
    """
    if not opts.gradient_accumulation_fusion:
        if grad_y2d is None:
            return None
        return grad_y2d.t().matmul(x2d)
    if main_grad is None:
        raise RuntimeError("gradient_accumulation_fusion=True needs weight.main_grad (the buffer the "
                           "weight gradient is added into, e.g. allocated by Megatron's "
                           "DistributedDataParallel); this weight had none at forward time")
    # A module reused across layers (e.g. MTP logits) may have its main_grad swapped between
    # forward and backward; Megatron restores the one captured at forward time.
    weight.main_grad = main_grad
    if grad_y2d is not None:
        if main_grad.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise RuntimeError(f"Unsupported gradient type for gradient accumulation fusion: "
                               f"main_grad dtype {main_grad.dtype}")
        if fused_weight_gradient_mlp_cuda is not None and main_grad.is_cuda:
            if main_grad.dtype == torch.float32:
                fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x2d, grad_y2d, main_grad)
            else:
                fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(x2d, grad_y2d, main_grad)
        else:
            # Products of low-precision values are exact in fp32, so casting the operands up
            # first gives what Apex's fp32-accumulating GEMM gives.
            main_grad.addmm_(grad_y2d.t().to(main_grad.dtype), x2d.to(main_grad.dtype))
    if hasattr(weight, "grad_added_to_main_grad"):
        # Megatron's DDP with overlap_grad_reduce expects a (dummy) gradient so that its hooks run
        # on the main backward thread, and reads the flag to skip adding .grad to main_grad.
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        weight.grad_added_to_main_grad = True
        return make(main_grad.shape, dtype=x2d.dtype if x2d is not None else weight.dtype,
                    device=main_grad.device)
    return None


def _autocast(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple:
    """Operands in the autocast dtype when autocast is on for their device.

    A plain ``torch.matmul`` would be autocast by torch; the kernels ops check that x, weight and
    bias share one dtype, so the cast that autocast would apply to the GEMM is made explicit.
    """
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    return (x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


# --------------------------------------------------------------------------------------------
# Autograd Functions
# --------------------------------------------------------------------------------------------

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
    @_custom_fwd
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                group: Group, allreduce_dgrad: bool, coc_in_backward: bool,
                wgrad_opts: _WgradOptions) -> torch.Tensor:
        # The parameter itself: main_grad and Megatron's DDP flags live on it, not on a cast copy.
        ctx.weight_param = weight
        ctx.main_grad = _main_grad_for(weight, wgrad_opts)
        x, weight, bias = _autocast(x, weight, bias)
        # x is read by the weight gradient only: a frozen weight (a LoRA base, say) keeps none.
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        ctx.group = group
        ctx.allreduce_dgrad = allreduce_dgrad and _world(group) > 1
        ctx.coc_in_backward = coc_in_backward
        ctx.wgrad_opts = wgrad_opts
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    @_custom_bwd
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_y2d = _rows(grad_y.contiguous())
        grad_x = handle = None
        if need_x:
            if ctx.allreduce_dgrad and ctx.coc_in_backward:
                grad_x = _matmul_all_reduce(grad_y2d, weight.t(), None, ctx.group)
            else:
                grad_x = grad_y2d.matmul(weight)
                if ctx.allreduce_dgrad:
                    handle = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
            grad_x = grad_x.view(ctx.x_shape)
        grad_w = None
        if need_w:
            deferred = _defer_wgrad(grad_y, ctx.wgrad_opts)
            grad_w = _weight_grad(ctx.weight_param, ctx.main_grad, ctx.wgrad_opts,
                                  None if deferred else grad_y2d, _rows(x))
        grad_b = grad_y2d.sum(dim=0) if (ctx.has_bias and need_b) else None
        if handle is not None:
            handle.wait()
        return grad_x, grad_w, grad_b, None, None, None, None


class ColumnParallelLinearSPFunction(torch.autograd.Function):
    """Column-parallel linear with sequence parallelism.

    Shapes: ``x_shard_s [s/W, b, k]``, ``w_shard_n [n/W, k]``, ``bias_shard_n [n/W]``.

    - forward, one ``kernels.all_gather_matmul``::

        x = all_gather_s(x_shard_s)                                      # [s, b, k]
        y_shard_n = x @ w_shard_n.T + bias_shard_n                       # [s, b, n/W]

      ``recompute_all_gather=True`` keeps only ``x_shard_s`` and gathers again in the backward
      (less memory); False keeps the gathered ``x`` (the op's ``return_gathered``).

    - dgrad::

        grad_x_shard_s = reduce_scatter_s(grad_y_shard_n @ w_shard_n)    # [s/W, b, k]

      the reduce-scatter runs asynchronously and overlaps the wgrad GEMM, or, with
      ``enable_coc_in_column_backward``, is one ``kernels.matmul_reduce_scatter``.
      The recomputed all-gather of ``x`` is started first so it overlaps the dgrad GEMM.

    - wgrad::

        grad_w_shard_n = grad_y_shard_n.T @ x                            # [n/W, k]
        grad_bias_shard_n = grad_y_shard_n.sum(rows)                     # [n/W]
    """

    @staticmethod
    @_custom_fwd
    def forward(ctx: Any, x_shard_s: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], group: Group, recompute_all_gather: bool,
                coc_in_backward: bool, wgrad_opts: _WgradOptions) -> torch.Tensor:
        # The parameter itself: main_grad and Megatron's DDP flags live on it, not on a cast copy.
        ctx.weight_param = weight
        ctx.main_grad = _main_grad_for(weight, wgrad_opts)
        x_shard_s, weight, bias = _autocast(x_shard_s, weight, bias)
        world = _world(group)
        x2d = _rows(x_shard_s)
        need_w = ctx.needs_input_grad[1]
        if recompute_all_gather or not need_w:
            # The input (shard or gathered) is read by the weight gradient only: a frozen weight
            # keeps none, in particular not the W-times larger gathered input.
            y2d = _all_gather_matmul(x2d, weight, bias, group, return_gathered=False)
            ctx.save_for_backward(x2d if need_w else None, weight)
        else:
            y2d, x_full2d = _all_gather_matmul(x2d, weight, bias, group, return_gathered=True)
            ctx.save_for_backward(x_full2d, weight)
        ctx.x_shape = x_shard_s.shape
        ctx.has_bias = bias is not None
        ctx.group = group
        ctx.recompute_all_gather = recompute_all_gather
        ctx.coc_in_backward = coc_in_backward
        ctx.wgrad_opts = wgrad_opts
        return y2d.view(x_shard_s.shape[0] * world, *x_shard_s.shape[1:-1], weight.shape[0])

    @staticmethod
    @_custom_bwd
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        saved_x2d, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        group = ctx.group
        grad_y2d = _rows(grad_y.contiguous())
        deferred = need_w and _defer_wgrad(grad_y, ctx.wgrad_opts)
        compute_wgrad = need_w and not deferred
        x_full2d, gather = saved_x2d, None
        if compute_wgrad and ctx.recompute_all_gather:
            x_full2d, gather = _gather_rows(saved_x2d, group, async_op=True)

        grad_x = scatter = None
        if need_x:
            if ctx.coc_in_backward:
                grad_x = _matmul_reduce_scatter(grad_y2d, weight.t(), None, group)
            else:
                grad_x_full = grad_y2d.matmul(weight)
                world = _world(group)
                if world == 1:
                    grad_x = grad_x_full
                else:
                    grad_x = grad_x_full.new_empty((grad_x_full.shape[0] // world, grad_x_full.shape[1]))
                    scatter = comm.reduce_scatter(grad_x, grad_x_full, group, async_op=True)
        if gather is not None:
            gather.wait()
        grad_w = None
        if need_w:
            grad_w = _weight_grad(ctx.weight_param, ctx.main_grad, ctx.wgrad_opts,
                                  grad_y2d if compute_wgrad else None, x_full2d)
        grad_b = grad_y2d.sum(dim=0) if (ctx.has_bias and need_b) else None
        if scatter is not None:
            scatter.wait()
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, grad_w, grad_b, None, None, None, None


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
    @_custom_fwd
    def forward(ctx: Any, x_shard_k: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], group: Group, wgrad_opts: _WgradOptions
                ) -> torch.Tensor:
        # The parameter itself: main_grad and Megatron's DDP flags live on it, not on a cast copy.
        ctx.weight_param = weight
        ctx.main_grad = _main_grad_for(weight, wgrad_opts)
        x_shard_k, weight, bias = _autocast(x_shard_k, weight, bias)
        # x is read by the weight gradient only: a frozen weight keeps none.
        ctx.save_for_backward(x_shard_k if ctx.needs_input_grad[1] else None, weight)
        ctx.x_shape = x_shard_k.shape
        ctx.has_bias = bias is not None
        ctx.wgrad_opts = wgrad_opts
        y2d = _matmul_all_reduce(_rows(x_shard_k), weight, bias, group)
        return y2d.view(*x_shard_k.shape[:-1], weight.shape[0])

    @staticmethod
    @_custom_bwd
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x_shard_k, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_y2d = _rows(grad_y.contiguous())
        grad_x = grad_y2d.matmul(weight).view(ctx.x_shape) if need_x else None
        grad_w = (_weight_grad(ctx.weight_param, ctx.main_grad, ctx.wgrad_opts, grad_y2d, _rows(x_shard_k))
                  if need_w else None)
        grad_b = grad_y2d.sum(dim=0) if (ctx.has_bias and need_b) else None
        return grad_x, grad_w, grad_b, None, None


class RowParallelLinearSPFunction(torch.autograd.Function):
    """Row-parallel linear with sequence parallelism.

    Shapes: ``x_shard_k [s, b, k/W]``, ``w_shard_k [n, k/W]``, ``bias [n]`` (whole).

    - forward, one ``kernels.matmul_reduce_scatter`` (bias added once, after the reduction)::

        y_shard_s = reduce_scatter_s(x_shard_k @ w_shard_k.T) + bias     # [s/W, b, n]

    - dgrad, one ``kernels.all_gather_matmul`` with ``return_gathered=True``::

        grad_y = all_gather_s(grad_y_shard_s)                            # [s, b, n]
        grad_x_shard_k = grad_y @ w_shard_k                              # [s, b, k/W]

    - wgrad, from the gathered ``grad_y`` the dgrad op returned::

        grad_w_shard_k = grad_y.T @ x_shard_k                            # [n, k/W]
        grad_bias = grad_y_shard_s.sum(rows)                             # [n], partial over ranks

      The bias gradient is this rank's rows only, as in Megatron, where such parameters carry
      ``sequence_parallel=True`` and the trainer all-reduces their gradients over the TP group.
    """

    @staticmethod
    @_custom_fwd
    def forward(ctx: Any, x_shard_k: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], group: Group, wgrad_opts: _WgradOptions
                ) -> torch.Tensor:
        # The parameter itself: main_grad and Megatron's DDP flags live on it, not on a cast copy.
        ctx.weight_param = weight
        ctx.main_grad = _main_grad_for(weight, wgrad_opts)
        x_shard_k, weight, bias = _autocast(x_shard_k, weight, bias)
        world = _world(group)
        if x_shard_k.dim() < 2 or x_shard_k.shape[0] % world != 0:
            raise ValueError(f"sequence-parallel RowParallelLinear needs the sequence dim (dim 0) of "
                             f"the input divisible by the tensor-parallel size W={world}, got input "
                             f"shape {tuple(x_shard_k.shape)}")
        # x is read by the weight gradient only: a frozen weight keeps none.
        ctx.save_for_backward(x_shard_k if ctx.needs_input_grad[1] else None, weight)
        ctx.x_shape = x_shard_k.shape
        ctx.has_bias = bias is not None
        ctx.group = group
        ctx.wgrad_opts = wgrad_opts
        y2d = _matmul_reduce_scatter(_rows(x_shard_k), weight, bias, group)
        return y2d.view(x_shard_k.shape[0] // world, *x_shard_k.shape[1:-1], weight.shape[0])

    @staticmethod
    @_custom_bwd
    def backward(ctx: Any, grad_y_shard_s: torch.Tensor) -> tuple:
        x_shard_k, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        group = ctx.group
        grad_y_shard2d = _rows(grad_y_shard_s.contiguous())
        grad_x = None
        if need_x:
            grad_x2d, grad_y2d = _all_gather_matmul(grad_y_shard2d, weight.t(), None, group,
                                                    return_gathered=True)
            grad_x = grad_x2d.view(ctx.x_shape)
        elif need_w:
            grad_y2d, _ = _gather_rows(grad_y_shard2d, group, async_op=False)
        grad_w = (_weight_grad(ctx.weight_param, ctx.main_grad, ctx.wgrad_opts, grad_y2d, _rows(x_shard_k))
                  if need_w else None)
        grad_b = grad_y_shard2d.sum(dim=0) if (ctx.has_bias and need_b) else None
        return grad_x, grad_w, grad_b, None, None


# --------------------------------------------------------------------------------------------
# Last-dim scatter / gather (gather_output, input_is_parallel=False)
# --------------------------------------------------------------------------------------------

def _gather_last_dim(t: torch.Tensor, group: Group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return t
    rows = _rows(t.contiguous())
    gathered, _ = _gather_rows(rows, group, async_op=False)
    full = torch.cat(gathered.chunk(world, dim=0), dim=-1)
    return full.view(*t.shape[:-1], t.shape[-1] * world)


def _split_last_dim(t: torch.Tensor, group: Group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return t
    if t.shape[-1] % world != 0:
        raise ValueError(f"the last dim of the input ({t.shape[-1]}, shape {tuple(t.shape)}) must be "
                         f"divisible by the tensor-parallel size W={world} to scatter it")
    return t.chunk(world, dim=-1)[_rank(group)].contiguous()


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Scatter along the last dim (row linear with ``input_is_parallel=False``).

    - forward (local slice)::

        x_shard_k = x[..., rank * k/W : (rank + 1) * k/W]               # [s, b, k] -> [s, b, k/W]

    - backward::

        grad_x = all_gather_last_dim(grad_x_shard_k)                     # [s, b, k/W] -> [s, b, k]
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Gather along the last dim (column linear with ``gather_output``).

    - forward::

        y = all_gather_last_dim(y_shard_n)                               # [s, b, n/W] -> [s, b, n]

    - backward (local slice)::

        grad_y_shard_n = grad_y[..., rank * n/W : (rank + 1) * n/W]      # [s, b, n] -> [s, b, n/W]
    """

    @staticmethod
    def forward(ctx: Any, y_shard: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _gather_last_dim(y_shard, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _split_last_dim(grad, ctx.group), None


# --------------------------------------------------------------------------------------------
# Forwards shared with patched Megatron modules
# --------------------------------------------------------------------------------------------

def _wgrad_options(module: torch.nn.Module, column: bool) -> _WgradOptions:
    config = module.config
    defer = column and getattr(config, "defer_embedding_wgrad_compute", False)
    return _WgradOptions(
        gradient_accumulation_fusion=bool(module.gradient_accumulation_fusion),
        grad_output_buffer=module.grad_output_buffer if defer else None,
        wgrad_deferral_limit=getattr(config, "wgrad_deferral_limit", 0) if defer else 0,
    )


def _mark_offloading(config: Any, input_parallel: torch.Tensor) -> None:
    ctx = getattr(config, "_cpu_offloading_context", None)
    if ctx is not None and getattr(ctx, "inside_context", False):
        input_parallel.activation_offloading = getattr(config, "cpu_offloading_activations", False)


def column_parallel_forward(module: torch.nn.Module, input_: torch.Tensor,
                            weight: Optional[torch.Tensor] = None,
                            runtime_gather_output: Optional[bool] = None
                            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Forward of a column-parallel linear (ours or Megatron's) on the overlapped paths.

    Returns ``(output, output_bias)``: ``output`` is ``[s, b, n/W]`` (``[s, b, n]`` when
    gathering the output); ``output_bias`` is the bias when ``skip_bias_add``, else None.
    """
    if weight is None:
        if module.weight is None:
            raise RuntimeError("weight was not supplied to ColumnParallelLinear forward pass "
                               "and skip_weight_param_allocation is True.")
        weight = module.weight
    else:
        expected_shape = (module.output_size_per_partition, module.input_size)
        if tuple(weight.shape) != expected_shape:
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, "
                               f"not {expected_shape} as expected")
    checks.check_input_k(input_, weight.shape[1], name="input_",
                         expected=f"weight has k={weight.shape[1]} (shape {tuple(weight.shape)})")
    group = module.tp_group
    bias = module.bias if not module.skip_bias_add else None
    config = module.config
    if getattr(config, "defer_embedding_wgrad_compute", False):
        buf = module.embedding_activation_buffer
        limit = getattr(config, "wgrad_deferral_limit", 0)
        if limit == 0 or len(buf) < limit:
            buf.append(input_)
    _mark_offloading(config, input_)

    coc = get_config()
    wgrad_opts = _wgrad_options(module, column=True)
    explicit_expert_comm = getattr(module, "explicit_expert_comm", False)
    if module.sequence_parallel and not explicit_expert_comm:
        output_parallel = ColumnParallelLinearSPFunction.apply(
            input_, weight, bias, group, coc.recompute_all_gather,
            coc.enable_coc_in_column_backward, wgrad_opts)
    else:
        allreduce_dgrad = module.allreduce_dgrad and not explicit_expert_comm
        output_parallel = ColumnParallelLinearFunction.apply(
            input_, weight, bias, group, allreduce_dgrad, coc.enable_coc_in_column_backward,
            wgrad_opts)

    gather_output = module.gather_output if runtime_gather_output is None else runtime_gather_output
    output = (_GatherFromTensorParallelRegion.apply(output_parallel, group) if gather_output
              else output_parallel)
    return output, (module.bias if module.skip_bias_add else None)


def row_parallel_forward(module: torch.nn.Module, input_: torch.Tensor
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Forward of a row-parallel linear (ours or Megatron's) on the overlapped paths.

    Returns ``(output, output_bias)``: ``output`` is ``[s, b, n]`` (``[s/W, b, n]`` with sequence
    parallelism); ``output_bias`` is the bias when ``skip_bias_add``, else None.
    """
    group = module.tp_group
    k_local = module.weight.shape[1]
    if module.input_is_parallel:
        checks.check_input_k(input_, k_local, name="input_",
                             expected=f"weight has k={k_local} (shape {tuple(module.weight.shape)})")
    else:
        checks.check_input_k(input_, module.input_size, name="input_",
                             expected=f"input_is_parallel=False needs the full input_size={module.input_size}")
    if module.input_is_parallel:
        input_parallel = input_
    else:
        if module.sequence_parallel:
            raise RuntimeError("To enable `sequence_parallel`, `input_is_parallel` must be `True`")
        input_parallel = _ScatterToTensorParallelRegion.apply(input_, group)
    _mark_offloading(module.config, input_parallel)

    explicit_expert_comm = getattr(module, "explicit_expert_comm", False)
    if explicit_expert_comm and not module.skip_bias_add:
        raise RuntimeError("an expert RowParallelLinear with explicit expert communication "
                           "needs skip_bias_add=True (its output is not reduced here)")
    bias = None if module.skip_bias_add else module.bias
    wgrad_opts = _wgrad_options(module, column=False)
    if explicit_expert_comm:
        output = RowParallelLinearFunction.apply(input_parallel, module.weight, None, None, wgrad_opts)
    elif module.sequence_parallel:
        output = RowParallelLinearSPFunction.apply(input_parallel, module.weight, bias, group,
                                                   wgrad_opts)
    else:
        output = RowParallelLinearFunction.apply(input_parallel, module.weight, bias, group,
                                                 wgrad_opts)
    return output, (module.bias if module.skip_bias_add else None)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------

def _set_tp_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Megatron's ``set_tensor_model_parallel_attributes`` (read by its optimizer, checkpointing
    and gradient-norm code)."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size "
                         f"W={denominator}")
    return numerator // denominator


def _use_device_init(config: Any) -> bool:
    """Megatron's GPU initialization (per-shard init under the model-parallel CUDA RNG).

    Only with CUDA and Megatron's RNG tracker seeded (``model_parallel_cuda_manual_seed``);
    otherwise the master-weight initialization runs: it gives every rank its own slice of one
    full weight, where initializing shards from one unforked RNG would repeat them across ranks.
    """
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return False
    random = _megatron_module("megatron.core.tensor_parallel.random")
    return random is not None and random.get_cuda_rng_tracker().is_initialized()


def _init_weight(weight: Parameter, *, output_size: int, input_size: int, per_partition: int,
                 partition_dim: int, init_method: Callable, stride: int, return_master: bool,
                 params_dtype: torch.dtype, rank: int, world: int, device_init: bool,
                 is_expert: bool) -> Optional[torch.Tensor]:
    """Megatron's ``_initialize_affine_weight_cpu`` / ``_gpu``: same values for the same seed."""
    _set_tp_attributes(weight, True, partition_dim, stride)
    if device_init:
        from megatron.core.tensor_parallel.random import (get_cuda_rng_tracker,
                                                          get_expert_parallel_rng_tracker_name)
        tracker = get_cuda_rng_tracker()
        with tracker.fork(get_expert_parallel_rng_tracker_name()) if is_expert else tracker.fork():
            init_method(weight)
        return None
    master = torch.empty(output_size, input_size, dtype=torch.float, requires_grad=False)
    init_method(master)
    master = master.to(dtype=params_dtype)
    per_stride = _divide(per_partition, stride, "per-partition size / stride")
    pieces = torch.split(master, per_stride, dim=partition_dim)[rank::world]
    with torch.no_grad():
        weight.data.copy_(torch.cat(pieces, dim=partition_dim))
    return master if return_master else None


def _param_device(config: Any) -> torch.device:
    if not getattr(config, "use_cpu_initialization", False) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _ExtraStateMixin:
    """Megatron/TE state-dict compatibility: an empty ``_extra_state`` entry, sharded checkpoints."""

    def _register_extra_state_hook(self) -> None:
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))

    def set_extra_state(self, state: Any) -> None:
        """Extra state is ignored."""

    def get_extra_state(self) -> None:
        """Keep compatibility with TE state dicts."""
        return None

    def _sharded_state_dict(self, prefix: str, sharded_offsets: tuple, metadata: Optional[dict],
                            tp_axis_map: dict[str, int]) -> dict:
        # Megatron's distributed checkpointing calls this on every submodule that has it and
        # otherwise treats the parameters as replicated over TP, which would save one rank's
        # shard as the whole tensor; so the TP axes must be declared as Megatron's modules do.
        try:
            from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                         make_sharded_tensors_for_checkpoint)
        except ImportError as e:
            raise ImportError("sharded_state_dict() is Megatron's distributed checkpointing and "
                              f"needs megatron-core (pip install megatron-core): {e}") from e
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, tp_axis_map, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


class ColumnParallelLinear(_ExtraStateMixin, torch.nn.Module):
    """``Y = X A^T + b`` with ``A [output_size, input_size]`` split along its rows (the output
    features): each rank holds ``weight [output_size / W, input_size]`` and ``bias [output_size / W]``.

    Constructor and forward arguments are Megatron-core's
    ``megatron.core.tensor_parallel.ColumnParallelLinear``; ``tp_comm_buffer_name`` is accepted and
    unused (as in Megatron's non-TE module). ``forward(input_, weight=None,
    runtime_gather_output=None) -> (output, output_bias)``.
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable,
                 bias: bool = True, gather_output: bool = False, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False,
                 embedding_activation_buffer: Optional[list] = None,
                 grad_output_buffer: Optional[list] = None, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, disable_grad_reduce: bool = False,
                 tp_group: Group = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.expert_parallel = getattr(config, "expert_model_parallel_size", 1) > 1
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        self.config = config
        self.disable_grad_reduce = disable_grad_reduce
        self.tp_group = resolve_tp_group(tp_group, is_expert=is_expert)
        world, rank = _world(self.tp_group), _rank(self.tp_group)
        self.explicit_expert_comm = self.is_expert and (world > 1 or self.expert_parallel)
        self.output_size_per_partition = _divide(output_size, world, "output_size")
        params_dtype = getattr(config, "params_dtype", torch.float32)
        device = _param_device(config)
        perform_init = getattr(config, "perform_initialization", True)

        self.master_weight = None
        if not skip_weight_param_allocation:
            self.weight = Parameter(torch.empty(self.output_size_per_partition, input_size,
                                                device=device, dtype=params_dtype))
            if perform_init:
                self.master_weight = _init_weight(
                    self.weight, output_size=output_size, input_size=input_size,
                    per_partition=self.output_size_per_partition, partition_dim=0,
                    init_method=init_method, stride=stride,
                    return_master=keep_master_weight_for_test, params_dtype=params_dtype,
                    rank=rank, world=world, device_init=_use_device_init(config),
                    is_expert=is_expert)
            else:
                _set_tp_attributes(self.weight, True, 0, stride)
            self.weight.allreduce = not (self.is_expert and self.expert_parallel)
        else:
            self.weight = None

        if bias:
            self.bias = Parameter(torch.empty(self.output_size_per_partition, device=device,
                                              dtype=params_dtype))
            _set_tp_attributes(self.bias, True, 0, stride)
            if perform_init:
                with torch.no_grad():
                    self.bias.zero_()
            self.bias.allreduce = not (self.is_expert and self.expert_parallel)
        else:
            self.register_parameter("bias", None)

        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        if self.sequence_parallel and world <= 1:
            warnings.warn("`sequence_parallel` is set to `True`, but tensor model parallel size "
                          f"is {world}. Disabling sequence parallel.")
            self.sequence_parallel = False
        self.allreduce_dgrad = world > 1 and not self.sequence_parallel and not disable_grad_reduce
        self.gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        self._register_extra_state_hook()

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``input_ [s, b, input_size]`` (``[s/W, b, input_size]`` with sequence parallelism) ->
        ``(output [s, b, output_size / W] or [s, b, output_size] when gathering, output_bias)``."""
        return column_parallel_forward(self, input_, weight, runtime_gather_output)

    def backward_dw(self) -> None:
        """Delayed weight-gradient computation is not supported (as in Megatron's module)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Megatron distributed checkpointing: weight and bias sharded along axis 0 over TP."""
        return self._sharded_state_dict(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0})

    def __repr__(self) -> str:
        tp = self.output_size // self.output_size_per_partition
        return (f"{type(self).__name__}(in_features={self.input_size}, "
                f"out_features={self.output_size}, bias={self.bias is not None}, TP={tp})")


class RowParallelLinear(_ExtraStateMixin, torch.nn.Module):
    """``Y = X A^T + b`` with ``A [output_size, input_size]`` split along its columns (the input
    features): each rank holds ``weight [output_size, input_size / W]``; ``bias [output_size]`` is
    whole and added once, after the reduction.

    Constructor and forward arguments are Megatron-core's
    ``megatron.core.tensor_parallel.RowParallelLinear``. ``forward(input_) -> (output, output_bias)``.
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable,
                 bias: bool, input_is_parallel: bool, skip_bias_add: bool, stride: int = 1,
                 keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, tp_group: Group = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.config = config
        self.is_expert = is_expert
        self.expert_parallel = getattr(config, "expert_model_parallel_size", 1) > 1
        self.gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        if self.sequence_parallel and not input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel`, `input_is_parallel` must be `True`")
        self.tp_group = resolve_tp_group(tp_group, is_expert=is_expert)
        world, rank = _world(self.tp_group), _rank(self.tp_group)
        self.explicit_expert_comm = self.is_expert and (world > 1 or self.expert_parallel)
        self.input_size_per_partition = _divide(input_size, world, "input_size")
        params_dtype = getattr(config, "params_dtype", torch.float32)
        device = _param_device(config)
        perform_init = getattr(config, "perform_initialization", True)

        self.weight = Parameter(torch.empty(output_size, self.input_size_per_partition,
                                            device=device, dtype=params_dtype))
        self.master_weight = None
        if perform_init:
            self.master_weight = _init_weight(
                self.weight, output_size=output_size, input_size=input_size,
                per_partition=self.input_size_per_partition, partition_dim=1,
                init_method=init_method, stride=stride, return_master=keep_master_weight_for_test,
                params_dtype=params_dtype, rank=rank, world=world,
                device_init=_use_device_init(config), is_expert=is_expert)
        else:
            _set_tp_attributes(self.weight, True, 1, stride)
        self.weight.allreduce = not (self.is_expert and self.expert_parallel)

        if bias:
            self.bias = Parameter(torch.empty(output_size, device=device, dtype=params_dtype))
            if perform_init:
                with torch.no_grad():
                    self.bias.zero_()
            self.bias.allreduce = not (self.is_expert and self.expert_parallel)
            # With sequence parallelism each rank's bias gradient covers its own rows only; the
            # trainer all-reduces gradients of parameters carrying this flag over the TP group.
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)
        self._register_extra_state_hook()

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``input_ [s, b, input_size / W]`` (or ``[s, b, input_size]`` when not
        ``input_is_parallel``) -> ``(output [s, b, output_size] or [s/W, b, output_size] with
        sequence parallelism, output_bias)``."""
        return row_parallel_forward(self, input_)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Megatron distributed checkpointing: weight sharded along axis 1 over TP, bias whole."""
        return self._sharded_state_dict(prefix, sharded_offsets, metadata, {"weight": 1})

    def __repr__(self) -> str:
        tp = self.input_size // self.input_size_per_partition
        return (f"{type(self).__name__}(in_features={self.input_size}, "
                f"out_features={self.output_size}, bias={self.bias is not None}, TP={tp})")
