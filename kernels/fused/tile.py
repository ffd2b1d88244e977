"""The Triton tile core of every fused GEMM, for every operand format (:mod:`kernels.format`).

:func:`tile_matmul` computes one ``[BLOCK_M, BLOCK_N]`` tile of ``x @ dequant(w).T`` for ``w`` in
``F.linear`` layout ``[n, k]``; the kernels decide which rows a program owns, where they come from
(local or gathered memory) and where the tile goes (:func:`store_tile` into an output, or a peer's
slot). Rows and columns outside the matrices are masked, so any ``m``, ``n``, ``k`` works. Offsets
are int64: with a transposed operand such as ``weight.t()``, ``offs_k * stride`` reaches its numel.

Every kernel passes its arguments in the same bundles (tuples: Triton specializes their elements
like separate arguments, so strides of 1 stay constants and vector loads stay vector loads; values a
kernel must not specialize on, such as the rank, stay separate arguments):

* ``X = (x, stride_m, stride_k, scale, stride_sm, stride_sk)``: the A operand and, for FP8, its
  fp32 scales (``None`` otherwise): per row (``stride_sk`` 0; a tensorwise scalar is a row scale of
  stride 0) or per row and 128-deep k block;
* ``W = (w, stride_n, stride_k, scale, offset, stride_sn, stride_sk, group_size)``: the B operand
  and its scales: FP8 per row of ``w`` or per 128 x 128 block; int8 per tensor, per row or per row
  and group of ``group_size`` k columns, with optional zero points ``offset`` of the scale's layout;
* ``tile = (offs_m, mask_m, offs_n, mask_n)``: the rows of X and the columns of the output of a tile;
* ``OUT = (c, stride_cm, stride_cn, bias)``: an output and its bias (``None``: no bias);
* constexprs ``FMT`` (:class:`Format`), ``TILE`` (:class:`Tile`), ``MATH`` (:class:`Math`) and the
  epilogue's ``ROUND``.

Constexpr bundles are ``typing.NamedTuple`` values read by field name, never by position: one
named structure per kernel family (this module's for the tile core, the protocol's in each op's
module), built at the launch site. Triton 3.6 and 3.9 both specialize on them as on a plain
tuple, in the interpreter and compiled. Under 3.6 a field read is the plain Python value, not a
constexpr (as a read by index was): a field used as a shape or a ``tl.static_range`` bound is
bound to a ``NAME: tl.constexpr`` local first, and so is a named tuple nested in another before
it is passed to a function.

Formats (``FMT``):

* plain: ``BLOCK_K`` steps of ``tl.dot`` accumulated in ``ACC_DTYPE`` (fp64 for fp64 inputs);
* FP8: a loop over 128-deep scale blocks whose tensor-core sums (FP8 wgmma on sm_90) are promoted
  into a separate fp32 accumulator, scaled per block (``PER_BLOCK``) or once at the end (``PER_ROW``).
  Promoting every 128 k is what keeps the result accurate on Hopper, whose FP8 wgmma accumulates
  with about 14 significant bits (DeepSeek-V3, section 3.3.2). ``BLOCK_N`` and ``BLOCK_K`` divide 128;
* int8 weights (w8A16): each ``[BLOCK_K, BLOCK_N]`` weight tile loaded as int8, turned into
  ``(q - offset) * scale`` in fp32 and rounded to x's dtype before the dot, exactly as
  :func:`kernels.quant.dequantize` does for the reference; the dequantized weight never exists in
  memory. Scales are loaded once (per tensor, per channel), once per k step (``PER_GROUP_ALIGNED``:
  a step lies inside one group) or per element (``PER_GROUP``).

Every format-specific load sits in its constexpr branch, so each specialization compiles to the code
of its format alone.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .runtime import triton_interpreted


class Format(NamedTuple):
    """The ``FMT`` constexpr (:func:`blocks.kernel_format`): the operand format ``KIND`` (``PLAIN``, ``FP8``,
    ``INT8``), its scale layout ``SCALES`` (the constants below) and whether int8 scales carry zero points."""

    KIND: int
    SCALES: int
    HAS_OFFSET: bool


class Tile(NamedTuple):
    """The ``TILE`` constexpr of the GEMM kernels (:meth:`blocks.BlockConfig.tile`): a ``[BLOCK_M, BLOCK_N]``
    output tile, ``BLOCK_K``-deep k steps, ``GROUP_M`` row tiles per group of the grouped order."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int


class Math(NamedTuple):
    """The ``MATH`` constexpr (:func:`blocks.dot_math`): the accumulator dtype and ``tl.dot``'s input precision."""

    ACC_DTYPE: tl.dtype
    DOT_PRECISION: str


# FMT.KIND: the operand format.
PLAIN, FP8, INT8 = 0, 1, 2
# FMT.SCALES of FP8: scales constant along k (per row; tensorwise as stride 0) or per 128-deep k block.
PER_ROW, PER_BLOCK = 0, 1
# FMT.SCALES of int8 (kernels.quant's layouts). PER_GROUP_ALIGNED is per_group with group_size % BLOCK_K
# == 0: a k step lies inside one group, so one [BLOCK_N] row of scales serves the whole step.
PER_TENSOR, PER_CHANNEL, PER_GROUP, PER_GROUP_ALIGNED = 0, 1, 2, 3
# The epilogue's rounding: one cast to the output dtype after bias is added in fp32, to nearest even
# (plain, FP8), or the product rounded to the output dtype before bias is added in fp32 (int8, as the
# w8A16 reference's ``partial.add_(bias)``).
CAST, ROUND_FIRST = 0, 1
# Columns of k per FP8 scale, and rows of n per weight scale in block mode (DeepSeek-V3's 1x128 / 128x128).
SCALE_BLOCK = 128

# The same constants as seen from inside kernels (Triton reads only constexpr globals).
_FP8 = tl.constexpr(FP8)
_INT8 = tl.constexpr(INT8)
_PER_BLOCK = tl.constexpr(PER_BLOCK)
_PER_TENSOR = tl.constexpr(PER_TENSOR)
_PER_CHANNEL = tl.constexpr(PER_CHANNEL)
_PER_GROUP = tl.constexpr(PER_GROUP)
_PER_GROUP_ALIGNED = tl.constexpr(PER_GROUP_ALIGNED)
_ROUND_FIRST = tl.constexpr(ROUND_FIRST)
_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)

# The Triton interpreter (3.6 to 3.9 at least) multiplies bf16 dot operands wrongly (results off by
# 1e10: NumPy has no bf16 and the emulated product is garbage), while loads, stores and casts of
# bf16 are exact. A product of two bf16 values is exact in fp32 (8 + 8 significant bits) and the
# dot accumulates in fp32 anyway, so widening both operands first gives the tensor-core result.
# Compiled kernels keep bf16 operands: this is a constant False there.
_WIDEN_BF16_DOT = tl.constexpr(triton_interpreted())
# The interpreter (3.6 and 3.9) loads, stores and converts FP8 exactly except for the special
# values: it decodes e4m3fn NaN (0x7f) as 480 and e5m2 Inf/NaN as finite numbers, in casts and in
# its fp8 dot alike. Interpreted kernels therefore widen the operands themselves, restore NaN/Inf
# from the bits and multiply in fp32 (FP8 products are exact in fp32, so this is the tensor-core
# result). Compiled kernels feed the FP8 operands to tl.dot: this is a constant False there.
_WIDEN_FP8_DOT = tl.constexpr(triton_interpreted())


@triton.jit
def grouped_tile(pid, M, N, TILE: tl.constexpr):
    """``tile`` of program ``pid`` of an ``M x N`` output in grouped order.

    Consecutive programs walk a group of ``GROUP_M`` row tiles column by column, so the programs
    resident at one time read a few A row panels and a few B column panels, which stay in L2; in
    row-major order every row tile streams all of B again. The mapping is a bijection (the last
    group may have fewer row tiles).
    """
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    GROUP_M: tl.constexpr = TILE.GROUP_M
    m_tiles = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    local = pid % per_group
    offs_m = (first_m + local % group_rows) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = (local // group_rows) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    return offs_m, offs_m < M, offs_n, offs_n < N


@triton.jit
def load_a(A, tile, k0, K, BLOCK_K: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_K]`` tile of ``A = (a, stride_m, stride_k)`` at k step ``k0`` (zeros
    outside), its ``offs_k`` and ``mask_k``."""
    a_ptr, stride_am, stride_ak = A
    offs_m, mask_m, _, _ = tile
    offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    mask_k = offs_k < K
    a = tl.load(
        a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )
    return a, offs_k, mask_k


@triton.jit
def load_b(B, tile, offs_k, mask_k):
    """The ``[BLOCK_K, BLOCK_N]`` tile of ``B = (b, stride_n, stride_k)`` (``F.linear`` layout) at ``offs_k``."""
    b_ptr, stride_bn, stride_bk = B
    _, _, offs_n, mask_n = tile
    return tl.load(
        b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
        mask=mask_n[None, :] & mask_k[:, None],
        other=0.0,
    )


@triton.jit
def dot_acc(a, b, acc, MATH: tl.constexpr):
    """``acc + a @ b`` for the plain and int8 formats (see ``_WIDEN_BF16_DOT``)."""
    if _WIDEN_BF16_DOT and a.dtype == tl.bfloat16:
        # fp32 operands must not be rounded to TF32 here: they hold exact bf16 values.
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=MATH.ACC_DTYPE)
    else:
        # out_dtype must name the accumulator's type: Triton 3.6 rejects an fp64 acc with the fp32 default.
        result = tl.dot(a, b, acc, input_precision=MATH.DOT_PRECISION, out_dtype=MATH.ACC_DTYPE)
    return result


@triton.jit
def _widen(v):
    """FP8 ``v`` as fp32, NaN and Inf included (see ``_WIDEN_FP8_DOT``)."""
    f = v.to(tl.float32)
    bits = v.to(tl.uint8, bitcast=True)
    if v.dtype == tl.float8e5:
        inf = tl.where((bits & 0x80) != 0, float("-inf"), float("inf"))
        f = tl.where((bits & 0x7C) == 0x7C, tl.where((bits & 0x03) == 0, inf, float("nan")), f)
    else:
        f = tl.where((bits & 0x7F) == 0x7F, float("nan"), f)
    return f


@triton.jit
def fp8_dot(a, b, acc, BLOCK_K: tl.constexpr):
    """``acc + a @ b`` for FP8 ``a``, ``b`` and an fp32 ``acc`` (FP8 wgmma when compiled for sm_90).

    k steps narrower than FP8 wgmma's 32 (unaligned rows, ``blocks.NARROW_BLOCK_K``) widen the
    operands to fp16 in registers, which holds every e4m3 and e5m2 value exactly: the products and
    their fp32 sum are the same, at fp16 tensor-core rate.
    """
    if BLOCK_K < 32:
        if _WIDEN_FP8_DOT:
            a16 = _widen(a).to(tl.float16)
            b16 = _widen(b).to(tl.float16)
        else:
            a16 = a.to(tl.float16)
            b16 = b.to(tl.float16)
        result = tl.dot(a16, b16, acc, out_dtype=tl.float32)
    elif _WIDEN_FP8_DOT:
        result = tl.dot(_widen(a), _widen(b), acc, input_precision="ieee", out_dtype=tl.float32)
    else:
        result = tl.dot(a, b, acc, out_dtype=tl.float32)
    return result


@triton.jit
def _fp8_step(A, B, tile, k0, K, blk, BLOCK_K: tl.constexpr):
    """``blk`` plus the FP8 product of the k step at ``k0`` (masked)."""
    a, offs_k, mask_k = load_a(A, tile, k0, K, BLOCK_K)
    return fp8_dot(a, load_b(B, tile, offs_k, mask_k), blk, BLOCK_K)


@triton.jit
def _fp8_tile(X, W, tile, K, FMT: tl.constexpr, TILE: tl.constexpr):
    """fp32 ``dequant(x)[offs_m, :] @ dequant(w)[offs_n, :].T`` (the module docstring's FP8 format)."""
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_K: tl.constexpr = TILE.BLOCK_K
    tl.static_assert(_SCALE_BLOCK % BLOCK_K == 0, "BLOCK_K must divide the 128-deep scale block")
    tl.static_assert(_SCALE_BLOCK % BLOCK_N == 0, "BLOCK_N must divide the 128-row weight scale block")
    x_ptr, stride_xm, stride_xk, xs_ptr, stride_xsm, stride_xsk = X
    w_ptr, stride_wn, stride_wk, ws_ptr, _, stride_wsn, stride_wsk, _ = W
    offs_m, mask_m, offs_n, mask_n = tile
    A = (x_ptr, stride_xm, stride_xk)
    B = (w_ptr, stride_wn, stride_wk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FMT.SCALES == _PER_BLOCK:
        # BLOCK_N divides 128 and tiles start at multiples of BLOCK_N: one weight scale row per tile.
        bs_row = ws_ptr + (tl.min(offs_n, axis=0) // _SCALE_BLOCK) * stride_wsn
        as_rows = xs_ptr + offs_m * stride_xsm
    for k0 in range(0, K, _SCALE_BLOCK):
        blk = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCK_K == _SCALE_BLOCK:
            # One step per scale block: the k-block loop itself is the innermost, pipelined loop.
            blk = _fp8_step(A, B, tile, k0, K, blk, BLOCK_K)
        else:
            # A loop, not unrolled: eight unrolled 16-deep steps of byte loads spilled on sm_90.
            for k1 in range(k0, tl.minimum(k0 + _SCALE_BLOCK, K), BLOCK_K):
                blk = _fp8_step(A, B, tile, k1, K, blk, BLOCK_K)
        if FMT.SCALES == _PER_BLOCK:
            kb = k0 // _SCALE_BLOCK
            sa = tl.load(as_rows + kb * stride_xsk, mask=mask_m, other=0.0)
            sb = tl.load(bs_row + kb * stride_wsk)
            acc += blk * (sa[:, None] * sb)
        else:
            acc += blk
    if FMT.SCALES != _PER_BLOCK:
        sa = tl.load(xs_ptr + offs_m * stride_xsm, mask=mask_m, other=0.0)
        sb = tl.load(ws_ptr + offs_n * stride_wsn, mask=mask_n, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def tile_matmul(X, W, tile, K, G, FMT: tl.constexpr, TILE: tl.constexpr, MATH: tl.constexpr):
    """The tile ``x[offs_m, :] @ dequant(w)[offs_n, :].T`` (fp32; ``ACC_DTYPE`` for plain operands).

    ``G = (g, stride_gm, g_mask_m)`` (plain and int8 only; ``None``: nothing stored): also copy the
    A rows selected by ``g_mask_m`` to ``g`` as the k loop loads them.
    """
    if FMT.KIND == _FP8:
        acc = _fp8_tile(X, W, tile, K, FMT, TILE)
    else:
        BLOCK_M: tl.constexpr = TILE.BLOCK_M
        BLOCK_N: tl.constexpr = TILE.BLOCK_N
        BLOCK_K: tl.constexpr = TILE.BLOCK_K
        x_ptr, stride_xm, stride_xk, _, _, _ = X
        w_ptr, stride_wn, stride_wk, s_ptr, o_ptr, stride_sn, stride_sg, group_size = W
        offs_m, _, offs_n, mask_n = tile
        A = (x_ptr, stride_xm, stride_xk)
        B = (w_ptr, stride_wn, stride_wk)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=MATH.ACC_DTYPE)
        if FMT.KIND == _INT8:
            if FMT.SCALES == _PER_TENSOR:
                s_tile = tl.load(s_ptr).to(tl.float32)
                if FMT.HAS_OFFSET:
                    o_tile = tl.load(o_ptr).to(tl.float32)
            if FMT.SCALES == _PER_CHANNEL:
                s_tile = tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                if FMT.HAS_OFFSET:
                    o_tile = tl.load(o_ptr + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        for k0 in range(0, K, BLOCK_K):
            a, offs_k, mask_k = load_a(A, tile, k0, K, BLOCK_K)
            b = load_b(B, tile, offs_k, mask_k)
            if FMT.KIND == _INT8:
                b = b.to(tl.float32)
                b_mask = mask_n[None, :] & mask_k[:, None]
                if FMT.SCALES == _PER_GROUP_ALIGNED:
                    s_offs = offs_n * stride_sn + (k0 // group_size) * stride_sg
                    s_tile = tl.load(s_ptr + s_offs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                    if FMT.HAS_OFFSET:
                        o_tile = tl.load(o_ptr + s_offs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                if FMT.SCALES == _PER_GROUP:
                    # Groups run along k; a partial last group indexes the same column as its full peers.
                    s_offs = offs_n[None, :] * stride_sn + (offs_k // group_size)[:, None] * stride_sg
                    s_tile = tl.load(s_ptr + s_offs, mask=b_mask, other=0.0).to(tl.float32)
                    if FMT.HAS_OFFSET:
                        o_tile = tl.load(o_ptr + s_offs, mask=b_mask, other=0.0).to(tl.float32)
                if FMT.HAS_OFFSET:
                    b = b - o_tile
                # Round to x's dtype before the dot, as kernels.quant.dequantize does for the reference.
                b = (b * s_tile).to(x_ptr.dtype.element_ty)
            if G is not None:
                g_ptr, stride_gm, g_mask_m = G
                tl.store(
                    g_ptr + offs_m[:, None] * stride_gm + offs_k[None, :], a, mask=g_mask_m[:, None] & mask_k[None, :]
                )
            acc = dot_acc(a, b, acc, MATH)
    return acc


@triton.jit
def store_tile(OUT, acc, tile, ROUND: tl.constexpr):
    """``c[offs_m, offs_n] = acc + bias`` in ``c``'s dtype, rounded as ``ROUND`` says (module constants)."""
    c_ptr, stride_cm, stride_cn, bias_ptr = OUT
    offs_m, mask_m, offs_n, mask_n = tile
    if ROUND == _ROUND_FIRST:
        acc = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(acc.dtype)[None, :]
    values = acc.to(c_ptr.dtype.element_ty)
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
        values,
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def split_rows(local_rows, block, rows_per_block, WORLD: tl.constexpr):
    """Rows ``local_rows`` of row block ``block`` (a source or an owner) when x's rows are outer blocks
    of ``WORLD`` row blocks of ``rows_per_block`` (L) rows each (``gather_dim`` / ``scatter_dim`` > 0):
    local row i is row ``(i // L) * W * L + block * L + i % L``, strided rows instead of a transposing
    copy. Called where the rows are used, after the GEMM loop when they address its output, so they
    are never live next to it.
    """
    # int32 division: an int64 one is a long subroutine whose registers, next to the live
    # accumulator, spilled. Local rows are below an int32 launch argument.
    rows32 = local_rows.to(tl.int32)
    outer = (rows32 // rows_per_block).to(tl.int64)
    inner = (rows32 % rows_per_block).to(tl.int64)
    return outer * (WORLD * rows_per_block) + block * rows_per_block + inner


@triton.jit
def copy_rows(SRC, DST, mask_r, COLS, BLOCK_C: tl.constexpr):
    """``dst[dst_rows, :COLS] = src[src_rows, :COLS]`` for ``SRC = (src, stride_m, stride_c, src_rows)`` and
    ``DST = (dst, dst_rows)`` (``dst`` rows contiguous, ``COLS`` wide): payload rows and fp32 scale rows alike."""
    src_ptr, stride_sm, stride_sc, src_rows = SRC
    dst_ptr, dst_rows = DST
    for c0 in range(0, COLS, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
        mask = mask_r[:, None] & (cols < COLS)[None, :]
        v = tl.load(src_ptr + src_rows[:, None] * stride_sm + cols[None, :] * stride_sc, mask=mask)
        tl.store(dst_ptr + dst_rows[:, None] * COLS + cols[None, :], v, mask=mask)
