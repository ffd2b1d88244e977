"""What a tp_plan leaves out, checked before anything is sharded: never a silently wrong gradient, never a
forward that fails on mixed plain tensors and DTensors.

**Sharded regions.** A module whose children include a column-parallel linear (its output sharded on the
features) and a row-parallel one (its input sharded on them), an MLP or an attention block, computes on
sharded features in between. A parameter there that the plan does not name stays a full plain tensor on every
rank, and each rank's gradient for it is only its shard's part: without a sum over the ranks every rank trains
on a different, partial gradient (Apertus' learnable xIELU activation scalars). :func:`check_regions` finds
them: the parameters of an activation module (its input is the sharded features, elementwise, so the true
gradient is the sum of the ranks' parts) get a gradient hook that all-reduces them
(:func:`sum_gradients_over`); any other one is refused by name, since whether its gradient is partial depends on
where the module's forward uses it.

**Sequence parallelism.** With ``sequence_parallel=True`` the residual stream between the blocks is a
sequence-sharded DTensor, so every block child that holds linears must take it through a plan entry; a child
the plan leaves whole (a Mamba mixer, a linear-attention layer of a hybrid model) would meet a DTensor with plain
weights. :func:`check_sequence_parallel` refuses such a plan by name before anything is sharded, and as well any
parameter no plan entry reaches (a gated delta net's ``A_log``, a model-level initial state) outside what computes
on plain tensors anyway (a sharded region's activation, a norm of its sibling linears' local outputs, a sparse MoE
block, whose experts' style gathers the sequence). What no static check can see (a parameter-free computation
mixing the streams, a hook) fails in the first forward inside torch's DTensor dispatch; :func:`name_mixed_layouts`
turns that error into one that names the cause and the way out.
"""

from __future__ import annotations

import fnmatch
import functools
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Row styles whose input is sharded on the features; with "colwise" / "packed_colwise" (output sharded on them)
# they bound a sharded region (the gathering and splitting variants put replicated activations on that side).
_ROW = ("rowwise", "rowwise_rep")
_ACTIVATION_NAMES = ("act_fn", "act", "activation", "activation_fn", "act_func")


def _matches(name: str, key: str) -> bool:
    atoms, pats = name.split("."), key.split(".")
    return len(atoms) == len(pats) and all(fnmatch.fnmatch(a, p) for a, p in zip(atoms, pats, strict=True))


def _style(name: str, strings: dict[str, str]) -> str | None:
    return next((s for k, s in strings.items() if _matches(name, k)), None)


def _is_activation(name: str, module: nn.Module) -> bool:
    return name.rpartition(".")[2] in _ACTIVATION_NAMES or type(module).__module__.endswith(".activations")


def _is_region(parent: nn.Module, prefix: str, strings: dict[str, str]) -> bool:
    """Whether ``parent`` (named ``prefix`` with its dot) holds a column- and a row-parallel linear: the
    children between them see this rank's shard of the features."""
    styles = [_style(prefix + child, strings) or "" for child, _ in parent.named_children()]
    column = any(s == "colwise" or s.startswith("packed_colwise") for s in styles)
    return column and any(s in _ROW for s in styles)


def _unplanned_params(module: nn.Module, name: str, strings: dict[str, str]) -> Iterator[tuple[str, nn.Module, str]]:
    """``(submodule name, submodule, parameter name)`` of every parameter under ``module`` (named ``name``) that
    no plan entry names."""
    for sub_name, sub in module.named_modules(prefix=name):
        for pname, _ in sub.named_parameters(recurse=False):
            if _style(f"{sub_name}.{pname}", strings) is None:
                yield sub_name, sub, pname


def check_regions(model: nn.Module, strings: dict[str, str]) -> list[str]:
    """The names of the activations' parameters inside sharded regions (module docstring), whose gradients must
    be summed over the ranks; raises ``ValueError`` naming any other parameter there that the plan leaves out."""
    summed: list[str] = []
    refused: list[str] = []
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        if not _is_region(parent, prefix, strings):
            continue
        for child_name, child in parent.named_children():
            if _style(prefix + child_name, strings) is not None:
                continue
            for sub_name, sub, pname in _unplanned_params(child, prefix + child_name, strings):
                if _is_activation(sub_name, sub):
                    summed.append(f"{sub_name}.{pname}")
                else:
                    refused.append(f"{sub_name}.{pname} ({type(sub).__name__})")
        for pname, _ in parent.named_parameters(recurse=False):
            # A parameter the plan names itself (transformers' "local_params" on attention sinks) is the plan's.
            if _style(prefix + pname, strings) is None:
                refused.append(f"{prefix}{pname} ({type(parent).__name__})")
    if refused:
        raise ValueError(
            "parallelize_hf: these parameters sit in a tensor-parallel region (between the column- and row-parallel "
            f"linears of their module) and no plan entry shards them or sums their gradients: {', '.join(refused)}. "
            "Each rank would compute with them on its shard of the features and train on a partial gradient; add "
            "plan entries for them (plan=...), or keep the model unsharded"
        )
    return summed


_hooked: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()


def _sum_over(grad: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def _hook_parameters(module: nn.Module, args: Any, *, group: dist.ProcessGroup) -> None:
    # At every forward, so that parameters a checkpoint load or a deep copy replaced are hooked too (a set of
    # the hooked tensors, not an attribute, which a copy would carry without the hook).
    for p in module.parameters(recurse=False):
        if p.requires_grad and p not in _hooked:
            p.register_hook(functools.partial(_sum_over, group=group))
            _hooked.add(p)


def sum_gradients_over(model: nn.Module, names: list[str], group: dist.ProcessGroup) -> None:
    """The gradient of each parameter ``names`` names all-reduced (summed) over ``group`` before it accumulates
    (a tensor hook: once per backward, on the gradient of all its uses together), hooked by its module at each
    forward."""
    for owner in sorted({name.rpartition(".")[0] for name in names}):
        module = model.get_submodule(owner)
        if not getattr(module, "_coc_sums_gradients", False):
            module.register_forward_pre_hook(functools.partial(_hook_parameters, group=group))
            module._coc_sums_gradients = True


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder blocks: the elements of the model's longest ModuleList."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    name, blocks = max(lists, key=lambda item: len(item[1]))
    return [(f"{name}.{i}", block) for i, block in enumerate(blocks)]


def _holds_linears(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D" for m in module.modules())


def check_sequence_parallel(model: nn.Module, strings: dict[str, str]) -> None:
    """Refuse (``ValueError``) a sequence-parallel plan that leaves a block child with linears unsharded, or any
    other parameter where the sequence-sharded stream would meet it as a plain tensor (module docstring), naming
    them and their types."""
    whole = []
    for block_name, block in _blocks(model):
        for child_name, child in block.named_children():
            name = f"{block_name}.{child_name}"
            if not _holds_linears(child) or _style(name, strings) is not None:
                continue
            inside = [n for n, _ in child.named_modules(prefix=name) if _style(n, strings) is not None]
            if not inside:
                whole.append(f"{name} ({type(child).__name__})")
    if whole:
        raise ValueError(
            f"parallelize_hf: sequence_parallel=True needs every block module that holds linears to be in the plan; "
            f"these are not: {_shown(whole)}. Their input would be a sequence-sharded DTensor beside plain weights; "
            "use sequence_parallel=False, or add plan entries for them (plan=...)"
        )
    loose = _uncovered_parameters(model, strings)
    if loose:
        raise ValueError(
            "parallelize_hf: sequence_parallel=True needs every parameter on the residual stream's path to be in the "
            f"plan; these are not: {_shown(loose)}. The forward would combine them, plain tensors, with the "
            "sequence-sharded stream (a DTensor); use sequence_parallel=False, or add plan entries for them (plan=...)"
        )


def _shown(names: list[str]) -> str:
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def _uncovered_parameters(model: nn.Module, strings: dict[str, str]) -> list[str]:
    """Parameters no plan entry reaches (the entry of their module or of an ancestor) outside what computes on
    plain tensors under sequence parallelism anyway: the sharded regions' activations (:func:`check_regions`), a
    norm beside the planned linears of its parent (it normalizes their outputs, local tensors: OLMo's q / k norms)
    and the sparse
    MoE blocks (their experts' style gathers the sequence for the whole block)."""
    summed = set(check_regions(model, strings))
    names = [n for n, _ in model.named_modules()]
    planned = {n for n in names if _style(n, strings) is not None}
    moe_blocks = {n.rpartition(".")[0] for n in names if _style(n, strings) in _SEQUENCE_GATHERING_EXPERTS}
    loose = []
    for pname, _ in model.named_parameters():
        owner = pname.rpartition(".")[0]
        atoms = owner.split(".") if owner else []
        ancestors = {".".join(atoms[:i]) for i in range(len(atoms) + 1)}
        if pname in summed or _style(pname, strings) is not None or ancestors & (planned | moe_blocks):
            continue
        if owner and _is_norm(model.get_submodule(owner)) and _beside_planned_linears(owner, planned):
            continue
        loose.append(f"{pname} ({type(model.get_submodule(owner)).__name__})")
    return loose


# The experts styles whose block parallelize_hf wraps in CocMoeBlockSequenceParallel (the sequence gathered).
_SEQUENCE_GATHERING_EXPERTS = ("moe_tp_experts", "ep_dispatch_experts")


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _beside_planned_linears(owner: str, planned: set[str]) -> bool:
    parent = owner.rpartition(".")[0]
    return any(p.rpartition(".")[0] == parent for p in planned if p != owner)


_MIXED = "got mixed torch.Tensor and DTensor"


def _named_forward(self: nn.Module, *args: Any, __forward: Any = None, **kwargs: Any) -> Any:
    try:
        return __forward(*args, **kwargs)
    except RuntimeError as e:
        if _MIXED not in str(e):
            raise
        raise RuntimeError(
            f"parallelize_hf(sequence_parallel=True): {type(self).__name__}'s forward combines the sequence-sharded "
            "residual stream (a DTensor) with a plain tensor of a module or computation the plan does not cover "
            f"(torch: {str(e).splitlines()[0]}). This model's plan does not support sequence parallelism: use "
            "sequence_parallel=False, or add plan entries for the modules on that path (plan=...)"
        ) from e


def name_mixed_layouts(model: nn.Module) -> None:
    """The model's forward, with torch's mixed Tensor / DTensor error replaced by one naming the cause (module
    docstring). Every rank runs the same code to the same op, so every rank raises it."""
    forward = model.forward
    model.forward = types.MethodType(functools.partial(_named_forward, __forward=forward), model)
