"""Normalizations: ``softmax`` and ``F.layer_norm``, never sharded along the normalized dims."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rules import RuleResult, einsum_rule
from ..tensor import HANDLERS, DistTensor
from .dispatch import Op, apply, as_dist, mesh_of
from .elementwise import nonlinear_rule


def softmax(x: DistTensor, dim: int, _stacklevel: int = 3, dtype=None) -> DistTensor:
    d = dim % x.ndim
    key = ("softmax", x._lid, d)
    op = Op(lambda t: nonlinear_rule(t, [d]), lambda t: torch.softmax(t, d, dtype=dtype))
    return apply(key, op, [x], out_dtype=dtype)


def _torch_softmax(x: DistTensor, dim: int, dtype=None) -> DistTensor:
    """``torch.softmax(x, dim, dtype)`` / ``Tensor.softmax``: dtype is the third positional."""
    return softmax(x, dim, dtype=dtype)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> DistTensor:
    mesh = mesh_of(x)
    x = as_dist(x, mesh)
    normalized_shape = tuple(normalized_shape)
    k = len(normalized_shape)
    if tuple(x._shape[x.ndim - k :]) != normalized_shape:
        raise ValueError(
            f"layer_norm: normalized_shape {list(normalized_shape)} is not the trailing shape of x {list(x._shape)}"
        )
    ops = [x] + [as_dist(t, mesh) for t in (weight, bias) if t is not None]
    has_w, has_b = weight is not None, bias is not None
    key = ("layer_norm", normalized_shape, has_w, has_b, eps) + tuple(t._lid for t in ops)

    def rule(*_: DistTensor) -> RuleResult:
        lab = "abcdefghijklmnop"[: x.ndim]
        norm = lab[x.ndim - k :]
        return einsum_rule(
            [lab] + [norm] * (len(ops) - 1),
            lab,
            [t._shape for t in ops],
            [t._placements for t in ops],
            "nonlinear",
            forbidden=frozenset(norm),
        )

    def local_fn(xl, *wb):
        w = wb[0] if has_w else None
        b = wb[-1] if has_b else None
        return F.layer_norm(xl, normalized_shape, w, b, eps)

    return apply(key, Op(rule, local_fn), ops)


def install() -> None:
    HANDLERS.update(
        {
            torch.softmax: _torch_softmax,
            F.softmax: softmax,
            torch.Tensor.softmax: _torch_softmax,
            F.layer_norm: layer_norm,
        }
    )
