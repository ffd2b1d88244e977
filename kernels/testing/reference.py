"""Inputs, the fp64 reference of the three ops (and the quantized all-reduce), and the one tolerance rule.

Every correctness check of the fused, chunked and sequential paths (tests, gpu-check, bench) builds
its inputs with :func:`make_inputs`, computes the expected result with :func:`reference` and
compares with :func:`assert_close`. Semantics of the ops (``W`` ranks, rank ``r`` holds ``x_r``)::

    ag   (all_gather_matmul):       y = cat(x_0 .. x_{W-1}) @ w.T + b          (every rank: all rows)
    ag_v2:                          the same, and the gathered x is returned too
    rs   (matmul_reduce_scatter):   y = (sum_r x_r @ w_r.T + b)[rows of rank r]
    ar*  (matmul_all_reduce):       y = sum_r x_r @ w_r.T + b                  (ar_one, ar_two: algorithms)
    w8a16 (quantized all-reduce):   ar with w_r = dequantize(q_r, scale_r) rounded to x.dtype

The tolerance (:func:`tolerance`) is derived from the summation error analysis, elementwise:
a dot product of length k accumulated in fp32 (the kernels' accumulator, whatever the operand
dtype) errs by at most ``gamma_k * S <= k * eps32 * S`` with ``S = sum_i |x_i| |w_i|`` (Higham,
*Accuracy and Stability of Numerical Algorithms*, 3.1; ``eps`` is twice the unit roundoff, so the
bound holds with a margin of 2); adding the W partial sums and the bias in fp32 adds at most
``(W + 2) * eps32 * S``; rounding the partials (rs / ar reduce partials stored in the output
dtype) and the result to the output dtype adds ``eps(dtype) * S`` (two roundings of ``eps / 2``),
and a reduction that sums the W rounded partials in the output dtype itself (NCCL and gloo reduce in
the tensor's dtype) adds ``W - 1`` more roundings: ``W / 2 * eps(dtype) * S`` in all. So, with the
larger of the two and a margin of 2 at small W::

    |y - y_ref| <= ((k + W + 2) * eps32 + max(2, W / 2) * eps(dtype)) * (|x| @ |w|.T + |b|)

No constant is tuned to pass: the bound follows from dtype, k and W, and a result that needs more
is wrong. Where nothing is reduced (the gathered x) the check is exact.
"""

from __future__ import annotations

from typing import Any

import torch

OPS = ("ag", "ag_v2", "rs", "ar_one", "ar_two")

Reference = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def tolerance(dtype: torch.dtype, k: int, world: int = 1, operand_eps: float = 0.0) -> float:
    """The coefficient ``c`` of the bound ``|y - y_ref| <= c * (|x| @ |w|.T + |b|)`` (module docstring).

    ``operand_eps``: the eps of a narrower format the GEMM rounds its operands to before multiplying
    (TF32's ``2**-10`` when torch allows TF32 for fp32 matmuls); rounding both operands of a product
    errs by at most ``eps`` relative (two unit roundoffs), added per product like the summation's."""
    if k < 0 or world < 1 or operand_eps < 0:
        raise ValueError(
            f"tolerance needs k >= 0, world >= 1 and operand_eps >= 0, got k={k}, world={world}, "
            f"operand_eps={operand_eps}"
        )
    eps32, eps = torch.finfo(torch.float32).eps, torch.finfo(dtype).eps
    return (k + world + 2) * eps32 + max(2.0, world / 2) * eps + 2 * operand_eps


def row_norm_bound(x_row_norms: list[torch.Tensor], w_row_norms: list[torch.Tensor]) -> torch.Tensor:
    """``sum_r outer(x_row_norms[r], w_row_norms[r])`` in fp64, where the norms are the 2-norms of the
    rows of ``x_r`` and ``w_r``: an elementwise upper bound of ``sum_r |x_r| @ |w_r|.T`` (Cauchy-Schwarz)
    for checks at sizes where that would cost W more GEMMs; ranks exchange norms, not operands. For
    random operands it exceeds the exact magnitude by about pi/2."""
    if not x_row_norms or len(x_row_norms) != len(w_row_norms):
        raise ValueError(f"row_norm_bound needs equally many (>= 1) norms, got {len(x_row_norms)}, {len(w_row_norms)}")
    out = torch.zeros(x_row_norms[0].shape[0], w_row_norms[0].shape[0], dtype=torch.float64)
    for xn, wn in zip(x_row_norms, w_row_norms, strict=True):
        out = out.to(xn.device) + torch.outer(xn.double(), wn.double())
    return out


def rows_of(op: str, world: int, m_local: int) -> int:
    """Rows of one rank's x: ``ag`` ``m_local``; ``rs`` ``m_local * W``; ``ar`` ``2 m_local + 1`` (not a
    multiple of W nor of a tile)."""
    return {"ag": m_local, "ag_v2": m_local, "rs": m_local * world}.get(op, 2 * m_local + 1)


def seeded_randn(*shape: int, seed: int) -> torch.Tensor:
    """Standard normal ``shape`` from a generator seeded with ``seed``: the same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make_inputs(
    op: str,
    world: int,
    m_local: int,
    k: int,
    n: int,
    *,
    bias: bool,
    seed: int,
    noncontig: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """Every rank's x and weight ``[n, k]`` (the same on all ranks: drawn from ``seed``), and the bias.

    ``ag``: one weight shared by the ranks; ``rs`` / ``ar``: one weight per rank. With ``noncontig``
    x and weight are transposed views and the bias a stride-2 view, so the kernels must honour strides.
    """
    g = torch.Generator().manual_seed(seed)
    rows = rows_of(op, world, m_local)

    def rand(*shape: int) -> torch.Tensor:
        if noncontig:
            return torch.randn(*reversed(shape), generator=g).t().to(device=device, dtype=dtype)
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    xs = [rand(rows, k) for _ in range(world)]
    ws = [rand(n, k)] * world if op.startswith("ag") else [rand(n, k) for _ in range(world)]
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype) if bias else None
    if b is not None and noncontig:
        # Every other element of a [2n] tensor: the kernels must not assume a unit bias stride.
        b = torch.stack([b, torch.full_like(b, float("nan"))], dim=1)[:, 0]
    return xs, ws, b


def reference(op: str, xs: list[torch.Tensor], ws: list[torch.Tensor], b: torch.Tensor | None, rank: int) -> Reference:
    """Torch math in fp64 from every rank's inputs: ``(y, elementwise bound, gathered x or None)``.

    ``op`` is one of :data:`OPS` or ``"ar"``; the bound is :func:`tolerance` times ``|x| @ |w|.T + |b|``.
    An ``x`` with more than two dims (``[rows, ..., k]``, the ops' leading dims) is computed as its
    ``[-1, k]`` rows and the result given the same leading dims.
    """
    if xs[0].dim() > 2:
        middle = tuple(xs[0].shape[1:-1])
        y, bound, gathered = reference(op, [x.reshape(-1, x.shape[-1]) for x in xs], ws, b, rank)
        gathered = torch.cat([x.cpu() for x in xs]) if gathered is not None else None
        return y.reshape(-1, *middle, y.shape[-1]), bound.reshape(-1, *middle, y.shape[-1]), gathered
    world = len(xs)
    k = xs[0].shape[1]
    ws64 = [w.double().cpu() for w in ws]
    b64 = b.double().cpu() if b is not None else torch.zeros(ws[0].shape[0], dtype=torch.float64)
    gathered = None
    if op.startswith("ag"):
        xg = torch.cat([x.double().cpu() for x in xs])
        y = xg @ ws64[0].T + b64
        s = xg.abs() @ ws64[0].abs().T + b64.abs()
        if op == "ag_v2":
            gathered = torch.cat([x.cpu() for x in xs])
    elif op.startswith("ar") or op == "rs":
        y, s = reduced(op, [x.double().cpu() for x in xs], ws64, b64, rank)
    else:
        raise ValueError(f"op must be one of {OPS} or 'ar', got {op!r}")
    return y, tolerance(xs[0].dtype, k, world) * s, gathered


def reduced(
    op: str, xs64: list[torch.Tensor], ws64: list[torch.Tensor], b64: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, |x| @ |w|.T + |b|)`` of a reducing op (``rs``, ``ar*``) in fp64 from every rank's fp64 operands: the
    partial products summed over ranks, ``rs`` keeping this rank's block of rows. The FP8 reference
    (:mod:`kernels.testing.fp8`) sums its dequantized operands the same way."""
    world = len(xs64)
    y = sum(xs64[i] @ ws64[i].T for i in range(world)) + b64
    s = sum(xs64[i].abs() @ ws64[i].abs().T for i in range(world)) + b64.abs()
    if op == "rs":
        rows = y.shape[0] // world
        y, s = y[rank * rows : (rank + 1) * rows], s[rank * rows : (rank + 1) * rows]
    return y, s


def quantized_weights(ws: list[torch.Tensor], dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, ...]], list]:
    """Per-channel int8 ``(q, scale)`` of each weight, and the weights the kernel multiplies by: the
    dequantized values rounded to ``dtype`` (as :mod:`kernels.quant` documents), for :func:`reference`."""
    from kernels.quant import dequantize, quantize_weight

    quantized = [quantize_weight(w.float(), mode="per_channel") for w in ws]
    return quantized, [dequantize(q, s).to(dtype) for q, s in quantized]


def assert_close(what: str, got: Any, ref: Reference, dtype: torch.dtype) -> None:
    """``got`` (``(y, gathered x)`` where the reference has a gathered x) within the reference's bound,
    in ``dtype`` and the reference's shape; the gathered x exactly equal. AssertionError naming ``what``."""
    want, bound, gathered = ref
    if gathered is not None:
        y, xg = got
        assert torch.equal(xg.cpu(), gathered), f"{what}: gathered x differs"
        got = y
    assert_within(what, got, want, bound, dtype)


def assert_within(what: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` in ``dtype`` and ``want``'s shape, within ``bound`` of ``want`` elementwise; AssertionError naming
    ``what`` (the check of :func:`assert_close` and of the FP8 ops' ``kernels.testing.fp8.assert_close``)."""
    assert tuple(got.shape) == tuple(want.shape) and got.dtype == dtype, (
        f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {dtype}"
    )
    if got.numel() == 0:
        return
    # NaN (a read of an unwritten slot) counts as an infinite excess.
    excess = ((got.double().cpu() - want).abs() - bound).nan_to_num(nan=float("inf"))
    worst = float(excess.max())
    assert worst <= 0, f"{what}: error exceeds the bound by {worst:.3g} at flat index {int(excess.argmax())}"
