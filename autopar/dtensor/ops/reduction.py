"""Reductions: ``sum`` and ``mean`` over all dims or some (``keepdim`` too). Linear: a sharded
reduced dim makes the result Partial."""

from __future__ import annotations

import torch

from ..placements import Shard
from ..rules import RuleResult, einsum_rule, reduction_labels
from ..tensor import HANDLERS, DistTensor
from .dispatch import Op, apply


def _reduce(op: str, x: DistTensor, dim, keepdim: bool, dtype: torch.dtype | None = None) -> DistTensor:
    if dim is None:
        dims = tuple(range(x.ndim))
    else:
        dims = tuple(sorted(d % x.ndim for d in ((dim,) if isinstance(dim, int) else dim)))
    key = (op, x._lid, dims, keepdim)

    def rule(*_: DistTensor) -> RuleResult:
        lab, out = reduction_labels(x.ndim, dims)
        res = einsum_rule([lab], out, [x._shape], [x._placements], "linear")
        if not keepdim:
            return res
        shape = [1 if i in dims else n for i, n in enumerate(x._shape)]
        kept = [i for i in range(x.ndim) if i not in dims]
        pl = tuple(Shard(kept[p.dim]) if type(p) is Shard else p for p in res.out_placements)
        return RuleResult(res.in_placements, pl, torch.Size(shape))

    # mean over a sharded dim: each rank sums its piece and divides by the *global* count, so the
    # Partial(sum) of the pieces is the global mean.
    count = 1
    if op == "mean":
        for d in dims:
            count *= x._shape[d]

    def local_fn(t):
        s = t.sum(dim=dims, keepdim=keepdim, dtype=dtype)
        return s if count == 1 else s / count

    def vjp(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
        t = saved[0]
        if not keepdim:
            for d in dims:
                g = g.unsqueeze(d)
        g = g.expand(t.shape)
        return [(g if count == 1 else g / count).to(t.dtype)]

    return apply(key, Op(rule, local_fn, vjp), [x], out_dtype=dtype)


def _sum(x, dim=None, keepdim=False, dtype=None, **kw):
    return _reduce("sum", x, dim, keepdim, dtype)


def _mean(x, dim=None, keepdim=False, dtype=None, **kw):
    return _reduce("mean", x, dim, keepdim, dtype)


def install() -> None:
    HANDLERS.update({torch.sum: _sum, torch.Tensor.sum: _sum, torch.mean: _mean, torch.Tensor.mean: _mean})
