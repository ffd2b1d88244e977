"""Conversion to and from PyTorch DTensor, sharing the local piece (no copy).

``ProcessMesh`` <-> ``DeviceMesh``: the same ranks in the same N-D layout and the same dim names.
Placements are handed over as they are: a DistTensor's placements are torch's own ``Shard``,
``Replicate`` and ``Partial`` objects (autopar has no classes of its own), so only what one side
cannot hold raises: DTensor's other reduce ops (``product``, bitwise) and its internal placements
(``_StridedShard``, ``_MaskPartial``) in ``from_dtensor``, mixed Partial reduce ops in
``to_dtensor``. Both libraries split uneven shards like ``torch.chunk``, so the local pieces mean
the same thing and are handed over as they are too.

Building a mesh for the first time is collective over the default group (both libraries create
process groups for it), so every rank must convert in the same order; later conversions on the
same mesh reuse the cached one and do not communicate.
"""

from __future__ import annotations

from typing import Any

import torch

from .autograd import grad_placements_of, requires_grad, reshard_backward, reshard_nograd
from .mesh import ProcessMesh
from .placements import REDUCE_TYPES, Partial, Placement, check_placement
from .tensor import DistTensor, make, uninit

_DEVICE_MESHES: dict[tuple, Any] = {}
_PROCESS_MESHES: dict[tuple, ProcessMesh] = {}


def _dtensor_api():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    return DeviceMesh, DTensor


def device_mesh_of(mesh: ProcessMesh, device_type: str = "cpu") -> Any:
    """The DeviceMesh with ``mesh``'s ranks and dim names (built once; collective then)."""
    DeviceMesh = _dtensor_api()[0]
    key = (mesh.shape, mesh.process_ids, mesh.dim_names, device_type)
    dm = _DEVICE_MESHES.get(key)
    if dm is None:
        dm = DeviceMesh(device_type, torch.tensor(mesh.tolist(), dtype=torch.int64), mesh_dim_names=mesh.dim_names)
        _DEVICE_MESHES[key] = dm
    return dm


def process_mesh_of(device_mesh: Any) -> ProcessMesh:
    """The ProcessMesh with ``device_mesh``'s ranks and dim names (built once; collective then)."""
    ranks = device_mesh.mesh.tolist()
    names = device_mesh.mesh_dim_names
    key = (tuple(device_mesh.mesh.shape), tuple(device_mesh.mesh.flatten().tolist()), tuple(names) if names else None)
    mesh = _PROCESS_MESHES.get(key)
    if mesh is None:
        mesh = _PROCESS_MESHES[key] = ProcessMesh(ranks, list(names) if names else None)
    return mesh


def _to_dtensor_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """A DistTensor's placements are torch's own objects; only what this torch's DTensor lacks is
    refused (older releases do not list their reduce ops and pass any to the collective)."""
    supported = getattr(Partial, "ALL_REDUCE_OPS", REDUCE_TYPES)
    for p in placements:
        if type(p) is Partial and p.reduce_op not in supported:
            raise ValueError(
                f"to_dtensor: this torch's DTensor has no {p!r} (it supports {list(supported)}); "
                f"reshard to Replicate first"
            )
    return placements


def _from_dtensor_placements(placements: Any) -> tuple[Placement, ...]:
    placements = tuple(placements)
    for m, p in enumerate(placements):
        check_placement(p, f"from_dtensor: the DTensor's placements[{m}]")
    return placements


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _as_dtensor(t: DistTensor) -> Any:
    """The DTensor viewing ``t``'s piece (no copy, not tracked)."""
    DTensor = _dtensor_api()[1]
    mixed = {p.reduce_op for p in t._placements if type(p) is Partial}
    if len(mixed) > 1:
        raise ValueError(
            f"to_dtensor: placements {list(t._placements)} mix Partial reduce types "
            f"{sorted(mixed)}, which DTensor does not support; reshard first"
        )
    local = t._local
    dm = device_mesh_of(t._mesh, local.device.type)
    placements = _to_dtensor_placements(t._placements)
    return DTensor.from_local(
        local.detach(), dm, placements, run_check=False, shape=t._shape, stride=_contiguous_stride(t._shape)
    )


def _as_dist_tensor(t: Any) -> DistTensor:
    """The DistTensor around DTensor ``t``'s piece (no copy, not tracked)."""
    mesh = process_mesh_of(t.device_mesh)
    placements = _from_dtensor_placements(t.placements)
    local = t._local_tensor.detach()
    shape = torch.Size(t.shape)
    if mesh.my_coordinate is None:
        return uninit(mesh, placements, shape, t.dtype, local.device)
    return make(local, mesh, placements, shape, t.dtype)


class _ToDTensor(torch.autograd.Function):
    """``d = to_dtensor(t)``: forward ``d`` views ``t``'s piece; backward: the DTensor gradient
    as a DistTensor, sharded like ``t`` (Replicate where ``t`` is Partial; a Replicate ``t`` keeps
    a Partial gradient, reduced later by ``sync_gradients``)."""

    @staticmethod
    def forward(ctx, t: DistTensor) -> Any:
        ctx.src = t._placements
        ctx.set_materialize_grads(False)
        return _as_dtensor(t)

    @staticmethod
    def backward(ctx, g: Any):
        if g is None:
            return None
        return reshard_backward(ctx.src, (), _as_dist_tensor(g))[0]


class _FromDTensor(torch.autograd.Function):
    """``t = from_dtensor(d)``: forward ``t`` views ``d``'s piece; backward: the DistTensor
    gradient as a DTensor with ``d``'s placements, Partial made Replicate (what DTensor's
    ``from_local`` backward gives)."""

    @staticmethod
    def forward(ctx, d: Any) -> DistTensor:
        t = _as_dist_tensor(d)
        ctx.want = grad_placements_of(t._placements)
        ctx.set_materialize_grads(False)
        return t

    @staticmethod
    def backward(ctx, g: DistTensor | None):
        if g is None:
            return None
        if g._placements != ctx.want:
            g = reshard_nograd(g, ctx.want)
        return _as_dtensor(g)


def to_dtensor(t: DistTensor) -> Any:
    """A ``torch.distributed.tensor.DTensor`` viewing ``t``'s local piece (no copy).

    Differentiable (with grad mode on and ``t`` requiring grad): the DTensor's gradient flows
    back to ``t``.
    """
    if not isinstance(t, DistTensor):
        raise TypeError(f"to_dtensor(t): expected an autopar DistTensor, got {type(t).__name__}")
    if torch.is_grad_enabled() and requires_grad(t):
        with torch._C.DisableTorchFunctionSubclass():
            return _ToDTensor.apply(t)
    return _as_dtensor(t)


def from_dtensor(t: Any) -> DistTensor:
    """An autopar DistTensor around ``t``'s local piece (no copy).

    Differentiable (with grad mode on and ``t`` requiring grad): the DistTensor's gradient flows
    back to the DTensor.
    """
    DTensor = _dtensor_api()[1]
    if not isinstance(t, DTensor):
        raise TypeError(f"from_dtensor(t): expected a torch DTensor, got {type(t).__name__}")
    if torch.is_grad_enabled() and t.requires_grad:
        return _FromDTensor.apply(t)
    return _as_dist_tensor(t)
