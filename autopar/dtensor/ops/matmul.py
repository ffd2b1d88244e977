"""matmul and linear: the einsum rule, and the two patterns that run as one overlapped
matmul + collective from ``kernels`` (a pending Partial product reduced by the next reshard; an
all-gather of a Shard(0) activation fused with the GEMM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..autograd import (
    grad_placement,
    kernels_api,
    output_grad,
    pieces_nonempty,
    record,
    requires_grad,
    requires_grads,
    reshard_backward,
)
from ..placements import Partial, Replicate, Shard
from ..rules import RuleResult, einsum_rule, matmul_labels
from ..tensor import HANDLERS, DistTensor, lid_of, make, pending, uninit, wrap
from .dispatch import PLAIN, Op, apply, as_dist, mesh_of
from .elementwise import binary

_MM_CACHE: dict[tuple, tuple] = {}
_grad_enabled = torch.is_grad_enabled


def _mm_backward(ctx: tuple, saved: tuple, g: DistTensor) -> list[DistTensor | None]:
    """Explicit vjp of ``y = x @ w.T`` (x [..., k], w [n, k]) for the overlapped paths.

    dgrad ``dx = dy @ w``, wgrad ``dw = dy_2d.T @ x_2d``; placements as any local vjp.
    """
    res, in_pls, in_shapes, in_dtypes, need, transposed = ctx
    x_local, w_local = saved
    out_pl = res.out_placements
    g = output_grad(g, out_pl)
    mesh = g._mesh
    grads: list[DistTensor | None] = []
    for i in range(2):
        if not need[i]:
            grads.append(None)
            continue
        pl = grad_placement(in_pls[i], in_pls[:i] + in_pls[i + 1 :], out_pl, g._placements)
        if not g._init:
            grads.append(uninit(mesh, pl, in_shapes[i], in_dtypes[i], g._local.device))
            continue
        gl = g._local
        if i == 0:
            partial = [m for m, p in enumerate(pl) if type(p) is Partial]
            if (
                len(partial) == 1
                and mesh.shape[partial[0]] > 1
                and gl.ndim >= 2
                and pieces_nonempty(res.out_shape[-1], mesh.shape[partial[0]])
            ):
                # dgrad that is Partial on one mesh dim (e.g. Megatron's sequence-parallel column
                # backward): left pending, so the reshard that follows (reduce-scatter back to
                # Shard(0)) runs as one overlapped matmul_reduce_scatter.
                grads.append(pending(gl, w_local.mT, mesh, pl, in_shapes[i], dtype=in_dtypes[i], mesh_dim=partial[0]))
                continue
            lg = torch.matmul(gl, w_local)
        else:
            lg = gl.flatten(0, -2).T @ x_local.flatten(0, -2)
            if transposed:
                lg = lg.T
        grads.append(make(lg, mesh, pl, in_shapes[i], lg.dtype))
    return grads


def _record_mm(
    out: DistTensor,
    inputs: tuple[DistTensor, DistTensor],
    pieces: tuple[torch.Tensor, torch.Tensor],
    res: RuleResult,
    transposed: bool,
) -> DistTensor:
    """Record ``out``'s autograd node: ``inputs`` are ``(x, b)``, ``pieces`` the saved ``(x_local, w_local)``."""
    if not torch.is_grad_enabled():
        return out
    x, b = inputs
    need = requires_grads(inputs)
    if not any(need):
        return out
    ctx = (res, [x._placements, b._placements], [x._shape, b._shape], [x._dtype, b._dtype], need, transposed)
    return record(out, [x, b], _mm_backward, ctx, list(pieces))


def _matmul_like(key: tuple, op: Op, a: DistTensor, b: DistTensor, *, transposed: bool) -> DistTensor:
    """matmul / linear with a 2-D weight: route the two overlappable patterns to ``kernels``.

    ``transposed``: b is ``[k, n]`` (matmul) rather than ``[n, k]`` (linear).
    """
    entry = _MM_CACHE.get(key)
    if entry is None:
        res = op.rule(a, b)
        partial = [m for m, p in enumerate(res.out_placements) if type(p) is Partial]
        pend_dim = (
            partial[0]
            if len(partial) == 1 and b.ndim == 2 and a.ndim >= 2 and res.out_placements[partial[0]].reduce_op == "sum"
            else -1
        )
        entry = _MM_CACHE[key] = (
            res,
            (lid_of(a._shape, res.in_placements[0]), lid_of(b._shape, res.in_placements[1])),
            lid_of(res.out_shape, res.out_placements),
            pend_dim,
        )
    res, in_lids, out_lid, pend_dim = entry
    mesh = a._mesh
    if mesh._coord is None or b._lid != in_lids[1]:
        return apply(key, op, [a, b])
    if a._lid == in_lids[0]:
        if pend_dim >= 0 and mesh.shape[pend_dim] > 1 and pieces_nonempty(a._shape[-1], mesh.shape[pend_dim]):
            w_local = b._local.mT if transposed else b._local
            out = pending(
                a._local,
                w_local,
                mesh,
                res.out_placements,
                res.out_shape,
                dtype=torch.promote_types(a._dtype, b._dtype),
                mesh_dim=pend_dim,
                lid=out_lid,
            )
            return _record_mm(out, (a, b), (a._local, w_local), res, transposed)
        local = op.local_fn(a._local, b._local)
        out = make(local, mesh, res.out_placements, res.out_shape, local.dtype, lid=out_lid)
        if not _grad_enabled():
            PLAIN[key] = (mesh, res.out_placements, res.out_shape, out_lid)
            return out
        return _record_mm(out, (a, b), (a._local, b._local.mT if transposed else b._local), res, transposed)
    w_local = b._local.mT if transposed else b._local
    # all_gather_matmul: a is Shard(0) on exactly one mesh dim that the rule gathers, b is
    # sharded on the output columns there, and nothing else changes.
    diff = [m for m, (p, q) in enumerate(zip(a._placements, res.in_placements[0], strict=False)) if p != q]
    if len(diff) != 1:
        return apply(key, op, [a, b])
    m = diff[0]
    W = mesh.shape[m]
    if (
        a._placements[m] != Shard(0)
        or type(res.in_placements[0][m]) is not Replicate
        or res.out_placements[m] != Shard(a.ndim - 1)
        or a._shape[0] % W
    ):
        return apply(key, op, [a, b])
    y, gathered = kernels_api().all_gather_matmul(a._local, w_local, group=mesh.get_group(m), return_gathered=True)
    a_full = make(gathered, mesh, res.in_placements[0], a._shape, a._dtype, lid=in_lids[0])
    if torch.is_grad_enabled() and requires_grad(a):
        a_full = record(a_full, [a], reshard_backward, a._placements)
    out = make(y, mesh, res.out_placements, res.out_shape, y.dtype, lid=out_lid)
    return _record_mm(out, (a_full, b), (gathered, w_local), res, transposed)


def _matmul_rule(a: DistTensor, b: DistTensor) -> RuleResult:
    labels, out, forbidden = matmul_labels(a._shape, b._shape)
    return einsum_rule(
        labels,
        out,
        [a._shape, b._shape],
        [a._placements, b._placements],
        "linear",
        forbidden=forbidden,
        priority=(1, 0),
    )


_MATMUL = Op(_matmul_rule, torch.matmul)


def matmul(a, b) -> DistTensor:
    if type(a) is DistTensor and type(b) is DistTensor:
        f = PLAIN.get(("matmul", a._lid, b._lid))
        if f is not None and f[0] is a._mesh and f[0] is b._mesh and not _grad_enabled():
            local = torch.matmul(a._local, b._local)
            return wrap(local, f[0], f[1], f[2], f[3])
    if type(a) is not DistTensor or type(b) is not DistTensor or a._mesh is not b._mesh:
        mesh = mesh_of(a, b)
        a, b = as_dist(a, mesh), as_dist(b, mesh)
    key = ("matmul", a._lid, b._lid)
    if len(b._shape) == 2 and len(a._shape) >= 2:
        return _matmul_like(key, _MATMUL, a, b, transposed=True)
    return apply(key, _MATMUL, [a, b])


def _linear_rule(x: DistTensor, w: DistTensor) -> RuleResult:
    if x.ndim < 1 or w.ndim != 2:
        raise ValueError(f"linear: x {list(x._shape)} and weight {list(w._shape)} (need 2-D weight)")
    lead = "abcdefghij"[: x.ndim - 1]
    return einsum_rule(
        [lead + "k", "nk"], lead + "n", [x._shape, w._shape], [x._placements, w._placements], "linear", priority=(1, 0)
    )


_LINEAR = Op(_linear_rule, F.linear)


def linear(x, weight, bias=None) -> DistTensor:
    """``F.linear``: ``x @ weight.T`` (einsum ``...k,nk->...n``), then ``+ bias`` by the add rule."""
    mesh = mesh_of(x, weight, bias)
    x, w = as_dist(x, mesh), as_dist(weight, mesh)
    key = ("linear", x._lid, w._lid)
    y = _matmul_like(key, _LINEAR, x, w, transposed=False) if x.ndim >= 2 else apply(key, _LINEAR, [x, w])
    return y if bias is None else binary("add", y, bias)


def install() -> None:
    """Register the handlers and the ``@`` operator methods (which skip the torch-function round trip)."""
    methods = {"__matmul__": matmul, "__rmatmul__": lambda a, b: matmul(b, a)}
    for name, fn in methods.items():
        HANDLERS[getattr(torch.Tensor, name)] = fn
        setattr(DistTensor, name, fn)
    HANDLERS.update(
        {
            torch.matmul: matmul,
            torch.mm: matmul,
            torch.Tensor.matmul: matmul,
            torch.Tensor.mm: matmul,
            F.linear: linear,
        }
    )
