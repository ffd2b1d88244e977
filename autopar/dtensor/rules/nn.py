"""SPMD rules of the neural-network ops that are not einsums: embedding, scaled dot-product
attention, cross entropy. Like the shape rules they may need the mesh sizes (``mesh_shape``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..placements import PARTIAL_SUM, REPLICATE, Placement, Shard
from .einsum import RuleResult


def embedding_rule(
    ids_shape: Sequence[int], ids_pl: Sequence[Placement], w_shape: Sequence[int], w_pl: Sequence[Placement]
) -> RuleResult:
    """``F.embedding(ids, weight)``, weight ``[V, D]``, output ``ids.shape + [D]``. Per mesh dim:

    * weight Shard(1): the output is Shard on its last dim (ids gathered there);
    * weight Shard(0) (vocab parallel): each rank looks up the ids in its rows and writes zeros for
      the others, so the output is Partial(sum) (ids gathered there);
    * else ids Shard(d): the output is Shard(d) (weight gathered there);
    * a Partial weight is linear in the output: Partial out when the ids are not sharded there.
    """
    n = len(ids_shape)
    in_ids: list[Placement] = []
    in_w: list[Placement] = []
    out: list[Placement] = []
    for pi, pw in zip(ids_pl, w_pl, strict=True):
        if type(pw) is Shard:
            in_ids.append(REPLICATE)
            in_w.append(pw)
            out.append(Shard(n) if pw.dim == 1 else PARTIAL_SUM)
        elif type(pi) is Shard:
            in_ids.append(pi)
            in_w.append(REPLICATE)
            out.append(pi)
        else:
            in_ids.append(REPLICATE)
            in_w.append(pw)
            out.append(pw)
    return RuleResult((tuple(in_ids), tuple(in_w)), tuple(out), torch.Size(list(ids_shape) + [w_shape[1]]))


def sdpa_rule(
    shapes: Sequence[Sequence[int]],
    placements: Sequence[Sequence[Placement]],
    mesh_shape: Sequence[int],
) -> RuleResult:
    """``F.scaled_dot_product_attention(q, k, v[, attn_mask])``: q ``[..., Hq, L, E]``, k
    ``[..., Hk, S, E]``, v ``[..., Hk, S, Ev]``, mask broadcastable to ``[..., Hq, L, S]``; output
    ``[..., Hq, L, Ev]``.

    Per mesh dim, the first of q, k, v sharded on a leading (batch or head) dim decides: all three
    and the output are sharded on it, and the mask where it has that dim at full size. With
    grouped-query heads (``Hq != Hk``) the head dim is sharded only if both head counts divide
    by the mesh size, so each rank keeps whole groups. The sequence and feature dims are never
    sharded (softmax over S, contraction over E); anything else and Partial are gathered.
    """
    q, k, v = shapes[:3]
    mask = shapes[3] if len(shapes) > 3 else None
    nd = len(q)
    lead = nd - 2
    req: list[list[Placement]] = [[REPLICATE] * len(mesh_shape) for _ in shapes]
    out: list[Placement] = [REPLICATE] * len(mesh_shape)
    for m, W in enumerate(mesh_shape):
        dim = None
        for pl in placements[:3]:
            p = pl[m]
            if type(p) is Shard and p.dim < lead and _shardable(q, k, v, p.dim, W):
                dim = p.dim
                break
        if dim is None:
            continue
        for i in range(3):
            req[i][m] = Shard(dim)
        out[m] = Shard(dim)
        if mask is not None:
            md = dim - (nd - len(mask))
            if md >= 0 and mask[md] != 1:
                req[3][m] = Shard(md)
    return RuleResult(tuple(tuple(r) for r in req), tuple(out), torch.Size(list(q[:-1]) + [v[-1]]))


def _shardable(q: Sequence[int], k: Sequence[int], v: Sequence[int], dim: int, W: int) -> bool:
    if q[dim] == k[dim] == v[dim]:
        return True
    return k[dim] == v[dim] and q[dim] % W == 0 and k[dim] % W == 0


def cross_entropy_rule(
    in_shape: Sequence[int],
    in_pl: Sequence[Placement],
    target_shape: Sequence[int],
    target_pl: Sequence[Placement],
    reduction: str,
) -> RuleResult:
    """``F.cross_entropy(input [N, C, ...], target)``: the class dim is never sharded (log-softmax
    over it) and nothing Partial survives. The batch dim stays sharded for ``reduction="none"``
    (output Shard(0)) and ``"sum"`` (output Partial(sum)); ``"mean"`` divides by a global count
    (of the targets that are not ``ignore_index``), so it gathers the batch first."""
    batched = len(in_shape) >= 2
    in_req: list[Placement] = []
    t_req: list[Placement] = []
    out: list[Placement] = []
    for m, p in enumerate(in_pl):
        q = target_pl[m]
        batch_shard = batched and reduction != "mean" and (p == Shard(0) or (type(p) is not Shard and q == Shard(0)))
        if batch_shard and len(target_shape) >= 1:
            in_req.append(Shard(0))
            t_req.append(Shard(0))
            out.append(Shard(0) if reduction == "none" else PARTIAL_SUM)
        else:
            in_req.append(REPLICATE)
            t_req.append(REPLICATE)
            out.append(REPLICATE)
    if reduction == "none":
        shape = [in_shape[0]] + list(in_shape[2:]) if batched else []
    else:
        shape = []
    return RuleResult((tuple(in_req), tuple(t_req)), tuple(out), torch.Size(shape))
