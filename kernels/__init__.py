"""Fused and overlapped communication-computation operators (docs/api.md section 1).

Each op takes ``x`` with any number of leading dims (communication is along dim 0, or the
``gather_dim`` / ``scatter_dim`` given) and ``weight`` in ``torch.nn.functional.linear`` layout
``[n, k]`` (``all_gather_matmul`` also takes a list of weights: one gather, one output each), and
returns a tensor with the leading dims restored. ``backend=None`` resolves from the COC_* environment
(``kernels.config``); every backend gives the result of ``"sequential"`` within floating-point
tolerance. The ops are forward-only building blocks: the autopar linears wrap them in autograd
Functions.

Each function validates, chooses the backend (``kernels.dispatch``) and makes one call to a
registered torch operator (``torch.ops.coc.*``, ``kernels.library``), so the ops trace whole
under ``torch.compile(fullgraph=True)``: one opaque call per op in the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import agree, callcheck, checks, dispatch, inductor_pass, library, name_clash, quant
from .config import CocConfig, get_config
from .fp8 import (
    all_gather_scaled_matmul,
    dequantize_fp8,
    quantize_fp8,
    scaled_matmul,
    scaled_matmul_all_reduce,
    scaled_matmul_reduce_scatter,
)
from .inductor_pass import disable_inductor_pass, enable_inductor_pass, use_inductor_pass
from .quant import quantize_weight

# Before anything runs: another installed 'kernels' distribution would have mixed its files with ours.
name_clash.check(__path__[0])
# COC_INDUCTOR_PASS=1: compiled tensor-parallel models get the coc ops with no code change (docs/inductor.md).
inductor_pass.enable_from_environment()

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "get_config",
    "CocConfig",
    "quantize_weight",
    "quantized_matmul_all_reduce",
    "check_errors",
    "enable_inductor_pass",
    "disable_inductor_pass",
    "use_inductor_pass",
    "quantize_fp8",
    "dequantize_fp8",
    "all_gather_scaled_matmul",
    "scaled_matmul_reduce_scatter",
    "scaled_matmul_all_reduce",
    "scaled_matmul",
]


def _describe(
    op: str, x2d: torch.Tensor, n: int, quant: tuple[str, int] | None = None, **fields: Any
) -> agree.Descriptor:
    """The call's descriptor (``kernels.agree``) for 2-D ``x2d`` and a weight of ``n`` rows; ``quant`` the
    ``(mode, group_size)`` of a w8A16 weight."""
    mode, group_size = quant if quant is not None else (None, 0)
    return agree.describe_call(
        op,
        x2d.shape[0],
        x2d.shape[1],
        n,
        x2d.dtype,
        quant_mode=mode,
        group_size=group_size if mode == "per_group" else 0,
        **fields,
    )


def _device(x: object) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor | Sequence[torch.Tensor],
    bias: torch.Tensor | None | Sequence[torch.Tensor | None] = None,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    return_gathered: bool = False,
    gather_dim: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | list[torch.Tensor] | tuple[list[torch.Tensor], torch.Tensor]:
    """``y = all_gather(x, dim=gather_dim) @ weight.T + bias``.

    Reference::

        x_gathered = cat([x_of_rank_0, ..., x_of_rank_W-1], dim=gather_dim)
        y = x_gathered @ weight.T + bias
        return (y, x_gathered) if return_gathered else y

    ``gather_dim`` indexes ``x``'s dims (negative allowed; not the last, ``k``): ``x [s_local, b, k]``
    with 0 gives ``[s_local * W, b, n]``, ``x [b, s_local, k]`` with 1 (or -2) gives ``[b, s_local * W, n]``.

    Several weights, one gather: ``weight`` a list / tuple ``[w_0, w_1, ...]`` (each ``[n_i, k]``,
    ``n_i`` may differ) and ``bias`` None or a list of the same length holding tensors or None::

        ys = [x_gathered @ w_i.T + b_i for each i]
        return (ys, x_gathered) if return_gathered else ys          # ys is a list
    """
    if isinstance(weight, (list, tuple)):
        return _all_gather_matmul_multi(x, weight, bias, group, backend, parallel_num, return_gathered, gather_dim)
    op = "all_gather_matmul"
    world = checks.world_of(group)

    def validate() -> agree.Descriptor:
        checks.check_matmul_operands(x, weight, bias)
        checks.check_options(backend, parallel_num, "return_gathered", return_gathered)
        d = checks.normalize_dim("gather_dim", gather_dim, x)
        return _describe(
            op,
            x.flatten(0, -2),
            weight.shape[0],
            bias=bias is not None,
            flag=return_gathered,
            backend=backend,
            parallel_num=parallel_num,
            comm_dim=d,
            outer=library.blocks_before(x, d),
        )

    callcheck.admit(op, group, world, _device(x), validate, backend=backend)
    d = gather_dim % x.dim()
    name, num, group_name = dispatch.decide(op, backend, parallel_num, x.flatten(0, -2), weight, group, world)
    if return_gathered:
        return library.all_gather_matmul_gathered(x, weight, bias, group_name, world, name, num, d)
    return library.all_gather_matmul(x, weight, bias, group_name, world, name, num, d)


def _all_gather_matmul_multi(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: object,
    group: dist.ProcessGroup | None,
    backend: str | None,
    parallel_num: int | None,
    return_gathered: bool,
    gather_dim: int,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], torch.Tensor]:
    op = "all_gather_matmul"
    world = checks.world_of(group)

    def validate() -> agree.Descriptor:
        if len(weights) == 0:
            raise ValueError("weight: an empty list; pass one weight [n, k] or a non-empty list of them")
        if biases is not None and not isinstance(biases, (list, tuple)):
            raise TypeError(
                f"bias must be None or a list / tuple of tensors or None (one per weight) when weight is a list, "
                f"got {type(biases).__name__}"
            )
        if biases is not None and len(biases) != len(weights):
            raise ValueError(
                f"bias: {len(biases)} entries for {len(weights)} weights; pass one per weight (None allowed)"
            )
        for i, w in enumerate(weights):
            b = None if biases is None else biases[i]
            checks.check_matmul_operands(x, w, b, weight_name=f"weight[{i}]", bias_name=f"bias[{i}]")
        checks.check_options(backend, parallel_num, "return_gathered", return_gathered)
        d = checks.normalize_dim("gather_dim", gather_dim, x)
        return _describe(
            op,
            x.flatten(0, -2),
            sum(w.shape[0] for w in weights),
            bias=biases is not None and biases[0] is not None,
            flag=return_gathered,
            backend=backend,
            parallel_num=parallel_num,
            comm_dim=d,
            outer=library.blocks_before(x, d),
        )

    callcheck.admit(op, group, world, _device(x), validate, backend=backend)
    biases = list(biases) if biases is not None else [None] * len(weights)
    d = gather_dim % x.dim()
    name, num, group_name = dispatch.decide(
        op,
        backend,
        parallel_num,
        x.flatten(0, -2),
        weights[0],
        group,
        world,
        n=sum(w.shape[0] for w in weights),
    )
    ys, x_gathered = library.all_gather_matmul_multi(
        x, list(weights), biases, group_name, world, name, num, d, return_gathered
    )
    return (ys, x_gathered) if return_gathered else ys


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    deterministic: bool = False,
    scatter_dim: int = 0,
) -> torch.Tensor:
    """``y = reduce_scatter(x @ weight.T, dim=scatter_dim) + bias``; bias is added once, after the reduction.

    Reference::

        partial = x @ weight.T                                   # [..., n] on every rank
        y = chunk(sum(partial_of_rank_r for r in range(W)), W, dim=scatter_dim)[rank] + bias

    ``scatter_dim`` indexes ``x``'s dims (negative allowed; not the last, ``k``) and
    ``x.shape[scatter_dim]`` must divide by W: ``x [s, b, k]`` with 0 gives ``[s / W, b, n]``,
    ``x [b, s, k]`` with 1 (or -2) gives ``[b, s / W, n]``. ``deterministic=True`` sums the
    partials in rank order, so repeated calls give identical bits.
    """
    op = "matmul_reduce_scatter"
    world = checks.world_of(group)

    def validate() -> agree.Descriptor:
        checks.check_matmul_operands(x, weight, bias)
        checks.check_options(backend, parallel_num, "deterministic", deterministic)
        d = checks.normalize_dim("scatter_dim", scatter_dim, x)
        if x.shape[d] % world != 0:
            raise ValueError(
                f"matmul_reduce_scatter: scatter_dim={scatter_dim} splits x.shape[{d}] (m={x.shape[d]}, x shape "
                f"{tuple(x.shape)}), which is not divisible by the group size W={world}"
            )
        return _describe(
            op,
            x.flatten(0, -2),
            weight.shape[0],
            bias=bias is not None,
            flag=deterministic,
            backend=backend,
            parallel_num=parallel_num,
            comm_dim=d,
            outer=library.blocks_before(x, d),
        )

    callcheck.admit(op, group, world, _device(x), validate, backend=backend)
    name, num, group_name = dispatch.decide(op, backend, parallel_num, x.flatten(0, -2), weight, group, world)
    return library.matmul_reduce_scatter(
        x, weight, bias, group_name, world, name, num, deterministic, scatter_dim % x.dim()
    )


def matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """``y = all_reduce(x @ weight.T) + bias``.

    Reference::

        partial = x @ weight.T                                     # [m, n] on every rank
        y = sum(partial_of_rank_r for r in range(W)) + bias        # [m, n], same on all ranks

    ``deterministic=True`` sums the partials in rank order: repeated calls give identical bits and
    all ranks hold identical bits.
    """
    op = "matmul_all_reduce"
    world = checks.world_of(group)

    def validate() -> agree.Descriptor:
        checks.check_matmul_operands(x, weight, bias)
        checks.check_options(backend, parallel_num, "deterministic", deterministic)
        return _describe(
            op,
            x.flatten(0, -2),
            weight.shape[0],
            bias=bias is not None,
            flag=deterministic,
            backend=backend,
            parallel_num=parallel_num,
        )

    callcheck.admit(op, group, world, _device(x), validate, backend=backend)
    lead = x.shape[:-1]
    x2d = x.flatten(0, -2)
    name, num, group_name = dispatch.decide(op, backend, parallel_num, x2d, weight, group, world)
    out = library.matmul_all_reduce(x2d, weight, bias, group_name, world, name, num, deterministic)
    return out.view(tuple(lead) + (weight.shape[0],))


def quantized_matmul_all_reduce(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group_size: int | None = None,
    offset: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """w8A16 ``y = all_reduce(x @ dequant(qweight).T) + bias``.

    Reference::

        w = (qweight - offset) * scale         # per mode of scale's shape, fp32, rounded to x.dtype
        partial = x @ w.T                      # [m, n] on every rank
        y = sum(partial_of_rank_r for r in range(W)) + bias

    ``qweight`` int8 ``[n, k]`` and ``scale`` (``[]``, ``[n]`` or ``[n, G]``) as returned by
    :func:`quantize_weight`; ``x`` fp16 / bf16 (fp32 allowed on CPU). See ``kernels.quant`` for
    the group and offset conventions.
    """
    op = "quantized_matmul_all_reduce"
    world = checks.world_of(group)

    spec: quant.QuantSpec | None = None

    def validate() -> agree.Descriptor:
        nonlocal spec
        quant.check_activation(x)
        spec = quant.quant_spec(qweight, scale, group_size, offset)
        checks.check_matmul_operands(x, qweight, bias, weight_dtypes=(torch.int8,))
        checks.check_options(backend, parallel_num, "deterministic", deterministic)
        return _describe(
            op,
            x.flatten(0, -2),
            qweight.shape[0],
            bias=bias is not None,
            flag=deterministic,
            backend=backend,
            parallel_num=parallel_num,
            quant=(spec.mode, spec.group_size),
        )

    callcheck.admit(op, group, world, _device(x), validate, backend=backend)
    assert spec is not None
    lead = x.shape[:-1]
    x2d = x.flatten(0, -2)
    name, num, group_name = dispatch.decide(op, backend, parallel_num, x2d, qweight, group, world)
    out = library.quantized_matmul_all_reduce(
        x2d, qweight, scale, bias, offset, spec.mode, spec.group_size, group_name, world, name, num, deterministic
    )
    return out.view(tuple(lead) + (qweight.shape[0],))


def check_errors(group: dist.ProcessGroup | None = None) -> None:
    """Raise the ``RuntimeError`` of a fused call that failed and was not reported yet.

    A fused call queues its kernels and returns without waiting for the device; a wait that timed
    out or a peer that made a different call is recorded by the kernels in host memory, and
    reported by the next fused call on the group or by this function (for ``group``, or every
    group when None), naming the op, this rank, the peer and what was awaited. It reads host
    memory only: call it after ``torch.cuda.synchronize()`` to cover every call made so far.
    Nothing to report (or no fused call ever made) returns None.
    """
    import sys

    # Without a fused call the fused package (and Triton) need not be imported at all.
    if "kernels.fused.runtime" in sys.modules:
        sys.modules["kernels.fused.runtime"].check_errors(group)
