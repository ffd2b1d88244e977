"""Building the Megatron-style linears from existing weights, and the sequence-parallel gradient sum.

``ColumnParallelLinear.from_linear`` / ``from_weight`` and the row twins (defined in
:mod:`autopar.tp.layers`, implemented here) cut this rank's slice of a full ``nn.Linear``,
Hugging Face ``Conv1D`` (``[in, out]`` weight) or ``[out, in]`` tensor, strided slices included
(Megatron's ``stride``: a packed q/k/v gives each rank its slice of every block).

:func:`sum_sequence_parallel_grads` is Megatron's finalize step for sequence parallelism: the
gradients of parameters marked ``sequence_parallel`` (replicated parameters applied to
sequence-sharded rows: the row bias, norms) summed over the tensor-parallel group.
:func:`sequence_parallel_grad_hooks` does the same from hooks, in the backward.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm import Group, rank_of, resolve_tp_group, world_size


class _NoInit:
    """``config`` as the constructor sees it, with ``perform_initialization=False``: the weights
    are copied in afterwards, so the init (and the full master weight it allocates) is skipped."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        if name == "perform_initialization":
            return False
        return getattr(self._config, name)


def _unused_init(tensor: torch.Tensor) -> None:
    raise AssertionError("from_weight copies the weights; no init_method runs")


def linear_weight(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [out, in], bias [out] or None)`` of an ``nn.Linear`` or transformers ``Conv1D``."""
    if isinstance(linear, nn.Linear):
        return linear.weight, linear.bias
    if type(linear).__name__ == "Conv1D" and hasattr(linear, "nf"):
        return linear.weight.t(), linear.bias
    raise TypeError(f"from_linear takes an nn.Linear or transformers' Conv1D, got {type(linear).__name__}")


def owners(param: torch.Tensor) -> list[nn.Module]:
    """The modules that hold ``param`` in their ``_parameters`` (more than one: a tied weight)."""
    found = []
    for holder in gc.get_referrers(param):
        if not isinstance(holder, dict):
            continue
        for ref in gc.get_referrers(holder):
            # The module itself (inline attribute values) or its materialized __dict__.
            if isinstance(ref, nn.Module) and ref.__dict__.get("_parameters") is holder:
                found.append(ref)
            elif isinstance(ref, dict) and ref.get("_parameters") is holder:
                found += [m for m in gc.get_referrers(ref) if isinstance(m, nn.Module) and m.__dict__ is ref]
    return found


def check_untied(param: torch.Tensor, what: str) -> None:
    """A named error where slicing ``param`` into a new parameter would untie it from another
    module (a language model's head tied to its input embedding): that module would keep the old
    tensor and never see this layer's gradient, a silently wrong model."""
    holders = owners(param) if isinstance(param, nn.Parameter) else []
    tied = len(holders) > 1 or any(isinstance(m, nn.Embedding) for m in holders)
    if tied:
        names = ", ".join(type(m).__name__ for m in holders)
        raise ValueError(
            f"{what} is a tied weight (held by {names}): the parallel layer would get its own slice and the other "
            "module would no longer see this layer's gradient (silently wrong). Untie it first "
            "(config.tie_word_embeddings=False, or a cloned weight), or parallelize the model with "
            "autopar.parallelize_hf, which shards the embedding and the head on the vocabulary and keeps them tied"
        )


def strided_slice(full: torch.Tensor, dim: int, stride: int, rank: int, world: int) -> torch.Tensor:
    """This rank's slice along ``dim`` as Megatron's initialization cuts it: ``full`` split into
    ``stride * W`` equal blocks, rank ``r`` takes blocks ``r, r + W, r + 2W, ...``."""
    size = full.shape[dim]
    if size % (world * stride) != 0:
        raise ValueError(
            f"dim {dim} of the weight (size {size}) must divide by the tensor-parallel size W={world} times "
            f"stride={stride}"
        )
    pieces = torch.split(full, size // (world * stride), dim=dim)[rank::world]
    return torch.cat(pieces, dim=dim)


def from_weight(cls: type, weight: torch.Tensor, bias: torch.Tensor | None, *, config: Any, **kwargs: Any) -> nn.Module:
    """A ``cls`` layer (``kwargs``: its other constructor arguments) holding this rank's slice of
    ``weight [out, in]`` and of ``bias``. The slice is the one the layer's weight declares in Megatron's
    attributes (``partition_dim``, ``partition_stride``); a bias is cut with the weight's rows (column) or
    whole (row)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2-D [out_features, in_features] tensor, got {getattr(weight, 'shape', weight)}"
        )
    check_untied(weight, "weight")
    out_features, in_features = weight.shape
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias must have shape ({out_features},) = [out_features], got {tuple(bias.shape)}")
    layer = cls(
        in_features, out_features, config=_NoInit(config), init_method=_unused_init, bias=bias is not None, **kwargs
    )
    layer.config = config
    group = layer.tp_group
    rank, world = rank_of(group), world_size(group)
    dim, stride = layer.weight.partition_dim, layer.weight.partition_stride
    with torch.no_grad():
        layer.weight.copy_(strided_slice(weight.detach(), dim, stride, rank, world))
        if bias is not None:
            layer.bias.copy_(strided_slice(bias.detach(), 0, stride, rank, world) if dim == 0 else bias.detach())
    return layer


def _params(module_or_params: nn.Module | Iterable[torch.Tensor | nn.Module]) -> list[torch.Tensor]:
    """The parameters of a module, or of a list of modules and tensors (each once)."""
    items = [module_or_params] if isinstance(module_or_params, nn.Module) else list(module_or_params)
    seen: dict[int, torch.Tensor] = {}
    for item in items:
        for p in item.parameters() if isinstance(item, nn.Module) else [item]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def mark_sequence_parallel(module_or_params: nn.Module | Iterable[torch.Tensor | nn.Module]) -> None:
    """Mark replicated parameters applied to sequence-sharded rows (norm weights and biases) with
    ``sequence_parallel = True``, as Megatron does, so the gradient sum includes them."""
    for p in _params(module_or_params):
        p.sequence_parallel = True


def sum_sequence_parallel_grads(
    module_or_params: nn.Module | Iterable[torch.Tensor | nn.Module], tp_group: Group = None
) -> int:
    """Sum over the tensor-parallel group the ``.grad`` of every parameter marked
    ``sequence_parallel`` (one all-reduce of a flat buffer); call after ``backward()``, before the
    optimizer step (Megatron's ``finalize_model_grads``). Returns how many gradients it summed."""
    group = resolve_tp_group(tp_group)
    grads = [p.grad for p in _params(module_or_params) if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or world_size(group) == 1:
        return len(grads)
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(summed)
    return len(grads)


def sequence_parallel_grad_hooks(
    module_or_params: nn.Module | Iterable[torch.Tensor | nn.Module], tp_group: Group = None
) -> list[Any]:
    """Hooks that sum each marked parameter's gradient over the group in the backward, before it
    is accumulated into ``.grad`` (so gradient accumulation over micro-batches stays right); the
    training loop then needs no :func:`sum_sequence_parallel_grads`. Returns the hook handles."""
    group = resolve_tp_group(tp_group)
    if world_size(group) == 1:
        return []

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    return [p.register_hook(summed) for p in _params(module_or_params) if getattr(p, "sequence_parallel", False)]
