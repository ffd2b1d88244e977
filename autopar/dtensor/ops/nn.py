"""Neural-network ops: ``F.embedding`` (vocab-parallel included), ``F.scaled_dot_product_attention``,
``F.cross_entropy``, ``F.dropout`` (identity when off). Rules in :mod:`autopar.dtensor.rules.nn`;
the local vjps come from the op's local graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..placements import REPLICATE, Shard, chunk_bounds
from ..rules import RuleResult
from ..rules.nn import cross_entropy_rule, embedding_rule, sdpa_rule
from ..tensor import HANDLERS, DistTensor
from .dispatch import Op, apply, as_dist, mesh_of, rule_entry


def embedding(
    input,
    weight,
    *,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> DistTensor:
    """``F.embedding``; with a Shard(0) (vocab-parallel) weight each rank looks up the ids in its
    rows, writes zeros for the others and the output is Partial(sum), as Megatron's
    VocabParallelEmbedding before its all-reduce. ``F.embedding`` hands its options to a
    ``__torch_function__`` handler as keywords."""
    if max_norm is not None or sparse:
        raise NotImplementedError(
            f"F.embedding on DistTensors with max_norm={max_norm} / sparse={sparse}: "
            f"renormalizing rows in place and sparse gradients have no SPMD rule"
        )
    mesh = mesh_of(input, weight)
    ids, w = as_dist(input, mesh), as_dist(weight, mesh)
    if ids._dtype.is_floating_point or ids._dtype.is_complex:
        raise TypeError(f"F.embedding(input): expected integer ids, got {ids._dtype}")
    if w.ndim != 2:
        raise ValueError(f"F.embedding(weight): expected a 2-D weight, got shape {list(w._shape)}")
    vocab = w._shape[0]
    if padding_idx is not None and padding_idx < 0:
        padding_idx += vocab
    key = ("embedding", ids._lid, w._lid, padding_idx, scale_grad_by_freq)

    def rule(i: DistTensor, t: DistTensor) -> RuleResult:
        return embedding_rule(i._shape, i._placements, t._shape, t._placements)

    res = rule_entry(key, rule, [ids, w])[0]
    if scale_grad_by_freq and any(type(p) is Shard for p in res.in_placements[0]):
        raise NotImplementedError(
            "F.embedding(scale_grad_by_freq=True) with sharded ids: the counts would be per rank, not global"
        )
    vocab_dims = [m for m, p in enumerate(res.in_placements[1]) if p == Shard(0)]

    def local_fn(ids_piece: torch.Tensor, w_piece: torch.Tensor) -> torch.Tensor:
        if not vocab_dims:
            return F.embedding(ids_piece, w_piece, padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        m = vocab_dims[0]
        start, end = chunk_bounds(vocab, mesh.shape[m], mesh.my_coordinate[m])
        rows = end - start
        if rows == 0:
            return w_piece.new_zeros(tuple(ids_piece.shape) + (w_piece.shape[1],))
        local = ids_piece - start
        outside = (local < 0) | (local >= rows)
        pad = padding_idx - start if padding_idx is not None and start <= padding_idx < end else None
        out = F.embedding(local.masked_fill(outside, 0), w_piece, pad, scale_grad_by_freq=scale_grad_by_freq)
        return out.masked_fill(outside.unsqueeze(-1), 0)

    return apply(key, Op(rule, local_fn), [ids, w], out_dtype=w._dtype)


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> DistTensor:
    """``F.scaled_dot_product_attention`` sharded over batch or heads (never over the sequence).

    torch's own signature: a builtin hands its ``__torch_function__`` handler the arguments as the
    caller wrote them, and ``attn_mask``, ``dropout_p``, ``is_causal`` may come positionally."""
    if dropout_p:
        raise NotImplementedError(
            f"scaled_dot_product_attention(dropout_p={dropout_p}) on DistTensors: ranks would draw different "
            f"dropout masks for replicated values; use dropout_p=0"
        )
    mesh = mesh_of(query, key, value, attn_mask)
    ins = [as_dist(t, mesh) for t in (query, key, value)]
    if attn_mask is not None:
        ins.append(as_dist(attn_mask, mesh))
    if ins[0].ndim < 2:
        raise ValueError(f"scaled_dot_product_attention(query): expected >= 2 dims, got {list(ins[0]._shape)}")
    op_key = ("sdpa", is_causal, scale, enable_gqa, mesh.shape) + tuple(t._lid for t in ins)
    gqa = {"enable_gqa": True} if enable_gqa else {}

    def rule(*ts: DistTensor) -> RuleResult:
        return sdpa_rule([t._shape for t in ts], [t._placements for t in ts], mesh.shape)

    def local_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[0] if mask else None, is_causal=is_causal, scale=scale, **gqa
        )

    return apply(op_key, Op(rule, local_fn), ins, out_dtype=ins[0]._dtype)


def cross_entropy(
    input,
    target,
    weight=None,
    *,
    size_average=None,
    ignore_index: int = -100,
    reduce=None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> DistTensor:
    """``F.cross_entropy``: never sharded over classes; over the batch for ``none`` / ``sum``.
    ``F.cross_entropy`` hands its options to a ``__torch_function__`` handler as keywords."""
    if size_average is not None or reduce is not None:
        raise NotImplementedError("F.cross_entropy on DistTensors: use reduction= instead of size_average/reduce")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"F.cross_entropy(reduction): expected 'none', 'sum' or 'mean', got {reduction!r}")
    mesh = mesh_of(input, target, weight)
    ins = [as_dist(input, mesh), as_dist(target, mesh)]
    if weight is not None:
        ins.append(as_dist(weight, mesh))
    key = ("cross_entropy", ignore_index, reduction, label_smoothing) + tuple(t._lid for t in ins)

    def rule(x: DistTensor, t: DistTensor, *w: DistTensor) -> RuleResult:
        res = cross_entropy_rule(x._shape, x._placements, t._shape, t._placements, reduction)
        extra = ((REPLICATE,) * mesh.ndim,) if w else ()
        return RuleResult(res.in_placements + extra, res.out_placements, res.out_shape)

    def local_fn(x: torch.Tensor, t: torch.Tensor, *w: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            x,
            t,
            w[0] if w else None,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
        )

    return apply(key, Op(rule, local_fn), ins, out_dtype=ins[0]._dtype)


def dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False) -> DistTensor:
    """The identity when off (``training=False`` or ``p=0``, as in evaluation and in models
    configured without dropout); random masks have no rule (replicated values would get different
    masks on different ranks)."""
    if not training or p == 0:
        return input
    raise NotImplementedError(
        f"F.dropout(p={p}, training=True) on a DistTensor: ranks would draw different masks for "
        f"replicated values; set p=0 or evaluate with training=False"
    )


def install() -> None:
    HANDLERS.update(
        {
            F.embedding: embedding,
            F.scaled_dot_product_attention: scaled_dot_product_attention,
            F.cross_entropy: cross_entropy,
            F.dropout: dropout,
        }
    )
