"""transformers' mixture-of-experts layers under tensor parallelism on the CoC MoE ops (``"moe_tp_experts"``).

transformers 5 stores a MoE layer's experts as one module with 3-D weights (Qwen2-MoE, Qwen3-MoE, Mixtral, ...):
``gate_up_proj [E, 2 I, H]`` (each expert's gate and up projections stacked) and ``down_proj [E, H, I]``, called
as ``experts(hidden [T, H], top_k_index [T, topk], top_k_weights [T, topk])`` by the sparse block after its
router. Its tensor-parallel plan shards every expert as a dense Megatron MLP: ``"packed_colwise"`` on
``experts.gate_up_proj`` (gate and up each ``Shard`` on the intermediate, a ``_StridedShard(1, split_factor=2)``
DTensor), ``"rowwise"`` on ``experts.down_proj`` (``Shard(2)``) and ``"moe_tp_experts"`` on the module.
:class:`CocMoeExpertsParallel` gives the parameters exactly those placements and runs the module as::

    y, routing = kernels.all_gather_grouped_matmul(x_tokens, top_k_index, gate_up_shard)   # rows by expert
    out_tokens = kernels.grouped_matmul_reduce_scatter(act(gate) * up, down_shard, routing, top_k_weights)

(autograd: :mod:`kernels.ops.moe_autograd`). The ops take each rank's own tokens: without sequence parallelism
the replicated tokens are split over the ranks first (padded with zero-weight rows to a multiple of W) and the
output rows gathered after; with it (:class:`CocMoeBlockSequenceParallel` on the sparse block) each rank's
sequence shard goes in and comes out as it is. Expert parallelism (``"grouped_gemm"``, ``"ep_dispatch_experts"``):
:mod:`autopar.tp.moe_ep`, whose experts style the sparse block's sequence-parallel style takes as well.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

import kernels

from . import comm, strided_load
from .style_common import (
    AllReduceGrad,
    StridedShard,
    distribute_param,
    install_forward,
    local_input,
    local_of,
    mesh_group,
    replicate_param,
)

# The parameter entries transformers' plans give a "moe_tp_experts" module, which its style shards itself.
EXPERT_PARAM_STYLES = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
# The same for an "ep_dispatch_experts" module (transformers' ep_plan; autopar.tp.moe_ep).
EP_PARAM_STYLES = {"gate_up_proj": "grouped_gemm", "down_proj": "grouped_gemm"}
_PARAM_STYLES = {"moe_tp_experts": EXPERT_PARAM_STYLES, "ep_dispatch_experts": EP_PARAM_STYLES}


class SplitRows(torch.autograd.Function):
    """This rank's rows of a replicated tensor (the rows divide by W).

    - forward::

        x_shard_m = x[rank * M/W : (rank + 1) * M/W]                    # [M, c] -> [M/W, c]

    - backward::

        grad_x = all_gather(grad_x_shard_m)                             # [M/W, c] -> [M, c]
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        world = comm.world_size(group)
        return x.view_as(x) if world == 1 else x.chunk(world)[comm.rank_of(group)].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return comm.gather_rows(grad.contiguous(), ctx.group), None


class GatherRows(torch.autograd.Function):
    """Every rank's rows, replicated (the gradient of a replicated result is whole on every rank).

    - forward::

        y = all_gather(y_shard_m)                                       # [M/W, c] -> [M, c]

    - backward (local slice)::

        grad_y_shard_m = grad_y[rank * M/W : (rank + 1) * M/W]
    """

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return comm.gather_rows(y.contiguous(), group) if comm.world_size(group) > 1 else y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        world = comm.world_size(ctx.group)
        return (grad if world == 1 else grad.chunk(world)[comm.rank_of(ctx.group)].contiguous()), None


def check_experts_module(module: nn.Module, world: int, where: str = "", style: str = "moe_tp_experts") -> None:
    """What the style computes in the module's place: the stacked gate / up layout with the default gating, no
    biases, no norm after the experts (``NotImplementedError`` otherwise, naming the module), and an intermediate
    size the mesh size divides (``ValueError`` naming the config field)."""
    name = f"{type(module).__name__}{f' ({where})' if where else ''}"
    gate_up, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3 or not hasattr(module, "act_fn"):
        raise NotImplementedError(
            f"{style}: {name} is not a transformers experts module with 3-D gate_up_proj [E, 2I, H], down_proj "
            "[E, H, I] and act_fn; leave it out of the plan or use transformers' own TP loader instead"
        )
    layout = {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True}
    layout["has_post_expert_norm"] = False
    odd = [f"{k}={getattr(module, k)!r}" for k, v in layout.items() if getattr(module, k, v) != v]
    gating = getattr(type(module), "_apply_gate", None)
    if gating is not None and gating.__name__ != "_default_apply_gate":
        odd.append(f"its own _apply_gate ({type(module).__qualname__})")
    experts, inter2, hidden = gate_up.shape
    if odd or tuple(down.shape) != (experts, hidden, inter2 // 2) or inter2 % 2:
        raise NotImplementedError(
            f"{style}: {name} has a layout this style does not compute ({', '.join(odd) or 'shapes'}: "
            f"gate_up_proj {tuple(gate_up.shape)}, down_proj {tuple(down.shape)}); leave it out of the plan or use "
            "transformers' own TP loader instead"
        )
    if (inter2 // 2) % world:
        config = getattr(module, "config", None)
        field = next((f for f in ("moe_intermediate_size", "intermediate_size") if hasattr(config, f)), "intermediate")
        raise ValueError(
            f"{style}: {name}: {field}={inter2 // 2} (each expert's intermediate size) does not divide by the "
            f"mesh size W={world}; the plan shards it over the ranks"
        )


def apply_gate(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` of this rank's columns ``[gate shard | up shard]`` (transformers' default gating)."""
    gate, up = y.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def check_plain_expert_inputs(style: str, hidden: torch.Tensor, top_k_weights: torch.Tensor) -> None:
    """The experts styles take plain tensors: a DTensor means the sparse block around them was not parallelized
    for sequence parallelism (``TypeError`` naming ``style``)."""
    if isinstance(hidden, DTensor) or isinstance(top_k_weights, DTensor):
        raise TypeError(
            f"{style}: the experts take plain tensors; a DTensor input means its sparse block was not "
            "parallelized for sequence parallelism (parallelize_hf(sequence_parallel=True) does it)"
        )


class ExpertsStyle(ParallelStyle):
    """What the experts-module styles share: the call of the installed forward (the plain-input check, the local
    expert weights), then the style's own :meth:`_experts`."""

    _style = ""

    def _forward(
        self,
        mesh: DeviceMesh,
        module: nn.Module,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """``hidden [T, H]``: every token (replicated) or, inside :class:`CocMoeBlockSequenceParallel` with a
        sequence-sharded input, this rank's tokens; the result is laid out as ``hidden``."""
        check_plain_expert_inputs(self._style, hidden, top_k_weights)
        weights = (local_of(module.gate_up_proj), local_of(module.down_proj))
        return self._experts(mesh, module, (hidden, top_k_index, top_k_weights), weights)

    def _experts(self, mesh: DeviceMesh, module: nn.Module, tokens: tuple, weights: tuple) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CocMoeExpertsParallel(ExpertsStyle):
    """transformers' ``"moe_tp_experts"`` (with ``"packed_colwise"`` on ``gate_up_proj`` and ``"rowwise"`` on
    ``down_proj``) on the CoC MoE ops (module docstring). Parameters: ``gate_up_proj``
    ``_StridedShard(1, split_factor=2)``, ``down_proj`` ``Shard(2)``, the placements transformers' own TP gives,
    so state dicts, ``full_tensor()`` and optimizers see the same DTensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_experts_module(module, device_mesh.size())
        if StridedShard is None:  # pragma: no cover
            raise RuntimeError("moe_tp_experts needs torch's _StridedShard placement (torch >= 2.5)")
        strided_load.install()
        distribute_param(module, "gate_up_proj", device_mesh, StridedShard(1, split_factor=2), self.src_data_rank)
        distribute_param(module, "down_proj", device_mesh, Shard(2), self.src_data_rank)
        module._coc_tokens_sharded = False
        return install_forward(module, functools.partial(self._forward, device_mesh))

    _style = "moe_tp_experts"

    def _experts(self, mesh: DeviceMesh, module: nn.Module, tokens: tuple, weights: tuple) -> torch.Tensor:
        (hidden, top_k_index, top_k_weights), (gate_up, down) = tokens, weights
        group = mesh_group(mesh)
        if module._coc_tokens_sharded:
            # The ops combine every rank's tokens on every rank: the top-k weights of all of them, gathered.
            y, routing = kernels.all_gather_grouped_matmul(hidden, top_k_index, gate_up, group=group)
            tw = GatherRows.apply(top_k_weights, group)
            return kernels.grouped_matmul_reduce_scatter(apply_gate(module, y), down, routing, tw, group=group)
        count, world = hidden.shape[0], mesh.size()
        pad = (-count) % world
        if pad:
            # Zero rows with zero weights: their products are exact zeros and their output rows are dropped.
            hidden, top_k_weights = F.pad(hidden, (0, 0, 0, pad)), F.pad(top_k_weights, (0, 0, 0, pad))
            top_k_index = F.pad(top_k_index, (0, 0, 0, pad))
        mine = SplitRows.apply(hidden, group)
        ids = top_k_index.chunk(world)[mesh.get_local_rank()].contiguous()
        y, routing = kernels.all_gather_grouped_matmul(mine, ids, gate_up, group=group)
        out = kernels.grouped_matmul_reduce_scatter(apply_gate(module, y), down, routing, top_k_weights, group=group)
        return GatherRows.apply(out, group)[:count]


class CocMoeBlockSequenceParallel(ParallelStyle):
    """A sparse MoE block (router, ``experts`` under :class:`CocMoeExpertsParallel`, shared experts) under
    sequence parallelism: the block runs on this rank's sequence shard, so the experts' ops take and return
    each rank's own tokens (no split, no gather).

    The block's other parameters (the router's, a shared expert's) become ``Replicate()`` DTensors, as
    ``CocSequenceParallel`` makes a norm's; they run on the local rows and their gradients (each rank's rows)
    are summed over the mesh in the backward. An input the sequence did not divide (a replicated DTensor: the
    styles' fallback) runs replicated, the experts splitting the tokens themselves.
    """

    def __init__(self, *, sequence_dim: int = 1) -> None:
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        experts = getattr(module, "experts", None)
        if not hasattr(experts, "_coc_tokens_sharded"):
            raise ValueError(
                f"CocMoeBlockSequenceParallel: {type(module).__name__}.experts must be parallelized with "
                "moe_tp_experts (CocMoeExpertsParallel) or ep_dispatch_experts (CocEpDispatchExpertsParallel) first"
            )
        sharded = [n for n, p in module.named_parameters() if isinstance(p, DTensor) and not n.startswith("experts.")]
        if sharded:
            # A plan-sharded child (GLM-4-MoE's shared expert) would take the block's local rows as its
            # sequence shard under the styles' own layouts: refused, not guessed.
            raise ValueError(
                f"CocMoeBlockSequenceParallel: {type(module).__name__} holds parameters a plan style already "
                f"sharded ({', '.join(sharded[:4])}); sequence parallelism around such a mixture-of-experts block "
                "is not supported yet: use sequence_parallel=False"
            )
        for owner, pname, param in _replicated_params(module):
            replicate_param(owner, pname, param, device_mesh)
        return install_forward(module, functools.partial(self._forward, device_mesh, module.forward))

    def _forward(self, mesh: DeviceMesh, inner: Any, module: nn.Module, x: torch.Tensor, *args: Any, **kw: Any):
        group = mesh_group(mesh)
        x, layout = local_input(x, Shard(self.sequence_dim))
        sharded = isinstance(layout, Shard)
        params = list(_replicated_params(module))
        try:
            for owner, pname, p in params:
                local = p.to_local()
                # Bypasses Module.__setattr__: the forward reads a plain tensor for one call.
                owner._parameters[pname] = AllReduceGrad.apply(local, group) if sharded else local
            module.experts._coc_tokens_sharded = sharded
            y = inner(x, *args, **kw)
        finally:
            module.experts._coc_tokens_sharded = False
            for owner, pname, p in params:
                owner._parameters[pname] = p
        if not isinstance(y, torch.Tensor):
            raise TypeError(
                f"CocMoeBlockSequenceParallel: {type(module).__name__}'s forward returned {type(y).__name__}; "
                "the block must return the hidden states (one tensor)"
            )
        return DTensor.from_local(y, mesh, [layout], run_check=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_dim={self.sequence_dim})"


def _replicated_params(block: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(owner, name, parameter)`` of every parameter of ``block`` outside its experts."""
    found = []
    for mname, owner in block.named_modules():
        if mname == "experts" or mname.startswith("experts."):
            continue
        found += [(owner, n, p) for n, p in owner._parameters.items() if p is not None]
    return found


def plan_key_matches(name: str, key: str) -> bool:
    atoms, pats = name.split("."), key.split(".")
    return len(atoms) == len(pats) and all(fnmatch.fnmatch(a, p) for a, p in zip(atoms, pats, strict=True))


def without_expert_params(strings: dict[str, str]) -> dict[str, str]:
    """``strings`` without the parameter entries of its ``"moe_tp_experts"`` and ``"ep_dispatch_experts"`` modules
    (``<experts>.gate_up_proj``, ``<experts>.down_proj``: the experts styles shard them, and torch's
    ``parallelize_module`` resolves module names only). An entry that asks another layout of them than
    transformers' plans (``EXPERT_PARAM_STYLES``, ``EP_PARAM_STYLES``) raises ``ValueError``: the style would shard
    them otherwise than asked."""
    experts = {k: s for k, s in strings.items() if s in _PARAM_STYLES}
    kept = {}
    for key, style in strings.items():
        parent, _, leaf = key.rpartition(".")
        if parent not in experts:
            kept[key] = style
        elif _PARAM_STYLES[experts[parent]].get(leaf) != style:
            wanted = _PARAM_STYLES[experts[parent]]
            raise ValueError(
                f"tp_plan entry {key!r}: {style!r} on a parameter of the {experts[parent]} module {parent!r}; the CoC "
                f"experts style shards them as transformers' plan does ({wanted}): pass those or leave the entry out"
            )
    return kept


def check_moe_plan(model: nn.Module, strings: dict[str, str], world: int) -> None:
    """Every ``"moe_tp_experts"`` module of ``model`` can be sharded over ``world`` ranks (before anything is)."""
    keys = [k for k, s in strings.items() if s == "moe_tp_experts"]
    for name, module in model.named_modules():
        key = next((k for k in keys if plan_key_matches(name, k)), None)
        if key is not None:
            check_experts_module(module, world, where=f"{name}, plan key {key!r}")


def parallelize_moe_blocks(model: nn.Module, mesh: DeviceMesh, sequence_dim: int) -> None:
    """Under sequence parallelism: :class:`CocMoeBlockSequenceParallel` on the parent of every experts module
    :class:`CocMoeExpertsParallel` or :class:`autopar.tp.moe_ep.CocEpDispatchExpertsParallel` parallelized."""
    for module in list(model.modules()):
        if hasattr(getattr(module, "experts", None), "_coc_tokens_sharded"):
            CocMoeBlockSequenceParallel(sequence_dim=sequence_dim)._apply(module, mesh)


__all__ = [
    "CocMoeBlockSequenceParallel",
    "CocMoeExpertsParallel",
    "check_plain_expert_inputs",
    "check_moe_plan",
    "parallelize_moe_blocks",
    "without_expert_params",
]
