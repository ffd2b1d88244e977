"""SPMD rules of the shape ops: view / reshape (and flatten, unflatten, unsqueeze, squeeze through
them), permute / transpose, expand, basic indexing, cat.

All of them move values without arithmetic, so a ``Partial`` input stays Partial. A sharded tensor
dim stays sharded when every rank's piece of the output is the op applied to its piece of the
input; otherwise the rule asks for that mesh dim to be gathered (Replicate) first, which is always
correct. For view that needs the sharded dim to lead its group of merged / split dims and the
``torch.chunk`` piece boundaries to coincide: merging ``(a, b) -> (a * b)`` with ``a`` sharded
over ``W`` ranks keeps the shard iff ``ceil(a / W) * b == ceil(a * b / W)``. The rules need the
mesh sizes (``mesh_shape``), so callers key their caches by it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..placements import REPLICATE, Placement, Shard
from .einsum import RuleResult, einsum_rule


def infer_view_shape(numel: int, shape: Sequence[int], what: str) -> torch.Size:
    """``shape`` with its one ``-1`` resolved (as ``Tensor.view``); a named error otherwise."""
    shape = [int(n) for n in shape]
    unknown = [i for i, n in enumerate(shape) if n == -1]
    if len(unknown) > 1 or any(n < -1 for n in shape):
        raise ValueError(f"{what}: invalid shape {shape} (at most one -1, no other negative size)")
    known = math.prod(n for n in shape if n != -1)
    if unknown:
        if known == 0 or numel % known:
            raise ValueError(f"{what}: shape {shape} is invalid for a tensor of {numel} elements")
        shape[unknown[0]] = numel // known
    elif known != numel:
        raise ValueError(f"{what}: shape {shape} is invalid for a tensor of {numel} elements")
    return torch.Size(shape)


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The minimal groups of source and destination dims of equal products (size-1 dims left out):
    ``[6, 4] -> [2, 3, 4]`` gives ``[([0], [0, 1]), ([1], [2])]``."""
    s_dims = [i for i, n in enumerate(src) if n != 1]
    d_dims = [j for j, n in enumerate(dst) if n != 1]
    groups = []
    i = j = 0
    while i < len(s_dims) and j < len(d_dims):
        gs, gd = [s_dims[i]], [d_dims[j]]
        ps, pd = src[s_dims[i]], dst[d_dims[j]]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                gs.append(s_dims[i])
                ps *= src[s_dims[i]]
                i += 1
            else:
                gd.append(d_dims[j])
                pd *= dst[d_dims[j]]
                j += 1
        groups.append((gs, gd))
    return groups


def view_rule(
    src: Sequence[int], placements: Sequence[Placement], dst: Sequence[int], mesh_shape: Sequence[int]
) -> RuleResult:
    """``x.view(dst)`` (``dst`` already resolved) for ``x`` of global shape ``src``."""
    in_pl: list[Placement] = list(placements)
    out_pl: list[Placement] = list(placements)
    lead = {}
    if math.prod(src) != 0:
        for gs, gd in view_groups(src, dst):
            lead[gs[0]] = (gd[0], math.prod(src[d] for d in gs[1:]), math.prod(dst[d] for d in gd[1:]))
    for m, p in enumerate(placements):
        if type(p) is not Shard:
            continue
        hit = lead.get(p.dim)
        W = mesh_shape[m]
        if hit is not None:
            o, inner_in, inner_out = hit
            if -(-src[p.dim] // W) * inner_in == -(-dst[o] // W) * inner_out:
                out_pl[m] = Shard(o)
                continue
        in_pl[m] = out_pl[m] = REPLICATE
    return RuleResult((tuple(in_pl),), tuple(out_pl), torch.Size(dst))


def permute_rule(src: Sequence[int], placements: Sequence[Placement], perm: Sequence[int]) -> RuleResult:
    """``x.permute(perm)``: output dim ``j`` is input dim ``perm[j]``."""
    where = {d: j for j, d in enumerate(perm)}
    out = tuple(Shard(where[p.dim]) if type(p) is Shard else p for p in placements)
    return RuleResult((tuple(placements),), out, torch.Size([src[d] for d in perm]))


def expand_rule(src: Sequence[int], placements: Sequence[Placement], sizes: Sequence[int]) -> RuleResult:
    """``x.expand(sizes)``: new leading dims, size-1 dims broadcast; a sharded broadcast dim is
    gathered first (its one row lives on one rank)."""
    new = len(sizes) - len(src)
    if new < 0:
        raise ValueError(f"expand: {len(sizes)} sizes {list(sizes)} for a tensor of {len(src)} dims")
    out_shape = []
    for j, n in enumerate(sizes):
        if j < new:
            if n < 0:
                raise ValueError(f"expand: size -1 is not allowed in a new leading dim ({list(sizes)})")
            out_shape.append(n)
            continue
        s = src[j - new]
        if n == -1:
            n = s
        if s != 1 and n != s:
            raise ValueError(f"expand: the expanded size {n} must match the existing size {s} at dim {j}")
        out_shape.append(n)
    in_pl: list[Placement] = list(placements)
    out_pl: list[Placement] = list(placements)
    for m, p in enumerate(placements):
        if type(p) is Shard:
            if src[p.dim] == out_shape[p.dim + new]:
                out_pl[m] = Shard(p.dim + new)
            else:
                in_pl[m] = out_pl[m] = REPLICATE
    return RuleResult((tuple(in_pl),), tuple(out_pl), torch.Size(out_shape))


def normalize_index(index: Any, ndim: int) -> tuple:
    """A basic index (ints, slices, None, one Ellipsis) as a tuple without the Ellipsis; anything
    else (tensors, lists, bools: advanced indexing, data-dependent on a clipped rank) raises."""
    items = index if isinstance(index, tuple) else (index,)
    for it in items:
        if not (it is None or it is Ellipsis or isinstance(it, slice) or (type(it) is int)):
            raise NotImplementedError(
                f"DistTensor indexing with {type(it).__name__} {it!r}: only ints, slices, None and "
                f"Ellipsis (basic indexing) have an SPMD rule; advanced indexing depends on the data, which "
                f"a rank outside the mesh cannot infer; convert with full_tensor() first"
            )
    if sum(it is Ellipsis for it in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(1 for it in items if it is not None and it is not Ellipsis)
    if used > ndim:
        raise IndexError(f"too many indices for a DistTensor of dimension {ndim}")
    out = []
    for it in items:
        if it is Ellipsis:
            out.extend([slice(None)] * (ndim - used))
        else:
            out.append(it)
    if Ellipsis not in items:
        out.extend([slice(None)] * (ndim - used))
    return tuple(out)


def getitem_rule(src: Sequence[int], placements: Sequence[Placement], index: tuple) -> RuleResult:
    """``x[index]`` for a normalized basic ``index``: a sharded dim stays sharded only under a
    full slice (every rank keeps its whole piece); an int or a partial slice of it gathers first."""
    out_dim_of: dict[int, int] = {}
    d = j = 0
    for it in index:
        if it is None:
            j += 1
            continue
        if isinstance(it, slice):
            out_dim_of[d] = j
            j += 1
        d += 1
    out_shape = torch.empty(tuple(src), device="meta")[index].shape
    in_pl: list[Placement] = list(placements)
    out_pl: list[Placement] = list(placements)
    for m, p in enumerate(placements):
        if type(p) is not Shard:
            continue
        o = out_dim_of.get(p.dim)
        it = _item_for_dim(index, p.dim)
        if o is not None and _is_full(it, src[p.dim]):
            out_pl[m] = Shard(o)
        else:
            in_pl[m] = out_pl[m] = REPLICATE
    return RuleResult((tuple(in_pl),), tuple(out_pl), out_shape)


def _item_for_dim(index: tuple, dim: int) -> Any:
    d = 0
    for it in index:
        if it is None:
            continue
        if d == dim:
            return it
        d += 1
    return slice(None)


def _is_full(it: Any, size: int) -> bool:
    if not isinstance(it, slice):
        return False
    start, stop, step = it.start, it.stop, it.step
    return start in (None, 0) and (stop is None or stop >= size) and step in (None, 1)


def cat_rule(shapes: Sequence[Sequence[int]], placements: Sequence[Sequence[Placement]], dim: int) -> RuleResult:
    """``torch.cat(xs, dim)``: the other dims follow one sharding (the first input's, as an
    elementwise sum would); the cat dim is never sharded; Partial survives only if every input is
    Partial of the same sum/avg type (``cat`` adds nothing but mixes the inputs like ``+``)."""
    ndim = len(shapes[0])
    if any(len(s) != ndim for s in shapes):
        raise ValueError(f"cat: inputs must have the same number of dims, got shapes {[list(s) for s in shapes]}")
    letters = "abcdefghijklmnopqrstuvwxyz"[:ndim]
    labels = [letters[:dim] + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[i] + letters[dim + 1 :] for i in range(len(shapes))]
    for i, s in enumerate(shapes):
        for d in range(ndim):
            if d != dim and s[d] != shapes[0][d]:
                raise ValueError(
                    f"cat: sizes must match except in dim {dim}: input {i} has shape {list(s)}, "
                    f"input 0 {list(shapes[0])}"
                )
    out_labels = letters[:dim] + letters[dim + 1 :]
    cat_labels = frozenset(lab[dim] for lab in labels)
    res = einsum_rule(labels, out_labels, shapes, placements, "add", forbidden=cat_labels)
    out_pl = tuple(Shard(p.dim + (p.dim >= dim)) if type(p) is Shard else p for p in res.out_placements)
    out_shape = list(shapes[0])
    out_shape[dim] = sum(s[dim] for s in shapes)
    return RuleResult(res.in_placements, out_pl, torch.Size(out_shape))
