"""Tile configurations of every fused GEMM, per operand format, and the operands as kernel arguments.

One path chooses the tiles of every GEMM the fused ops launch, whatever the format
(:class:`kernels.format.OperandFormat`): :func:`block_config` looks the tuned file of this GPU up
(:mod:`tuned`, entries keyed by op, dtype and format), else takes the format's defaults, then
narrows ``block_k`` where the format's loads need it. ``block_m`` and ``block_n`` follow only what
every rank agrees on (the rows per tile owner, ``n``, the op, the dtype and the format), so the tile
counts that become signal targets are the same on every rank; ``block_k`` may follow each rank's own
``k`` (uneven contracted shards), since no count depends on it.

The kernels take each operand as one tuple (:func:`x_operand`, :func:`w_operand`) and the format, tiles
and dot arithmetic as named constexprs (:func:`kernel_format`, :meth:`BlockConfig.tile`,
:func:`dot_math`); see :mod:`tile` for their layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ..format import OperandFormat
from . import tuned
from .gemm_configs import GemmConfig
from .tile import (
    FP8,
    INT8,
    PER_BLOCK,
    PER_CHANNEL,
    PER_GROUP,
    PER_GROUP_ALIGNED,
    PER_ROW,
    PER_TENSOR,
    PLAIN,
    Format,
    Math,
    Tile,
)


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch parameters; identical on every rank (tile counts drive the signal targets).

    ``ag_splits``: chunks per all-gather shard, each with its own ready flag, so the GEMM starts on
    a shard's first rows before the rest arrive (at most ``signals.AG_MAX_SPLITS``). ``group_m``:
    row tiles per group of the grouped tile order (:func:`tile.grouped_tile`).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    ag_splits: int
    group_m: int

    def tile(self) -> Tile:
        """The ``TILE`` constexpr of the kernels."""
        return Tile(self.block_m, self.block_n, self.block_k, self.group_m)

    def launch(self) -> dict[str, int]:
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


# The interpreter costs per program and per loop step, so CPU tiles stay small to keep tests fast
# while still crossing tile boundaries with test shapes of a few dozen rows.
CPU_BLOCKS = BlockConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, ag_splits=2, group_m=2)
GPU_BLOCKS = BlockConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, ag_splits=4, group_m=8)
# Decode-size m: a 128-row tile would compute at least half masked rows; 64 rows is the M of one
# warpgroup's wgmma, so 4 warps carry the tile.
GPU_SMALL_M_BLOCKS = replace(GPU_BLOCKS, block_m=64, num_warps=4, num_stages=4)
SMALL_M = 64
# FP8: BLOCK_N and BLOCK_K divide 128 (a tile's columns share one weight scale row in block mode, a k
# step never straddles a scale block). On sm_90 a 128-deep FP8 k step is 128 bytes per row, the same
# smem tile as a 64-deep bf16 step.
CPU_FP8_BLOCKS = replace(CPU_BLOCKS, block_k=64)
GPU_FP8_BLOCKS = replace(GPU_BLOCKS, block_k=128)
GPU_FP8_SMALL_M_BLOCKS = replace(GPU_FP8_BLOCKS, block_m=64, num_warps=4, num_stages=4)
# 16-deep k steps where deeper ones spill on sm_90: operand rows that do not start 16-byte aligned
# (loaded one element per instruction; 500-800 bytes spilled per thread; FP8 k steps of 32 or more
# 48 to 600 bytes), the exact-fp32 dot (FMA, no tensor cores; 16 bytes spilled under Triton 3.6, up
# to 6 KB in the broadcast scatter) and int8 per-group scales whose groups a deeper step would
# straddle (a [BLOCK_K, BLOCK_N] scale gather per step).
NARROW_BLOCK_K = 16


def block_config(
    fmt: OperandFormat,
    device: torch.device,
    rows: int | None = None,
    k: int | None = None,
    *,
    dtype: torch.dtype | None = None,
    op: str | None = None,
    n: int | None = None,
) -> BlockConfig:
    """Tile configuration of a GEMM of format ``fmt`` on ``device`` with an x of ``dtype``.

    ``rows``: the row count a tile owner has (``m`` of a local GEMM, the rows per owner of a
    scatter); at most :data:`SMALL_M` selects 64-row tiles on GPU. ``rows`` must come from shapes
    every rank agrees on (the call descriptor checks them): ``block_m``/``block_n`` set the tile
    counts that become signal targets. ``k`` (which may differ between ranks) and ``dtype`` select
    only ``block_k``, which no count depends on (nor does the TF32 switch, a per-process setting).

    ``op`` (the tuned file's op: ``matmul``, ``all_gather_matmul``, ``matmul_reduce_scatter``,
    ``matmul_all_reduce``, ``grouped_matmul`` (``rows``: its rows per expert), for every format) and
    ``n``: the tuned file of this GPU is consulted for ``(op, dtype, format, rows, n)``, never ``k`` for
    the fused ops, so every rank of a reducing op that agrees on the call gets the same tiles.
    ``all_gather_matmul`` ranks may differ in ``n``, so its tiles are each rank's own: nothing that
    peers count may follow them (its pushed chunks follow the untuned tiles, :func:`chunk_rows`).
    """
    cfg = _tuned_blocks(fmt, device, dtype, op, (rows, k, n))
    if cfg is None:
        cfg = _defaults(fmt, device, rows)
        if device.type != "cuda":
            return _group_narrowed(fmt, cfg)
    if fmt.kind == "fp8":
        # Unaligned FP8 rows take the fp16 path of tile.fp8_dot, 16 deep.
        if k is not None and k % 16:
            cfg = replace(cfg, block_k=NARROW_BLOCK_K)
    elif dtype is not None and ((k is not None and k * dtype.itemsize % 16) or dot_precision(dtype, device) == "ieee"):
        cfg = replace(cfg, block_k=min(cfg.block_k, NARROW_BLOCK_K))
    return _group_narrowed(fmt, cfg)


def _defaults(fmt: OperandFormat, device: torch.device, rows: int | None) -> BlockConfig:
    small = rows is not None and rows <= SMALL_M
    if fmt.kind == "fp8":
        if device.type != "cuda":
            return CPU_FP8_BLOCKS
        return GPU_FP8_SMALL_M_BLOCKS if small else GPU_FP8_BLOCKS
    if device.type != "cuda":
        return CPU_BLOCKS
    return GPU_SMALL_M_BLOCKS if small else GPU_BLOCKS


def _group_narrowed(fmt: OperandFormat, cfg: BlockConfig) -> BlockConfig:
    """int8 per-group scales: 16-deep steps lie inside one group whenever ``group_size % 16 == 0``
    (one scale row per step instead of a gather: 64-deep steps spilled on sm_90)."""
    if fmt.kind == "int8" and fmt.mode == "per_group" and fmt.group_size % cfg.block_k:
        return replace(cfg, block_k=min(cfg.block_k, NARROW_BLOCK_K))
    return cfg


def _tuned_blocks(
    fmt: OperandFormat, device: torch.device, dtype: torch.dtype | None, op: str | None, shape: tuple
) -> BlockConfig | None:
    rows, k, n = shape
    if op is None or rows is None or n is None or dtype is None or rows < 1 or n < 1:
        return None
    tc = tuned.lookup(tuned.Query(op, dtype, rows, n, k, fmt.encode()), device)
    if tc is None:
        return None
    base = CPU_BLOCKS if device.type != "cuda" else GPU_BLOCKS
    return BlockConfig(tc.block_m, tc.block_n, tc.block_k, tc.num_warps, tc.num_stages, base.ag_splits, tc.group_m)


def chunk_rows(device: torch.device, m_local: int) -> int:
    """Rows per pushed chunk of an all-gather shard: a peer flags each chunk and the GEMM here waits on
    those flags, so every rank must count the same chunks. They follow ``m_local`` (in the checked
    descriptor) and the untuned plain tile height for it (the FP8 defaults have the same heights),
    never the tuned tiles, which each rank looks up by its own ``n``; a tile of another height waits
    for every chunk it overlaps."""
    base = _defaults(OperandFormat(), device, m_local)
    return max(1, triton.cdiv(triton.cdiv(m_local, base.ag_splits), base.block_m)) * base.block_m


def as_blocks(cfg: GemmConfig, ag_splits: int) -> BlockConfig:
    """A tile-core :class:`GemmConfig` (the tuner's space) as the fused kernels' :class:`BlockConfig`."""
    return BlockConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, ag_splits, cfg.group_m)


def acc_dtype(dtype: torch.dtype) -> tl.dtype:
    """Accumulator of products and reductions: fp64 for fp64 inputs, else fp32 (every other format)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    """``tl.dot``'s input precision. Triton multiplies fp32 operands as TF32 by default; on CUDA fp32
    follows ``torch.backends.cuda.matmul.allow_tf32`` instead (off by default), as the sequential
    path's cuBLAS GEMM does, so the fused result stays within fp32 tolerance of it."""
    if dtype == torch.float32 and device.type == "cuda" and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def dot_math(dtype: torch.dtype, device: torch.device) -> Math:
    """The ``MATH`` constexpr of the kernels for an x of ``dtype``: (accumulator, dot precision). FP8 tiles
    accumulate in fp32 whatever it says."""
    return Math(acc_dtype(dtype), dot_precision(dtype, device))


def kernel_format(fmt: OperandFormat, cfg: BlockConfig) -> Format:
    """The ``FMT`` constexpr of the kernels: :class:`tile.Format`, ``(kind, scale layout, offset)``.

    int8 per-group scales are ``PER_GROUP_ALIGNED`` when a k step lies inside one group
    (``group_size % block_k == 0``: one ``[BLOCK_N]`` scale row per step), else gathered per element.
    """
    if fmt.kind == "fp8":
        return Format(FP8, PER_BLOCK if fmt.mode == "block" else PER_ROW, False)
    if fmt.kind == "int8":
        if fmt.mode == "per_group":
            layout = PER_GROUP_ALIGNED if fmt.group_size % cfg.block_k == 0 else PER_GROUP
        else:
            layout = PER_TENSOR if fmt.mode == "per_tensor" else PER_CHANNEL
        return Format(INT8, layout, fmt.offset)
    return Format(PLAIN, 0, False)


def _scale_strides(fmt: OperandFormat, scale: torch.Tensor) -> tuple[int, int]:
    """``(stride along rows, stride along k blocks)`` of an FP8 scale (0: broadcast). A 0-dim scale
    (tensorwise) is a row scale of stride 0; ``[rows, 1]`` a row scale; k blocks only in block mode."""
    if scale.dim() == 0:
        return 0, 0
    return scale.stride(0), scale.stride(1) if fmt.mode == "block" else 0


def x_operand(fmt: OperandFormat, x: torch.Tensor, x_scale: torch.Tensor | None) -> tuple:
    """``X = (x, stride_m, stride_k, scale, stride_sm, stride_sk)``: 2-D ``x`` and, for FP8, its scales
    (``[]``, ``[m, 1]`` or ``[m, G]``; ``None`` otherwise)."""
    if fmt.kind != "fp8":
        return (x, x.stride(0), x.stride(1), None, 0, 0)
    assert x_scale is not None
    return (x, x.stride(0), x.stride(1), x_scale, *_scale_strides(fmt, x_scale))


def w_operand(
    fmt: OperandFormat, weight: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None
) -> tuple:
    """``W = (weight, stride_n, stride_k, scale, offset, stride_sn, stride_sk, group_size)``.

    FP8: the weight scale (``[]``, ``[n, 1]``, ``[ceil(n / 128), G]``). int8: the scale and its zero
    points, which share one set of strides (same shape, both contiguous; 0 where the layout has no
    such dim), and the per-group width. Plain: no scale (``None``).
    """
    head = (weight, weight.stride(0), weight.stride(1))
    if fmt.kind == "fp8":
        assert scale is not None
        return (*head, scale, None, *_scale_strides(fmt, scale), 1)
    if fmt.kind == "int8":
        assert scale is not None
        scale = scale.contiguous()
        zeros = None if offset is None else offset.to(torch.float32).contiguous()
        stride_sn = scale.stride(0) if scale.dim() >= 1 else 0
        stride_sg = scale.stride(1) if scale.dim() == 2 else 0
        return (*head, scale, zeros, stride_sn, stride_sg, max(fmt.group_size, 1))
    return (*head, None, None, 0, 0, 1)


def scale_rows(fmt: OperandFormat, x_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """An FP8 x scale as one row of scales per row of x (a tensorwise scalar on each row)."""
    return x_scale.reshape(1, 1).expand(rows, 1) if x_scale.dim() == 0 else x_scale
