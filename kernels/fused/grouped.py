"""The grouped GEMM of mixture-of-experts layers: each expert's rows of ``x`` times that expert's weight.

``out[r] = x[r] @ dequant(weight[e]).T`` for the rows ``r`` of expert ``e``, ``expert_offsets[e - 1] <= r <
expert_offsets[e]`` (cumulative end offsets, ``torch._grouped_mm``'s ``offs``), in every operand format the
tile core has (:mod:`tile`; the public op takes plain and FP8). The tile is :func:`tile.tile_matmul` itself,
given the expert's weight and weight-scale pointers, so a format added to the core is a format here.

Persistent walk with no host read of the group sizes (CUDA graphs replay it whatever the routing): the
expert ``e`` has ``cdiv(rows_e, BLOCK_M)`` row tiles, so all experts together have at most
``cdiv(m, BLOCK_M) + E - 1`` of them, a bound known from the shapes. A fixed grid of programs walks tile
ids ``pid, pid + P, ...`` below that bound times the column tiles; the tiles of expert ``e`` follow those of
expert ``e - 1``, so a program's experts only move forward, and each program finds its tile's expert by
advancing a cursor through ``expert_offsets`` (read on the device, each entry once per program). Ids past
the experts' real tiles (the bound is not reached when an expert's rows do not fill its last tile) are
skipped. Within an expert the tiles go in grouped order (:func:`gemm_persistent.tile_coords`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..format import OperandFormat
from .blocks import BlockConfig, block_config, dot_math, kernel_format, w_operand, x_operand
from .gemm_persistent import num_programs, tile_coords
from .matmul import ROUNDING
from .tile import PLAIN, Format, Tile, store_tile, tile_matmul

_PLAIN = tl.constexpr(PLAIN)


class GroupedConfig(NamedTuple):
    """``CONFIG`` of :func:`_grouped_kernel`: the tile core's format and tiles and the epilogue's rounding."""

    FMT: Format
    TILE: Tile
    ROUND: int


@triton.jit
def _clamped(end, start, M):
    """An expert's end row kept in ``[start, M]``: unchecked offsets (a GPU call reads none on the host) that
    decrease or pass ``m`` give wrong rows, never an access outside x and out."""
    return tl.minimum(tl.maximum(end.to(tl.int32), start), M)


@triton.jit
def _grouped_kernel(OPERANDS, OUT, GROUPS, CONFIG: tl.constexpr, MATH: tl.constexpr):
    # OPERANDS = (X, W) and CONFIG (GroupedConfig) hold tile.py's bundles: five parameters at most (the repo's
    # positional budget; Triton 3.6's interpreter cannot bind keyword-only ones), MATH on its own (Triton 3.6
    # could not take a constexpr tuple holding a string out of a larger one by index).
    X, W = OPERANDS
    w_ptr, stride_wn, stride_wk, ws_ptr, wo_ptr, stride_wsn, stride_wsk, group_size = W
    # Bound to constexpr locals before they are passed on: Triton 3.6 reads a nested named tuple's field as a
    # plain tuple, which a function call cannot take.
    FMT: tl.constexpr = CONFIG.FMT
    TILE: tl.constexpr = CONFIG.TILE
    ROUND: tl.constexpr = CONFIG.ROUND
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    offsets_ptr, num_experts, M, N, K, stride_we, stride_wse = GROUPS
    n_tiles = tl.cdiv(N, BLOCK_N)
    # Every expert holds at most one partial row tile: the walk's bound from the shapes alone.
    bound = (tl.cdiv(M, BLOCK_M) + num_experts - 1) * n_tiles
    # The cursor: expert e owns rows [start, end) and row tiles [first, first + tiles) of the walk.
    # (int32 tensors from the start: loop-carried values keep one type.)
    e = tl.full((), 0, tl.int32)
    start = tl.full((), 0, tl.int32)
    end = _clamped(tl.load(offsets_ptr), start, M)
    first = tl.full((), 0, tl.int32)
    tiles = tl.cdiv(end, BLOCK_M)
    for tile_id in range(tl.program_id(0), bound, tl.num_programs(0)):
        tile_m = tile_id // n_tiles
        while (tile_m >= first + tiles) & (e < num_experts - 1):
            e += 1
            first += tiles
            start = end
            end = _clamped(tl.load(offsets_ptr + e), start, M)
            tiles = tl.cdiv(end - start, BLOCK_M)
        if tile_m < first + tiles:
            pid_m, pid_n = tile_coords(tile_id - first * n_tiles, tiles, n_tiles, TILE.GROUP_M)
            offs_m = start.to(tl.int64) + pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
            offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
            tile = (offs_m, offs_m < end, offs_n, offs_n < N)
            # The expert's weight and scale slices. W_e is built here, not returned by a helper: Triton 3.6
            # cannot return a tuple holding None (the plain format's scale, any format's offset) from a function.
            e64 = e.to(tl.int64)
            w_e = w_ptr + e64 * stride_we
            if FMT.KIND == _PLAIN:
                W_e = (w_e, stride_wn, stride_wk, ws_ptr, wo_ptr, stride_wsn, stride_wsk, group_size)
            else:
                ws_e = ws_ptr + e64 * stride_wse
                W_e = (w_e, stride_wn, stride_wk, ws_e, wo_ptr, stride_wsn, stride_wsk, group_size)
            acc = tile_matmul(X, W_e, tile, K, None, FMT, TILE, MATH)
            store_tile(OUT, acc, tile, ROUND)


def config(fmt: OperandFormat, x: torch.Tensor, n: int, num_experts: int) -> BlockConfig:
    """The tiles of a grouped GEMM: :func:`blocks.block_config`'s for the mean rows per expert (the shapes
    are all the host knows of the routing), the tuned file's ``grouped_matmul`` entry nearest to them
    (keyed by those rows, :mod:`tuned`; its plain entries only) where there is one."""
    m, k = x.shape
    rows = triton.cdiv(m, max(num_experts, 1))
    return block_config(fmt, x.device, rows, k, dtype=x.dtype, op="grouped_matmul", n=n)


def launch(
    fmt: OperandFormat,
    x: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    cfg: BlockConfig | None = None,
) -> torch.Tensor:
    """``out[rows of e] = dequant(x[rows of e]) @ dequant(weight[e]).T`` for every expert ``e``; returns ``out``.

    ``x [m, k]``, ``weight [E, n, k]``, ``expert_offsets [E]`` (int32 / int64, cumulative ends, last ``m``),
    ``out [m, n]``; FP8: ``x_scale`` in the kernels' rows layout (``[]``, ``[m, 1]``, ``[m, G]``) and
    ``w_scale`` with a leading expert dim (``[E]``, ``[E, n, 1]``, ``[E, ceil(n / 128), G]``). Arguments are
    validated by the caller (:mod:`kernels.ops.grouped_matmul`); ``cfg`` overrides the tiles (tests).
    """
    m, k = x.shape
    num_experts, n, _ = weight.shape
    if m == 0 or n == 0:
        return out
    cfg = cfg if cfg is not None else config(fmt, x, n, num_experts)
    bound = (triton.cdiv(m, cfg.block_m) + num_experts - 1) * triton.cdiv(n, cfg.block_n)
    scale_e = None if w_scale is None else w_scale[0]
    _grouped_kernel[(num_programs(x.device, bound),)](
        # W: expert 0's slices, the same base pointers, with the per-expert strides of the slices.
        (x_operand(fmt, x, x_scale), w_operand(fmt, weight[0], scale_e, None)),
        (out, out.stride(0), out.stride(1), None),
        (expert_offsets, num_experts, m, n, k, weight.stride(0), 0 if w_scale is None else w_scale.stride(0)),
        GroupedConfig(kernel_format(fmt, cfg), cfg.tile(), ROUNDING[fmt.kind]),
        dot_math(x.dtype, x.device),
        **cfg.launch(),
    )
    return out
