"""Fused w8A16 GEMM + all-reduce: the int8 weight is dequantized tile by tile in the GEMM main loop.

``y = all_reduce(x @ dequant(qweight).T) + bias`` with the exchange of :mod:`gemm_ar` (one-shot
for small outputs, else reduce-scatter then push of the reduced rows), the same heap regions,
counters and epochs: only the GEMM differs. Each ``[BLOCK_K, BLOCK_N]`` weight tile is loaded as
int8 (a quarter of the bytes of fp32, half of fp16), turned into ``(q - offset) * scale`` in fp32,
rounded to ``x.dtype`` and fed to ``tl.dot``; the dequantized weight never exists in memory.
Rounding the dequantized tile to ``x.dtype`` exactly as :func:`kernels.quant.dequantize` does
means the fused result differs from the sequential reference only by summation order.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from . import runtime, signals
from .gemm import NARROW_BLOCK_K, BlockConfig, block_config, dot_acc, load_a
from .gemm_ar import ONE_SHOT_MAX_BYTES, all_reduce_partials, tile_rows
from .gemm_rs import group_and_size, push_tile, scatter_tile, slot_stride, tiles
from .legacy import int8_format, operands
from .matmul import gemm

# Scale layouts (kernels.quant.QuantSpec.mode) as kernel constants. PER_GROUP_ALIGNED is
# per_group with ``group_size % BLOCK_K == 0``: a k-tile lies inside one group, so one [BLOCK_N]
# row of scales serves the whole tile instead of a [BLOCK_K, BLOCK_N] gather.
PER_TENSOR, PER_CHANNEL, PER_GROUP, PER_GROUP_ALIGNED = 0, 1, 2, 3


@triton.jit
def _tile_matmul_w8a16(
    x_ptr,
    stride_xm,
    stride_xk,
    q_ptr,
    stride_qn,
    stride_qk,
    s_ptr,
    o_ptr,
    stride_sn,
    stride_sg,
    offs_m,
    mask_m,
    offs_n,
    mask_n,
    K,
    GROUP_SIZE,
    MODE: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 ``x[offs_m, :] @ dequant(q)[offs_n, :].T`` for int8 ``q [n, k]``."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MODE == 0:
        s_tile = tl.load(s_ptr).to(tl.float32)
        if HAS_OFFSET:
            o_tile = tl.load(o_ptr).to(tl.float32)
    if MODE == 1:
        s_tile = tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if HAS_OFFSET:
            o_tile = tl.load(o_ptr + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    for k0 in range(0, K, BLOCK_K):
        a, offs_k, mask_k = load_a(x_ptr, stride_xm, stride_xk, offs_m, mask_m, k0, K, BLOCK_K)
        b_mask = mask_n[None, :] & mask_k[:, None]
        b = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None] * stride_qk, mask=b_mask, other=0).to(
            tl.float32
        )
        if MODE == 3:
            s_offs = offs_n * stride_sn + (k0 // GROUP_SIZE) * stride_sg
            s_tile = tl.load(s_ptr + s_offs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if HAS_OFFSET:
                o_tile = tl.load(o_ptr + s_offs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if MODE == 2:
            # Groups run along k; a partial last group indexes the same column as its full peers.
            s_offs = offs_n[None, :] * stride_sn + (offs_k // GROUP_SIZE)[:, None] * stride_sg
            s_tile = tl.load(s_ptr + s_offs, mask=b_mask, other=0.0).to(tl.float32)
            if HAS_OFFSET:
                o_tile = tl.load(o_ptr + s_offs, mask=b_mask, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            b = b - o_tile
        # Round to x's dtype before the dot, as kernels.quant.dequantize does for the reference.
        b = (b * s_tile).to(x_ptr.dtype.element_ty)
        acc = dot_acc(a, b, acc, "tf32", tl.float32)
    return acc


@triton.jit(do_not_specialize=["rank", "timeout"])
def _gemm_w8a16_scatter_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    data_tab_ptr,
    sig_tab_ptr,
    M,
    N,
    K,
    LD,
    ROWS_OWN,
    GROUP_SIZE,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_qk,
    stride_sn,
    stride_sg,
    rank,
    timeout: tl.int64,
    done_offset,
    cnt_offset,
    MODE: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    WORLD: tl.constexpr,
    BROADCAST: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # gemm_rs's tile mapping and push, so its reduce (gemm_rs.reduce_slots) and gemm_ar's gather
    # kernel consume these tiles unchanged.
    owner, local_rows, offs_m, mask_m, offs_n, mask_n = scatter_tile(
        tl.program_id(0), rank, M, N, ROWS_OWN, WORLD, BROADCAST, BLOCK_M, BLOCK_N, GROUP_M
    )
    acc = _tile_matmul_w8a16(
        x_ptr,
        stride_xm,
        stride_xk,
        q_ptr,
        stride_qn,
        stride_qk,
        s_ptr,
        o_ptr,
        stride_sn,
        stride_sg,
        offs_m,
        mask_m,
        offs_n,
        mask_n,
        K,
        GROUP_SIZE,
        MODE,
        HAS_OFFSET,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    push_tile(
        acc.to(x_ptr.dtype.element_ty),
        data_tab_ptr,
        sig_tab_ptr,
        owner,
        local_rows,
        mask_m,
        offs_n,
        LD,
        ROWS_OWN,
        rank,
        timeout,
        done_offset,
        cnt_offset,
        WORLD,
        BROADCAST,
        USE_GLOBALTIMER,
    )


def _quant_args(scale: torch.Tensor, offset: torch.Tensor | None) -> tuple:
    """``(scale, offset or scale, stride_sn, stride_sg)``; one set of strides serves both tensors
    (same shape, both contiguous), 0 where the layout has no such dim."""
    scale = scale.contiguous()
    offset = scale if offset is None else offset.to(torch.float32).contiguous()
    stride_sn = scale.stride(0) if scale.dim() >= 1 else 0
    stride_sg = scale.stride(1) if scale.dim() == 2 else 0
    return scale, offset, stride_sn, stride_sg


def _scatter(
    call: runtime.FusedCall,
    x: torch.Tensor,
    qweight: torch.Tensor,
    quant: tuple,
    mode: int,
    has_offset: bool,
    group_size: int,
    rows_own: int,
    broadcast: bool,
    cfg: BlockConfig,
) -> int:
    """Launch the dequantizing scatter GEMM; return the ``RS`` target (as gemm_rs.scatter_partials)."""
    heap, w = call.heap, call.world_size
    m, k = x.shape
    n = qweight.shape[0]
    scale, offset, stride_sn, stride_sg = quant
    per_owner = tiles(rows_own, n, cfg)
    grid = (per_owner * (1 if broadcast else w),)
    if grid[0] > 0:
        _gemm_w8a16_scatter_kernel[grid](
            x,
            qweight,
            scale,
            offset,
            heap.data_ptrs,
            heap.sig_ptrs,
            m,
            n,
            k,
            slot_stride(n),
            rows_own,
            group_size,
            x.stride(0),
            x.stride(1),
            qweight.stride(0),
            qweight.stride(1),
            stride_sn,
            stride_sg,
            call.rank,
            call.timeout_ticks,
            signals.channel_offset(signals.CH_DONE, w),
            signals.channel_offset(signals.CH_RS, w),
            MODE=mode,
            HAS_OFFSET=has_offset,
            WORLD=w,
            BROADCAST=broadcast,
            USE_GLOBALTIMER=call.use_globaltimer,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return per_owner


def matmul_w8a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Local ``x @ dequant(qweight).T + bias`` (the W == 1 path): :func:`matmul.gemm` of the int8 format."""
    ops = operands(x, [qweight], [bias], w_scales=[scale], w_offsets=[offset])
    return gemm(int8_format(scale, group_size, offset), ops)


def _quant_config(cfg: BlockConfig, scale: torch.Tensor, group_size: int) -> tuple[BlockConfig, int]:
    """The launch configuration and scale layout (a kernel ``MODE``) for ``scale``.

    Per-group scales with ``group_size % block_k != 0`` would be gathered as a ``[BLOCK_K, BLOCK_N]``
    tile every k step (it spilled at 64-deep steps on sm_90); 16-deep steps lie inside one group
    whenever ``group_size % 16 == 0``. Only ``block_k`` changes, which no tile count depends on.
    """
    if scale.dim() < 2:
        return cfg, (PER_TENSOR, PER_CHANNEL)[scale.dim()]
    if group_size % cfg.block_k:
        cfg = replace(cfg, block_k=min(cfg.block_k, NARROW_BLOCK_K))
    return cfg, PER_GROUP_ALIGNED if group_size % cfg.block_k == 0 else PER_GROUP


def matmul_all_reduce_w8a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    deterministic: bool,
) -> torch.Tensor:
    """Fused w8A16 GEMM + all-reduce over the group's symmetric heap.

    Shapes: x ``[m, k_local]`` (fp16 / bf16; fp32 under the interpreter), qweight int8
    ``[n, k_local]``, scale / offset ``[]``, ``[n]`` or ``[n, ceil(k_local / group_size)]``
    (validated by :func:`kernels.quant.quant_spec`), bias ``[n]`` -> y ``[m, n]``, the same bits
    on every rank.

    Reference semantics::

        w_src = ((qweight_src - offset_src) * scale_src).to(x.dtype)   # per tile, never stored
        partial_src = x_src @ w_src.T                                   # rounded to x.dtype
        y = sum(partial_src for src in 0..W-1) + bias                   # fp32, in rank order

    Always deterministic, as :func:`gemm_ar.matmul_all_reduce` (``deterministic`` costs nothing).
    """
    group, w = group_and_size(group)
    if w == 1:
        return matmul_w8a16(x, qweight, scale, offset, group_size, bias)
    m, _ = x.shape
    n = qweight.shape[0]
    size = x.element_size()
    algorithm = "one_shot" if m * n * size <= ONE_SHOT_MAX_BYTES else "two_shot"
    cfg = block_config(x.device, tile_rows(algorithm, m, w), x.shape[1], x.dtype)
    cfg, mode = _quant_config(cfg, scale, group_size)
    quant = _quant_args(scale, offset)
    # The fixed-order reduce of gemm_rs is always used; ``deterministic`` is compared across ranks only.
    layout = ("per_tensor", "per_channel", "per_group")[scale.dim()]
    descriptor = runtime.describe(
        "quantized_matmul_all_reduce",
        m,
        x.shape[1],
        n,
        x.dtype,
        bias is not None,
        deterministic,
        layout,
        group_size if layout == "per_group" else 0,
        tiles=(cfg.block_m, cfg.block_n),
    )
    return all_reduce_partials(
        "quantized_matmul_all_reduce",
        group,
        x,
        n,
        bias,
        algorithm,
        cfg,
        descriptor,
        lambda call, rows_own, broadcast: _scatter(
            call, x, qweight, quant, mode, offset is not None, group_size, rows_own, broadcast, cfg
        ),
    )
