"""The RMSNorm epilogue of the GEMM + all-reduce ops (kernels/ops/norm.py, ``matmul_all_reduce(..., residual=,
norm_weight=, quant=)`` and its FP8 and int8 forms) on every backend against an fp64 reference.

Each rank holds a row-parallel shard: ``x_r [m, k]``, ``w_r [n, k]``; bias, residual and the norm weight are
replicated. Bounds (``M = sum_r |x_r| @ |w_r|^T + |bias| + |residual|``; ``u_p`` the unit roundoff of the partials'
dtype: x's for plain and int8, 0 for FP8, whose partials are fp32; ``u`` the output dtype's; fp32 accumulation):

- ``h``: ``|h - h64| <= (u_p + (k + W + 2) 2^-24) M``: each partial rounded once, a k-term fp32 dot, a W-term
  fp32 sum, bias and residual;
- ``residual_out = h`` rounded: that plus ``u |h64|``;
- ``out``: ``rstd`` moves by the relative rms of h's error (``d``), then two roundings: ``(2u + (n + 4W) 2^-24 + d)
  |y64|`` plus h's error scaled as h is, ``2 rstd |g| bound_h``;
- FP8 ``out`` dequantized: plus ``2^-4 |y64| + 2^-9 scale`` (3 mantissa bits, the subnormal step).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kernels
from kernels.fp8.quantize import expand_scale
from kernels.testing import run_ranks

M, K, N = 5, 24, 40
EPS = 1e-5
# format -> (x dtype, output dtype, partial unit roundoff)
FORMATS = {
    "plain-fp32": (torch.float32, torch.float32, 0.0),
    "plain-bf16": (torch.bfloat16, torch.bfloat16, 2.0**-8),
    "fp8-block": (torch.float32, torch.bfloat16, 0.0),
    "int8-channel": (torch.float32, torch.float32, 0.0),
}
QUANTS = (None, "row", "block")


def _operands(rank: int, world: int, fmt: str) -> dict[str, Any]:
    """Rank ``rank``'s operands (seeded by rank) and the replicated ones; ``dequant``: x_r and w_r as multiplied."""
    x_dtype, out_dtype, _ = FORMATS[fmt]
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K**0.5
    shared = torch.Generator().manual_seed(7)
    bias = torch.randn(N, generator=shared).to(out_dtype)
    residual = torch.randn(M, N, generator=shared).to(out_dtype)
    norm_weight = (1 + 0.3 * torch.randn(N, generator=shared)).to(out_dtype)
    ops: dict[str, Any] = dict(bias=bias, residual=residual, norm_weight=norm_weight)
    if fmt.startswith("plain"):
        x, w = x.to(x_dtype), w.to(x_dtype)
        ops.update(args=(x, w), dequant=(x.double(), w.double()))
    elif fmt == "fp8-block":
        xq, xs = kernels.quantize_fp8(x, "block")
        wq, ws = kernels.quantize_fp8(w, "block2d")
        xd = xq.double() * expand_scale(xs, "block", M, K).double()
        wd = wq.double() * expand_scale(ws, "block2d", N, K).double()
        ops.update(args=(xq, xs, wq, ws), dequant=(xd, wd), out_dtype=out_dtype)
    else:
        q, s = kernels.quantize_weight(w, "per_channel")
        wd = (q.float() * s[:, None]).to(x_dtype)  # dequantized to x's dtype, as the op multiplies it
        ops.update(args=(x, q, s), dequant=(x.double(), wd.double()))
    return ops


def _call(ops: dict[str, Any], fmt: str, quant: str | None, backend: str) -> kernels.NormOutputs:
    kw = dict(residual=ops["residual"], norm_weight=ops["norm_weight"], eps=EPS, quant=quant, backend=backend)
    if fmt.startswith("plain"):
        return kernels.matmul_all_reduce(*ops["args"], ops["bias"], **kw)
    if fmt == "fp8-block":
        return kernels.scaled_matmul_all_reduce(*ops["args"], ops["bias"], out_dtype=ops["out_dtype"], **kw)
    return kernels.quantized_matmul_all_reduce(*ops["args"], ops["bias"], **kw)


def _body(rank: int, world: int, runs: list[tuple[str, str | None, str]]) -> list:
    out = []
    for fmt, quant, backend in runs:
        res = _call(_operands(rank, world, fmt), fmt, quant, backend)
        assert isinstance(res, kernels.NormOutputs), type(res)
        out.append(tuple(res))
    return out


def _check(world: int, run: tuple, got: tuple) -> None:
    fmt, quant, backend = run
    _, out_dtype, u_p = FORMATS[fmt]
    u = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}[out_dtype]
    per_rank = [_operands(r, world, fmt) for r in range(world)]
    shared = per_rank[0]
    extras = shared["bias"].double() + shared["residual"].double()
    h64 = sum(o["dequant"][0] @ o["dequant"][1].T for o in per_rank) + extras
    mag = sum(o["dequant"][0].abs() @ o["dequant"][1].abs().T for o in per_rank)
    mag = mag + shared["bias"].double().abs() + shared["residual"].double().abs()
    bound_h = (u_p + (K + world + 2) * 2.0**-24) * mag
    rstd = torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS)
    g = shared["norm_weight"].double()
    y64 = h64 * rstd * g
    out, residual_out, scale = got
    tag = f"{run} W={world}"
    assert ((residual_out.double() - h64).abs() <= bound_h + u * h64.abs()).all(), tag
    d = bound_h.pow(2).mean(-1, keepdim=True).sqrt() * rstd
    bound_y = (2 * u + (N + 4 * world) * 2.0**-24 + d) * y64.abs() + 2 * rstd * g.abs() * bound_h
    if quant is None:
        assert scale is None and out.dtype == out_dtype, tag
        assert ((out.double() - y64).abs() <= bound_y).all(), (tag, (out.double() - y64).abs().max())
        return
    s = expand_scale(scale, quant, M, N).double()
    error = (out.double() * s - y64).abs()
    assert (error <= bound_y + 2.0**-4 * y64.abs() + 2.0**-9 * s).all(), (tag, error.max())


def _runs(backends: tuple[str, ...]) -> list[tuple[str, str | None, str]]:
    return [(f, q, b) for b in backends for f in FORMATS for q in QUANTS if not (f != "plain-fp32" and q == "row")]


def _verify(world: int, runs: list, per_rank: list) -> None:
    for outs in per_rank:
        for run, got in zip(runs, outs, strict=True):
            _check(world, run, got)
    # Every rank holds the same bits (the sum is in rank order on every backend).
    for outs in per_rank[1:]:
        for run, a, b in zip(runs, per_rank[0], outs, strict=True):
            for ta, tb in zip(a, b, strict=True):
                assert (ta is None and tb is None) or torch.equal(
                    ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)
                ), run


@pytest.mark.parametrize("world", [1, 2, 3])
def test_scripted_epilogue_matches_fp64_on_every_format(world: int) -> None:
    runs = _runs(("sequential", "chunked"))
    _verify(world, runs, run_ranks(_body, world, runs, timeout=600))


@pytest.mark.triton
@pytest.mark.parametrize("world", [1, 2])
def test_fused_epilogue_matches_fp64_on_every_format(world: int) -> None:
    runs = _runs(("fused",))
    _verify(world, runs, run_ranks(_body, world, runs, timeout=900))


def _bad(kwargs: dict[str, Any]) -> None:
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    kernels.matmul_all_reduce(x, w, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(residual=torch.randn(3, 5)), "needs both residual and norm_weight; norm_weight is None"),
        (dict(norm_weight=torch.randn(5)), "needs both residual and norm_weight; residual is None"),
        (dict(quant="row"), "quant='row' quantizes the RMSNorm epilogue"),
        (dict(residual=torch.randn(3, 8), norm_weight=torch.randn(5)), r"residual must be \[3, 5\] torch.float32"),
        (dict(residual=torch.randn(3, 5).double(), norm_weight=torch.randn(5)), r"got \[3, 5\] torch.float64"),
        (dict(residual=torch.randn(3, 5), norm_weight=torch.randn(8)), r"norm_weight must be a floating \[n\] = \[5\]"),
        (dict(residual=torch.randn(3, 5), norm_weight=torch.randn(5), eps=float("nan")), "eps must be a finite"),
        (dict(residual=torch.randn(3, 5), norm_weight=torch.randn(5), quant="block2d"), "quant='block2d' is not"),
    ],
)
def test_bad_epilogue_arguments_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _bad(kwargs)


def _epilogue_differs(rank: int, world: int) -> str:
    x, w, r, g = torch.randn(3, 8), torch.randn(5, 8), torch.randn(3, 5), torch.randn(5)
    try:
        kernels.matmul_all_reduce(x, w, residual=r, norm_weight=g, quant="row" if rank == 0 else None)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ranks_with_other_epilogues_are_refused_naming_them() -> None:
    """A rank without the epilogue's residual in a two-shot reduce would leave its rows' residual out of every
    rank's result: the call check compares the epilogue."""
    for message in run_ranks(_epilogue_differs, 2, timeout=300):
        assert "epilogue" in message and "rmsnorm:row" in message and "rmsnorm" in message, message
