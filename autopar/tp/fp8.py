"""The FP8 recipe of the tensor-parallel linears: forward, dgrad and wgrad GEMMs in FP8.

Switched on per layer with ``fp8=autopar.Fp8Recipe()`` on :class:`autopar.ColumnParallelLinear` /
:class:`autopar.RowParallelLinear`, or for every layer built while ``COC_FP8=1`` (the default recipe).
Scaling is DeepSeek-V3's: activations and gradients one fp32 scale per row per 128 columns
(``quantize_fp8(mode="block")``), weights one per 128 x 128 block (``"block2d"``). The weight is
quantized once per change: the quantized copy is keyed on the parameter's version counter (bumped
by every in-place update, optimizer steps included; an update through ``.data`` is not seen, call
``layer.fp8_cache.clear()`` after one). Its transpose for the dgrad is the transposed copy (128 x 128
blocks are the same blocks of ``w.T``, so this is exact). Master weights, their gradients and the
optimizer stay in the parameter dtype. The communicating GEMMs are the FP8 ops of
:mod:`kernels.fp8` (backend from the ``COC_*`` environment), the local ones ``kernels.scaled_matmul``.

wgrad: ``grad_w = grad_y.T @ x`` contracts over the tokens, so both operands are quantized along
the token dim: ``grad_y.T`` 1 x 128 (a gradient, the finer scales) and ``x.T`` in 128 x 128 blocks
(the op's weight operand layout; DeepSeek-V3 uses 128 x 1 there). Where only the FP8 copy of an
operand exists (the gathered input of a sequence-parallel column layer, the gathered gradient of a
sequence-parallel row layer), it is dequantized and requantized along the token dim: a second
rounding of at most the FP8 unit roundoff. Not supported with FP8 (refused by name):
``gradient_accumulation_fusion``, ``defer_embedding_wgrad_compute``, explicit expert communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import kernels
from kernels import checks
from kernels.fp8.scales import FP8_DTYPES, OUT_DTYPES

from . import comm
from .comm import GatherFromTensorParallelRegion, Group, ScatterToTensorParallelRegion, rows

ENV_FP8 = "COC_FP8"


@dataclass(frozen=True)
class Fp8Recipe:
    """Which FP8 formats the linears use. DeepSeek-V3 uses E4M3 everywhere (its fine-grained scales
    make E5M2's range unnecessary); ``grad_dtype=torch.float8_e5m2`` gives the older hybrid recipe."""

    activation_dtype: torch.dtype = torch.float8_e4m3fn
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    grad_dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self) -> None:
        for name in ("activation_dtype", "weight_dtype", "grad_dtype"):
            value = getattr(self, name)
            if value not in FP8_DTYPES:
                raise ValueError(f"Fp8Recipe.{name}={value!r} is not accepted; use one of {FP8_DTYPES}")


def resolve_recipe(fp8: Fp8Recipe | None) -> Fp8Recipe | None:
    """``fp8`` itself, else the default recipe when ``COC_FP8=1``, else None (validated: 0 or 1)."""
    if fp8 is not None:
        if not isinstance(fp8, Fp8Recipe):
            raise TypeError(f"fp8 must be an autopar.Fp8Recipe or None, got {type(fp8).__name__}")
        return fp8
    from kernels.config import get_config

    return Fp8Recipe() if get_config().fp8 else None


class Fp8WeightCache:
    """The quantized weight ``(q, scale)`` and its transpose, requantized when the weight changes."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._key: tuple | None = None
        self._fwd: tuple[torch.Tensor, torch.Tensor] | None = None
        self._t: tuple[torch.Tensor, torch.Tensor] | None = None
        self.quantizations = 0

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (weight._version, weight.data_ptr(), tuple(weight.shape), weight.dtype, dtype)
        if key != self._key or self._fwd is None:
            self._fwd = kernels.quantize_fp8(weight.detach(), "block2d", dtype=dtype)
            self._t = None
            self._key = key
            self.quantizations += 1
        return self._fwd

    def transposed(self, weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize_fp8(weight.T, "block2d")``, from the cached copy (the same 128 x 128 blocks)."""
        q, s = self.get(weight, dtype)
        if self._t is None:
            self._t = (q.t().contiguous(), s.t().contiguous())
        return self._t


def _act(t2d: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.quantize_fp8(t2d, "block", dtype=dtype)


def _cols(t2d: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t2d.T`` quantized in 128 x 128 blocks (the wgrad's weight operand)."""
    q, s = kernels.quantize_fp8(t2d, "block2d", dtype=dtype)
    return q.t().contiguous(), s.t().contiguous()


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if bias is None:
        return None
    b = bias.detach()
    return b if b.dtype in (dtype, torch.float32) else b.float()


def _wgrad(
    grad_y2d: torch.Tensor, x_cols: tuple[torch.Tensor, torch.Tensor], recipe: Fp8Recipe, weight: torch.Tensor
) -> torch.Tensor:
    """``grad_w [n, k] = grad_y.T @ x``: ``grad_y.T`` 1 x 128 along the tokens, ``x.T`` 128 x 128."""
    gq, gs = _act(grad_y2d.t(), recipe.grad_dtype)
    out = weight.dtype if weight.dtype in OUT_DTYPES else torch.float32
    return kernels.scaled_matmul(gq, gs, x_cols[0], x_cols[1], out_dtype=out).to(weight.dtype)


def _bias_grad(grad_y2d: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else grad_y2d.sum(0).to(bias.dtype)


class Fp8ColumnParallelLinearFunction(torch.autograd.Function):
    """FP8 column-parallel linear, no sequence parallelism. ``q(.)`` is FP8 quantization.

    - forward (local): ``y_shard_n = q(x) @ q(w_shard_n).T + bias_shard_n``
    - dgrad: ``grad_x = all_reduce(q(grad_y_shard_n) @ q(w_shard_n.T).T)`` (``kernels.scaled_matmul_all_reduce``;
      local when ``allreduce_dgrad`` is False)
    - wgrad (local): ``grad_w_shard_n = q(grad_y_shard_n.T) @ q(x.T).T``, ``grad_bias = grad_y_shard_n.sum(rows)``
    """

    @staticmethod
    def forward(ctx: Any, x, weight, bias, group, allreduce_dgrad, recipe, cache) -> torch.Tensor:
        x2d = rows(x)
        xq, xs = _act(x2d, recipe.activation_dtype)
        wq, ws = cache.get(weight, recipe.weight_dtype)
        y = kernels.scaled_matmul(xq, xs, wq, ws, _bias(bias, x.dtype), out_dtype=x.dtype)
        ctx.save_for_backward(*(_cols(x2d, recipe.activation_dtype) if ctx.needs_input_grad[1] else (None, None)))
        ctx.weight, ctx.bias, ctx.group, ctx.recipe, ctx.cache, ctx.x_shape = (
            weight,
            bias,
            group,
            recipe,
            cache,
            x.shape,
        )
        ctx.allreduce_dgrad = allreduce_dgrad and comm.world_size(group) > 1
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x_cols = ctx.saved_tensors
        recipe, weight = ctx.recipe, ctx.weight
        grad_y2d = rows(grad_y.contiguous())
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq, gs = _act(grad_y2d, recipe.grad_dtype)
            wtq, wts = ctx.cache.transposed(weight, recipe.weight_dtype)
            if ctx.allreduce_dgrad:
                grad_x = kernels.scaled_matmul_all_reduce(gq, gs, wtq, wts, out_dtype=grad_y.dtype, group=ctx.group)
            else:
                grad_x = kernels.scaled_matmul(gq, gs, wtq, wts, out_dtype=grad_y.dtype)
            grad_x = grad_x.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = _wgrad(grad_y2d, x_cols, recipe, weight)
        grad_b = _bias_grad(grad_y2d, ctx.bias) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None


class Fp8ColumnParallelLinearSPFunction(torch.autograd.Function):
    """FP8 column-parallel linear with sequence parallelism.

    - forward: ``y_shard_n = all_gather_s(q(x_shard_s)) @ q(w_shard_n).T + bias_shard_n``
      (``kernels.all_gather_scaled_matmul``; the FP8 rows travel with their scales, and the gathered FP8
      input is kept for the wgrad: half the bytes of the bf16 one)
    - dgrad: ``grad_x_shard_s = reduce_scatter_s(q(grad_y_shard_n) @ q(w_shard_n.T).T)``
      (``kernels.scaled_matmul_reduce_scatter``)
    - wgrad: ``grad_w_shard_n = q(grad_y_shard_n.T) @ q(dequant(x_gathered).T).T``, ``grad_bias = grad_y.sum(rows)``
    """

    @staticmethod
    def forward(ctx: Any, x_shard_s, weight, bias, group, recipe, cache) -> torch.Tensor:
        world = comm.world_size(group)
        xq, xs = _act(rows(x_shard_s), recipe.activation_dtype)
        wq, ws = cache.get(weight, recipe.weight_dtype)
        y, xg, xsg = kernels.all_gather_scaled_matmul(
            xq, xs, wq, ws, _bias(bias, x_shard_s.dtype), out_dtype=x_shard_s.dtype, group=group, return_gathered=True
        )
        ctx.save_for_backward(xg if ctx.needs_input_grad[1] else None, xsg if ctx.needs_input_grad[1] else None)
        ctx.weight, ctx.bias, ctx.group, ctx.recipe, ctx.cache = weight, bias, group, recipe, cache
        ctx.x_shape = x_shard_s.shape
        return y.view(x_shard_s.shape[0] * world, *x_shard_s.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        xg, xsg = ctx.saved_tensors
        recipe, weight = ctx.recipe, ctx.weight
        grad_y2d = rows(grad_y.contiguous())
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq, gs = _act(grad_y2d, recipe.grad_dtype)
            wtq, wts = ctx.cache.transposed(weight, recipe.weight_dtype)
            grad_x = kernels.scaled_matmul_reduce_scatter(gq, gs, wtq, wts, out_dtype=grad_y.dtype, group=ctx.group)
            grad_x = grad_x.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            x_full = kernels.dequantize_fp8(xg, xsg, "block")
            grad_w = _wgrad(grad_y2d, _cols(x_full, recipe.activation_dtype), recipe, weight)
        grad_b = _bias_grad(grad_y2d, ctx.bias) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


class Fp8RowParallelLinearFunction(torch.autograd.Function):
    """FP8 row-parallel linear, no sequence parallelism.

    - forward: ``y = all_reduce(q(x_shard_k) @ q(w_shard_k).T) + bias`` (``kernels.scaled_matmul_all_reduce``)
    - dgrad (local): ``grad_x_shard_k = q(grad_y) @ q(w_shard_k.T).T``
    - wgrad (local): ``grad_w_shard_k = q(grad_y.T) @ q(x_shard_k.T).T``, ``grad_bias = grad_y.sum(rows)``
    """

    @staticmethod
    def forward(ctx: Any, x_shard_k, weight, bias, group, recipe, cache) -> torch.Tensor:
        x2d = rows(x_shard_k)
        xq, xs = _act(x2d, recipe.activation_dtype)
        wq, ws = cache.get(weight, recipe.weight_dtype)
        y = kernels.scaled_matmul_all_reduce(
            xq, xs, wq, ws, _bias(bias, x_shard_k.dtype), out_dtype=x_shard_k.dtype, group=group
        )
        ctx.save_for_backward(*(_cols(x2d, recipe.activation_dtype) if ctx.needs_input_grad[1] else (None, None)))
        ctx.weight, ctx.bias, ctx.recipe, ctx.cache, ctx.x_shape = weight, bias, recipe, cache, x_shard_k.shape
        return y.view(*x_shard_k.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x_cols = ctx.saved_tensors
        recipe, weight = ctx.recipe, ctx.weight
        grad_y2d = rows(grad_y.contiguous())
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq, gs = _act(grad_y2d, recipe.grad_dtype)
            wtq, wts = ctx.cache.transposed(weight, recipe.weight_dtype)
            grad_x = kernels.scaled_matmul(gq, gs, wtq, wts, out_dtype=grad_y.dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = _wgrad(grad_y2d, x_cols, recipe, weight)
        grad_b = _bias_grad(grad_y2d, ctx.bias) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


class Fp8RowParallelLinearSPFunction(torch.autograd.Function):
    """FP8 row-parallel linear with sequence parallelism.

    - forward: ``y_shard_s = reduce_scatter_s(q(x_shard_k) @ q(w_shard_k).T) + bias``
      (``kernels.scaled_matmul_reduce_scatter``)
    - dgrad: ``grad_x_shard_k = all_gather_s(q(grad_y_shard_s)) @ q(w_shard_k.T).T``
      (``kernels.all_gather_scaled_matmul`` with the gathered FP8 gradient returned)
    - wgrad: ``grad_w_shard_k = q(dequant(grad_y_gathered).T) @ q(x_shard_k.T).T``;
      ``grad_bias = grad_y_shard_s.sum(rows)`` (this rank's rows, as the bf16 layer)
    """

    @staticmethod
    def forward(ctx: Any, x_shard_k, weight, bias, group, recipe, cache) -> torch.Tensor:
        world = comm.world_size(group)
        if x_shard_k.dim() < 2 or x_shard_k.shape[0] % world != 0:
            raise ValueError(
                f"sequence-parallel RowParallelLinear needs the sequence dim (dim 0) of the input divisible by the "
                f"tensor-parallel size W={world}, got input shape {tuple(x_shard_k.shape)}"
            )
        x2d = rows(x_shard_k)
        xq, xs = _act(x2d, recipe.activation_dtype)
        wq, ws = cache.get(weight, recipe.weight_dtype)
        y = kernels.scaled_matmul_reduce_scatter(
            xq, xs, wq, ws, _bias(bias, x_shard_k.dtype), out_dtype=x_shard_k.dtype, group=group
        )
        ctx.save_for_backward(*(_cols(x2d, recipe.activation_dtype) if ctx.needs_input_grad[1] else (None, None)))
        ctx.weight, ctx.bias, ctx.group, ctx.recipe, ctx.cache = weight, bias, group, recipe, cache
        ctx.x_shape = x_shard_k.shape
        return y.view(x_shard_k.shape[0] // world, *x_shard_k.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_y_shard_s: torch.Tensor) -> tuple:
        x_cols = ctx.saved_tensors
        recipe, weight = ctx.recipe, ctx.weight
        g2d = rows(grad_y_shard_s.contiguous())
        gq, gs = _act(g2d, recipe.grad_dtype)
        wtq, wts = ctx.cache.transposed(weight, recipe.weight_dtype)
        grad_x, ggq, ggs = kernels.all_gather_scaled_matmul(
            gq, gs, wtq, wts, out_dtype=grad_y_shard_s.dtype, group=ctx.group, return_gathered=True
        )
        grad_x = grad_x.view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_y_full = kernels.dequantize_fp8(ggq, ggs, "block")
            grad_w = _wgrad(grad_y_full, x_cols, recipe, weight)
        grad_b = _bias_grad(g2d, ctx.bias) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


def _refuse_unsupported(module: torch.nn.Module) -> None:
    config = module.config
    for name, on in (
        ("gradient_accumulation_fusion", bool(getattr(module, "gradient_accumulation_fusion", False))),
        ("defer_embedding_wgrad_compute", bool(getattr(config, "defer_embedding_wgrad_compute", False))),
        ("explicit expert communication", bool(getattr(module, "explicit_expert_comm", False))),
    ):
        if on:
            raise NotImplementedError(f"{type(module).__name__} with fp8: {name} is not supported with the FP8 recipe")


def _check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in OUT_DTYPES:
        raise TypeError(f"input_ dtype {x.dtype} is not accepted by the FP8 linears; use one of {OUT_DTYPES}")


def fp8_column_forward(
    module: torch.nn.Module,
    input_: torch.Tensor,
    weight: torch.Tensor | None = None,
    runtime_gather_output: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ColumnParallelLinear.forward`` with the FP8 recipe ``module.fp8``."""
    _refuse_unsupported(module)
    if weight is None:
        if module.weight is None:
            raise RuntimeError(
                "weight was not supplied to ColumnParallelLinear forward pass and skip_weight_param_allocation is True."
            )
        weight = module.weight
    checks.check_input_k(
        input_, weight.shape[1], name="input_", expected=f"weight has k={weight.shape[1]} (shape {tuple(weight.shape)})"
    )
    _check_dtype(input_)
    group = module.tp_group
    bias = module.bias if not module.skip_bias_add else None
    if module.sequence_parallel:
        out = Fp8ColumnParallelLinearSPFunction.apply(input_, weight, bias, group, module.fp8, module.fp8_cache)
    else:
        out = Fp8ColumnParallelLinearFunction.apply(
            input_, weight, bias, group, module.allreduce_dgrad, module.fp8, module.fp8_cache
        )
    gather_output = module.gather_output if runtime_gather_output is None else runtime_gather_output
    if gather_output:
        out = GatherFromTensorParallelRegion.apply(out, group)
    return out, (module.bias if module.skip_bias_add else None)


def fp8_row_forward(module: torch.nn.Module, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``RowParallelLinear.forward`` with the FP8 recipe ``module.fp8``."""
    _refuse_unsupported(module)
    group: Group = module.tp_group
    k_local = module.weight.shape[1]
    expected = module.weight.shape[1] if module.input_is_parallel else module.input_size
    checks.check_input_k(input_, expected, name="input_", expected=f"the layer takes k={expected} (weight k={k_local})")
    _check_dtype(input_)
    x = input_ if module.input_is_parallel else ScatterToTensorParallelRegion.apply(input_, group)
    bias = None if module.skip_bias_add else module.bias
    fn = Fp8RowParallelLinearSPFunction if module.sequence_parallel else Fp8RowParallelLinearFunction
    out = fn.apply(x, module.weight, bias, group, module.fp8, module.fp8_cache)
    return out, (module.bias if module.skip_bias_add else None)


__all__ = ["ENV_FP8", "Fp8Recipe", "Fp8WeightCache", "fp8_column_forward", "fp8_row_forward", "resolve_recipe"]
