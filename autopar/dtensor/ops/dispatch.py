"""The dispatch core every rules-based op goes through: cached rule, reshards the rule asks for,
the local torch op, one wrapper, and (when a gradient is wanted) one autograd node
(:mod:`autopar.dtensor.autograd`).

On a rank outside the op's mesh (pipeline non-computation clip) an op runs only its cached rule
and returns an uninitialized DistTensor (zero-element piece, no storage) with the right global
shape, dtype, mesh and placements; its backward likewise does nothing there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..autograd import (
    from_local_tracked,
    graph_vjp,
    record,
    requires_grad,
    requires_grads,
    reshard_same_mesh,
    vjp_backward,
)
from ..mesh import ProcessMesh
from ..placements import REPLICATE
from ..rules import RuleResult
from ..tensor import DistTensor, empty_local, lid_of, make, uninit, wrap


class Op(NamedTuple):
    """One op on DistTensors: its SPMD rule, the torch op on the local pieces, and their vector-Jacobian
    product ``vjp(saved_input_pieces, grad_piece, need)``.

    The rule runs only when the call's key is not cached, so a module-level function (not a closure made per
    call) keeps the hot path free of allocations. Without a vjp the local op is recorded on torch's graph and
    differentiated with ``torch.autograd.grad`` (a reentrant engine call, several times slower).
    """

    rule: Callable[..., RuleResult]
    local_fn: Callable
    vjp: Callable | None = None


RULE_CACHE: dict[tuple, tuple] = {}
# (op, input layout ids) -> (mesh, out placements, out shape, out layout id) for calls that need no
# reshard, no overlapped kernel and no autograd: the per-op hot path of inference (and of
# bench.cost.dispatch). The mesh is compared by identity, so an entry serves one mesh only.
PLAIN: dict[tuple, tuple] = {}


def as_dist(x: Any, mesh: ProcessMesh) -> DistTensor:
    """A plain tensor mixed into a DistTensor op is the same value on every rank: Replicate.

    Differentiable: a plain tensor that requires grad (an embedding output, a plain norm weight)
    gets the reduced gradient back (Partial -> Replicate in backward), so parameters behind it
    are trained.
    """
    if isinstance(x, DistTensor):
        if x._mesh is not mesh and x._mesh != mesh:
            raise ValueError(
                f"operands live on different meshes ({x._mesh} and {mesh}); move one "
                f"with autopar.reshard(t, mesh, placements) first"
            )
        return x
    if isinstance(x, torch.Tensor):
        pl = (REPLICATE,) * mesh.ndim
        if mesh.my_coordinate is None:
            out = uninit(mesh, pl, x.shape, x.dtype, x.device)
        else:
            out = make(x.detach(), mesh, pl, x.shape, x.dtype)
        if _grad_enabled() and requires_grad(x):
            return from_local_tracked(out, x)
        return out
    raise TypeError(f"expected a DistTensor or torch.Tensor, got {type(x).__name__}")


def mesh_of(*xs) -> ProcessMesh:
    for x in xs:
        if isinstance(x, DistTensor):
            return x._mesh
    raise TypeError("no DistTensor among the operands")


def rule_entry(key: tuple, rule: Callable[..., RuleResult], inputs: Sequence[DistTensor]) -> tuple:
    entry = RULE_CACHE.get(key)
    if entry is None:
        res = rule(*inputs)
        entry = RULE_CACHE[key] = (
            res,
            tuple(lid_of(x._shape, p) for x, p in zip(inputs, res.in_placements, strict=False)),
            lid_of(res.out_shape, res.out_placements),
        )
    return entry


# The hot paths for one and two inputs (no gradient wanted, rule cached, inputs already in the
# layout the rule wants, this rank in the mesh): bench.cost.dispatch times exactly these, so
# they do nothing beyond the lookup, the local op and the wrapper, and fill PLAIN for next time.
_grad_enabled = torch.is_grad_enabled


def apply1(key: tuple, op: Op, x: DistTensor, *, plain: dict[int, tuple] | None = None) -> DistTensor:
    """``plain``: the op's UNARY_PLAIN table, for ops whose registered torch functions compute
    ``local_fn(piece)`` when given the piece alone; a call served here enters its layout there."""
    entry = RULE_CACHE.get(key)
    if entry is not None and not _grad_enabled() and x._lid == entry[1][0] and x._mesh._coord is not None:
        local = op.local_fn(x._local)
        res = entry[0]
        f = (x._mesh, res.out_placements, res.out_shape, entry[2])
        if plain is not None:
            plain[x._lid] = f
        return wrap(local, *f)
    return apply(key, op, [x])


def apply2(key: tuple, op: Op, a: DistTensor, b: DistTensor) -> DistTensor:
    entry = RULE_CACHE.get(key)
    if entry is not None and not _grad_enabled():
        in_lids = entry[1]
        if a._lid == in_lids[0] and b._lid == in_lids[1] and a._mesh._coord is not None:
            local = op.local_fn(a._local, b._local)
            res = entry[0]
            PLAIN[key] = (a._mesh, res.out_placements, res.out_shape, entry[2])
            return wrap(local, a._mesh, res.out_placements, res.out_shape, entry[2])
    return apply(key, op, [a, b])


def apply(key: tuple, op: Op, inputs: list[DistTensor], *, out_dtype: torch.dtype | None = None) -> DistTensor:
    """Run one op: cached rule, reshard inputs, local op (or clip), record the autograd node.

    ``op.rule(*inputs)`` is called only when ``key`` is not cached. ``out_dtype``: the output's dtype where
    it is not the inputs' promoted one (a clipped rank computes nothing to read it from).
    """
    res, in_lids, out_lid = rule_entry(key, op.rule, inputs)
    for i, x in enumerate(inputs):
        if x._lid != in_lids[i]:
            inputs[i] = reshard_same_mesh(x, res.in_placements[i])
    mesh = inputs[0]._mesh
    need = requires_grads(inputs) if _grad_enabled() else None
    if need is None or not any(need):
        if mesh._coord is None:
            return _clipped(inputs, res, out_lid, out_dtype)
        local = op.local_fn(*[x._local for x in inputs])
        return wrap(local, mesh, res.out_placements, res.out_shape, out_lid)
    ctx = (
        res,
        [x._placements for x in inputs],
        [x._shape for x in inputs],
        [x._dtype for x in inputs],
        need,
        op.vjp or graph_vjp,
    )
    if mesh._coord is None:
        return record(_clipped(inputs, res, out_lid, out_dtype), inputs, vjp_backward, ctx)
    if op.vjp is not None:
        pieces = [x._local for x in inputs]
        local = op.local_fn(*pieces)
        out = make(local, mesh, res.out_placements, res.out_shape, local.dtype, lid=out_lid)
        return record(out, inputs, vjp_backward, ctx, pieces)
    leaves = [x._local.detach().requires_grad_() if n else x._local for x, n in zip(inputs, need, strict=False)]
    with torch.enable_grad():
        local = op.local_fn(*leaves)
    out = make(local.detach(), mesh, res.out_placements, res.out_shape, local.dtype, lid=out_lid)
    return record(out, inputs, vjp_backward, ctx, [local] + [leaf for leaf, n in zip(leaves, need, strict=False) if n])


def _clipped(inputs: list[DistTensor], res: RuleResult, out_lid: int, out_dtype: torch.dtype | None) -> DistTensor:
    """The output on a rank outside the op's mesh: uninitialized, no storage."""
    dtype = out_dtype or promote(inputs)
    return make(
        empty_local(dtype, inputs[0]._local.device),
        inputs[0]._mesh,
        res.out_placements,
        res.out_shape,
        dtype,
        init=False,
        lid=out_lid,
    )


def promote(ins: list[DistTensor]) -> torch.dtype:
    dtype = ins[0]._dtype
    for x in ins[1:]:
        dtype = torch.promote_types(dtype, x._dtype)
    return dtype
