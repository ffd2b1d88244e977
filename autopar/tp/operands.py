"""Operand formats of the linear Functions: what a GEMM's operands are and which op multiplies them.

The four Functions of :mod:`autopar.tp.functions` are written once against :class:`Operands`; the format
is part of their options (``LinearOptions.operands``). :class:`PlainOperands` passes tensors through to
torch's GEMM and the bf16 ``kernels`` ops; :class:`autopar.tp.fp8.Fp8Operands` quantizes them (DeepSeek-V3
scaling) and runs the FP8 ops. An operand is whatever the format's GEMMs take: a tensor (plain) or FP8
bytes with their scales (FP8).

Every ``a`` below is ``[..., k]`` with any leading dims (the rows), every ``w`` the ``[n, k]`` weight
operand; the results keep ``a``'s leading dims.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

import kernels
from kernels import checks

from .comm import Group, rows
from .wgrad import autocast_operands

Operand = Any  # torch.Tensor (plain) or (fp8 bytes, fp32 scales)


class CommCall(NamedTuple):
    """A communicating GEMM's call besides its operands (as kernels' ``GemmCall``): the group (None: one
    process, the local GEMM), the dtype the result is rounded to, and the dim its collective gathers or
    scatters along (an all-reduce has none)."""

    group: Group
    out_dtype: torch.dtype
    dim: int = 0


class Operands(Protocol):
    """The GEMMs, collectives and conversions the linear Functions need from an operand format."""

    #: The dgrad GEMM and its collective always run as one ``kernels`` op (no separate async collective).
    fused_dgrad: bool
    #: Column with sequence parallelism: the backward gathers the input shard again (else the forward keeps it).
    recompute_all_gather: bool

    def check(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        """``(x, weight, bias)`` as the format's ops take them; named errors for operands they refuse."""

    def input(self, x: torch.Tensor) -> Operand:
        """An activation as a GEMM operand."""

    def grad(self, g: torch.Tensor) -> Operand:
        """An output gradient as a GEMM operand."""

    def weight(self, w: torch.Tensor) -> Operand:
        """The ``[n, k]`` weight as the forward's weight operand."""

    def weight_t(self, w: torch.Tensor) -> Operand:
        """``w.T`` (``[k, n]``) as the dgrad's weight operand."""

    def dequant(self, a: Operand) -> torch.Tensor:
        """A gathered operand back as a float tensor (the wgrad reads it along the tokens)."""

    def wgrad_input(self, x: torch.Tensor) -> Operand:
        """``x [..., k]`` as the wgrad's token operand (what the backward keeps of an input)."""

    def pack(self, a: Operand | None) -> tuple:
        """An operand as tensors for ``ctx.save_for_backward`` (a fixed count per format, None included)."""

    def unpack(self, tensors: tuple) -> Operand | None:
        """The operand :meth:`pack` saved."""

    def linear(self, a: Operand, w: Operand, bias: torch.Tensor | None, *, out_dtype: torch.dtype) -> torch.Tensor:
        """``a @ w.T + bias``, local."""

    def linear_all_reduce(self, a: Operand, w: Operand, bias: torch.Tensor | None, call: CommCall) -> torch.Tensor:
        """``all_reduce(a @ w.T) + bias``."""

    def linear_reduce_scatter(self, a: Operand, w: Operand, bias: torch.Tensor | None, call: CommCall) -> torch.Tensor:
        """``reduce_scatter(a @ w.T, call.dim) + bias``."""

    def all_gather_linear(
        self, a: Operand, w: Operand, bias: torch.Tensor | None, call: CommCall, *, keep: bool
    ) -> tuple[torch.Tensor, Operand | None]:
        """``(all_gather(a, call.dim) @ w.T + bias, the gathered operand if keep else None)``."""

    def all_gather_linears(self, a: Operand, ws: list, bs: list, call: CommCall) -> tuple[list[torch.Tensor], Operand]:
        """``([all_gather(a, call.dim) @ w_i.T + b_i for each i], the gathered operand)`` from one gather."""

    def partial_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype partial sums are kept in before a separate reduction (the shared gather's dgrad)."""

    def wgrad_gemm(self, grad_y2d: torch.Tensor, x_tokens: Operand, dtype: torch.dtype) -> torch.Tensor:
        """``grad_y2d.T @ x`` (``[n, k]``, in the weight's ``dtype``), contracting over the tokens."""


def _dim_kw(name: str, dim: int) -> dict[str, int]:
    # Dim 0 is passed as the ops' default so that the common Megatron call stays the plain one.
    return {} if dim == 0 else {name: dim}


class PlainOperands:
    """The operands as they come (bf16, fp16, fp32): torch's GEMM and the bf16 ``kernels`` ops. Results are in
    the operands' dtype (``out_dtype`` is that dtype wherever the Functions pass it)."""

    def __init__(self, coc_in_backward: bool = False, recompute_all_gather: bool = True) -> None:
        self.fused_dgrad = coc_in_backward
        self.recompute_all_gather = recompute_all_gather

    def check(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        x, weight, bias = autocast_operands(x, weight, bias)
        # Named errors on every path, W = 1 and group=None included (where no kernels op would check).
        checks.check_matmul_operands(x, weight, bias)
        return x, weight, bias

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def grad(self, g: torch.Tensor) -> torch.Tensor:
        return g

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def weight_t(self, w: torch.Tensor) -> torch.Tensor:
        return w.t()

    def dequant(self, a: torch.Tensor) -> torch.Tensor:
        return a

    def wgrad_input(self, x: torch.Tensor) -> torch.Tensor:
        # Kept as it is: flattening a non-contiguous input here would keep a copy for the whole backward.
        return x

    def pack(self, a: torch.Tensor | None) -> tuple:
        return (a,)

    def unpack(self, tensors: tuple) -> torch.Tensor | None:
        return tensors[0]

    def linear(
        self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, *, out_dtype: torch.dtype
    ) -> torch.Tensor:
        return F.linear(a, w, bias)

    def linear_all_reduce(
        self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, call: CommCall
    ) -> torch.Tensor:
        a2d = rows(a)
        if call.group is None:
            y = F.linear(a2d, w, bias)
        else:
            y = kernels.matmul_all_reduce(a2d, w, bias, group=call.group)
        return y.view(*a.shape[:-1], w.shape[0])

    def linear_reduce_scatter(
        self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, call: CommCall
    ) -> torch.Tensor:
        if call.group is None:
            return F.linear(a, w, bias)
        return kernels.matmul_reduce_scatter(a, w, bias, group=call.group, **_dim_kw("scatter_dim", call.dim))

    def all_gather_linear(
        self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, call: CommCall, *, keep: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if call.group is None:
            return F.linear(a, w, bias), (a if keep else None)
        out = kernels.all_gather_matmul(
            a, w, bias, group=call.group, return_gathered=keep, **_dim_kw("gather_dim", call.dim)
        )
        return out if keep else (out, None)

    def all_gather_linears(
        self, a: torch.Tensor, ws: list, bs: list, call: CommCall
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        if call.group is None:
            return [F.linear(a, w, b) for w, b in zip(ws, bs, strict=True)], a
        return kernels.all_gather_matmul(
            a, ws, bs, group=call.group, return_gathered=True, **_dim_kw("gather_dim", call.dim)
        )

    def partial_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def wgrad_gemm(self, grad_y2d: torch.Tensor, x_tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return grad_y2d.t().matmul(rows(x_tokens))


__all__ = ["CommCall", "Operand", "Operands", "PlainOperands"]
