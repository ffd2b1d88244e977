"""The Triton GEMM core shared by the fused ops, and a bare ``matmul`` launcher over it.

``tile_matmul`` computes one ``[BLOCK_M, BLOCK_N]`` fp32 tile of ``a @ b.T`` for ``b`` in
``F.linear`` layout ``[n, k]``; the fused kernels decide which rows a program owns, where the rows
come from (local or gathered memory) and where the tile goes (local output or a peer's slot).
Rows and columns outside the matrices are masked, so any ``m``, ``n``, ``k`` works.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .gemm_configs import GemmConfig
from .runtime import triton_interpreted

# The Triton interpreter (3.6 to 3.9 at least) multiplies bf16 dot operands wrongly (results off by
# 1e10: NumPy has no bf16 and the emulated product is garbage), while loads, stores and casts of
# bf16 are exact. A product of two bf16 values is exact in fp32 (8 + 8 significant bits) and the
# dot accumulates in fp32 anyway, so widening both operands first gives the tensor-core result.
# Compiled kernels keep bf16 operands: this is a constant False there.
_WIDEN_BF16_DOT = tl.constexpr(triton_interpreted())


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch parameters; identical on every rank (tile counts drive the signal targets).

    ``ag_splits``: chunks per all-gather shard, each with its own ready flag, so the GEMM starts on
    a shard's first rows before the rest arrive (at most ``signals.AG_MAX_SPLITS``). ``group_m``:
    row tiles per group of the bare GEMM's grouped tile order (:func:`grouped_tile`).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    ag_splits: int
    group_m: int


# The interpreter costs per program and per loop step, so CPU tiles stay small to keep tests fast
# while still crossing tile boundaries with test shapes of a few dozen rows.
CPU_BLOCKS = BlockConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, ag_splits=2, group_m=2)
GPU_BLOCKS = BlockConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, ag_splits=4, group_m=8)
# Decode-size m: a 128-row tile would compute at least half masked rows; 64 rows is the M of one
# warpgroup's wgmma, so 4 warps carry the tile.
GPU_SMALL_M_BLOCKS = replace(GPU_BLOCKS, block_m=64, num_warps=4, num_stages=4)
SMALL_M = 64
# 16-deep k steps where 64-deep ones spill on sm_90: operand rows that do not start 16-byte aligned
# (loaded one element per instruction; 500-800 bytes spilled per thread) and the exact-fp32 dot
# (FMA, no tensor cores; 16 bytes spilled under Triton 3.6, up to 6 KB in the broadcast scatter).
NARROW_BLOCK_K = 16


def block_config(
    device: torch.device,
    rows: int | None = None,
    k: int | None = None,
    dtype: torch.dtype | None = None,
    *,
    op: str | None = None,
    n: int | None = None,
) -> BlockConfig:
    """Tile configuration of a GEMM launch on ``device`` with operands of ``dtype``.

    ``rows``: the row count a tile owner has (``m`` of a local GEMM, the rows per owner of a
    scatter); at most :data:`SMALL_M` selects 64-row tiles on GPU. ``rows`` must come from shapes
    every rank agrees on (the call descriptor checks them): ``block_m``/``block_n`` set the tile
    counts that become signal targets. ``k`` (which may differ between ranks) and ``dtype`` select
    only ``block_k``, which no count depends on (nor does the TF32 switch, a per-process setting).

    ``op`` (a fused op's name) and ``n``: the tuned file of this GPU (:mod:`tuned`) is consulted for
    ``(op, dtype, rows, n)``, never ``k``, so every rank of a reducing op that agrees on the call gets
    the same tiles. ``all_gather_matmul`` ranks may differ in ``n``, so its tiles are each rank's own:
    nothing that peers count may follow them (its pushed chunks follow the untuned tiles).
    """
    cfg = _tuned_blocks(device, rows, dtype, op, n)
    if cfg is None:
        if device.type != "cuda":
            return CPU_BLOCKS
        cfg = GPU_SMALL_M_BLOCKS if rows is not None and rows <= SMALL_M else GPU_BLOCKS
    if dtype is not None and ((k is not None and k * dtype.itemsize % 16) or dot_precision(dtype, device) == "ieee"):
        cfg = replace(cfg, block_k=min(cfg.block_k, NARROW_BLOCK_K))
    return cfg


def _tuned_blocks(
    device: torch.device, rows: int | None, dtype: torch.dtype | None, op: str | None, n: int | None
) -> BlockConfig | None:
    if op is None or rows is None or n is None or dtype is None or rows < 1 or n < 1:
        return None
    from . import tuned

    tc = tuned.lookup(op, device, dtype, rows, n)
    if tc is None:
        return None
    base = CPU_BLOCKS if device.type != "cuda" else GPU_BLOCKS
    return BlockConfig(
        block_m=tc.block_m,
        block_n=tc.block_n,
        block_k=tc.block_k,
        num_warps=tc.num_warps,
        num_stages=tc.num_stages,
        ag_splits=base.ag_splits,
        group_m=tc.group_m,
    )


def acc_dtype(dtype: torch.dtype) -> tl.dtype:
    """Accumulator of products and reductions: fp64 for fp64 inputs, else fp32 (fp16/bf16/fp32 inputs)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    """``tl.dot``'s input precision. Triton multiplies fp32 operands as TF32 by default; on CUDA fp32
    follows ``torch.backends.cuda.matmul.allow_tf32`` instead (off by default), as the sequential
    path's cuBLAS GEMM does, so the fused result stays within fp32 tolerance of it."""
    if dtype == torch.float32 and device.type == "cuda" and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@triton.jit
def load_a(a_ptr, stride_am, stride_ak, offs_m, mask_m, k0, K, BLOCK_K: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_K]`` A tile of k step ``k0`` (zeros outside), its ``offs_k`` and ``mask_k``."""
    offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    mask_k = offs_k < K
    a = tl.load(
        a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )
    return a, offs_k, mask_k


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(offs_m, mask_m, offs_n, mask_n)`` of tile ``pid`` of an ``M x N`` output in grouped order.

    Consecutive programs walk a group of ``GROUP_M`` row tiles column by column, so the programs
    resident at one time read a few A row panels and a few B column panels, which stay in L2; in
    row-major order every row tile streams all of B again. The mapping is a bijection (the last
    group may have fewer row tiles).
    """
    m_tiles = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    local = pid % per_group
    offs_m = (first_m + local % group_rows) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = (local // group_rows) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    return offs_m, offs_m < M, offs_n, offs_n < N


@triton.jit
def store_tile(
    c_ptr,
    acc,
    bias_ptr,
    offs_m,
    mask_m,
    offs_n,
    mask_n,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
):
    """``c[offs_m, offs_n] = acc + bias`` in ``c``'s dtype. ``ROUND_FIRST`` rounds the product to that
    dtype before bias is added in fp32, as the w8A16 reference does (``partial.add_(bias)``)."""
    if ROUND_FIRST:
        acc = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(acc.dtype)[None, :]
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def tile_matmul(
    a_ptr,
    stride_am,
    stride_ak,
    b_ptr,
    stride_bn,
    stride_bk,
    offs_m,
    mask_m,
    offs_n,
    mask_n,
    K,
    g_ptr,
    stride_gm,
    g_mask_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STORE_A: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``a[offs_m, :] @ b[offs_n, :].T`` accumulated in ``ACC_DTYPE``; with ``STORE_A`` also copies the
    A rows selected by ``g_mask_m`` to ``g``.

    ``offs_m``/``offs_n``/``offs_k`` are int64 so addresses of large matrices cannot overflow (with a
    transposed operand such as ``weight.t()``, ``offs_k * stride`` reaches the operand's numel).
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        a, offs_k, mask_k = load_a(a_ptr, stride_am, stride_ak, offs_m, mask_m, k0, K, BLOCK_K)
        b = tl.load(
            b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )
        if STORE_A:
            tl.store(g_ptr + offs_m[:, None] * stride_gm + offs_k[None, :], a, mask=g_mask_m[:, None] & mask_k[None, :])
        acc = dot_acc(a, b, acc, DOT_PRECISION, ACC_DTYPE)
    return acc


@triton.jit
def dot_acc(a, b, acc, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """``acc + a @ b`` for every GEMM of the fused ops (see ``_WIDEN_BF16_DOT``)."""
    if _WIDEN_BF16_DOT and a.dtype == tl.bfloat16:
        # fp32 operands must not be rounded to TF32 here: they hold exact bf16 values.
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=ACC_DTYPE)
    else:
        # out_dtype must name the accumulator's type: Triton 3.6 rejects an fp64 acc with the fp32 default.
        result = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return result


@triton.jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    offs_m, mask_m, offs_n, mask_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tile_matmul(
        a_ptr,
        stride_am,
        stride_ak,
        b_ptr,
        stride_bn,
        stride_bk,
        offs_m,
        mask_m,
        offs_n,
        mask_n,
        K,
        c_ptr,
        0,
        mask_m,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        False,
        ACC_DTYPE,
        DOT_PRECISION,
    )
    store_tile(c_ptr, acc, bias_ptr, offs_m, mask_m, offs_n, mask_n, stride_cm, stride_cn, HAS_BIAS, False)


def local_launch(x: torch.Tensor, n: int) -> tuple[torch.Tensor, BlockConfig, tuple[int]]:
    """Output ``[m, n]``, tile configuration and grid of a local GEMM of ``x [m, k]`` (grid ``(0,)``
    when the output is empty)."""
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = block_config(x.device, m, k, x.dtype)
    return out, cfg, tile_grid(m, n, cfg)


def tile_grid(m: int, n: int, cfg: BlockConfig | GemmConfig) -> tuple[int]:
    """The 1-D grid of a bare GEMM of ``[m, n]``: one program per output tile (``(0,)`` when empty);
    the kernel orders the tiles itself (:func:`grouped_tile`)."""
    return (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)


def tile_launch_options(cfg: BlockConfig | GemmConfig) -> dict:
    """The tile constants and launch options of a bare GEMM kernel (``BLOCK_*``, ``GROUP_M``, warps, stages)."""
    return dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def default_config(x: torch.Tensor) -> GemmConfig:
    """Today's GEMM of ``x [m, k]`` without a tuned file: the plain kernel with :func:`block_config`'s tiles."""
    b = block_config(x.device, x.shape[0], x.shape[1], x.dtype)
    return GemmConfig(b.block_m, b.block_n, b.block_k, b.num_warps, b.num_stages, b.group_m, "plain")


def matmul_config(x: torch.Tensor, n: int) -> GemmConfig:
    """The config the bare :func:`matmul` runs for ``x [m, k]`` and ``n`` columns: this GPU's tuned
    file entry (:mod:`tuned`), else :func:`default_config`."""
    m, k = x.shape
    tc = None
    if m > 0 and n > 0 and k > 0:
        from . import tuned

        tc = tuned.lookup("matmul", x.device, x.dtype, m, n, k)
    return default_config(x) if tc is None else tc


# Configs whose launch failed in this process (compile error, out of resources): not tried again.
_failed: set[tuple[GemmConfig, torch.dtype]] = set()


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemmConfig | None = None,
    fallback: bool = True,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with the GEMM core (fp32 accumulate, fp64 for fp64); the W == 1 path.

    x ``[m, k]`` (any strides), weight ``[n, k]`` (any strides), bias ``[n]`` or None -> ``[m, n]``.
    Reference: ``torch.nn.functional.linear(x, weight, bias)``.

    ``config`` (the tuner, tests): run this config instead of :func:`matmul_config`'s. A "tma"
    config on operands TMA cannot address (unaligned rows, a transposed operand) runs the
    "persistent" variant with the same tiles; pointer-loaded variants take the narrow ``block_k``
    where :func:`block_config` does; a config that fails to compile or launch falls back to
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
        from . import gemm_persistent

        if cfg.variant == "tma" and not gemm_persistent.tma_usable(x, weight, out):
            cfg = replace(cfg, variant="persistent")
        cfg = _narrowed(x, cfg)
        try:
            gemm_persistent.launch(x, weight, bias, out, cfg, acc_dtype(x.dtype), dot_precision(x.dtype, x.device))
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
    _launch_plain(x, weight, bias, out, _narrowed(x, cfg))
    return out


def _narrowed(x: torch.Tensor, cfg: GemmConfig) -> GemmConfig:
    """``cfg`` with :func:`block_config`'s narrow ``block_k`` where pointer loads of ``x`` would spill."""
    if cfg.variant == "tma" or block_config(x.device, x.shape[0], x.shape[1], x.dtype).block_k != NARROW_BLOCK_K:
        return cfg
    return replace(cfg, block_k=min(cfg.block_k, NARROW_BLOCK_K))


def _launch_plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, cfg) -> None:
    m, k = x.shape
    n = weight.shape[0]
    bias_arg = bias.contiguous() if bias is not None else out
    _matmul_kernel[tile_grid(m, n, cfg)](
        x,
        weight,
        bias_arg,
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        ACC_DTYPE=acc_dtype(x.dtype),
        DOT_PRECISION=dot_precision(x.dtype, x.device),
        **tile_launch_options(cfg),
    )
