"""The FP8 ops' inputs, fp64 reference and bound: :mod:`~kernels.testing.reference` for the scaled ops.

Every FP8 correctness check (the fused FP8 tests on CPU and GPU, the numerics table of every backend)
builds its reference here. Semantics (``W`` ranks, rank ``r`` holds FP8 ``x_r`` with scale ``xs_r``
and ``w_r`` with ``ws_r``)::

    dq(p, s) = p.double() * s broadcast      (tensor: scalar; row: per row; block: x per row per 128
                                              columns, w per 128 x 128 block; partial blocks at the edges)
    ag:  y = cat(dq(x_0, xs_0) .. dq(x_{W-1}, xs_{W-1})) @ dq(w, ws).T + b
    rs:  y = (sum_r dq(x_r, xs_r) @ dq(w_r, ws_r).T + b)[rows of rank r]
    ar:  y = sum_r dq(x_r, xs_r) @ dq(w_r, ws_r).T + b

The reference is of the *dequantized* inputs (exact in fp64: an FP8 value times an fp32 scale), so
the bound covers the GEMM's arithmetic, not the quantization: :func:`kernels.fp8.numerics.op_error_bound`
under an accumulation model (``"fp32"`` for the sequential and chunked backends, ``"promoted"`` for the
fused kernels, :func:`kernels.fp8.numerics.accumulation_of`) and the tensor-core sums' unit roundoff
``u_acc`` (fp32's under the interpreter, ``HOPPER_FP8_ACCUMULATOR`` on a GPU).
"""

from __future__ import annotations

import torch

from .reference import assert_within, reduced

BLOCK = 128
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

Pair = tuple[torch.Tensor, torch.Tensor]


def quantize(t: torch.Tensor, mode: str, weight: bool, dtype: torch.dtype = torch.float8_e4m3fn) -> Pair:
    """``(payload, scale)`` of ``t`` with amax / fp8-max scales (block: 1x128 rows, 128x128 for a weight).

    Written apart from ``kernels.quantize_fp8`` so that the inputs of a check do not depend on the
    quantizer under test; the layouts are the same."""
    top = FP8_MAX[dtype]
    if mode == "tensor":
        scale = (t.abs().amax() / top).clamp(min=1e-12).float()
        return (t / scale).to(dtype), scale
    if mode == "row":
        scale = (t.abs().amax(dim=1, keepdim=True) / top).clamp(min=1e-12).float()
        return (t / scale).to(dtype), scale
    rows, cols = t.shape
    row_block = BLOCK if weight else 1
    grid = torch.nn.functional.pad(t.abs(), (0, -cols % BLOCK, 0, -rows % row_block))
    grid = grid.reshape(-1, row_block, grid.shape[1] // BLOCK, BLOCK)
    scale = (grid.amax(dim=(1, 3)) / top).clamp(min=1e-12).float()
    return (t / expand(scale, mode, weight, rows, cols)).to(dtype), scale.contiguous()


def expand(scale: torch.Tensor, mode: str, weight: bool, rows: int, cols: int) -> torch.Tensor:
    """``scale`` broadcast to ``[rows, cols]`` (the dequantization's layout)."""
    if mode != "block":
        return scale.expand(rows, cols) if scale.dim() else scale.reshape(1, 1).expand(rows, cols)
    full = scale.repeat_interleave(BLOCK, dim=1)[:, :cols]
    return full.repeat_interleave(BLOCK, dim=0)[:rows] if weight else full


def dequant(payload: torch.Tensor, scale: torch.Tensor, mode: str, weight: bool) -> torch.Tensor:
    """``dq(payload, scale)`` in fp64 (module docstring)."""
    rows, cols = payload.shape
    return payload.double() * expand(scale.double(), mode, weight, rows, cols)


def make_inputs(
    op: str, world: int, m: int, k: int, n: int, *, mode: str, bias: bool, out_dtype: torch.dtype, seed: int
) -> tuple[list[Pair], list[Pair], torch.Tensor | None]:
    """Every rank's ``(x, xs)`` and ``(w, ws)`` (the same on every rank: drawn from ``seed``) and the bias.

    ``ag``: ``m`` rows per rank, one weight; ``rs``: ``m * W`` rows; ``ar``: ``m`` rows. Rows are
    scaled by powers of 2 so tensor, row and block scales see different magnitudes.
    """
    g = torch.Generator().manual_seed(seed)
    rows = m * world if op == "rs" else m

    def rand(r: int, c: int) -> torch.Tensor:
        return torch.randn(r, c, generator=g) * torch.exp2(torch.randint(-3, 4, (r, 1), generator=g).float())

    # Each rank quantizes its own x, as callers do: in tensor mode every rank has its own scale.
    xs = [quantize(rand(rows, k), mode, False) for _ in range(world)]
    w_one = quantize(rand(n, k), mode, True)
    ws = [w_one] * world if op.startswith("ag") else [quantize(rand(n, k), mode, True) for _ in range(world)]
    b = torch.randn(n, generator=g).to(out_dtype) if bias else None
    return xs, ws, b


def reference(
    op: str,
    xs: list[Pair],
    ws: list[Pair],
    b: torch.Tensor | None,
    rank: int,
    *,
    mode: str,
    out_dtype: torch.dtype,
    accumulation: str = "promoted",
    u_acc: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, elementwise bound)`` in fp64 from every rank's ``(payload, scale)`` pairs (module docstring);
    ``op`` is ``ag`` / ``ag_v2``, ``rs`` or ``ar*``. The positional parameters are
    :func:`kernels.testing.reference.reference`'s."""
    from kernels.fp8.numerics import U32, op_error_bound

    world = len(xs)
    k = xs[0][0].shape[1]
    dx = [dequant(p, s, mode, False) for p, s in xs]
    dw = [dequant(p, s, mode, True) for p, s in ws]
    b64 = b.double() if b is not None else torch.zeros(dw[0].shape[0], dtype=torch.float64)
    if op.startswith("ag"):
        xg = torch.cat(dx)
        y, s = xg @ dw[0].T + b64, xg.abs() @ dw[0].abs().T + b64.abs()
    elif op == "rs" or op.startswith("ar"):
        y, s = reduced(op, dx, dw, b64, rank)
    else:
        raise ValueError(f"op must be 'ag', 'ag_v2', 'rs' or 'ar*', got {op!r}")
    bound = op_error_bound(
        y, s, k, world, out_dtype=out_dtype, accumulation=accumulation, u_acc=U32 if u_acc is None else u_acc
    )
    return y, bound


def error_ratio(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    """``max |got - want| / bound``: at most 1 within the bound (NaN counts as infinite)."""
    ratio = ((got.double().cpu() - want).abs() / bound).nan_to_num(nan=float("inf"))
    return float(ratio.max()) if ratio.numel() else 0.0


def assert_close(what: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, out_dtype: torch.dtype) -> None:
    """``got`` in ``out_dtype`` and ``want``'s shape, within ``bound``; AssertionError naming ``what``."""
    assert_within(what, got, want, bound, out_dtype)
