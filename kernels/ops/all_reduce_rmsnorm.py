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

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import agree, callcheck, checks
from ..call import group_name, resolve_group
from ..config import get_config
from ..op_registration import define_op
from .all_reduce import fixed_order_all_reduce
from .entry import rows_of
from .norm import NormOutputs, accumulator, check_epilogue, check_fp8_dtype, finish, scale_shape

ALGORITHMS = agree.NORM_ALGORITHMS
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_warned: set[str] = set()


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
    @functools.lru_cache(maxsize=1024)
    def decode(text: str) -> NormCall:
        """Inverse of :meth:`encode` (cached: the registered operator decodes its string at each call)."""
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
    FP8 linears' activation layout); ``algorithm`` (fused backend): ``"one_shot"``, ``"two_shot"``,
    ``"unfused"`` (the torch.distributed exchange, then the fused norm) or ``"auto"``: by x's bytes and the
    world size, from the gates of the tuned file (``kernels.fused.tuned.all_reduce_gates``; defaults: one-shot
    up to 256 KiB, two-shot up to 8 MiB); ranks that choose differently (tuned files that differ) are refused
    by name. ``backend``: as the other ops (``USE_COC_FUSED_KERNEL=1`` picks ``"fused"``). Bad arguments raise
    ``ValueError`` / ``TypeError`` naming them before any communication, on every rank when only one rank's
    are bad.
    """
    world = checks.world_of(group)
    device = x.device if isinstance(x, torch.Tensor) else None
    chosen: list[str] = []

    def validate() -> agree.Descriptor:
        _check(x, residual, weight, eps, quant=quant, fp8_dtype=fp8_dtype, algorithm=algorithm)
        checks.check_backend(backend)
        chosen.append(choose_algorithm(algorithm, x, world))
        return _descriptor(x, backend, quant, chosen[-1])

    callcheck.admit("all_reduce_rmsnorm", group, world, device, validate, backend=backend)
    call = NormCall(quant, fp8_dtype, chosen[-1], _backend(backend, group, x.device), group_name(group), world)
    out, residual_out, scale = operator(x, residual, weight, float(eps), call.encode())
    return NormOutputs(out, residual_out, scale if quant else None)


def _check(
    x: object, residual: object, weight: object, eps: object, *, quant: object, fp8_dtype: object, algorithm: object
) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"all_reduce_rmsnorm: x must be a tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"all_reduce_rmsnorm: x must be [..., n] of {_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    names = ("all_reduce_rmsnorm", "residual", "weight")
    check_epilogue(residual, weight, eps, quant, shape=tuple(x.shape), dtype=x.dtype, names=names)
    devices = {t.device for t in (x, residual, weight)}  # type: ignore[union-attr]
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


def reference(x: torch.Tensor, residual: torch.Tensor, call: NormCall) -> torch.Tensor:
    """``h = x_0 + ... + x_{W-1} + residual`` (module docstring) through torch.distributed; rows ``[m, n]``."""
    acc = accumulator(x.dtype)
    h = x.to(acc)
    if call.world > 1:
        # Each rank's rows travel at fp32 so that the rank-order sum is the fused one's (same bits).
        h = fixed_order_all_reduce(h, resolve_group(call.group_name), call.world)
    return h + residual.to(acc)


def fused(x: torch.Tensor, residual: torch.Tensor, call: NormCall) -> torch.Tensor:
    """:func:`reference` on the symmetric heap (:mod:`kernels.fused.all_reduce_norm`)."""
    from ..fused import all_reduce_norm

    m, n = x.shape
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
    if call.algorithm == "unfused":
        # The fused backend's calls are compared by its kernels, not on the host (kernels.callcheck): the
        # heap's check runs here too, so that a peer that chose a fused algorithm is refused by name instead
        # of waiting for a rank that is inside a torch.distributed collective.
        all_reduce_norm.check_peers(group, x.device, descriptor)
        return reference(x, residual, call)
    return all_reduce_norm.reduced_rows(x, residual, group=group, algorithm=call.algorithm, descriptor=descriptor)


IMPL = {"sequential": reference, "fused": fused}


def _run(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, call_text: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = NormCall.decode(call_text)
    h = IMPL[call.backend](rows_of(x), rows_of(residual), call)
    quant = (call.quant, call.fp8_dtype)
    shape = tuple(x.shape)
    return finish(
        h, weight, eps, dtypes=(x.dtype, residual.dtype), quant=quant, fused=call.backend == "fused", shape=shape
    )


def _fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, call_text: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = NormCall.decode(call_text)
    out = x.new_empty(x.shape, dtype=call.fp8_dtype if call.quant else x.dtype)
    scale = x.new_empty(scale_shape(tuple(x.shape), call.quant), dtype=torch.float32)
    return out, residual.new_empty(residual.shape), scale


operator = define_op(
    "all_reduce_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps, str call) -> (Tensor, Tensor, Tensor)",
    _run,
    _fake,
)
