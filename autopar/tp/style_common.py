"""What the CoC styles share (:mod:`autopar.tp.styles`, :mod:`autopar.tp.moe`, :mod:`autopar.tp.moe_ep`): the
mesh's process group, DTensor inputs and parameters as the local tensors the forwards compute on, parameters
distributed or replicated on the mesh, the forward a style installs, and the backward sum of a replicated
parameter's gradient over the mesh.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from . import comm

try:  # torch's layout for weights packed along a sharded dim (q/k/v in one GEMM); private, stable since 2.5
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
except ImportError:  # pragma: no cover
    StridedShard = None


def mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    if mesh.ndim != 1:
        raise ValueError(
            f"the CoC styles take a 1-D tensor-parallel mesh (mesh['tp'] of a larger one), got a {mesh.ndim}-D mesh "
            f"{tuple(mesh.mesh.shape)}"
        )
    return mesh.get_group()


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear whose weight is stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def local_of(t: torch.Tensor) -> torch.Tensor:
    # Differentiable: the gradient of the local piece becomes the DTensor's gradient (its placements).
    return t.to_local() if isinstance(t, DTensor) else t


class AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group.

    For a replicated parameter applied to sequence-sharded rows: each rank's gradient covers its
    own rows only, the parameter's gradient is their sum::

        forward:  w_out = w
        backward: grad_w = all_reduce(grad_w_out)
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if comm.world_size(ctx.group) == 1:
            return grad, None
        return comm.wait(comm.start_all_reduce(grad.contiguous(), ctx.group)), None


def local_input(x: torch.Tensor, default: Placement) -> tuple[torch.Tensor, Placement]:
    """``(the local tensor, its layout)``: a DTensor's own (a Partial one reduced first), else ``default``."""
    if not isinstance(x, DTensor):
        return x, default
    if isinstance(x.placements[0], Partial):
        x = x.redistribute(placements=[Replicate()])
    return x.to_local(), x.placements[0]


def replicate_param(owner: nn.Module, name: str, param: torch.Tensor, mesh: DeviceMesh) -> None:
    """``param`` as a ``Replicate()`` DTensor of its local value (the same on every rank, as torch's
    ``SequenceParallel`` assumes of norm weights)."""
    owner.register_parameter(
        name,
        nn.Parameter(
            DTensor.from_local(param, mesh, [Replicate()], run_check=False), requires_grad=param.requires_grad
        ),
    )


def distribute_param(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement, src_data_rank: int | None):
    param = module._parameters.get(name)
    if param is None:
        return
    module.register_parameter(
        name,
        nn.Parameter(
            distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad,
        ),
    )


def install_forward(module: nn.Module, forward: Any) -> nn.Module:
    module.forward = functools.partial(forward, module)
    return module
