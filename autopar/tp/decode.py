"""The decode path in models: a row-parallel linear's all-reduce fused with the residual add and the next RMSNorm.

A pre-norm decoder layer ends each half with ``hidden = residual + o_proj(attn)`` (``down_proj(...)``) and
normalizes ``hidden`` next (``post_attention_layernorm``, the next layer's ``input_layernorm``, the final
``norm``). Under ``torch.no_grad()`` (``generate()``, inference) a row-parallel linear installed with
``fuse_norm=True`` returns its output *pending*: a :class:`PendingReduce` holding the local operands, not yet
reduced. The model's own code then runs as written:

- ``residual + pending`` (either order) gives a pending value that also holds the residual;
- an RMSNorm module :func:`fuse_rmsnorm` installed runs on it as ONE call,
  ``kernels.matmul_all_reduce(x, w, bias, residual=, norm_weight=, eps=)`` (the GEMM epilogue: GEMM,
  all-reduce, residual add and norm fused on the fused backend), and keeps the updated residual for the
  next ``residual + ...``;
- anything else a pending value meets (another op, a norm of another form, a hook reading it) first
  materializes it with the plain ``matmul_all_reduce`` (and the add), so a model whose layers differ from
  the pattern computes what it would without fusion, only unfused.

Numerics: ``h = sum(partial_r, fp32, rank order) + bias + residual`` rounded once (the unfused model rounds the
reduced output to the activation dtype before the add: equal bits in fp32, at most one rounding apart in
bf16 / fp16); the norm is the model's (``weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)``), checked by the
norm module's code (:func:`is_llama_rmsnorm`), and fused only where the weight's dtype is the activation's.

Every rank runs the same forward, so each pending value resolves at the same point on every rank (its
collective is the one the unfused linear would run there). :func:`resolve_outputs` turns pending values in a
model's outputs (``output_hidden_states``) into plain tensors before the forward returns, so none escapes
to code that may run on one rank only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

import kernels

_ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
# Reading these needs no value: answered from the wrapper's own metadata.
_METADATA = {
    torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__,  # type: ignore[attr-defined]
    torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    torch.Tensor.size,
    torch.Tensor.dim,
}


class PendingReduce(torch.Tensor):
    """``[residual +] all_reduce(x @ weight.T) + bias`` not computed yet (module docstring).

    A wrapper without storage: every op that reaches a kernel materializes it first (``__torch_dispatch__``),
    so no code can read the local partial sums as if they were the reduced output.
    """

    _operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dist.ProcessGroup | None]
    _residual: torch.Tensor | None
    _value: torch.Tensor | None
    _versions: tuple[int, ...]

    @staticmethod
    def __new__(
        cls,
        operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dist.ProcessGroup | None],
        residual: torch.Tensor | None = None,
    ) -> PendingReduce:
        x, weight = operands[0], operands[1]
        shape = tuple(x.shape[:-1]) + (weight.shape[0],)
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=x.dtype, device=x.device, requires_grad=False)
        self._operands = operands
        self._residual = residual
        self._value = None
        self._versions = _versions(operands, residual)
        return self

    def __repr__(self, *, tensor_contents: object = None) -> str:
        return f"PendingReduce({self.materialize()!r})"

    def materialize(self) -> torch.Tensor:
        """The value, reduced now if no norm has fused it (collective: every rank reaches it in the same place)."""
        if self._value is None:
            self._check_unchanged()
            x, weight, bias, group = self._operands
            y = kernels.matmul_all_reduce(x, weight, bias, group=group)
            self._value = y if self._residual is None else self._residual + y
        return self._value

    def fusable(self, weight: torch.Tensor) -> bool:
        """Whether :meth:`normalize` with ``weight`` computes what the model's norm would."""
        return self._value is None and self._residual is not None and weight.dtype == self.dtype

    def normalize(self, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm(residual + reduced) times ``weight``, in one fused call; keeps the sum as this value."""
        assert self._residual is not None and self._value is None
        self._check_unchanged()
        x, w, bias, group = self._operands
        out, residual, _ = kernels.matmul_all_reduce(
            x, w, bias, group=group, residual=self._residual, norm_weight=weight, eps=eps
        )
        self._value = residual
        return out

    def _check_unchanged(self) -> None:
        # The operands are read when the value is needed, not when the linear ran: an in-place write in between
        # (which the unfused model would not have seen) must not change the result silently.
        if _versions(self._operands, self._residual) != self._versions:
            raise RuntimeError(
                "autopar decode path: a row-parallel linear's input, weight, bias or the residual added to its "
                "output was modified in place before the output was used; the deferred all-reduce would read the "
                "new values. Pass fuse_norm=False to parallelize_hf for this model"
            )

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _ADDS and not kwargs and len(args) == 2:
            summed = _with_residual(*args)
            if summed is not None:
                return summed
        args, kwargs = tree_map(_plain, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        args, kwargs = tree_map(_plain, (args, kwargs or {}))
        return func(*args, **kwargs)


def _versions(operands: tuple, residual: torch.Tensor | None) -> tuple[int, ...]:
    return tuple(t._version for t in (*operands[:3], residual) if t is not None)


def _plain(value: Any) -> Any:
    return value.materialize() if isinstance(value, PendingReduce) else value


def _with_residual(a: Any, b: Any) -> PendingReduce | None:
    """``residual + pending`` (either order) as one pending value, when the pair is the layer-end add."""

    def bare(t: Any) -> bool:
        return isinstance(t, PendingReduce) and t._residual is None and t._value is None

    # The residual may itself be a resolved layer end (the attention half's sum, read by the MLP half's add).
    pending, residual = (a, b) if bare(a) else (b, a)
    if not bare(pending):
        return None
    if isinstance(residual, PendingReduce):
        residual = residual.materialize()
    if (
        type(residual) is not torch.Tensor
        or residual.shape != pending.shape
        or residual.dtype != pending.dtype
        or residual.device != pending.device
    ):
        return None
    return PendingReduce(pending._operands, residual=residual)


def defer(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None
) -> PendingReduce | None:
    """A row-parallel linear's output left pending, or None where the fused path does not apply (autograd
    recording, compiling, a tensor subclass among the operands)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    if any(t is not None and type(t) is not torch.Tensor for t in (x, weight, bias)):
        return None
    return PendingReduce((x, weight, bias, group))


def _stock_rmsnorm_code() -> Any:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm.forward.__code__


def is_llama_rmsnorm(module: nn.Module) -> bool:
    """Whether ``module`` computes Llama's RMSNorm: its class forward is Llama's, instruction for instruction
    (transformers' "Copied from" norms: Qwen2, Mistral, ...), with nothing set on the instance."""
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or "forward" in vars(module) or not isinstance(getattr(module, "weight", None), torch.Tensor):
        return False
    stock = _stock_rmsnorm_code()
    return (code.co_code, code.co_names, code.co_consts) == (stock.co_code, stock.co_names, stock.co_consts)


def fuse_rmsnorm(module: nn.Module) -> None:
    """Run ``module`` (a Llama-form RMSNorm) on a pending layer end as one fused call (module docstring)."""
    inner = module.forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(hidden_states, PendingReduce) and not args and not kwargs:
            weight = module.weight
            if type(weight) is torch.Tensor or type(weight) is nn.Parameter:
                if hidden_states.fusable(weight):
                    return hidden_states.normalize(weight, float(module.variance_epsilon))
        return inner(hidden_states, *args, **kwargs)

    module.forward = forward


def resolve_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of the parallelized model: pending values in its outputs become plain tensors."""
    if isinstance(output, dict):
        for key, value in list(output.items()):
            output[key] = tree_map(_plain, value)
        return output
    return tree_map(_plain, output)


__all__ = ["PendingReduce", "defer", "fuse_rmsnorm", "is_llama_rmsnorm", "resolve_outputs"]
