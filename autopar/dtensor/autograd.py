"""Gradients of DistTensor ops through torch's autograd engine, and ``reshard``.

Every recorded op is one ``torch.autograd.Function`` node (:class:`_Op`) whose backward derives
the gradient's *placements* as well as its values: the gradient of a Replicate input is Partial
exactly on the mesh dims where it met data it does not shard (a sharded batch, sequence or
context dim, a sharded output column, ...), which is what ``sync_gradients`` later reduces. The
local vector-Jacobian product comes from torch: the op's local computation is recorded on
detached copies of the input pieces, and the node's backward runs ``torch.autograd.grad`` on that
small local graph. The engine walks nodes in the same order on every rank (all ranks build the
same graph, clipped pipeline ranks included), so the collectives inside backward match.

Sums of gradient contributions with different placements (a Replicate weight met Shard(0) data
and a Partial activation) are unified in :func:`accumulate`, which the engine reaches through
``__torch_dispatch__`` (``aten.add``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import redistribute as _rd
from .mesh import ProcessMesh
from .placements import PARTIAL_SUM, REPLICATE, Partial, Placement, Replicate, Shard, normalize_placements
from .tensor import TRACKED_CONVERSIONS, DistTensor, PendingMatmul, make, uninit

_PARTIAL_AVG = Partial("avg")


class Node:
    """What one recorded op needs in backward. ``saved`` tensors go through ``save_for_backward``
    (freed by the engine after a backward without ``retain_graph``); ``ctx`` is the rest."""

    __slots__ = ("backward", "ctx", "saved", "out")

    def __init__(self, backward: Callable, ctx: Any, saved: Sequence[torch.Tensor] = ()):
        self.backward = backward
        self.ctx = ctx
        self.saved = tuple(saved)
        self.out: DistTensor | None = None


class _Op(torch.autograd.Function):
    @staticmethod
    def forward(ctx, node: Node, *inputs: DistTensor) -> DistTensor:
        ctx.node = node
        ctx.save_for_backward(*node.saved)
        out, node.out, node.saved = node.out, None, ()
        return out

    @staticmethod
    def backward(ctx, g: DistTensor):
        # Reading saved_tensors raises torch's "backward through the graph a second time" error
        # after a backward that did not retain the graph.
        saved = ctx.saved_tensors
        return (None,) + tuple(ctx.node.backward(ctx.node.ctx, saved, g))


def record(
    out: DistTensor, inputs: Sequence[DistTensor], backward: Callable, ctx: Any, saved: Sequence[torch.Tensor] = ()
) -> DistTensor:
    """Attach ``out`` to the autograd graph of ``inputs``; returns the tensor to hand out."""
    node = Node(backward, ctx, saved)
    node.out = out
    # Function.apply checks its arguments for __torch_function__; with it disabled here the call
    # goes straight to the engine instead of round-tripping through DistTensor's fallback.
    with _NO_TORCH_FUNCTION():
        return _APPLY(node, *inputs)


_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
# The C++ apply under Function.apply's Python wrapper, which only adds functorch and
# setup_context handling that _Op does not use.
_APPLY = super(torch.autograd.Function, _Op).apply


def requires_grad(x: torch.Tensor) -> bool:
    with _NO_TORCH_FUNCTION():
        return x.requires_grad


def requires_grads(xs: Sequence[torch.Tensor]) -> list[bool]:
    with _NO_TORCH_FUNCTION():
        return [x.requires_grad for x in xs]


# -- placements of gradients ---------------------------------------------------------------------


def grad_placement(in_pl: tuple, others: list[tuple], out_pl: tuple, g_pl: tuple) -> tuple:
    """Placements of an input's gradient from a local vector-Jacobian product.

    Per mesh dim: a sharded input gets a sharded gradient; a Partial input a Replicate one (the
    caller made the output gradient Replicate there); a Replicate input gets a Replicate gradient
    only if nothing in the op varied along that mesh dim (every operand and the output Replicate,
    the output gradient Replicate), else a Partial one: each rank's product covered only its
    shard of the data, and the true gradient is the sum over the mesh dim, or the mean when the
    output is ``Partial("avg")`` (its value is the mean of the ranks' local results).
    """
    out = []
    for m, p in enumerate(in_pl):
        tp = type(p)
        if tp is Shard:
            out.append(p)
        elif tp is Partial:
            out.append(REPLICATE)
        elif (
            type(g_pl[m]) is Replicate and type(out_pl[m]) is Replicate and all(type(o[m]) is Replicate for o in others)
        ):
            out.append(REPLICATE)
        elif out_pl[m] == _PARTIAL_AVG:
            out.append(_PARTIAL_AVG)
        else:
            out.append(PARTIAL_SUM)
    return tuple(out)


def output_grad(g: DistTensor, out_pl: tuple) -> DistTensor:
    """The gradient of a Partial output is Replicate; of a sharded output sharded the same way; of
    a Replicate output Replicate or Partial (a local vjp is linear in the gradient), never sharded:
    the local vjp needs a gradient piece shaped like the output piece."""
    want = tuple(
        REPLICATE
        if type(o) is Partial or (type(o) is Replicate and type(gp) is Shard)
        else (o if type(o) is Shard else gp)
        for o, gp in zip(out_pl, g._placements, strict=False)
    )
    return reshard_nograd(g, want) if want != g._placements else g


def graph_vjp(saved: tuple, g: torch.Tensor, need: list[bool]) -> list[torch.Tensor | None]:
    """Local vjp from a recorded local graph: ``saved`` is (output, leaf per needed input)."""
    local, leaves = saved[0], saved[1:]
    # retain_graph: this local graph belongs to the node, and torch frees it with the node's
    # saved tensors (after a backward without retain_graph), not here.
    grads = iter(torch.autograd.grad(local, leaves, g, retain_graph=True, allow_unused=True))
    out: list[torch.Tensor | None] = []
    k = 0
    for n in need:
        if not n:
            out.append(None)
            continue
        lg = next(grads)
        out.append(torch.zeros_like(leaves[k]) if lg is None else lg)
        k += 1
    return out


def vjp_backward(ctx: tuple, saved: tuple, g: DistTensor) -> list[DistTensor | None]:
    """Backward of one op: the local vjp (``local_vjp(saved, g_local, need)``, an explicit formula
    or :func:`graph_vjp`) and the placements of each input's gradient."""
    res, in_pls, in_shapes, in_dtypes, need, local_vjp = ctx
    out_pl = res.out_placements
    g = output_grad(g, out_pl)
    mesh = g._mesh
    pls = [
        grad_placement(in_pls[i], in_pls[:i] + in_pls[i + 1 :], out_pl, g._placements) if need[i] else None
        for i in range(len(need))
    ]
    if mesh._coord is None or not g._init:
        return [
            uninit(mesh, pl, in_shapes[i], in_dtypes[i], g._local.device) if pl else None for i, pl in enumerate(pls)
        ]
    return [
        None if lg is None else make(lg, mesh, pls[i], in_shapes[i], lg.dtype)
        for i, lg in enumerate(local_vjp(saved, g._local, need))
    ]


# -- reshard (same mesh and cross-mesh) ---------------------------------------------------------


def kernels_api():
    """The ``kernels`` package, imported on first use (a DistTensor that never reaches an
    overlapped op does not need it loaded)."""
    import kernels

    return kernels


def pieces_nonempty(size: int, world: int) -> bool:
    """Whether every ``torch.chunk`` piece of ``size`` over ``world`` ranks is non-empty.

    The overlapped ops need ``k > 0`` on every rank, and all ranks must choose the same path, so
    the choice is made from the global size of the contracted dim, never from a local piece.
    """
    return -(-size // world) * (world - 1) < size


def _fused_reduce(x: PendingMatmul, placements: tuple) -> torch.Tensor | None:
    """The local result of resharding a pending matmul, through one overlapped op, or None."""
    m = x._mesh_dim
    if x.is_computed() or x._placements[m] != PARTIAL_SUM:
        # The overlapped ops sum; a Partial("avg") dgrad takes the generic reshard.
        return None
    if any(p != q for k, (p, q) in enumerate(zip(x._placements, placements, strict=False)) if k != m):
        return None
    dst = placements[m]
    group = x._mesh.get_group(m)
    if type(dst) is Replicate:
        return kernels_api().matmul_all_reduce(x._x, x._w, group=group)
    if dst == Shard(0) and x._shape[0] % x._mesh.shape[m] == 0 and x.ndim >= 2:
        return kernels_api().matmul_reduce_scatter(x._x, x._w, group=group)
    return None


def reshard_nograd(x: DistTensor, placements: tuple) -> DistTensor:
    if not x._init:
        return uninit(x._mesh, placements, x._shape, x._dtype, x._local.device)
    local = _fused_reduce(x, placements) if type(x) is PendingMatmul else None
    if local is None:
        local = _rd.redistribute_local(x._local, x._shape, x._mesh, x._placements, placements)
    return make(local, x._mesh, placements, x._shape, x._dtype)


def reshard_backward(src: tuple, saved: tuple, g: DistTensor) -> list[DistTensor]:
    # Back to the input's layout: sharded stays sharded, a Partial input's gradient is Replicate,
    # a Replicate input keeps a Replicate or Partial gradient as it comes (no communication).
    want = tuple(
        s if type(s) is Shard else (REPLICATE if type(s) is Partial or type(gp) is Shard else gp)
        for s, gp in zip(src, g._placements, strict=False)
    )
    return [reshard_nograd(g, want)]


def reshard_same_mesh(x: DistTensor, placements: tuple) -> DistTensor:
    _rd.check_placements_reachable(x._placements, placements)
    out = reshard_nograd(x, placements)
    if torch.is_grad_enabled() and requires_grad(x):
        return record(out, [x], reshard_backward, x._placements)
    return out


def convert(x: DistTensor, placements: tuple) -> DistTensor:
    """Reshard ``x`` on its mesh (recorded for autograd) if the rule needs other placements."""
    if x._placements == placements:
        return x
    return reshard_same_mesh(x, placements)


def _move_backward(ctx: tuple, saved: tuple, g: DistTensor) -> list[DistTensor]:
    src_mesh, src_pl, shape, dtype = ctx
    dst_mesh = g._mesh
    same = src_mesh.shape == dst_mesh.shape
    if not same and any(type(p) is not Replicate for p in g._placements):
        # The forward move carried a Replicate tensor; send back the reduced gradient.
        g = reshard_nograd(g, (REPLICATE,) * dst_mesh.ndim)
    g_pl = g._placements if same else (REPLICATE,) * src_mesh.ndim
    recv_shape = _rd.local_shape(shape, src_mesh, g_pl) if src_mesh._coord is not None else None
    local = _rd.move_across_meshes(
        g._local if g._init else None, dst_mesh, src_mesh, recv_shape=recv_shape, dtype=dtype, device=g._local.device
    )
    if local is None:
        return [uninit(src_mesh, g_pl, shape, dtype, g._local.device)]
    return [make(local, src_mesh, g_pl, shape, dtype)]


def _move(x: DistTensor, mesh: ProcessMesh) -> DistTensor:
    """Same placements (same-shape meshes) or Replicate (different shapes) on another mesh."""
    same = x._mesh.shape == mesh.shape
    pl = x._placements if same else (REPLICATE,) * mesh.ndim
    recv_shape = _rd.local_shape(x._shape, mesh, pl) if mesh._coord is not None else None
    local = _rd.move_across_meshes(
        x._local if x._init else None, x._mesh, mesh, recv_shape=recv_shape, dtype=x._dtype, device=x._local.device
    )
    out = (
        uninit(mesh, pl, x._shape, x._dtype, x._local.device)
        if local is None
        else make(local, mesh, pl, x._shape, x._dtype)
    )
    if torch.is_grad_enabled() and requires_grad(x):
        return record(out, [x], _move_backward, (x._mesh, x._placements, x._shape, x._dtype))
    return out


def reshard(dt: DistTensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> DistTensor:
    """Move ``dt`` to ``placements`` on ``mesh`` (its own mesh, or another: a pipeline stage).

    Differentiable: the backward moves the gradient back. Across meshes every rank of both meshes
    must call it (all ranks run the same program); a rank in neither does nothing.
    """
    if not isinstance(dt, DistTensor):
        raise TypeError(f"reshard(dt): expected a DistTensor, got {type(dt).__name__}")
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"reshard(mesh): expected a ProcessMesh, got {type(mesh).__name__}")
    pl = normalize_placements(placements, mesh.ndim, dt.ndim)
    if mesh == dt._mesh:
        return convert(dt, pl)
    if any(type(p) is Partial for p in dt._placements):
        dt = convert(dt, tuple(REPLICATE if type(p) is Partial else p for p in dt._placements))
    if dt._mesh.shape == mesh.shape:
        return _move(convert(dt, pl), mesh) if not any(type(p) is Partial for p in pl) else convert(_move(dt, mesh), pl)
    moved = _move(convert(dt, (REPLICATE,) * dt._mesh.ndim), mesh)
    return convert(moved, pl)


def _sum_placement(pa: Placement, pb: Placement) -> Placement:
    if any(type(p) is Partial and p.reduce_op in ("max", "min") for p in (pa, pb)):
        return REPLICATE  # max(a) + max(b) is not max(a + b): reduce first
    if pa == pb:
        return pa
    if {type(pa), type(pb)} <= {Partial, Replicate}:
        return PARTIAL_SUM  # R -> P keeps the value on coordinate 0: free
    return pa  # anything else follows the first contribution's layout


def accumulate(a: DistTensor, b: DistTensor) -> DistTensor:
    """``a + b`` for two gradient contributions, unifying their placements first."""
    target = tuple(_sum_placement(pa, pb) for pa, pb in zip(a._placements, b._placements, strict=False))
    a = reshard_nograd(a, target) if a._placements != target else a
    b = reshard_nograd(b, target) if b._placements != target else b
    if not a._init:
        return a
    return make(a._local + b._local, a._mesh, a._placements, a._shape, torch.promote_types(a._dtype, b._dtype))


# -- conversions to and from plain tensors (DTensor's to_local / full_tensor / from_local) ----------


def grad_placements_of(placements: tuple) -> tuple:
    """DTensor's default for a conversion's gradient: the placements, Partial made Replicate (the
    gradient of a pending sum is the same for every term)."""
    return tuple(REPLICATE if type(p) is Partial else p for p in placements)


class _ToLocal(torch.autograd.Function):
    """``y = x.to_local()``: forward ``y = x``'s piece (a view, so autograd metadata lands on a
    fresh tensor and not on the piece); backward ``dx = DistTensor(dy, grad_placements)``."""

    @staticmethod
    def forward(ctx, x: DistTensor, grad_pl: tuple) -> torch.Tensor:
        ctx.meta = (x._mesh, grad_pl, x._shape, x._dtype, x._init)
        ctx.set_materialize_grads(False)
        local = x._local
        return local.view_as(local)

    @staticmethod
    def backward(ctx, g: torch.Tensor | None):
        mesh, grad_pl, shape, dtype, init = ctx.meta
        if g is None:
            return None, None
        if not init:
            return uninit(mesh, grad_pl, shape, dtype, g.device), None
        return make(g, mesh, grad_pl, shape, g.dtype), None


def to_local_tracked(x: DistTensor, grad_placements: Sequence[Placement] | None) -> torch.Tensor:
    if grad_placements is None:
        grad_pl = grad_placements_of(x._placements)
    else:
        grad_pl = normalize_placements(grad_placements, x._mesh.ndim, x.ndim)
    with _NO_TORCH_FUNCTION():
        return _ToLocal.apply(x, grad_pl)


def full_tensor_tracked(x: DistTensor, grad_placements: Sequence[Placement] | None) -> torch.Tensor:
    """``x.reshard(Replicate).to_local()``; the reshard's backward takes the gradient back to
    ``x``'s shards (Replicate where ``x`` is Partial)."""
    full = reshard_same_mesh(x, (REPLICATE,) * x._mesh.ndim)
    return to_local_tracked(full, grad_placements)


def _from_local_backward(ctx: tuple, saved: tuple, g: DistTensor) -> list[torch.Tensor | None]:
    if not g._init:
        return [None]
    return [reshard_nograd(g, ctx)._local]


def from_local_tracked(out: DistTensor, local: torch.Tensor) -> DistTensor:
    """``DistTensor.from_local(local, ...)`` on autograd's graph: the gradient of ``local`` is the
    piece of the DistTensor's gradient resharded to its placements (Partial made Replicate)."""
    return record(out, [local], _from_local_backward, grad_placements_of(out._placements))


TRACKED_CONVERSIONS.update(
    {"to_local": to_local_tracked, "full_tensor": full_tensor_tracked, "from_local": from_local_tracked}
)
