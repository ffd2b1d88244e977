"""Fused and overlapped communication-computation operators (docs/api.md section 1).

Each op takes ``x`` with any number of leading dims (flattened to ``m`` rows; communication is
along dim 0) and ``weight`` in ``torch.nn.functional.linear`` layout ``[n, k]``, and returns a
tensor with the leading dims restored. ``backend=None`` resolves from the COC_* environment
(``kernels.config``); every backend gives the result of ``"sequential"`` within floating-point
tolerance. The ops are forward-only building blocks: the autopar linears wrap them in autograd
Functions.

Each function validates, chooses the backend (``kernels.dispatch``) and makes one call to a
registered torch operator (``torch.ops.coc.*``, ``kernels.library``), so the ops trace whole
under ``torch.compile(fullgraph=True)``: one opaque call per op in the graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import checks, dispatch, library, name_clash, quant
from .config import CocConfig, get_config
from .quant import quantize_weight

# Before anything runs: another installed 'kernels' distribution would have mixed its files with ours.
name_clash.check(__path__[0])

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "get_config",
    "CocConfig",
    "quantize_weight",
    "quantized_matmul_all_reduce",
    "check_errors",
]


def _validate(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: object,
    backend: object,
    parallel_num: object,
    flag_name: str,
    flag: object,
    weight_dtypes: tuple = (),
) -> int:
    checks.check_matmul_operands(x, weight, bias, weight_dtypes=weight_dtypes)
    checks.check_group(group)
    checks.check_backend(backend)
    checks.check_parallel_num(parallel_num)
    checks.check_flag(flag_name, flag)
    return checks.group_size(group)


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    return_gathered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``y = all_gather_dim0(x) @ weight.T + bias``.

    Reference::

        x_gathered = cat([x_of_rank_0, ..., x_of_rank_W-1], dim=0)    # [m_local * W, k]
        y = x_gathered @ weight.T + bias                                # [m_local * W, n]
        return (y, x_gathered) if return_gathered else y

    With leading dims ``x [s_local, b, k]`` the results are ``[s_local * W, b, n]`` and
    ``[s_local * W, b, k]``.
    """
    world = _validate(x, weight, bias, group, backend, parallel_num, "return_gathered", return_gathered)
    lead = x.shape[:-1]
    x2d = x.flatten(0, -2)
    name, num, group_name = dispatch.decide(
        "all_gather_matmul", backend, parallel_num, x2d, weight, bias, return_gathered, group, world
    )
    gathered_lead = (lead[0] * world,) + tuple(lead[1:])
    if return_gathered:
        y, x_gathered = library.all_gather_matmul_gathered(x2d, weight, bias, group_name, world, name, num)
        return y.view(gathered_lead + (weight.shape[0],)), x_gathered.view(gathered_lead + (x.shape[-1],))
    y = library.all_gather_matmul(x2d, weight, bias, group_name, world, name, num)
    return y.view(gathered_lead + (weight.shape[0],))


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """``y = reduce_scatter_dim0(x @ weight.T) + bias``; bias is added once, after the reduction.

    Reference::

        partial = x @ weight.T                                     # [m, n] on every rank
        y = sum(partial_of_rank_r for r in range(W))[rank * m / W : (rank + 1) * m / W] + bias

    The leading dim 0 of ``x`` (``m`` after flattening ``x [s, b, k]`` to ``[s * b, k]``) is
    scattered: it must divide by W. ``deterministic=True`` sums the partials in rank order, so
    repeated calls give identical bits.
    """
    world = _validate(x, weight, bias, group, backend, parallel_num, "deterministic", deterministic)
    if x.shape[0] % world != 0:
        raise ValueError(
            f"matmul_reduce_scatter scatters dim 0 of x: m={x.shape[0]} (x shape "
            f"{tuple(x.shape)}) is not divisible by the group size W={world}"
        )
    lead = x.shape[:-1]
    x2d = x.flatten(0, -2)
    name, num, group_name = dispatch.decide(
        "matmul_reduce_scatter", backend, parallel_num, x2d, weight, bias, deterministic, group, world
    )
    out = library.matmul_reduce_scatter(x2d, weight, bias, group_name, world, name, num, deterministic)
    return out.view((lead[0] // world,) + tuple(lead[1:]) + (weight.shape[0],))


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
    world = _validate(x, weight, bias, group, backend, parallel_num, "deterministic", deterministic)
    lead = x.shape[:-1]
    x2d = x.flatten(0, -2)
    name, num, group_name = dispatch.decide(
        "matmul_all_reduce", backend, parallel_num, x2d, weight, bias, deterministic, group, world
    )
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
    quant.check_activation(x)
    spec = quant.quant_spec(qweight, scale, group_size, offset)
    world = _validate(
        x, qweight, bias, group, backend, parallel_num, "deterministic", deterministic, weight_dtypes=(torch.int8,)
    )
    lead = x.shape[:-1]
    x2d = x.flatten(0, -2)
    name, num, group_name = dispatch.decide(
        "quantized_matmul_all_reduce",
        backend,
        parallel_num,
        x2d,
        qweight,
        bias,
        deterministic,
        group,
        world,
        quant=(spec.mode, spec.group_size),
    )
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
