"""Shape ops: ``view`` / ``reshape`` / ``flatten`` / ``unflatten`` / ``unsqueeze`` / ``squeeze``,
``permute`` / ``transpose`` / ``t`` / ``.mT``, ``expand``, basic indexing (``x[..., :n]``,
``x[:, None]``), ``cat``, ``contiguous``. Rules in :mod:`autopar.dtensor.rules.shape`.

Each runs the same op on this rank's piece, with the piece's own sizes where the op takes sizes
(the piece of the output's layout). The wrapper reports contiguous global strides, so a piece that
``view`` cannot reinterpret (after a transpose) is reshaped, which copies: the global ``view`` was
legal on the contiguous tensor the wrapper stands for. Each has an explicit local vjp.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .. import redistribute as _rd
from ..rules import RuleResult
from ..rules.shape import (
    cat_rule,
    expand_rule,
    getitem_rule,
    infer_view_shape,
    normalize_index,
    permute_rule,
    view_rule,
)
from ..tensor import HANDLERS, DistTensor
from .dispatch import Op, apply, as_dist, mesh_of, rule_entry


def _sizes(args: tuple) -> tuple:
    """``f(x, 2, 3)`` and ``f(x, (2, 3))`` both give ``(2, 3)``."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def _vjp_reshape(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    return [g.reshape(saved[0].shape)]


def reshape_to(x: DistTensor, dst: Sequence[int], what: str = "view") -> DistTensor:
    """``x.view(dst)`` / ``x.reshape(dst)``; ``dst`` may hold one ``-1``."""
    dst = infer_view_shape(x.numel(), dst, what)
    mesh = x._mesh
    key = ("view", x._lid, tuple(dst), mesh.shape)

    def rule(t: DistTensor) -> RuleResult:
        return view_rule(t._shape, t._placements, dst, mesh.shape)

    res = rule_entry(key, rule, [x])[0]

    def local_fn(piece: torch.Tensor) -> torch.Tensor:
        shape = _rd.local_shape(res.out_shape, mesh, res.out_placements)
        return piece.view(shape) if _viewable(piece, shape) else piece.reshape(shape)

    return apply(key, Op(rule, local_fn, _vjp_reshape), [x])


def _viewable(piece: torch.Tensor, shape: Sequence[int]) -> bool:
    try:
        piece.view(shape)
    except RuntimeError:
        return False
    return True


def _view(x: DistTensor, *args: Any) -> DistTensor:
    if len(args) == 1 and isinstance(args[0], torch.dtype):
        raise NotImplementedError(f"view(dtype={args[0]}) of a DistTensor: reinterpreting pieces has no SPMD rule")
    return reshape_to(x, _sizes(args), "view")


def _reshape(x: DistTensor, *args: Any) -> DistTensor:
    return reshape_to(x, _sizes(args), "reshape")


def _torch_reshape(x: DistTensor, shape: Sequence[int]) -> DistTensor:
    return reshape_to(x, tuple(shape), "reshape")


def _flatten(x: DistTensor, start_dim: int = 0, end_dim: int = -1) -> DistTensor:
    shape = list(x._shape)
    if not shape:
        return reshape_to(x, (1,), "flatten")
    s, e = start_dim % len(shape), end_dim % len(shape)
    return reshape_to(x, shape[:s] + [math.prod(shape[s : e + 1])] + shape[e + 1 :], "flatten")


def _unflatten(x: DistTensor, dim: int, sizes: Sequence[int]) -> DistTensor:
    shape = list(x._shape)
    d = dim % len(shape)
    sizes = list(infer_view_shape(shape[d], sizes, "unflatten"))
    return reshape_to(x, shape[:d] + sizes + shape[d + 1 :], "unflatten")


def _unsqueeze(x: DistTensor, dim: int) -> DistTensor:
    shape = list(x._shape)
    shape.insert(dim % (len(shape) + 1), 1)
    return reshape_to(x, shape, "unsqueeze")


def _squeeze(x: DistTensor, dim: int | Sequence[int] | None = None) -> DistTensor:
    shape = list(x._shape)
    if dim is None:
        dims = {i for i, n in enumerate(shape) if n == 1}
    else:
        dims = {d % max(len(shape), 1) for d in ((dim,) if isinstance(dim, int) else dim)}
    return reshape_to(x, [n for i, n in enumerate(shape) if not (i in dims and n == 1)], "squeeze")


def permute(x: DistTensor, *dims: Any) -> DistTensor:
    """``x.permute(dims)``: no communication; shards follow their dims."""
    nd = x.ndim
    perm = tuple(d % nd for d in _sizes(dims)) if nd else ()
    if sorted(perm) != list(range(nd)):
        raise ValueError(f"permute(dims): {list(_sizes(dims))} is not a permutation of the {nd} dims")
    inverse = tuple(perm.index(d) for d in range(nd))
    op = Op(
        lambda t: permute_rule(t._shape, t._placements, perm),
        lambda piece: piece.permute(perm),
        lambda saved, g, need: [g.permute(inverse)],
    )
    return apply(("permute", x._lid, perm), op, [x])


def transpose(x: DistTensor, dim0: int, dim1: int) -> DistTensor:
    nd = x.ndim
    if nd == 0:
        return x
    perm = list(range(nd))
    a, b = dim0 % nd, dim1 % nd
    perm[a], perm[b] = perm[b], perm[a]
    return permute(x, perm)


def _t(x: DistTensor) -> DistTensor:
    if x.ndim > 2:
        raise ValueError(f"t() expects a tensor with <= 2 dims, but the DistTensor has {x.ndim}")
    return transpose(x, 0, -1) if x.ndim == 2 else x


def _mT(x: DistTensor) -> DistTensor:
    if x.ndim < 2:
        raise ValueError(f"mT: the DistTensor must have at least 2 dims, got {x.ndim}")
    return transpose(x, -2, -1)


def expand(x: DistTensor, *sizes: Any) -> DistTensor:
    """``x.expand(sizes)``: a view on every piece; its vjp sums over the broadcast dims."""
    sizes = tuple(int(n) for n in _sizes(sizes))
    mesh = x._mesh
    key = ("expand", x._lid, sizes)

    def rule(t: DistTensor) -> RuleResult:
        return expand_rule(t._shape, t._placements, sizes)

    res = rule_entry(key, rule, [x])[0]
    op = Op(
        rule,
        lambda piece: piece.expand(_rd.local_shape(res.out_shape, mesh, res.out_placements)),
        lambda saved, g, need: [g.sum_to_size(saved[0].shape)],
    )
    return apply(key, op, [x])


def _expand_as(x: DistTensor, other: torch.Tensor) -> DistTensor:
    return expand(x, tuple(other.shape))


def getitem(x: DistTensor, index: Any) -> DistTensor:
    """Basic indexing; a sharded dim must be taken whole (a full slice) to stay sharded."""
    idx = normalize_index(index, x.ndim)
    key = ("getitem", x._lid, tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in idx))

    def vjp(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
        z = g.new_zeros(saved[0].shape)
        z[idx] = g
        return [z]

    return apply(key, Op(lambda t: getitem_rule(t._shape, t._placements, idx), lambda piece: piece[idx], vjp), [x])


def cat(tensors: Sequence[Any], dim: int = 0, *, out: Any = None) -> DistTensor:
    """``torch.cat``: plain operands are Replicate; legacy 1-D empty plain tensors are skipped, as
    torch skips them (a KV cache starts from one)."""
    if out is not None:
        raise NotImplementedError("torch.cat(..., out=) with DistTensor operands")
    kept = [t for t in tensors if isinstance(t, DistTensor) or not (t.ndim == 1 and t.numel() == 0)]
    mesh = mesh_of(*kept)
    xs = [as_dist(t, mesh) for t in kept]
    nd = xs[0].ndim
    d = dim % nd
    key = ("cat", d) + tuple(x._lid for x in xs)

    def vjp(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
        parts = torch.split(g, [s.shape[d] for s in saved], d)
        return [p if n else None for p, n in zip(parts, need, strict=True)]

    op = Op(
        lambda *ts: cat_rule([t._shape for t in ts], [t._placements for t in ts], d),
        lambda *pieces: torch.cat(pieces, d),
        vjp,
    )
    return apply(key, op, xs)


def _torch_concatenate(tensors: Sequence[Any], axis: int = 0, *, out: Any = None) -> DistTensor:
    return cat(tensors, axis, out=out)


def _contiguous(x: DistTensor, memory_format: torch.memory_format = torch.contiguous_format) -> DistTensor:
    identity = tuple(range(x.ndim))
    op = Op(
        lambda t: permute_rule(t._shape, t._placements, identity),
        lambda piece: piece.contiguous(),
        lambda saved, g, need: [g],
    )
    return apply(("contiguous", x._lid), op, [x])


def install() -> None:
    T = torch.Tensor
    HANDLERS.update(
        {
            T.view: _view,
            T.reshape: _reshape,
            torch.reshape: _torch_reshape,
            T.flatten: _flatten,
            torch.flatten: _flatten,
            T.unflatten: _unflatten,
            torch.unflatten: _unflatten,
            T.unsqueeze: _unsqueeze,
            torch.unsqueeze: _unsqueeze,
            T.squeeze: _squeeze,
            torch.squeeze: _squeeze,
            T.permute: permute,
            torch.permute: permute,
            T.transpose: transpose,
            torch.transpose: transpose,
            T.swapaxes: transpose,
            T.swapdims: transpose,
            T.t: _t,
            torch.t: _t,
            T.mT.__get__: _mT,
            T.expand: expand,
            T.expand_as: _expand_as,
            T.__getitem__: getitem,
            torch.cat: cat,
            torch.concat: cat,
            torch.concatenate: _torch_concatenate,
            T.contiguous: _contiguous,
        }
    )
