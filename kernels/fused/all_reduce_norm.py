"""Fused all-reduce + residual add + RMSNorm over the symmetric heap: the decode path's layer boundary.

Reference semantics (``x``, ``residual`` ``[m, n]`` in x's dtype, ``weight [n]``)::

    h = x_0 + x_1 + ... + x_{W-1}              # fp32 (fp64 for fp64), in rank order
    h = h + residual                            # fp32, before any rounding
    residual_out = h.to(residual.dtype)
    rstd = rsqrt(mean(h * h, over n) + eps)     # per row, from the fp32 h
    quant None: y = (h * rstd).to(x.dtype) * weight            # rounded, then scaled (HF / vLLM RMSNorm)
    quant set:  y32 = h * rstd * weight (fp32); y, scale = quantize_fp8(y32, quant)

The exchange is :func:`kernels.fused.all_reduce.all_reduce_partials`, the one the fused GEMM + all-reduce
uses, with the rows of ``x`` as the partials (:class:`Rows`): one-shot pushes every tile to every rank,
two-shot pushes each owner its rows, the owners reduce and push the reduced fp32 rows back. Both sum
the ``W`` slots in rank order in fp32 and add the residual in fp32, so ``h`` (and ``residual_out``) has
the same bits on every rank, for both algorithms, and as the sequential reference computes it. The
norm then runs as one kernel (:func:`_rmsnorm_kernel`) on ``h`` with a tile that depends on ``n``
only, so the outputs are bitwise identical across algorithms and repeated calls. With ``quant="row"`` or
``"block"`` the same kernel quantizes ``y32`` as it writes it (the arithmetic of
:func:`kernels.fp8.quantize.quantize_fp8`: correctly rounded divisions, clamp, round to nearest even; a row
needs a pass for its amax first, a 1 x 128 block is one column step); ``"tensor"`` needs every row's amax, so
its ``y32`` is quantized after the kernel by that torch function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..fp8.quantize_triton import FP8_FORMAT, ROUND_BEFORE_CAST, round_to_fp8_grid
from ..fp8.scales import BLOCK, EPS, FP8_MAX
from . import runtime, signals
from .all_reduce import all_reduce_partials
from .blocks import BlockConfig
from .scatter import ScatterProto, push_tile, scatter_tile, slot_stride, tiles

# Rows and columns of a push / reduce tile (small m: decode steps of 1 to 256 tokens).
_CPU_BLOCKS = BlockConfig(block_m=8, block_n=32, block_k=16, num_warps=1, num_stages=1, ag_splits=1, group_m=1)
_GPU_BLOCKS = BlockConfig(block_m=16, block_n=256, block_k=16, num_warps=4, num_stages=1, ag_splits=1, group_m=1)
# Columns per step of the norm's two passes over a row.
_NORM_BLOCK_N = {"cpu": 64, "cuda": 1024}
# The quantization modes the norm kernel applies itself (QUANT codes); "tensor" needs every row's amax, a
# grid-wide reduction: its fp32 y32 is quantized after the kernel.
QUANT_IN_KERNEL = {"row": 2, "block": 3}
_AMAX_EPS = tl.constexpr(EPS)
# The "block" mode's quantization block (kernels.fp8.scales.BLOCK): one column step of its quantize pass.
_QBLOCK = tl.constexpr(BLOCK)


class Fp8Format(NamedTuple):
    """``FP8`` of :func:`_rmsnorm_kernel`: the FP8 dtype's largest value and the (mantissa bits, smallest normal
    exponent) of its grid (:data:`kernels.fp8.quantize_triton.FP8_FORMAT`)."""

    MAX: float
    MANTISSA: int
    MIN_EXP: int


@triton.jit(do_not_specialize=["rank", "timeout"])
def _push_rows_kernel(X, heap, dims, rank, timeout: tl.int64, TILE: tl.constexpr, PROTO: tl.constexpr):
    # X = (x, stride_xm, stride_xn); heap = (data table, signal table, DONE offset, RS offset);
    # dims = (M, N, 0, LD, ROWS_OWN); PROTO: scatter.ScatterProto, as the scatter GEMM's (SPLIT_BLOCKS False).
    x_ptr, stride_xm, stride_xn = X
    _, _, _, LD, ROWS_OWN = dims
    owner, local_rows, offs_m, mask_m, offs_n, mask_n = scatter_tile(tl.program_id(0), rank, dims, TILE, PROTO)
    # Columns [N, LD) load as zeros: the slot rows' padding, as the GEMM's masked columns.
    values = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn,
        mask=mask_m[:, None] & mask_n[None, :],
        other=0.0,
    )
    push_tile(values, heap, (owner, local_rows, mask_m, offs_n, LD, ROWS_OWN, rank, timeout), PROTO)


@triton.jit
def _rmsnorm_kernel(
    H, OUT, weight_ptr, dims, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr
):
    # H = (h, stride_hm); OUT = (residual_out, stride_rm, y, stride_ym, scale, stride_sm); dims = (M, N).
    # QUANT: 0 none (y in x's dtype); 1 y is the fp32 y32 (weight applied before any rounding; quantized by the
    # caller); 2 / 3 y is FP8 quantized here per row / per 1 x 128 block, with its scales. BLOCK_N, the sum of
    # squares' step, depends on n alone (not on QUANT): rstd has the same bits in every mode.
    h_ptr, stride_hm = H
    res_ptr, stride_rm, y_ptr, stride_ym, s_ptr, stride_sm = OUT
    M, N = dims
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=h_ptr.dtype.element_ty)
    # Fixed column steps and one final tree per row: the sum of squares has the same bits for every
    # algorithm that hands this kernel the same h.
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        h = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :], mask=mask, other=0.0)
        acc += h * h
        tl.store(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], h.to(res_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / N + eps)
    if QUANT == 2:
        # The row's amax needs every column before the first store: a pass for it, then y32 recomputed (the
        # same products, so the same bits) and quantized.
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        bad = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            y, mask, offs_n = _y32((h_ptr, weight_ptr), (offs_m, mask_m, stride_hm, N), rstd, start, BLOCK_N)
            ay = tl.abs(y)
            bad = tl.maximum(bad, tl.max(tl.where(ay < float("inf"), 0.0, 1.0), axis=1))
            amax = tl.maximum(amax, tl.max(tl.where(ay < float("inf"), ay, 0.0), axis=1))
        scale = _scale(amax, bad, FP8)
        for start in range(0, N, BLOCK_N):
            y, mask, offs_n = _y32((h_ptr, weight_ptr), (offs_m, mask_m, stride_hm, N), rstd, start, BLOCK_N)
            q = _quantized(y, scale, y_ptr.dtype.element_ty, FP8)
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], q, mask=mask)
        tl.store(s_ptr + offs_m * stride_sm, scale, mask=mask_m)
    elif QUANT == 3:
        for start in range(0, N, _QBLOCK):
            y, mask, offs_n = _y32((h_ptr, weight_ptr), (offs_m, mask_m, stride_hm, N), rstd, start, _QBLOCK)
            ay = tl.abs(y)
            bad = tl.max(tl.where(ay < float("inf"), 0.0, 1.0), axis=1)
            scale = _scale(tl.max(tl.where(ay < float("inf"), ay, 0.0), axis=1), bad, FP8)
            q = _quantized(y, scale, y_ptr.dtype.element_ty, FP8)
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], q, mask=mask)
            tl.store(s_ptr + offs_m * stride_sm + start // _QBLOCK, scale, mask=mask_m)
    else:
        for start in range(0, N, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask = mask_m[:, None] & (offs_n < N)[None, :]
            h = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :], mask=mask, other=0.0)
            w = tl.load(weight_ptr + offs_n, mask=offs_n < N, other=0.0).to(h.dtype)
            if QUANT == 1:
                y = h * rstd[:, None] * w[None, :]
            else:
                normed = (h * rstd[:, None]).to(y_ptr.dtype.element_ty).to(h.dtype)
                y = normed * w[None, :]
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _y32(PTRS, ROWS, rstd, start, BLOCK_N: tl.constexpr):
    """``(y32, mask, offs_n)`` of the column step at ``start``: ``h * rstd * weight`` in fp32, the torch
    path's order (masked columns 0)."""
    h_ptr, weight_ptr = PTRS
    offs_m, mask_m, stride_hm, N = ROWS
    offs_n = start + tl.arange(0, BLOCK_N)
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    h = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :], mask=mask, other=0.0)
    w = tl.load(weight_ptr + offs_n, mask=offs_n < N, other=0.0).to(h.dtype)
    return h * rstd[:, None] * w[None, :], mask, offs_n


@triton.jit
def _scale(amax, bad, FP8: tl.constexpr):
    """``max(amax, EPS) / FP8_MAX`` (correctly rounded, as torch divides), NaN where the block held a NaN or
    Inf: :func:`kernels.fp8.quantize.quantize_fp8`'s scale. ``FP8``: :class:`Fp8Format`."""
    scale = tl.math.div_rn(tl.maximum(amax, _AMAX_EPS), tl.full(amax.shape, FP8.MAX, tl.float32))
    return tl.where(bad > 0, float("nan"), scale)


@triton.jit
def _quantized(y, scale, DTYPE: tl.constexpr, FP8: tl.constexpr):
    """``cast(clamp(y / scale, -FP8_MAX, FP8_MAX))`` rounded to nearest even (the interpreter's cast does not:
    :mod:`kernels.fp8.quantize_triton`)."""
    scaled = tl.math.div_rn(y, scale[:, None])
    scaled = tl.minimum(tl.maximum(scaled, -FP8.MAX), FP8.MAX)
    if ROUND_BEFORE_CAST:
        scaled = round_to_fp8_grid(scaled, FP8.MANTISSA, FP8.MIN_EXP)
    return scaled.to(DTYPE)


def block_config(device: torch.device) -> BlockConfig:
    """The push / reduce tile: fixed per device type (every rank of a group has the same)."""
    return _GPU_BLOCKS if device.type == "cuda" else _CPU_BLOCKS


@dataclass(frozen=True)
class Rows:
    """The rows of ``x [m, n]`` as the partials of the all-reduce exchange (``all_reduce.Exchange``): pushed as
    they are (x's dtype), reduced into fp32 (fp64 for fp64) with ``residual`` added."""

    x: torch.Tensor
    residual: torch.Tensor
    cfg: BlockConfig
    bias: None = None

    @property
    def m(self) -> int:
        return self.x.shape[0]

    @property
    def n(self) -> int:
        return self.x.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def out_dtype(self) -> torch.dtype:
        return torch.float64 if self.x.dtype == torch.float64 else torch.float32

    @property
    def device(self) -> torch.device:
        return self.x.device

    def produce(self, call: runtime.FusedCall, rows_own: int, broadcast: bool) -> int:
        heap, w, x, cfg = call.heap, call.world_size, self.x, self.cfg
        per_owner = tiles(rows_own, self.n, cfg)
        grid = (per_owner * (1 if broadcast else w),)
        if grid[0] > 0:
            _push_rows_kernel[grid](
                (x, x.stride(0), x.stride(1)),
                (
                    heap.data_ptrs,
                    heap.sig_ptrs,
                    signals.channel_offset(signals.CH_DONE, w),
                    signals.channel_offset(signals.CH_RS, w),
                ),
                (self.m, self.n, 0, slot_stride(self.n), rows_own),
                call.rank,
                call.timeout_ticks,
                TILE=cfg.tile(),
                PROTO=ScatterProto(w, broadcast, False, call.use_globaltimer),
                num_warps=cfg.num_warps,
            )
        return per_owner


def reduced_rows(
    x: torch.Tensor, residual: torch.Tensor, *, group: object, algorithm: str, descriptor: tuple[int, ...]
) -> torch.Tensor:
    """``h = sum over ranks of x (rank order) + residual``, fp32 (fp64 for fp64), ``[m, n]`` on every rank;
    ``algorithm`` "one_shot" or "two_shot"; ``descriptor``: this rank's call, checked against the peers'."""
    rows = Rows(x, residual, block_config(x.device))
    if runtime.world_size(group) == 1:
        return x.to(rows.out_dtype) + residual.to(rows.out_dtype)
    return all_reduce_partials("all_reduce_rmsnorm", group, rows, algorithm, descriptor)


def check_peers(group: object, device: torch.device, descriptor: tuple[int, ...]) -> None:
    """The heap's call check alone (no data): every rank's descriptor compared, in the heap's call order, and its
    verdict read before returning. On a GPU the check kernel's verdict is otherwise read at a later call; the
    caller is about to enter a torch.distributed collective, which a peer that chose a fused algorithm would never
    join, so this one call waits for the device (the unfused path serves messages above the fused gate, where a
    synchronization costs little beside the transfer)."""
    if runtime.world_size(group) > 1:
        with runtime.fused_call("all_reduce_rmsnorm", group, device, 0, descriptor):
            pass
        if device.type == "cuda" and not runtime.capturing(device):
            torch.cuda.current_stream(device).synchronize()
            runtime.check_errors(group)


def rmsnorm(
    h: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    dtypes: tuple[torch.dtype, torch.dtype],
    quant: tuple[str | None, torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(y, residual_out, scale)`` of the module docstring from ``h`` (fp32 rows); ``dtypes = (x's,
    residual's)``, ``quant = (mode or None, FP8 dtype)``. Modes of :data:`QUANT_IN_KERNEL` come back quantized
    (``y`` FP8, ``scale`` fp32 ``[m, 1]`` / ``[m, ceil(n / 128)]``); ``"tensor"`` (and every mode of an fp64
    ``h``) as ``y32`` in h's dtype with ``scale`` None (quantized by the caller); no mode as ``y`` in x's dtype,
    ``scale`` None."""
    x_dtype, res_dtype = dtypes
    mode, fp8_dtype = quant
    m, n = h.shape
    code = 0 if mode is None else QUANT_IN_KERNEL.get(mode, 1)
    if code > 1 and h.dtype != torch.float32:
        # fp64 rows (an fp64 x): the kernel's correctly rounded division is fp32's, so torch quantizes their y32.
        code = 1
    residual_out = torch.empty((m, n), dtype=res_dtype, device=h.device)
    y_dtype = x_dtype if code == 0 else (h.dtype if code == 1 else fp8_dtype)
    y = torch.empty((m, n), dtype=y_dtype, device=h.device)
    scale = None
    if code >= 2:
        scale = torch.empty((m, 1 if code == 2 else triton.cdiv(n, BLOCK)), dtype=torch.float32, device=h.device)
    out_scale = scale if scale is not None else y
    block_m = 1 if h.device.type == "cuda" else 4
    grid = (triton.cdiv(m, block_m),)
    if grid[0] > 0:
        _rmsnorm_kernel[grid](
            (h, h.stride(0)),
            (residual_out, residual_out.stride(0), y, y.stride(0), out_scale, out_scale.stride(0)),
            weight,
            (m, n),
            eps,
            BLOCK_M=block_m,
            BLOCK_N=min(_NORM_BLOCK_N[h.device.type], triton.next_power_of_2(max(n, 1))),
            QUANT=code,
            FP8=Fp8Format(FP8_MAX[fp8_dtype], *FP8_FORMAT[fp8_dtype]),
            num_warps=4 if h.device.type == "cuda" else 1,
        )
    return y, residual_out, scale
