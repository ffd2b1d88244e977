"""All-reduce + residual add + RMSNorm (+ FP8 quantization): the boundary of every tensor-parallel decoder layer.

Public function: :func:`all_reduce_rmsnorm` (docs/api.md). Registered operator::

    coc::all_reduce_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps, str call)
        -> (Tensor out, Tensor residual_out, Tensor scale)       # call: NormCall.encode()

and one implementation per backend: :func:`reference` (``sequential``, also what ``chunked`` runs: there is
no GEMM to overlap) through torch.distributed, and :func:`fused` (:mod:`kernels.fused.all_reduce_norm`).
Semantics (both; ``x``, ``residual`` ``[..., n]``, ``weight [n]``)::

    h = x_0 + x_1 + ... + x_{W-1}               # fp32 (fp64 for fp64 x), in rank order
    h = h + residual                             # fp32, before any rounding
    residual_out = h.to(residual.dtype)
    rstd = rsqrt(mean(h * h, over n) + eps)      # per row, from the fp32 h
    quant None:  out = (h * rstd).to(x.dtype) * weight                      # as HF's / vLLM's RMSNorm
    quant mode:  out, scale = quantize_fp8(h * rstd * weight, quant)        # fp32 product, one rounding

``h`` and ``residual_out`` have the same bits on every rank, backend and algorithm. ``out`` has the same bits
on every rank, for repeated calls and for both fused algorithms; the reference computes the norm with torch's
reductions, so it may differ from the fused kernel's in the last bits of ``rstd``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import agree, callcheck, checks
from ..call import group_name, resolve_group
from ..config import get_config
from ..fp8.quantize import quantize_fp8
from ..fp8.scales import FP8_DTYPES, ceil_div
from ..op_registration import define_op
from .all_reduce import fixed_order_all_reduce
from .entry import rows_of

QUANT_MODES = (None, "tensor", "row", "block")
ALGORITHMS = agree.NORM_ALGORITHMS
# Pushed bytes up to which "auto" takes one-shot (kernels.fused.all_reduce's gate for its partials).
ONE_SHOT_MAX_BYTES = 256 * 1024
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_warned: set[str] = set()


class NormOutputs(NamedTuple):
    """``out`` (x's dtype, or the FP8 payload), ``residual`` (the updated residual stream) and ``scale`` (the
    FP8 scales of ``out``: ``[]``, ``[..., 1]`` or ``[..., ceil(n / 128)]``; None without ``quant``)."""

    out: torch.Tensor
    residual: torch.Tensor
    scale: torch.Tensor | None


@dataclass(frozen=True)
class NormCall:
    """One call without its tensors: what the registered operator's string carries."""

    quant: str | None
    fp8_dtype: torch.dtype
    algorithm: str
    backend: str
    group_name: str
    world: int

    def encode(self) -> str:
        fp8 = str(self.fp8_dtype).removeprefix("torch.")
        return "|".join((self.quant or "", fp8, self.algorithm, self.backend, self.group_name, str(self.world)))

    @staticmethod
    def decode(text: str) -> NormCall:
        quant, fp8, algorithm, backend, name, world = text.split("|")
        return NormCall(quant or None, getattr(torch, fp8), algorithm, backend, name, int(world))


def all_reduce_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    quant: str | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
) -> NormOutputs:
    """``h = all_reduce(x) + residual``; returns ``(rmsnorm(h) * weight, h, None)``, or with ``quant`` the
    normalized output as FP8 with its scales (module docstring for the exact arithmetic).

    ``x`` and ``residual``: ``[..., n]``, the same shape and dtype (fp16, bf16, fp32, fp64) on every rank;
    ``weight [n]``; ``quant``: None, ``"tensor"``, ``"row"`` (per token) or ``"block"`` (1 x 128 per token, the
    FP8 linears' activation layout); ``algorithm`` (fused backend): ``"auto"`` (one-shot up to
    ``ONE_SHOT_MAX_BYTES`` of ``x``, else two-shot), ``"one_shot"`` or ``"two_shot"``; ``backend``: as the
    other ops (``USE_COC_FUSED_KERNEL=1`` picks ``"fused"``). Bad arguments raise ``ValueError`` /
    ``TypeError`` naming them before any communication, on every rank when only one rank's are bad.
    """
    world = checks.world_of(group)
    device = x.device if isinstance(x, torch.Tensor) else None

    def validate() -> agree.Descriptor:
        _check(x, residual, weight, eps, quant=quant, fp8_dtype=fp8_dtype, algorithm=algorithm)
        checks.check_backend(backend)
        return _descriptor(x, backend, quant, algorithm)

    callcheck.admit("all_reduce_rmsnorm", group, world, device, validate, backend=backend)
    call = NormCall(quant, fp8_dtype, algorithm, _backend(backend, group, x.device), group_name(group), world)
    out, residual_out, scale = operator(x, residual, weight, float(eps), call.encode())
    return NormOutputs(out, residual_out, scale if quant else None)


def _check(
    x: object, residual: object, weight: object, eps: object, *, quant: object, fp8_dtype: object, algorithm: object
) -> None:
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_reduce_rmsnorm: {name} must be a tensor, got {type(t).__name__}")
    assert isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor) and isinstance(weight, torch.Tensor)
    if x.dim() < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"all_reduce_rmsnorm: x must be [..., n] of {_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"all_reduce_rmsnorm: residual must have x's shape and dtype {tuple(x.shape)} {x.dtype}, got "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
    n = x.shape[-1]
    if weight.shape != (n,) or not weight.is_floating_point():
        raise ValueError(
            f"all_reduce_rmsnorm: weight must be a floating [n] = [{n}] (x's last dim), got "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    if len({t.device for t in (x, residual, weight)}) > 1:
        raise ValueError(
            f"all_reduce_rmsnorm: x, residual and weight must be on one device, got {x.device}, "
            f"{residual.device}, {weight.device}"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"all_reduce_rmsnorm: eps must be a finite number >= 0, got {eps!r}")
    if quant not in QUANT_MODES:
        raise ValueError(f"all_reduce_rmsnorm: quant={quant!r} is not one of {QUANT_MODES}")
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"all_reduce_rmsnorm: fp8_dtype={fp8_dtype!r} is not one of {FP8_DTYPES}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"all_reduce_rmsnorm: algorithm={algorithm!r} is not one of {ALGORITHMS}")


def _descriptor(x: torch.Tensor, backend: str | None, quant: str | None, algorithm: str) -> agree.Descriptor:
    m, n = math.prod(x.shape[:-1]), x.shape[-1]
    return agree.describe_call(
        "all_reduce_rmsnorm",
        m,
        n,
        n,
        x.dtype,
        bias=False,
        flag=True,
        backend=backend,
        quant_mode=quant,
        comm_dim=ALGORITHMS.index(algorithm),
    )


def _backend(backend: str | None, group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The backend that runs: the argument, else ``"fused"`` where the environment asks for it; a fused
    request where the fused kernels cannot run warns (once per reason) and runs the reference."""
    if backend is None:
        backend = "fused" if get_config().use_fused else "sequential"
    if backend != "fused":
        return "sequential"
    from .. import fused

    reason = fused.unavailable_reason(group, device)
    if reason is None:
        return "fused"
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"all_reduce_rmsnorm: the fused backend cannot run here ({reason}); using the torch.distributed "
            "path instead (this warning is shown once per reason)",
            RuntimeWarning,
            stacklevel=3,
        )
    return "sequential"


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, call: NormCall
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, residual_out)`` of the module docstring through torch.distributed (``y``: fp32 ``y32`` when
    quantizing); ``x``, ``residual`` as rows ``[m, n]``."""
    acc = _accumulator(x.dtype)
    h = x.to(acc)
    if call.world > 1:
        # Each rank's rows travel at fp32 so that the rank-order sum is the fused one's (same bits).
        h = fixed_order_all_reduce(h, resolve_group(call.group_name), call.world)
    h = h + residual.to(acc)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if call.quant is not None:
        return h * rstd * weight.to(acc), h.to(residual.dtype)
    y = ((h * rstd).to(x.dtype).to(acc) * weight.to(acc)).to(x.dtype)
    return y, h.to(residual.dtype)


def fused(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, call: NormCall
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference` on the symmetric heap (:mod:`kernels.fused.all_reduce_norm`)."""
    from ..fused import all_reduce_norm

    m, n = x.shape
    algorithm = call.algorithm
    if algorithm == "auto":
        # m and n are in the checked descriptor: every rank picks the same algorithm.
        algorithm = "one_shot" if m * n * x.element_size() <= ONE_SHOT_MAX_BYTES else "two_shot"
    cfg = all_reduce_norm.block_config(x.device)
    descriptor = agree.describe_call(
        "all_reduce_rmsnorm",
        m,
        n,
        n,
        x.dtype,
        bias=False,
        flag=True,
        backend="fused",
        quant_mode=call.quant,
        comm_dim=ALGORITHMS.index(call.algorithm),
        tiles=(cfg.block_m, cfg.block_n),
    )
    group = resolve_group(call.group_name)
    h = all_reduce_norm.reduced_rows(x, residual, group=group, algorithm=algorithm, descriptor=descriptor)
    dtypes = (x.dtype, residual.dtype, call.quant is not None)
    return all_reduce_norm.rmsnorm(h, weight.contiguous(), eps=eps, dtypes=dtypes)


IMPL = {"sequential": reference, "fused": fused}


def _scale_shape(shape: tuple[int, ...], quant: str | None) -> tuple[int, ...]:
    if quant == "tensor":
        return ()
    if quant == "row":
        return shape[:-1] + (1,)
    if quant == "block":
        return shape[:-1] + (ceil_div(shape[-1], 128),)
    return (0,)


def _run(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, call_text: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = NormCall.decode(call_text)
    y, residual_out = IMPL[call.backend](rows_of(x), rows_of(residual), weight, eps, call)
    residual_out = residual_out.view(x.shape)
    if call.quant is None:
        return y.view(x.shape), residual_out, x.new_empty((0,), dtype=torch.float32)
    q, scale = quantize_fp8(y.view(x.shape), call.quant, dtype=call.fp8_dtype)
    return q, residual_out, scale


def _fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, call_text: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = NormCall.decode(call_text)
    out = x.new_empty(x.shape, dtype=call.fp8_dtype if call.quant else x.dtype)
    scale = x.new_empty(_scale_shape(tuple(x.shape), call.quant), dtype=torch.float32)
    return out, residual.new_empty(residual.shape), scale


operator = define_op(
    "all_reduce_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps, str call) -> (Tensor, Tensor, Tensor)",
    _run,
    _fake,
)
