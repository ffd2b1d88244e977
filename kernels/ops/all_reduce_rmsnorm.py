"""All-reduce + residual add + RMSNorm (+ FP8 quantization): the boundary of every tensor-parallel decoder layer.

Public function: :func:`all_reduce_rmsnorm` (docs/api.md). Registered operator::

    coc::all_reduce_rmsnorm(Tensor x, Tensor residual, Tensor weight, str call)
        -> (Tensor out, Tensor residual_out, Tensor scale)       # call: NormCall (eps among its fields)

and one implementation per backend: :func:`reference` (``sequential``) through torch.distributed, and
:func:`fused` (:mod:`kernels.fused.all_reduce_norm`). There is no chunked backend (no GEMM to overlap in
pieces): a chunked request runs sequential, with a warning naming it.
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

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import checks
from ..protocol import Built, Call, OpSpec, group_name, submit, tensors_key
from ..protocol.call import Items
from .all_reduce import fixed_order_all_reduce
from .gemm import rows_of
from .norm import (
    EpilogueArgs,
    NormOutputs,
    NormSpec,
    accumulator,
    cast_to,
    check_epilogue,
    check_fp8_dtype,
    finish,
    scale_shape,
)

ALGORITHMS = ("auto", "one_shot", "two_shot", "unfused")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, kw_only=True)
class NormCall(Call):
    """One call without its tensors: the FP8 ``quant`` mode and dtype, the ``algorithm`` (resolved from the
    size switch before the admission, so ranks whose tuned files choose differently are told so) and ``eps``."""

    quant: str | None = None
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    algorithm: str = "auto"
    eps: float = 1e-6

    def operand_items(self, operands: NormOperands) -> Items:
        x, residual, weight = operands.x, operands.residual, operands.weight
        return (
            ("x.shape", tuple(x.shape)),
            ("x.dtype", x.dtype),
            ("weight.dtype", weight.dtype),
            ("residual.dtype", residual.dtype),
        )


@dataclass(slots=True)
class NormOperands:
    x: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor

    def flat(self) -> tuple:
        return (self.x, self.residual, self.weight)


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
    FP8 linears' activation layout); ``algorithm`` (fused backend): ``"one_shot"``, ``"two_shot"``,
    ``"unfused"`` (the torch.distributed exchange, then the fused norm) or ``"auto"``: by x's bytes and the
    world size, from the gates of the tuned file (``kernels.fused.tuned.all_reduce_gates``; defaults: one-shot
    up to 256 KiB, two-shot up to 8 MiB); ranks that choose differently (tuned files that differ) are refused
    by name. Each rank adds its own ``residual`` (documented precondition: the residual stream is replicated;
    one that is not gives ``residual_r + all_reduce(x)`` on rank r on every backend and algorithm).
    ``backend``: as the other ops (``USE_COC_FUSED_KERNEL=1`` picks ``"fused"``). Bad arguments raise
    ``ValueError`` / ``TypeError`` naming them before any communication, on every rank when only one rank's
    are bad; ranks whose ``eps``, ``quant``, shapes or dtypes differ raise a named ``RuntimeError`` on every rank.
    """

    def build(world: int) -> Built:
        _check(x, EpilogueArgs(residual, weight, eps, quant), fp8_dtype=fp8_dtype, algorithm=algorithm)
        checks.check_backend(backend)
        call = NormCall(
            op="all_reduce_rmsnorm",
            group_name=group_name(group),
            world=world,
            backend=backend,
            quant=quant,
            fp8_dtype=fp8_dtype,
            algorithm=choose_algorithm(algorithm, x, world),
            eps=float(eps),
        )
        return Built(call, NormOperands(x, residual, weight), x.device)

    fast = None
    if type(eps) in (float, int):
        tensors = tensors_key(x, residual, weight)
        options = ("all_reduce_rmsnorm", group, backend, quant, fp8_dtype, algorithm, eps)
        fast = None if tensors is None else ((options, tensors), NormOperands(x, residual, weight))
    out, residual_out, scale = submit(SPEC, "all_reduce_rmsnorm", group, build, fast)
    return NormOutputs(out, residual_out, scale if quant else None)


def _check(x: object, given: EpilogueArgs, *, fp8_dtype: object, algorithm: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"all_reduce_rmsnorm: x must be a tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"all_reduce_rmsnorm: x must be [..., n] of {_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    names = ("all_reduce_rmsnorm", "residual", "weight")
    check_epilogue(given, shape=tuple(x.shape), dtype=x.dtype, names=names)
    devices = {t.device for t in (x, given.residual, given.weight)}  # type: ignore[union-attr]
    if len(devices) > 1:
        raise ValueError(
            f"all_reduce_rmsnorm: x, residual and weight must be on one device, got {sorted(map(str, devices))}"
        )
    check_fp8_dtype(fp8_dtype, "all_reduce_rmsnorm")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"all_reduce_rmsnorm: algorithm={algorithm!r} is not one of {ALGORITHMS}")


def choose_algorithm(algorithm: str, x: torch.Tensor, world: int) -> str:
    """``algorithm``, or for ``"auto"`` the one the gates of x's bytes at ``world`` ranks choose."""
    if algorithm != "auto" or world == 1:
        return algorithm
    from ..fused import tuned

    gates = tuned.all_reduce_gates(x.device, world)
    size = x.numel() * x.element_size()
    if size <= gates.one_shot_max_bytes:
        return "one_shot"
    return "two_shot" if size <= gates.fused_max_bytes else "unfused"


def reference(x: torch.Tensor, residual: torch.Tensor, call: NormCall) -> torch.Tensor:
    """``h = x_0 + ... + x_{W-1} + residual`` (module docstring) through torch.distributed; rows ``[m, n]``."""
    acc = accumulator(x.dtype)
    h = cast_to(x, acc)
    if call.world > 1:
        # Each rank's rows travel at fp32 so that the rank-order sum is the fused one's (same bits).
        h = fixed_order_all_reduce(h, call.group, call.world)
    return h + cast_to(residual, acc)


def fused(x: torch.Tensor, residual: torch.Tensor, call: NormCall, described: NormOperands) -> torch.Tensor:
    """:func:`reference` on the symmetric heap (:mod:`kernels.fused.all_reduce_norm`)."""
    from ..fused import all_reduce_norm, runtime

    cfg = all_reduce_norm.block_config(x.device)
    descriptor = runtime.describe(call, described, (cfg.block_m, cfg.block_n))
    group = call.group
    if call.algorithm == "unfused":
        # The heap's check runs here too, so that a peer that chose a fused algorithm is refused by name instead
        # of waiting for a rank that is inside a torch.distributed collective.
        all_reduce_norm.check_peers(group, x.device, descriptor)
        return reference(x, residual, call)
    return all_reduce_norm.reduced_rows(x, residual, group=group, algorithm=call.algorithm, descriptor=descriptor)


def _normed(call: NormCall, ops: NormOperands, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, residual = ops.x, ops.residual
    quant = (call.quant, call.fp8_dtype)
    spec = NormSpec(call.eps, (x.dtype, residual.dtype), quant, call.backend == "fused", x.shape)
    return finish(h, ops.weight, spec)


def _sequential(call: NormCall, ops: NormOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _normed(call, ops, reference(rows_of(ops.x), rows_of(ops.residual), call))


def _fused(call: NormCall, ops: NormOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _normed(call, ops, fused(rows_of(ops.x), rows_of(ops.residual), call, ops))


def _fake(call: NormCall, ops: NormOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, residual = ops.x, ops.residual
    out = x.new_empty(x.shape, dtype=call.fp8_dtype if call.quant else x.dtype)
    scale = x.new_empty(scale_shape(tuple(x.shape), call.quant), dtype=torch.float32)
    return out, residual.new_empty(residual.shape), scale


SPEC = OpSpec(
    name="all_reduce_rmsnorm",
    call=NormCall,
    schema="(Tensor x, Tensor residual, Tensor weight, str call) -> (Tensor, Tensor, Tensor)",
    operands=NormOperands,
    flat=NormOperands.flat,
    impl={"sequential": _sequential, "fused": _fused},
    fake=_fake,
)
