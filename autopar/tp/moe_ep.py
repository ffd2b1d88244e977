"""transformers' mixture-of-experts layers under expert parallelism on the CoC ops (``"ep_dispatch_experts"``).

transformers 5 declares an expert-parallel plan beside the tensor-parallel one (``config.base_model_ep_plan``,
``model.ep_plan``; Qwen2-MoE, Qwen3-MoE, Mixtral, ...): ``"grouped_gemm"`` on ``experts.gate_up_proj`` and
``experts.down_proj`` (whole experts per rank: ``Shard(0)`` on the expert dim) and ``"ep_dispatch_experts"`` on the
experts module (tokens sent to their experts' ranks and back). :class:`CocEpDispatchExpertsParallel` gives the
parameters those placements and runs the module as::

    y, handle = kernels.moe_dispatch_grouped_matmul(x_tokens, top_k_index, top_k_weights, E, gate_up_local)
    h = act(gate) * up of y                        # y: the dispatched rows (by local expert) times gate_up
    out_tokens = kernels.moe_combine(kernels.grouped_matmul(h, down_local, handle.expert_offsets), handle)

(``moe_dispatch_grouped_matmul`` is ``moe_dispatch`` then ``grouped_matmul``, the chunked backend multiplying each
piece of rows as it lands; the second grouped GEMM's autograd: :class:`_GroupedLinear`; the dispatch's, the first
GEMM's and the combine's: :mod:`kernels.ops.moe_ep_autograd`).
The expert group is the tensor-parallel mesh (transformers' ``ep_size == tp_size``): the attention and the rest
keep the TP plan's styles. Without sequence parallelism every rank holds every token, so the tokens are split
over the ranks first (padded with zero-weight rows to a multiple of W), each token dispatched by one rank, and
the output rows gathered after; with it (:class:`autopar.tp.moe.CocMoeBlockSequenceParallel` on the sparse block)
each rank dispatches its sequence shard. :func:`coc_ep_forward` is that computation on given groups, which the
``"coc"`` entry of transformers' ``EPImplementationInterface`` also runs (:mod:`autopar.tp.hf_registry`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

import kernels
from kernels.ops.grouped_matmul import grouped_matmul_grads

from . import comm
from .moe import ExpertsStyle, GatherRows, SplitRows, apply_gate, check_experts_module, plan_key_matches
from .style_common import distribute_param, install_forward, mesh_group

_STYLE = "ep_dispatch_experts"


class _GroupedLinear(torch.autograd.Function):
    """``y = kernels.grouped_matmul(x, weight, offsets)`` (forward-only op) with its gradients.

    - forward::

        y[rows of e] = x[rows of e] @ weight[e].T                      # [R, k] x [E_l, n, k] -> [R, n]

    - dgrad, the same op on the transposed weights::

        grad_x[rows of e] = grad_y[rows of e] @ weight[e]

    - wgrad, one ``torch.mm`` per expert (the offsets read on the host: the exact-mode dispatch read its counts
      there already)::

        grad_w[e] = grad_y[rows of e].T @ x[rows of e]                 # zeros for an expert with no rows
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets)
        return kernels.grouped_matmul(x, weight, offsets)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, offsets = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:2])
        return (*grouped_matmul_grads(grad, x, weight, offsets, needs=needs), None)


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _GroupedLinear.apply(x, weight, offsets)
    return kernels.grouped_matmul(x, weight, offsets)


def coc_ep_forward(
    module: nn.Module,
    tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    weights: tuple[torch.Tensor, torch.Tensor],
    *,
    ep_group: dist.ProcessGroup,
    split_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The experts module's output for ``tokens = (hidden [T, H], top_k_index [T, topk], top_k_weights [T, topk])``
    with this rank's experts ``weights = (gate_up [E_l, 2I, H], down [E_l, H, I])`` (local tensors) on the expert
    group ``ep_group`` (expert ``e`` on its rank ``e // E_l``).

    ``split_group``: None when the ranks of ``ep_group`` hold different tokens (each dispatches its own);
    otherwise the group whose ranks hold the same tokens: each dispatches its slice of them (padded with
    zero-weight rows to a multiple of its size) and the slices' outputs are gathered, so every token runs
    through its experts once and the result is laid out as ``hidden``."""
    hidden, top_k_index, top_k_weights = tokens
    gate_up, down = weights
    num_experts = gate_up.shape[0] * comm.world_size(ep_group)
    world = comm.world_size(split_group) if split_group is not None else 1
    count = hidden.shape[0]
    if world > 1:
        pad = (-count) % world
        if pad:
            # Zero rows with zero weights: their products are exact zeros and their output rows are dropped.
            hidden, top_k_weights = F.pad(hidden, (0, 0, 0, pad)), F.pad(top_k_weights, (0, 0, 0, pad))
            top_k_index = F.pad(top_k_index, (0, 0, 0, pad))
        hidden, top_k_weights = SplitRows.apply(hidden, split_group), SplitRows.apply(top_k_weights, split_group)
        top_k_index = top_k_index.chunk(world)[comm.rank_of(split_group)].contiguous()
    # The first expert GEMM rides on the dispatch: the chunked backend multiplies each piece as it lands.
    y, handle = kernels.moe_dispatch_grouped_matmul(
        hidden, top_k_index, top_k_weights, num_experts, gate_up, group=ep_group
    )
    out = _grouped_linear(apply_gate(module, y), down, handle.expert_offsets)
    combined = kernels.moe_combine(out, handle)
    if world > 1:
        return GatherRows.apply(combined, split_group)[:count]
    return combined


def check_ep_experts(module: nn.Module, world: int, where: str = "") -> None:
    """What :func:`coc_ep_forward` computes in the module's place (the checks of
    :func:`autopar.tp.moe.check_experts_module`: the stacked gate / up layout, the default gating, no biases),
    and a number of experts the expert group's size divides (``ValueError`` naming the config field)."""
    check_experts_module(module, 1, where, style=_STYLE)
    experts = module._parameters["gate_up_proj"].shape[0]
    if experts % world:
        config = getattr(module, "config", None)
        # The config field holding E (transformers 5 aliases num_experts to num_local_experts: the first that holds E).
        fields = ("num_local_experts", "num_experts", "n_routed_experts")
        field = next((f for f in fields if getattr(config, f, None) == experts), "E")
        name = f"{type(module).__name__}{f' ({where})' if where else ''}"
        raise ValueError(
            f"{_STYLE}: {name}: {field}={experts} does not divide by the expert-parallel group's size W={world} "
            "(each rank holds E / W whole experts); use a mesh size that divides it, or the tensor-parallel experts "
            "(expert_parallel=False: moe_tp_experts)"
        )


class CocEpDispatchExpertsParallel(ExpertsStyle):
    """transformers' ``"ep_dispatch_experts"`` (with ``"grouped_gemm"`` on ``gate_up_proj`` and ``down_proj``) on
    the CoC expert-parallel ops (module docstring). Parameters: ``gate_up_proj`` and ``down_proj`` ``Shard(0)``
    (rank r holds experts ``[r E / W, (r + 1) E / W)``), the placements transformers' ``grouped_gemm`` gives, so
    state dicts, ``full_tensor()`` and optimizers see the same DTensors. The expert group is the style's mesh."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_ep_experts(module, device_mesh.size())
        distribute_param(module, "gate_up_proj", device_mesh, Shard(0), self.src_data_rank)
        distribute_param(module, "down_proj", device_mesh, Shard(0), self.src_data_rank)
        module._coc_tokens_sharded = False
        return install_forward(module, functools.partial(self._forward, device_mesh))

    _style = _STYLE

    def _experts(self, mesh: DeviceMesh, module: nn.Module, tokens: tuple, weights: tuple) -> torch.Tensor:
        group = mesh_group(mesh)
        split = None if module._coc_tokens_sharded else group
        return coc_ep_forward(module, tokens, weights, ep_group=group, split_group=split)


def with_ep_plan(model: nn.Module, strings: dict[str, str]) -> dict[str, str]:
    """``strings`` with the model's expert-parallel plan (``model.ep_plan``: transformers' ``base_model_ep_plan``
    with the model's prefixes) merged as transformers merges them: a module with an EP entry keeps no TP entry,
    nor do its parameters (``ValueError`` naming the model when it declares none)."""
    ep_plan = dict(getattr(model, "ep_plan", None) or {})
    if not ep_plan:
        config = getattr(model, "config", None)
        raise ValueError(
            f"expert_parallel=True: {type(model).__name__} (model_type={getattr(config, 'model_type', None)!r}) "
            "declares no expert-parallel plan (config.base_model_ep_plan); pass plan= with 'ep_dispatch_experts' "
            "on its experts modules and 'grouped_gemm' on their gate_up_proj / down_proj"
        )

    def expert(key: str) -> bool:
        return any(key == k or key.startswith(k + ".") for k in ep_plan)

    return {**{k: s for k, s in strings.items() if not expert(k)}, **ep_plan}


def check_ep_plan(model: nn.Module, strings: dict[str, str], world: int) -> None:
    """Every ``"ep_dispatch_experts"`` module of ``model`` can hold its experts over ``world`` ranks (before
    anything is sharded)."""
    keys = [k for k, s in strings.items() if s == _STYLE]
    for name, module in model.named_modules():
        key = next((k for k in keys if plan_key_matches(name, k)), None)
        if key is not None:
            check_ep_experts(module, world, where=f"{name}, plan key {key!r}")


__all__ = ["CocEpDispatchExpertsParallel", "check_ep_plan", "coc_ep_forward", "with_ep_plan"]
