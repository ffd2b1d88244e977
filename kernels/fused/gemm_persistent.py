"""Persistent GEMM kernels for Hopper: one program per SM walks output tiles in grouped order.

``c = a @ b.T + bias`` for ``a [M, K]`` and ``b [N, K]`` (``F.linear`` layout). The grid is
``min(SM count, tiles)``; program ``p`` computes tiles ``p, p + grid, p + 2 * grid, ...`` of the
grouped order (:func:`tile_coords`, the same bijection as :func:`tile.grouped_tile`), so a wave of
resident programs reads a few A row panels and B column panels out of L2, and no launch pays for
more programs than the GPU holds (the prologue of tile ``i + 1`` overlaps the epilogue of tile ``i``
within one program's instruction stream).

Two variants:

* :func:`_tma_kernel`: A, B and C move through host-built TMA tensor descriptors
  (``triton.tools.tensor_descriptor.TensorDescriptor``, supported by Triton 3.6 and later): one
  ``cp.async.bulk.tensor`` (UTMALDG) per operand tile and k step; out-of-range rows and columns
  read as zeros and are not written. Needs row-major operands whose rows start 16-byte aligned;
* :func:`_pointer_kernel`: the same walk with masked pointer loads (cp.async), for any strides.

A ``walk`` tensor (tests only) gets 1 added to ``walk[tile]`` for every tile a program computes, so a test
can check that the walk covers every tile exactly once whatever order the programs run in.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .gemm_configs import GemmConfig
from .runtime import triton_interpreted
from .tile import CAST, Math, Tile, dot_acc, load_a, load_b, store_tile

# Programs of an interpreted persistent launch: a few, so tests see several tiles per program.
INTERPRETER_SMS = 3
# The pointer kernel's epilogue (tile.store_tile): the bias added in the accumulator, one rounding to c's dtype.
_CAST = tl.constexpr(CAST)


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of tile ``tile_id`` in grouped order (a bijection onto the tile grid)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile_id // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    local = tile_id % per_group
    return first_m + local % group_rows, local // group_rows


@triton.jit
def _record(walk_ptr, tile_id):
    if walk_ptr is not None:
        tl.atomic_add(walk_ptr + tile_id, 1)


@triton.jit(do_not_specialize=["num_programs"])
def _tma_kernel(a_desc, b_desc, c_desc, bias_ptr, walk_ptr, dims, num_programs, TILE: tl.constexpr, MATH: tl.constexpr):
    M, N, K = dims
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_K: tl.constexpr = TILE.BLOCK_K
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in range(tl.program_id(0), num_tiles, num_programs):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, TILE.GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=MATH.ACC_DTYPE)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k0])
            b = b_desc.load([off_n, k0])
            acc = dot_acc(a, b.T, acc, MATH)
        if bias_ptr is not None:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(MATH.ACC_DTYPE)[None, :]
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
        _record(walk_ptr, tile_id)


@triton.jit(do_not_specialize=["num_programs"])
def _pointer_kernel(A, B, OUT, walk_ptr, dims, num_programs, TILE: tl.constexpr, MATH: tl.constexpr):
    M, N, K = dims
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_K: tl.constexpr = TILE.BLOCK_K
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in range(tl.program_id(0), num_tiles, num_programs):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, TILE.GROUP_M)
        # int64: offs * stride of a large (or transposed) operand may pass 2^31.
        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        tile = (offs_m, offs_m < M, offs_n, offs_n < N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=MATH.ACC_DTYPE)
        for k0 in range(0, K, BLOCK_K):
            a, offs_k, mask_k = load_a(A, tile, k0, K, BLOCK_K)
            acc = dot_acc(a, load_b(B, tile, offs_k, mask_k), acc, MATH)
        store_tile(OUT, acc, tile, _CAST)
        _record(walk_ptr, tile_id)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device, tiles: int) -> int:
    """Grid of a persistent launch: one program per SM (a few under the interpreter), at most one per tile."""
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = INTERPRETER_SMS
    return max(1, min(sms, tiles))


def _rows_aligned(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


@functools.lru_cache(maxsize=1)
def interpreter_supports_tma() -> bool:
    """Whether this Triton's interpreter runs descriptor loads at runtime offsets (3.9 does; 3.6
    fails with "only 0-dimensional arrays can be converted to Python scalars")."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    a = torch.arange(32, dtype=torch.float32).reshape(2, 16)
    out = torch.zeros(2, 4)
    try:
        _probe_kernel[(1,)](TensorDescriptor(a, [2, 16], [16, 1], [2, 4]), out, 8)
    except Exception:
        return False
    return torch.equal(out, a[:, 8:12])


@triton.jit
def _probe_kernel(a_desc, out_ptr, k0):
    offs = tl.arange(0, 2)[:, None] * 4 + tl.arange(0, 4)[None, :]
    tl.store(out_ptr + offs, a_desc.load([0, k0]))


def tma_usable(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the TMA variant can run on these operands (else :func:`launch` needs "persistent")."""
    if triton_interpreted() and not interpreter_supports_tma():
        return False
    return all(_rows_aligned(t) for t in (x, weight, out))


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: GemmConfig,
    *,
    math: Math,
    walk: torch.Tensor | None = None,
) -> None:
    """``out = x @ weight.T + bias`` with the persistent kernel of ``cfg.variant`` ("tma" or "persistent").

    ``math``: the kernels' ``MATH`` (:func:`blocks.dot_math`). ``walk``
    (tests): int32 ``[tiles]`` that every computed tile increments. The caller checks
    :func:`tma_usable` before asking for "tma".
    """
    m, k = x.shape
    n = weight.shape[0]
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = num_programs(x.device, tiles)
    bias = bias.contiguous() if bias is not None else None
    common = dict(
        TILE=Tile(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m),
        MATH=math,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.variant == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
        b_desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [cfg.block_n, cfg.block_k])
        c_desc = TensorDescriptor(out, [m, n], [out.stride(0), 1], [cfg.block_m, cfg.block_n])
        _tma_kernel[(programs,)](a_desc, b_desc, c_desc, bias, walk, (m, n, k), programs, **common)
    elif cfg.variant == "persistent":
        _pointer_kernel[(programs,)](
            (x, x.stride(0), x.stride(1)),
            (weight, weight.stride(0), weight.stride(1)),
            (out, out.stride(0), out.stride(1), bias),
            walk,
            (m, n, k),
            programs,
            **common,
        )
    else:
        raise ValueError(f"cfg.variant: {cfg.variant!r} is not a persistent variant ('tma' or 'persistent')")
