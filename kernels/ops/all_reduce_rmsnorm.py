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

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from .. import checks
from ..protocol import MISS, Built, Call, OpSpec, group_name, resolved, submit
from ..protocol.call import Items
from .all_reduce import fixed_order_all_reduce
from .gemm import rows_of
from .norm import (
    EpilogueArgs,
    NormOutputs,
    NormSpec,
    accumulator,
    check_epilogue,
    check_fp8_dtype,
    finish,
    scale_shape,
    torch_finisher,
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

    options = ("all_reduce_rmsnorm", group, backend, quant, fp8_dtype, algorithm, eps)
    key = None
    # The signature (tensors_key's, flat and inline: this op is called twice per decoder layer and step).
    if (
        type(x) is type(residual) is type(weight) is torch.Tensor
        and type(eps) in (float, int)
        and not (torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad))
    ):
        # fmt: off
        key = (options, x.shape, x.dtype, x.device, residual.shape, residual.dtype, residual.device,
               weight.shape, weight.dtype, weight.device)
        # fmt: on
        out = resolved(SPEC, "all_reduce_rmsnorm", group, key, NormOperands(x, residual, weight))
        if out is not MISS:
            return NormOutputs(out[0], out[1], out[2] if quant else None)
    # A module-level build: a nested one would make every argument a cell, allocated on every call.
    build = partial(_build, x, residual, weight, options)
    out, residual_out, scale = submit(SPEC, "all_reduce_rmsnorm", group, build, key)
    return NormOutputs(out, residual_out, scale if quant else None)


def _build(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, options: tuple, world: int) -> Built:
    """The validation of one call (``options``: the public function's other arguments, as its signature holds
    them) and its call value."""
    _, group, backend, quant, fp8_dtype, algorithm, eps = options
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
    return _reducer(call, x.dtype, residual.dtype)(x, residual)


def _reducer(
    call: NormCall, x_dtype: torch.dtype, residual_dtype: torch.dtype
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """:func:`reference` with its choices made once for x's and the residual's dtypes: ``run(x, residual)``."""
    acc = accumulator(x_dtype)
    cast_x, cast_residual = x_dtype != acc, residual_dtype != acc
    world = call.world
    group = call.group if world > 1 else None

    def run(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = x.to(acc) if cast_x else x
        if world > 1:
            # Each rank's rows travel at fp32 so that the rank-order sum is the fused one's (same bits).
            h = fixed_order_all_reduce(h, group, world)
        return h + (residual.to(acc) if cast_residual else residual)

    return run


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


def _spec(call: NormCall, ops: NormOperands) -> NormSpec:
    x, quant = ops.x, (call.quant, call.fp8_dtype)
    return NormSpec(call.eps, (x.dtype, ops.residual.dtype), quant, call.backend == "fused", x.shape)


def _rows_shape(x: torch.Tensor) -> tuple[int, int] | None:
    """The ``[m, n]`` that rows_of reshapes ``x`` to, fixed by the signature; None for a 2-D x (its own rows)."""
    return None if x.dim() == 2 else tuple(rows_of(x).shape)  # type: ignore[return-value]


def _bind_sequential(call: NormCall, ops: NormOperands) -> Callable[[NormOperands], tuple]:
    """The sequential backend for every call of ``ops``'s signature (shapes, dtypes, device): the reduction and
    the norm with their choices made once (:func:`kernels.protocol.spec.resolved` runs it on the signature's calls)."""
    x, residual, weight = ops.x, ops.residual, ops.weight
    acc = accumulator(x.dtype)
    finish_rows = torch_finisher(_spec(call, ops), weight.dtype, acc, x.device)
    rows = _rows_shape(x)
    if call.world > 1 or x.dtype != acc or rows is not None:
        reduce = _reducer(call, x.dtype, residual.dtype)

        def run(ops: NormOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            x, residual = ops.x, ops.residual
            if rows is not None:
                x, residual = x.reshape(rows), residual.reshape(rows)
            return finish_rows(reduce(x, residual), ops.weight)

        return run

    def run_rows(ops: NormOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # _reducer's sum at W = 1 for x and residual already [m, n] in the accumulator's dtype: one frame less on
        # the single-rank decode step.
        return finish_rows(ops.x + ops.residual, ops.weight)

    return run_rows


def _bind_fused(call: NormCall, ops: NormOperands) -> Callable[[NormOperands], tuple]:
    """:func:`_bind_sequential` of the fused backend: the rows' shape and the norm's spec decided once."""
    spec = _spec(call, ops)
    rows = _rows_shape(ops.x)

    def run(ops: NormOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, residual = ops.x, ops.residual
        if rows is not None:
            x, residual = x.reshape(rows), residual.reshape(rows)
        return finish(fused(x, residual, call, ops), ops.weight, spec)

    return run


_BINDERS = {"sequential": _bind_sequential, "fused": _bind_fused}


def _bind(call: NormCall, ops: NormOperands) -> Callable[[NormOperands], tuple]:
    return _BINDERS[call.backend](call, ops)


def _sequential(call: NormCall, ops: NormOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bind_sequential(call, ops)(ops)


def _fused(call: NormCall, ops: NormOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bind_fused(call, ops)(ops)


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
    bind=_bind,
)
