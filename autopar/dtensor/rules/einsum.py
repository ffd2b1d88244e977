"""The generic SPMD rule in einsum notation, and the per-op label builders that use it.

Every supported op is described by einsum labels (one letter per tensor axis) and a *kind*:

* ``linear``: the output is multilinear in the inputs (matmul, linear, sum, mean, scaling). A
  sharded contracted label (in an input, not in the output) makes the output ``Partial`` on that
  mesh dim, and one ``Partial`` input may stay Partial (the output is then Partial too).
* ``add``: a sum of inputs (``+``, ``-``): Partial inputs stay Partial only if all are Partial of
  the same sum/avg type.
* ``linear_first``: linear in the first input only (backward helpers such as gelu's vjp).
* ``nonlinear``: gelu, relu, softmax, layer_norm, division by a tensor: no Partial input survives.

Per mesh dim the rule picks the sharded label: the first input in ``priority`` order (default:
argument order; matmul and linear put the weight first, so an activation sharded on the same mesh
dim is gathered, as in Megatron's sequence-parallel column layer) that shards an allowed label on
it wins, and every input holding that label is resharded to Shard along it,
others to Replicate. The same label sharded on two different mesh dims (by different inputs) is a
conflict and an error naming the axis and both mesh dims. Labels in ``forbidden`` (the softmax or
normalization axis, broadcast size-1 axes) are never sharded.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ..placements import PARTIAL_SUM, REPLICATE, Partial, Placement, Shard

_LETTERS = string.ascii_lowercase
_UNIQUE = string.ascii_uppercase


class RuleResult(NamedTuple):
    """Placements each input must be resharded to, and the output's placements and global shape."""

    in_placements: tuple[tuple[Placement, ...], ...]
    out_placements: tuple[Placement, ...]
    out_shape: torch.Size


KINDS = ("linear", "add", "linear_first", "nonlinear")


def einsum_rule(
    in_labels: Sequence[str],
    out_labels: str,
    shapes: Sequence[Sequence[int]],
    placements: Sequence[Sequence[Placement]],
    kind: str,
    *,
    forbidden: frozenset = frozenset(),
    priority: Sequence[int] | None = None,
) -> RuleResult:
    if kind not in KINDS:
        raise ValueError(f"einsum_rule(kind): {kind!r} not in {KINDS}")
    sizes = _label_sizes(in_labels, shapes)

    def allowed(lab: str) -> bool:
        return lab not in forbidden and (kind == "linear" or lab in out_labels)

    _check_conflicts(in_labels, out_labels, placements, allowed)
    mesh_ndim = len(placements[0])
    n_in = len(in_labels)
    req: list[list[Placement]] = [[REPLICATE] * mesh_ndim for _ in range(n_in)]
    out: list[Placement] = [REPLICATE] * mesh_ndim
    order = range(n_in) if priority is None else priority
    for m in range(mesh_ndim):
        column = [placements[i][m] for i in range(n_in)]
        chosen = _chosen_label(in_labels, column, order, allowed)
        if chosen is not None:
            for i in range(n_in):
                if chosen in in_labels[i]:
                    req[i][m] = Shard(in_labels[i].index(chosen))
            out[m] = Shard(out_labels.index(chosen)) if chosen in out_labels else PARTIAL_SUM
            continue
        keep = _kept_partials(column, kind)
        for i in keep:
            req[i][m] = column[i]
        if keep:
            out[m] = column[keep[0]]
    return RuleResult(tuple(tuple(r) for r in req), tuple(out), torch.Size([sizes[lab] for lab in out_labels]))


def _label_sizes(in_labels: Sequence[str], shapes: Sequence[Sequence[int]]) -> dict[str, int]:
    """The size of each label; a label with two sizes (or a shape with another count of labels) raises."""
    sizes: dict[str, int] = {}
    for i, (labels, shape) in enumerate(zip(in_labels, shapes, strict=False)):
        if len(labels) != len(shape):
            raise ValueError(f"input {i}: {len(labels)} labels {labels!r} for shape {list(shape)}")
        for axis, (lab, n) in enumerate(zip(labels, shape, strict=False)):
            if sizes.setdefault(lab, n) != n:
                raise ValueError(
                    f"size mismatch on axis {lab!r}: input {i} dim {axis} has {n}, "
                    f"another input has {sizes[lab]} (shapes {[list(s) for s in shapes]})"
                )
    return sizes


def _check_conflicts(
    in_labels: Sequence[str],
    out_labels: str,
    placements: Sequence[Sequence[Placement]],
    allowed: Callable[[str], bool],
) -> None:
    """Refuse one label sharded on two mesh dims (by different inputs)."""
    owner: dict[str, tuple[int, int, int]] = {}
    for i, pl in enumerate(placements):
        for m, p in enumerate(pl):
            if type(p) is not Shard:
                continue
            lab = in_labels[i][p.dim]
            if not allowed(lab):
                continue
            prev = owner.setdefault(lab, (m, i, p.dim))
            if prev[0] != m:
                raise ValueError(
                    f"conflicting shardings of one tensor axis: input {prev[1]} dim {prev[2]} is "
                    f"sharded on mesh dim {prev[0]} but input {i} dim {p.dim} (the same axis "
                    f"{lab!r} of '{','.join(in_labels)}->{out_labels}') is sharded on mesh dim {m}"
                )


def _chosen_label(
    in_labels: Sequence[str], column: Sequence[Placement], order: Sequence[int], allowed: Callable[[str], bool]
) -> str | None:
    """The label one mesh dim shards: that of the first input in ``order`` sharding an allowed label on it
    (``column``: each input's placement on that mesh dim)."""
    for i in order:
        p = column[i]
        if type(p) is Shard and allowed(in_labels[i][p.dim]):
            return in_labels[i][p.dim]
    return None


def _kept_partials(column: Sequence[Placement], kind: str) -> list[int]:
    """The inputs whose Partial placement on a mesh dim no label shards stays Partial (the output is then
    Partial as theirs); the others are reduced."""
    partial = [i for i, p in enumerate(column) if type(p) is Partial]
    if not partial or column[partial[0]].reduce_op not in ("sum", "avg"):
        return []
    rt = column[partial[0]].reduce_op
    if kind == "linear":
        return partial[:1]
    if kind == "add" and len(partial) == len(column) and all(column[i].reduce_op == rt for i in partial):
        return partial
    if kind == "linear_first" and partial[0] == 0:
        return [0]
    return []


# -- label builders -----------------------------------------------------------------------------


def broadcast_labels(shapes: Sequence[Sequence[int]]) -> tuple[list[str], str, frozenset]:
    """Elementwise broadcasting as einsum labels; size-1 broadcast axes get unique labels."""
    ndim = max(len(s) for s in shapes)
    out_sizes = [1] * ndim
    for s in shapes:
        for j, n in enumerate(s):
            pos = ndim - len(s) + j
            if n != 1:
                if out_sizes[pos] not in (1, n):
                    raise ValueError(
                        f"shapes {[list(x) for x in shapes]} do not broadcast (dim {pos}: {out_sizes[pos]} vs {n})"
                    )
                out_sizes[pos] = n
    out = _LETTERS[:ndim]
    labels, forbidden, u = [], set(), 0
    for s in shapes:
        lab = []
        for j, n in enumerate(s):
            pos = ndim - len(s) + j
            if n == 1 and out_sizes[pos] != 1:
                lab.append(_UNIQUE[u])
                forbidden.add(_UNIQUE[u])
                u += 1
            else:
                lab.append(out[pos])
        labels.append("".join(lab))
    return labels, out, frozenset(forbidden)


def matmul_labels(shape_a: Sequence[int], shape_b: Sequence[int]) -> tuple[list[str], str, frozenset]:
    """``torch.matmul`` semantics (1-D operands, batch broadcasting) as einsum labels."""
    if len(shape_a) == 0 or len(shape_b) == 0:
        raise ValueError("matmul: both operands must have at least 1 dim")
    # Core labels: a is [..., m, k] (or [k]), b is [..., k, n] (or [k]).
    a_core = "mk" if len(shape_a) >= 2 else "k"
    b_core = "kn" if len(shape_b) >= 2 else "k"
    batch_a, batch_b = list(shape_a[:-2]), list(shape_b[:-2])
    if batch_a or batch_b:
        (bl_a, bl_b), bout, forbidden = broadcast_labels([batch_a, batch_b])
    else:
        bl_a = bl_b = bout = ""
        forbidden = frozenset()
    out = bout + ("m" if len(shape_a) >= 2 else "") + ("n" if len(shape_b) >= 2 else "")
    return [bl_a + a_core, bl_b + b_core], out, forbidden


def reduction_labels(ndim: int, dims: Sequence[int]) -> tuple[str, str]:
    lab = _LETTERS[:ndim]
    return lab, "".join(c for i, c in enumerate(lab) if i not in dims)
