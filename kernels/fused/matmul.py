"""The local GEMM of every format: ``x @ dequant(w).T + bias`` without communication.

It is the W == 1 path of every fused op and the GEMM of the extra weights of a multi-weight
all-gather. One kernel (:func:`_matmul_kernel`, the tile core of :mod:`tile`) serves every format;
plain operands also have the persistent TMA and pointer-load variants of :mod:`gemm_persistent`,
which the tuned file may choose for them (:func:`linear`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import torch
import triton
import triton.language as tl

from ..format import PLAIN, OperandFormat
from ..ops.gemm import GemmCall, Operands
from . import gemm_persistent, tuned
from .blocks import NARROW_BLOCK_K, BlockConfig, block_config, dot_math, kernel_format, w_operand, x_operand
from .gemm_configs import GemmConfig
from .tile import CAST, ROUND_FIRST, Tile, grouped_tile, store_tile, tile_matmul

# The epilogue of each format (tile.store_tile).
ROUNDING = {"plain": CAST, "int8": ROUND_FIRST, "fp8": CAST}


@triton.jit
def _matmul_kernel(X, W, OUT, dims, FMT: tl.constexpr, TILE: tl.constexpr, MATH: tl.constexpr, ROUND: tl.constexpr):
    M, N, K = dims
    tile = grouped_tile(tl.program_id(0), M, N, TILE)
    acc = tile_matmul(X, W, tile, K, None, FMT, TILE, MATH)
    store_tile(OUT, acc, tile, ROUND)


def tile_grid(m: int, n: int, cfg: BlockConfig | GemmConfig) -> tuple[int]:
    """The 1-D grid of a GEMM of ``[m, n]``: one program per output tile (``(0,)`` when empty); the
    kernel orders the tiles itself (:func:`tile.grouped_tile`)."""
    return (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)


def rows(x: torch.Tensor) -> torch.Tensor:
    """x's rows as the kernels read them: ``[m, k]`` (a view when x's strides allow)."""
    # Both sizes spelled out: -1 cannot be inferred for an empty k shard (k = 0).
    return x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def gemm(
    fmt: OperandFormat,
    ops: Operands,
    index: int = 0,
    *,
    out_dtype: torch.dtype | None = None,
    cfg: BlockConfig | None = None,
) -> torch.Tensor:
    """``dequant(x) @ dequant(weights[index]).T + biases[index]`` for 2-D ``ops.x`` (x's rows) -> ``[m, n]``
    in ``out_dtype`` (default x's dtype).

    Semantics per format: plain ``F.linear`` with fp32 accumulation (fp64 for fp64); FP8 the scaled
    product accumulated and promoted in fp32, bias added in fp32, one rounding to ``out_dtype``; int8
    ``x @ ((q - offset) * scale).to(x.dtype).T``, rounded to x's dtype, then bias added in fp32.
    ``cfg`` overrides the tile configuration (tests: other k steps); plain operands without it run
    :func:`linear` (the tuned variants).
    """
    x = ops.x
    weight, bias = ops.weights[index], ops.biases[index]
    out_dtype = out_dtype or x.dtype
    if fmt.kind == "plain" and cfg is None:
        y = linear(x, weight, bias)
        return y if y.dtype == out_dtype else y.to(out_dtype)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    cfg = cfg if cfg is not None else block_config(fmt, x.device, m, k, dtype=x.dtype, op="matmul", n=n)
    grid = tile_grid(m, n, cfg)
    if grid[0] == 0:
        return out
    _matmul_kernel[grid](
        x_operand(fmt, x, ops.x_scale),
        w_operand(fmt, weight, ops.scale_of(index), ops.offset_of(index)),
        # The kernel indexes bias with unit stride.
        (out, out.stride(0), out.stride(1), None if bias is None else bias.contiguous()),
        (m, n, k),
        FMT=kernel_format(fmt, cfg),
        TILE=cfg.tile(),
        MATH=dot_math(x.dtype, x.device),
        ROUND=ROUNDING[fmt.kind],
        **cfg.launch(),
    )
    return out


def row_operands(ops: Operands) -> Operands:
    """``ops`` with x as its 2-D rows (and an FP8 x scale of leading dims as ``[m, G]``)."""
    x_scale = ops.x_scale
    if x_scale is not None and x_scale.dim() > 2:
        x_scale = x_scale.reshape(-1, x_scale.shape[-1])
    return Operands(rows(ops.x), ops.weights, ops.biases, x_scale, ops.w_scales, ops.w_offsets)


def blocks_before(x: torch.Tensor, dim: int) -> int:
    """``outer``: how many row blocks of x's rows are gathered / scattered on their own, the product of
    x's dims before ``dim`` (1 for dim 0, and for an empty x)."""
    outer = 1
    for size in x.shape[:dim]:
        outer *= size
    return outer if outer > 0 else 1


def run(call: GemmCall, ops: Operands) -> list[torch.Tensor]:
    """The local GEMM of every weight of ``ops`` on x's rows (no communication): ``[m, n_i]`` each, in
    ``call.out_dtype`` or x's dtype."""
    local = row_operands(ops)
    return [gemm(call.fmt, local, i, out_dtype=call.out_dtype) for i in range(len(ops.weights))]


def default_config(x: torch.Tensor) -> GemmConfig:
    """The plain GEMM of ``x [m, k]`` without a tuned file: the plain kernel with
    :func:`blocks.block_config`'s tiles."""
    b = block_config(PLAIN, x.device, x.shape[0], x.shape[1], dtype=x.dtype)
    return GemmConfig(b.block_m, b.block_n, b.block_k, b.num_warps, b.num_stages, b.group_m, "plain")


def matmul_config(x: torch.Tensor, n: int) -> GemmConfig:
    """The config :func:`linear` runs for ``x [m, k]`` and ``n`` columns: this GPU's tuned file entry
    (:mod:`tuned`), else :func:`default_config`."""
    m, k = x.shape
    tc = None
    if m > 0 and n > 0 and k > 0:
        tc = tuned.lookup(tuned.Query("matmul", x.dtype, m, n, k), x.device)
    return default_config(x) if tc is None else tc


# Configs whose launch failed in this process (compile error, out of resources): not tried again.
_failed: set[tuple[GemmConfig, torch.dtype]] = set()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemmConfig | None = None,
    fallback: bool = True,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for plain operands (fp32 accumulate, fp64 for fp64); the plain W == 1 path.

    x ``[m, k]`` (any strides), weight ``[n, k]`` (any strides), bias ``[n]`` or None -> ``[m, n]``.
    Reference: ``torch.nn.functional.linear(x, weight, bias)``.

    ``config`` (the tuner, tests): run this config instead of :func:`matmul_config`'s. A "tma"
    config on operands TMA cannot address (unaligned rows, a transposed operand) runs the
    "persistent" variant with the same tiles; pointer-loaded variants take the narrow ``block_k``
    where :func:`blocks.block_config` does; a config that fails to compile or launch falls back to
    :func:`default_config` with a warning (once per config and dtype); ``fallback=False`` (the
    tuner) raises instead.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [m, k] and [n, k]")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config if config is not None else matmul_config(x, n)
    if cfg.variant != "plain" and (k == 0 or (cfg, x.dtype) in _failed):
        cfg = default_config(x)
    if cfg.variant != "plain":
        if cfg.variant == "tma" and not gemm_persistent.tma_usable(x, weight, out):
            cfg = replace(cfg, variant="persistent")
        cfg = _narrowed(x, cfg)
        try:
            gemm_persistent.launch(x, weight, bias, out, cfg, math=dot_math(x.dtype, x.device))
            return out
        except Exception as err:  # every compile or launch failure of a variant has one remedy
            if not fallback:
                raise
            _failed.add((cfg, x.dtype))
            warnings.warn(
                f"matmul: GEMM config {cfg.label()} failed for {x.dtype} ({type(err).__name__}: {err}); "
                "running the default plain kernel instead",
                RuntimeWarning,
                stacklevel=2,
            )
        cfg = default_config(x)
    cfg = _narrowed(x, cfg)
    _matmul_kernel[tile_grid(m, n, cfg)](
        x_operand(PLAIN, x, None),
        w_operand(PLAIN, weight, None, None),
        (out, out.stride(0), out.stride(1), None if bias is None else bias.contiguous()),
        (m, n, k),
        FMT=kernel_format(PLAIN, None),
        TILE=Tile(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m),
        MATH=dot_math(x.dtype, x.device),
        ROUND=CAST,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _narrowed(x: torch.Tensor, cfg: GemmConfig) -> GemmConfig:
    """``cfg`` with :func:`blocks.block_config`'s narrow ``block_k`` where pointer loads of ``x`` would spill."""
    if (
        cfg.variant == "tma"
        or block_config(PLAIN, x.device, x.shape[0], x.shape[1], dtype=x.dtype).block_k != NARROW_BLOCK_K
    ):
        return cfg
    return replace(cfg, block_k=min(cfg.block_k, NARROW_BLOCK_K))
