"""Rank bodies of the per-op tests (tests/kernels/test_all_gather.py, test_reduce_scatter.py, test_all_reduce.py):
every operand format of one pattern on one backend, each case against its fp64 reference.

Formats: ``plain`` (fp32 operands), FP8 in each scaling mode (``fp8:tensor``, ``fp8:row``, ``fp8:block``; every
rank quantizes its own operands, so tensor-mode scales differ by rank) and int8 weights in each layout
(``int8:per_tensor``, ``int8:per_channel``, ``int8:per_group``, the last with an offset). Semantics, for rank r's
operands dequantized exactly in fp64 (``xd_r``, ``wd_r``; an int8 weight dequantized and rounded to x's dtype,
as the format defines)::

    all_gather:      y_i = cat(xd_0 .. xd_{W-1}, dim=gather_dim) @ wd_i.T + b_i     (one or several weights)
    reduce_scatter:  y = chunk(sum_r xd_r @ wd_r.T, W, dim=scatter_dim)[r] + b
    all_reduce:      y = sum_r xd_r @ wd_r.T + b

Bounds: plain and int8 :func:`kernels.testing.reference.tolerance` (fp32, k, W); FP8
:func:`kernels.fp8.numerics.op_error_bound` under the backend's accumulation model. Gathered x (and FP8
gathered scales, one row per row) are compared exactly. Each case returns None or its failure as text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import kernels
from kernels.fp8 import numerics
from kernels.quant import dequantize
from kernels.testing import tolerance
from kernels.testing.fp8 import dequant

FORMATS = (
    "plain",
    "fp8:tensor",
    "fp8:row",
    "fp8:block",
    "int8:per_tensor",
    "int8:per_channel",
    "int8:per_group",
)
K_PLAIN, K_FP8 = 20, 136  # k not a multiple of the 16-wide tiles nor of the 128-wide FP8 scale blocks
N = 24
GROUP = 8  # int8 per_group columns per scale (k = 20: a partial last group)


def _x(fmt: str, t: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """``(args, fp64 value)`` of an activation ``t [..., k]``: FP8 payload and scale, else t itself."""
    if not fmt.startswith("fp8"):
        return (t,), t.double()
    mode = fmt.split(":")[1]
    rows = t.reshape(t.shape[:-1].numel(), t.shape[-1])
    q, s = kernels.quantize_fp8(rows, mode)
    value = dequant(q, s, mode, False).reshape(t.shape)
    return (q.view(t.shape), s), value


def _w(fmt: str, w: torch.Tensor, x_dtype: torch.dtype) -> tuple[tuple, torch.Tensor]:
    """``(args, fp64 value)`` of a weight ``[n, k]`` in the format."""
    if fmt == "plain":
        return (w,), w.double()
    kind, mode = fmt.split(":")
    if kind == "fp8":
        q, s = kernels.quantize_fp8(w, "block2d" if mode == "block" else mode)
        return (q, s), dequant(q, s, mode, True)
    q, s = kernels.quantize_weight(w, mode, GROUP if mode == "per_group" else None)
    offset = None
    if mode == "per_group":
        offset = torch.randint(-3, 4, s.shape, generator=torch.Generator().manual_seed(7)).float()
    value = dequantize(q, s, GROUP if mode == "per_group" else None, offset, x_dtype).double()
    return (q, s, offset), value


def _call(pattern: str, fmt: str, x_args: tuple, w_args: list[tuple], bias: Any, **kwargs: Any) -> Any:
    """The public op of ``pattern`` in ``fmt`` with one weight (``w_args`` of one entry) or a list."""
    listed = len(w_args) > 1
    if fmt == "plain":
        weights = [a[0] for a in w_args]
        fn = {"all_gather": kernels.all_gather_matmul, "reduce_scatter": kernels.matmul_reduce_scatter}.get(
            pattern, kernels.matmul_all_reduce
        )
        return fn(x_args[0], weights if listed else weights[0], bias, **kwargs)
    if fmt.startswith("fp8"):
        fn = {
            "all_gather": kernels.all_gather_scaled_matmul,
            "reduce_scatter": kernels.scaled_matmul_reduce_scatter,
        }.get(pattern, kernels.scaled_matmul_all_reduce)
        weights, scales = [a[0] for a in w_args], [a[1] for a in w_args]
        return fn(
            *x_args,
            weights if listed else weights[0],
            scales if listed else scales[0],
            bias,
            out_dtype=torch.float32,
            **kwargs,
        )
    fn = {
        "all_gather": kernels.quantized_all_gather_matmul,
        "reduce_scatter": kernels.quantized_matmul_reduce_scatter,
    }.get(pattern, kernels.quantized_matmul_all_reduce)
    qs, ss, offs = [a[0] for a in w_args], [a[1] for a in w_args], [a[2] for a in w_args]
    group_size = GROUP if fmt.endswith("per_group") else None
    return fn(
        x_args[0],
        qs if listed else qs[0],
        ss if listed else ss[0],
        bias,
        group_size=group_size,
        offset=(offs if listed else offs[0]) if offs[0] is not None else None,
        **kwargs,
    )


def _bound(fmt: str, backend: str, y: torch.Tensor, s: torch.Tensor, k: int, world: int) -> torch.Tensor:
    if fmt.startswith("fp8"):
        accumulation = numerics.accumulation_of(backend, fmt.split(":")[1])
        return numerics.op_error_bound(y, s, k, world, out_dtype=torch.float32, accumulation=accumulation)
    return tolerance(torch.float32, k, world) * s


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> str | None:
    if tuple(got.shape) != tuple(want.shape) or got.dtype != torch.float32:
        return f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} torch.float32"
    excess = ((got.double() - want).abs() - bound).nan_to_num(nan=float("inf"))
    if excess.numel() and float(excess.max()) > 0:
        return f"{what}: error exceeds the bound by {float(excess.max()):.3g}"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as compared exactly: FP8 as its bytes (NaN payloads compare equal)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _rand(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows scaled by powers of 2 so tensor, row and block scales see different magnitudes.
    scales = torch.exp2(torch.randint(-3, 4, shape[:-1] + (1,), generator=g).float())
    return torch.randn(*shape, generator=g) * scales


def all_gather_case(rank: int, world: int, fmt: str, backend: str, case: dict) -> str | None:
    """``case``: ``lead`` (x's shape before k, dim ``dim`` holding this rank's rows), ``weights`` (how many),
    ``bias``, ``gathered`` (return_gathered)."""
    k = K_FP8 if fmt.startswith("fp8") else K_PLAIN
    lead, dim, count = case["lead"], case["dim"], case["weights"]
    xs = [_x(fmt, _rand(10 + r, *lead, k)) for r in range(world)]
    ws = [_w(fmt, _rand(20 + i + 5 * rank, N - 3 * i, k), torch.float32) for i in range(count)]
    biases = [_rand(30 + i + 5 * rank, N - 3 * i) if case["bias"] else None for i in range(count)]
    out = _call(
        "all_gather",
        fmt,
        xs[rank][0],
        [w[0] for w in ws],
        biases if count > 1 else biases[0],
        gather_dim=dim,
        return_gathered=case["gathered"],
        backend=backend,
        parallel_num=2,
    )
    ys = out[0] if case["gathered"] else out
    ys = list(ys) if count > 1 else [ys]
    xg = torch.cat([x[1] for x in xs], dim=dim)
    problems = []
    for i, ((_, wd), b, y) in enumerate(zip(ws, biases, ys, strict=True)):
        b64 = b.double() if b is not None else torch.zeros(wd.shape[0], dtype=torch.float64)
        want = xg @ wd.T + b64
        s = xg.abs() @ wd.abs().T + b64.abs()
        problems.append(_compare(f"y[{i}]", y, want, _bound(fmt, backend, want, s, k, 1)))
    if case["gathered"]:
        payload = torch.cat([x[0][0] for x in xs], dim=dim)
        got = out[1]
        if not torch.equal(_bits(got), _bits(payload)):
            problems.append("gathered x differs")
        if fmt.startswith("fp8"):
            scale_rows = [
                s.reshape(1, 1).expand(x[0][0].reshape(-1, k).shape[0], 1) if s.dim() == 0 else s
                for x in xs
                for s in (x[0][1],)
            ]
            per_rank = [r.reshape(tuple(lead) + (r.shape[-1],)) for r in scale_rows]
            want_scales = torch.cat(per_rank, dim=dim)
            if dim == 0:
                want_scales = want_scales.reshape(-1, want_scales.shape[-1])
            if not torch.equal(out[2], want_scales):
                problems.append(f"gathered scales {tuple(out[2].shape)} differ from {tuple(want_scales.shape)}")
    return "; ".join(p for p in problems if p) or None


def reduce_scatter_case(rank: int, world: int, fmt: str, backend: str, case: dict) -> str | None:
    """``case``: ``lead`` (x's shape before k; dim ``dim`` of size W * rows), ``bias``, ``deterministic``, ``k``
    (this rank's k: ``"empty_last"`` gives the last rank an empty shard)."""
    k_full = K_FP8 if fmt.startswith("fp8") else K_PLAIN
    ks = [k_full - (k_full if case.get("empty_last") and r == world - 1 else r) for r in range(world)]
    lead, dim = case["lead"], case["dim"]
    xs = [_x(fmt, _rand(40 + r, *lead, ks[r])) for r in range(world)]
    ws = [_w(fmt, _rand(50 + r, N, ks[r]), torch.float32) for r in range(world)]
    b = _rand(60, N) if case["bias"] else None
    y = _call(
        "reduce_scatter",
        fmt,
        xs[rank][0],
        [ws[rank][0]],
        b,
        scatter_dim=dim,
        deterministic=case["deterministic"],
        backend=backend,
        parallel_num=2,
    )
    b64 = b.double() if b is not None else torch.zeros(N, dtype=torch.float64)
    total = sum(x[1] @ w[1].T for x, w in zip(xs, ws, strict=True)) + b64
    s = sum(x[1].abs() @ w[1].abs().T for x, w in zip(xs, ws, strict=True)) + b64.abs()
    want, s = total.chunk(world, dim=dim)[rank], s.chunk(world, dim=dim)[rank]
    return _compare("y", y, want, _bound(fmt, backend, want, s, k_full, world))


def all_reduce_case(rank: int, world: int, fmt: str, backend: str, case: dict) -> str | None:
    """``case``: ``rows`` (x's rows), ``bias``, ``deterministic`` (then also bitwise equal on every rank)."""
    k = K_FP8 if fmt.startswith("fp8") else K_PLAIN
    xs = [_x(fmt, _rand(70 + r, case["rows"], k)) for r in range(world)]
    ws = [_w(fmt, _rand(80 + r, N, k), torch.float32) for r in range(world)]
    b = _rand(90, N) if case["bias"] else None
    y = _call(
        "all_reduce",
        fmt,
        xs[rank][0],
        [ws[rank][0]],
        b,
        deterministic=case["deterministic"],
        backend=backend,
        parallel_num=2,
    )
    b64 = b.double() if b is not None else torch.zeros(N, dtype=torch.float64)
    want = sum(x[1] @ w[1].T for x, w in zip(xs, ws, strict=True)) + b64
    s = sum(x[1].abs() @ w[1].abs().T for x, w in zip(xs, ws, strict=True)) + b64.abs()
    problem = _compare("y", y, want, _bound(fmt, backend, want, s, k, world))
    if problem is None and case["deterministic"] and world > 1:
        table = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(table, y)
        if not all(torch.equal(t, y) for t in table):
            problem = "deterministic: ranks hold different bits"
    return problem


CASES: dict[str, tuple[Callable[..., str | None], dict[str, dict]]] = {
    "all_gather": (
        all_gather_case,
        {
            "rows": {"lead": (3,), "dim": 0, "weights": 1, "bias": True, "gathered": False},
            "gathered": {"lead": (3,), "dim": 0, "weights": 1, "bias": False, "gathered": True},
            "seq_dim": {"lead": (2, 3), "dim": 1, "weights": 1, "bias": True, "gathered": True},
            "weights": {"lead": (2, 3), "dim": 1, "weights": 2, "bias": True, "gathered": True},
        },
    ),
    "reduce_scatter": (
        reduce_scatter_case,
        {
            "rows": {"lead": (6,), "dim": 0, "bias": True, "deterministic": False},
            "deterministic": {"lead": (6,), "dim": 0, "bias": False, "deterministic": True},
            "seq_dim": {"lead": (2, 6), "dim": 1, "bias": True, "deterministic": True},
            # x [2, 6, 0] on the last rank: an empty shard with leading dims (the rows cannot be inferred)
            "empty_k": {"lead": (2, 6), "dim": 1, "bias": True, "deterministic": False, "empty_last": True},
        },
    ),
    "all_reduce": (
        all_reduce_case,
        {
            "rows": {"rows": 5, "bias": True, "deterministic": False},
            "deterministic": {"rows": 7, "bias": False, "deterministic": True},
        },
    ),
}


def pattern_body(rank: int, world: int, pattern: str, backend: str) -> dict[str, str | None]:
    """Every (format, case) of ``pattern`` on ``backend``: ``{"<format> <case>": None or the failure}``."""
    fn, cases = CASES[pattern]
    results: dict[str, str | None] = {}
    with torch.no_grad():
        for fmt in FORMATS:
            for name, case in cases.items():
                try:
                    results[f"{fmt} {name}"] = fn(rank, world, fmt, backend, case)
                except Exception as e:  # reported per case; the other cases still run
                    results[f"{fmt} {name}"] = f"raised {type(e).__name__}: {e}"
    return results
