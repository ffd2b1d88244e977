"""Rank bodies of the per-op tests (tests/kernels/test_all_gather.py, test_reduce_scatter.py, test_all_reduce.py):
every operand format of one pattern on one backend, each case against its fp64 reference.

Formats: ``plain`` (operands in the case's dtype), FP8 in each scaling mode (``fp8:tensor``, ``fp8:row``,
``fp8:block``; every rank quantizes its own operands, so tensor-mode scales differ by rank; the case's dtype is
``out_dtype`` and the bias's) and int8 weights in each layout (``int8:per_tensor``, ``int8:per_channel``,
``int8:per_group``; x, bias and the weight quantized in the case's dtype, with an offset unless the case says
``offset: False``). Semantics, for rank r's operands dequantized exactly in fp64 (``xd_r``, ``wd_r``; an int8
weight dequantized and rounded to x's dtype, as the format defines)::

    all_gather:      y_i = cat(xd_0 .. xd_{W-1}, dim=gather_dim) @ wd_i.T + b_i     (one or several weights)
    reduce_scatter:  y = chunk(sum_r xd_r @ wd_r.T, W, dim=scatter_dim)[r] + b
    all_reduce:      y = sum_r xd_r @ wd_r.T + b

Bounds: plain and int8 :func:`kernels.testing.reference.tolerance` (dtype, k, W; W = 1 for the all-gather, which
reduces nothing); FP8 :func:`kernels.fp8.numerics.op_error_bound` under the backend's accumulation model, on
operands spread over six decades (the bound's worst cases: tiny terms next to large ones in one 128-block). Exact
(bitwise) where the arithmetic is the same: the gathered x (and FP8 gathered scales, one row per row), a second
call that differs only in ``return_gathered``, a deterministic reduction called again (and, for the all-reduce,
on every rank), FP8 scales given as ``[m, G]`` rows against the same scales in x's leading shape. Each case
returns None or its failure as text; :func:`fp8_table` reports the worst error / bound of the FP8 cases
(docs/fp8.md's measured table: ``TRITON_INTERPRET=1 python -m tests.kernels.op_cases``).
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
PATTERNS = ("all_gather", "reduce_scatter", "all_reduce")
K_PLAIN, K_FP8 = 20, 136  # k not a multiple of the 16-wide tiles nor of the 128-wide FP8 scale blocks
N = 24
N_WIDE = 130  # ``wide`` cases, FP8: n crosses the 128-row blocks of a block weight's scales
GROUP = 8  # int8 per_group columns per scale (k = 20: a partial last group)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCRIPTED = ("sequential", "chunked")  # shape-only cases: the fused kernels' shapes are tests/kernels/fused's

# The worst |error| / bound of each "<format> <case>" that pattern_body ran last in this process (fp8_table).
_RATIOS: dict[str, float] = {}
_RUNNING = [""]


def _dtype(case: dict) -> torch.dtype:
    return DTYPES[case.get("dtype", "fp32")]


def _n(fmt: str, case: dict) -> int:
    return N_WIDE if case.get("wide") and fmt.startswith("fp8") else N


def _rand(seed: int, *shape: int, decades: int = 0) -> torch.Tensor:
    """Random ``shape``, rows scaled by powers of 2 (tensor, row and block scales see different magnitudes);
    columns by powers of 2 too, or, with ``decades``, spread evenly over that many decades below 1 in a random
    order (FP8 operands: a 128-wide block holds values 10^6 apart, the small ones in FP8's subnormals)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-3, 4, shape[:-1] + (1,), generator=g).float())
    if decades:
        cols = torch.logspace(-decades, 0, shape[-1])[torch.randperm(shape[-1], generator=g)]
    else:
        cols = torch.exp2(torch.randint(-3, 4, (shape[-1],), generator=g).float())
    return torch.randn(*shape, generator=g) * rows * cols


def _operand(fmt: str, seed: int, *shape: int) -> torch.Tensor:
    return _rand(seed, *shape, decades=6 if fmt.startswith("fp8") else 0)


def _x(fmt: str, t: torch.Tensor, dtype: torch.dtype, scale_lead: bool = False) -> tuple[tuple, torch.Tensor]:
    """``(args, fp64 value)`` of an activation ``t [..., k]``: FP8 payload and scale (``[m, G]`` rows, or
    ``[..., G]`` in t's leading shape with ``scale_lead``), else t in ``dtype``."""
    if not fmt.startswith("fp8"):
        t = t.to(dtype)
        return (t,), t.double()
    mode = fmt.split(":")[1]
    rows = t.reshape(t.shape[:-1].numel(), t.shape[-1])
    q, s = kernels.quantize_fp8(rows, mode)
    value = dequant(q, s, mode, False).reshape(t.shape)
    if scale_lead and mode != "tensor":
        s = s.view(tuple(t.shape[:-1]) + (s.shape[-1],))
    return (q.view(t.shape), s), value


def _w(fmt: str, w: torch.Tensor, dtype: torch.dtype, offset: bool, seed: int) -> tuple[tuple, torch.Tensor]:
    """``(args, fp64 value)`` of a weight ``[n, k]`` in the format (plain and int8: in ``dtype``)."""
    if fmt == "plain":
        w = w.to(dtype)
        return (w,), w.double()
    kind, mode = fmt.split(":")
    if kind == "fp8":
        q, s = kernels.quantize_fp8(w, "block2d" if mode == "block" else mode)
        return (q, s), dequant(q, s, mode, True)
    group_size = GROUP if mode == "per_group" else None
    q, s = kernels.quantize_weight(w.to(dtype), mode, group_size)
    off = torch.randint(-3, 4, s.shape, generator=torch.Generator().manual_seed(seed)).float() if offset else None
    return (q, s, off), dequantize(q, s, group_size, off, dtype).double()


def _scale_1d(x_args: tuple, w_args: list[tuple]) -> tuple[tuple, list[tuple]]:
    """FP8 tensor-mode scales given as ``[1]`` (as torch._scaled_mm takes them) instead of ``[]``."""
    return (x_args[0], x_args[1].reshape(1)), [(w[0], w[1].reshape(1)) for w in w_args]


def _call(pattern: str, fmt: str, x_args: tuple, w_args: list[tuple], bias: Any, dtype: torch.dtype, **kw: Any) -> Any:
    """The public op of ``pattern`` in ``fmt``: one weight when ``w_args`` has one entry, else the weights as a
    list (a tuple with ``as_tuple``)."""
    as_tuple = kw.pop("as_tuple", False)
    listed = len(w_args) > 1
    seq = tuple if as_tuple else list

    def one_or_all(i: int) -> Any:
        items = [a[i] for a in w_args]
        return seq(items) if listed else items[0]

    if fmt == "plain":
        fn = {"all_gather": kernels.all_gather_matmul, "reduce_scatter": kernels.matmul_reduce_scatter}.get(
            pattern, kernels.matmul_all_reduce
        )
        return fn(x_args[0], one_or_all(0), bias, **kw)
    if fmt.startswith("fp8"):
        fn = {
            "all_gather": kernels.all_gather_scaled_matmul,
            "reduce_scatter": kernels.scaled_matmul_reduce_scatter,
        }.get(pattern, kernels.scaled_matmul_all_reduce)
        return fn(*x_args, one_or_all(0), one_or_all(1), bias, out_dtype=dtype, **kw)
    fn = {
        "all_gather": kernels.quantized_all_gather_matmul,
        "reduce_scatter": kernels.quantized_matmul_reduce_scatter,
    }.get(pattern, kernels.quantized_matmul_all_reduce)
    offsets = one_or_all(2) if w_args[0][2] is not None else None
    group_size = GROUP if fmt.endswith("per_group") else None
    return fn(x_args[0], one_or_all(0), one_or_all(1), bias, group_size=group_size, offset=offsets, **kw)


def _bound(fmt: str, backend: str, dtype: torch.dtype, y: torch.Tensor, s: torch.Tensor, k: int, world: int):
    if fmt.startswith("fp8"):
        accumulation = numerics.accumulation_of(backend, fmt.split(":")[1])
        return numerics.op_error_bound(y, s, k, world, out_dtype=dtype, accumulation=accumulation)
    return tolerance(dtype, k, world) * s


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype) -> str | None:
    if tuple(got.shape) != tuple(want.shape) or got.dtype != dtype:
        return f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {dtype}"
    error = (got.double().cpu() - want).abs().nan_to_num(nan=float("inf"))
    if not error.numel():
        return None
    ratio = torch.where(bound > 0, error / bound, torch.where(error > 0, float("inf"), 0.0))
    key = _RUNNING[0]
    _RATIOS[key] = max(_RATIOS.get(key, 0.0), float(ratio.max()))
    excess = float((error - bound).max())
    if excess > 0:
        return f"{what}: error exceeds the bound by {excess:.3g} ({float(ratio.max()):.3g} times the bound)"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as compared exactly: FP8 as its bytes (NaN payloads compare equal)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _same(what: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> str | None:
    if len(got) != len(want) or not all(torch.equal(_bits(g), _bits(w)) for g, w in zip(got, want, strict=False)):
        return f"{what}: not bitwise the same"
    return None


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _to(device: torch.device | None, obj: Any) -> Any:
    """``obj`` (tensors, in tuples and lists) on ``device`` (None: where it is)."""
    if device is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(device, o) for o in obj)
    return obj


def all_gather_case(rank: int, world: int, fmt: str, backend: str, case: dict, device=None) -> str | None:
    """``case``: ``lead`` (x's shape before k, dim ``dim`` holding this rank's rows), ``bias`` (per weight: a
    bias or none; several entries: a list call, a tuple with ``tuple``; the result is a list either way),
    ``gathered`` (return_gathered), ``pn`` (parallel_num), optional ``dtype``, ``wide``, ``scale_lead`` (FP8 x
    scales in x's leading shape, and bitwise the call with ``[m, G]`` scales), ``scale_1d`` (FP8 tensor scales
    ``[1]``), ``again`` (bitwise the call without return_gathered)."""
    k = K_FP8 if fmt.startswith("fp8") else K_PLAIN
    lead, dim, dtype = tuple(case["lead"]), case["dim"], _dtype(case)
    d = dim % (len(lead) + 1)
    ns = [_n(fmt, case), N - 3, 1][: len(case["bias"])]
    xs = [_x(fmt, _operand(fmt, 10 + r, *lead, k), dtype, case.get("scale_lead", False)) for r in range(world)]
    ws = [_w(fmt, _operand(fmt, 20 + i + 5 * rank, n, k), dtype, True, 7 + i) for i, n in enumerate(ns)]
    biases = [
        _rand(30 + i + 5 * rank, n).to(dtype) if has else None
        for i, (n, has) in enumerate(zip(ns, case["bias"], strict=True))
    ]
    x_args, w_args = xs[rank][0], [w[0] for w in ws]
    if case.get("scale_1d") and fmt == "fp8:tensor":
        x_args, w_args = _scale_1d(x_args, w_args)
    x_args, w_args = _to(device, x_args), _to(device, w_args)
    # Several weights: a bias list (None entries mixed in), or None for no bias at all.
    bias_arg = _to(device, biases[0] if len(ns) == 1 else biases if any(b is not None for b in biases) else None)
    opts = {"backend": backend, "parallel_num": case["pn"], "as_tuple": case.get("tuple", False)}
    problems = []

    def call(xa: tuple, gathered: bool) -> tuple[list[torch.Tensor], Any]:
        out = _call("all_gather", fmt, xa, w_args, bias_arg, dtype, gather_dim=dim, return_gathered=gathered, **opts)
        ys = out[0] if gathered else out
        if len(ns) == 1:
            return [ys], out
        if not isinstance(ys, list) or len(ys) != len(ns):
            problems.append(f"{len(ns)} weights: got {type(ys).__name__} of {len(ys)}, want a list of {len(ns)}")
        return list(ys), out

    ys, out = call(x_args, case["gathered"])
    xg = torch.cat([x[1] for x in xs], dim=dim)
    for i, ((_, wd), b, y) in enumerate(zip(ws, biases, ys, strict=True)):
        b64 = b.double() if b is not None else torch.zeros(wd.shape[0], dtype=torch.float64)
        want = xg @ wd.T + b64
        s = xg.abs() @ wd.abs().T + b64.abs()
        problems.append(_compare(f"y[{i}]", y, want, _bound(fmt, backend, dtype, want, s, k, 1), dtype))
    if case["gathered"]:
        payload = torch.cat([x[0][0] for x in xs], dim=dim)
        if not torch.equal(_bits(out[1].cpu()), _bits(payload)):
            problems.append("gathered x differs")
        if fmt.startswith("fp8"):
            # One scale row per gathered row (each rank's own scale in tensor mode), in x's leading shape.
            per_rank = []
            for x in xs:
                scale = x[0][1]
                rows = scale.reshape(1, 1).expand(_numel(lead), 1) if scale.dim() <= 1 else scale
                per_rank.append(rows.reshape(lead + (rows.shape[-1],)))
            want_scales = torch.cat(per_rank, dim=dim)
            if d == 0:
                want_scales = want_scales.reshape(-1, want_scales.shape[-1])
            if not torch.equal(out[2].cpu(), want_scales):
                problems.append(f"gathered scales {tuple(out[2].shape)} differ from {tuple(want_scales.shape)}")
    if case.get("again"):
        problems.append(_same("y without return_gathered", call(x_args, False)[0], ys))
    if case.get("scale_lead") and fmt in ("fp8:row", "fp8:block"):
        flat = (x_args[0], x_args[1].reshape(-1, x_args[1].shape[-1]))
        problems.append(_same("[m, G] x scales", call(flat, False)[0], ys))
    return "; ".join(p for p in problems if p) or None


def _reduced_inputs(fmt: str, world: int, full_lead: tuple[int, ...], case: dict, seed: int):
    """Every rank's x and weight (row-parallel: rank r's k shard, k - r wide; ``empty_last``: the last rank's is
    empty), the bias, the fp64 sum over ranks and its magnitude ``S + |b|``."""
    k_full = K_FP8 if fmt.startswith("fp8") else K_PLAIN
    ks = [k_full - (k_full if case.get("empty_last") and r == world - 1 else r) for r in range(world)]
    dtype, n = _dtype(case), _n(fmt, case)
    xs = [_x(fmt, _operand(fmt, seed + r, *full_lead, ks[r]), dtype) for r in range(world)]
    ws = [
        _w(fmt, _operand(fmt, seed + 10 + r, n, ks[r]), dtype, case.get("offset", True), seed + 20 + r)
        for r in range(world)
    ]
    b = _rand(seed + 30, n).to(dtype) if case["bias"] else None
    b64 = b.double() if b is not None else torch.zeros(n, dtype=torch.float64)
    want = sum(x[1] @ w[1].T for x, w in zip(xs, ws, strict=True)) + b64
    s = sum(x[1].abs() @ w[1].abs().T for x, w in zip(xs, ws, strict=True)) + b64.abs()
    return xs, ws, b, want, s, k_full


def reduce_scatter_case(rank: int, world: int, fmt: str, backend: str, case: dict, device=None) -> str | None:
    """``case``: ``lead`` (x's shape before k, dim ``dim`` giving each rank's rows: W times that on every rank),
    ``bias``, ``deterministic`` (then also bitwise the same when called again), ``pn``, optional ``dtype``,
    ``wide``, ``offset``, ``empty_last`` (the last rank's k shard is empty)."""
    lead, dim, dtype = list(case["lead"]), case["dim"], _dtype(case)
    lead[dim % (len(lead) + 1)] *= world
    xs, ws, b, want, s, k = _reduced_inputs(fmt, world, tuple(lead), case, 40)
    x_args, w_args, bias = _to(device, xs[rank][0]), _to(device, [ws[rank][0]]), _to(device, b)
    opts = {"deterministic": case["deterministic"], "backend": backend, "parallel_num": case["pn"]}
    y = _call("reduce_scatter", fmt, x_args, w_args, bias, dtype, scatter_dim=dim, **opts)
    want, s = want.chunk(world, dim=dim)[rank], s.chunk(world, dim=dim)[rank]
    problems = [_compare("y", y, want, _bound(fmt, backend, dtype, want, s, k, world), dtype)]
    if case["deterministic"]:
        again = _call("reduce_scatter", fmt, x_args, w_args, bias, dtype, scatter_dim=dim, **opts)
        problems.append(_same("deterministic, called again", [again], [y]))
    return "; ".join(p for p in problems if p) or None


def all_reduce_case(rank: int, world: int, fmt: str, backend: str, case: dict, device=None) -> str | None:
    """``case``: ``lead`` (x's shape before k), ``bias``, ``deterministic`` (then also bitwise the same when
    called again and on every rank), ``pn``, optional ``dtype``, ``wide``, ``offset``, ``empty_last``."""
    dtype = _dtype(case)
    xs, ws, b, want, s, k = _reduced_inputs(fmt, world, tuple(case["lead"]), case, 70)
    x_args, w_args, bias = _to(device, xs[rank][0]), _to(device, [ws[rank][0]]), _to(device, b)
    opts = {"deterministic": case["deterministic"], "backend": backend, "parallel_num": case["pn"]}
    y = _call("all_reduce", fmt, x_args, w_args, bias, dtype, **opts)
    problems = [_compare("y", y, want, _bound(fmt, backend, dtype, want, s, k, world), dtype)]
    if case["deterministic"]:
        again = _call("all_reduce", fmt, x_args, w_args, bias, dtype, **opts)
        problems.append(_same("deterministic, called again", [again], [y]))
        if world > 1:
            table = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(table, y)
            if not all(torch.equal(t, y) for t in table):
                problems.append("deterministic: ranks hold different bits")
    return "; ".join(p for p in problems if p) or None


# Every case runs in every format; the shape sweeps (SHAPE_CASES) on the scripted backends only. Between them:
# rows per rank 1 to 7 (odd), 2-D to 4-D x, every gather / scatter dim (negative too), parallel_num 1, 2, 4 and 8,
# fp32, bf16 and fp16, with and without bias.
CASES: dict[str, tuple[Callable[..., str | None], dict[str, dict]]] = {
    "all_gather": (
        all_gather_case,
        {
            "rows": {
                "lead": (3,),
                "dim": 0,
                "bias": (True,),
                "gathered": False,
                "pn": 8,
                "dtype": "bf16",
                "wide": True,
            },
            "gathered": {"lead": (1,), "dim": -2, "bias": (False,), "gathered": True, "pn": 1, "again": True},
            "seq_dim": {
                "lead": (2, 3),
                "dim": 1,
                "bias": (True,),
                "gathered": True,
                "pn": 2,
                "scale_lead": True,
                "scale_1d": True,
            },
            "weights": {
                "lead": (2, 3),
                "dim": -2,
                "bias": (True, False, True),
                "gathered": True,
                "pn": 4,
                "tuple": True,
            },
            "dim0_3d": {"lead": (3, 2), "dim": 0, "bias": (True,), "gathered": True, "pn": 2, "dtype": "fp16"},
            "one_row_blocks": {"lead": (3, 1), "dim": 1, "bias": (False,), "gathered": True, "pn": 2},
            "4d": {"lead": (2, 3, 1), "dim": 1, "bias": (True, False), "gathered": True, "pn": 4},
            "4d_neg": {"lead": (1, 2, 3), "dim": -2, "bias": (False,), "gathered": False, "pn": 2},
            "empty": {"lead": (2, 0), "dim": 1, "bias": (False, False), "gathered": True, "pn": 2},
        },
    ),
    "reduce_scatter": (
        reduce_scatter_case,
        {
            "rows": {
                "lead": (3,),
                "dim": -2,
                "bias": True,
                "deterministic": False,
                "pn": 8,
                "dtype": "bf16",
                "wide": True,
            },
            "deterministic": {"lead": (1,), "dim": 0, "bias": False, "deterministic": True, "pn": 1, "offset": False},
            "seq_dim": {"lead": (2, 3), "dim": 1, "bias": True, "deterministic": True, "pn": 2},
            # x [2, 3 W, 0] on the last rank: an empty shard with leading dims (the rows cannot be inferred)
            "empty_k": {"lead": (2, 3), "dim": 1, "bias": True, "deterministic": False, "pn": 2, "empty_last": True},
            "seq_dim_neg": {"lead": (2, 3), "dim": -2, "bias": False, "deterministic": False, "pn": 4},
            "dim0_3d": {"lead": (3, 2), "dim": 0, "bias": True, "deterministic": True, "pn": 2, "dtype": "fp16"},
            "4d": {"lead": (2, 1, 3), "dim": 1, "bias": False, "deterministic": False, "pn": 2},
            "4d_neg": {"lead": (3, 2, 1), "dim": -2, "bias": True, "deterministic": True, "pn": 4},
        },
    ),
    "all_reduce": (
        all_reduce_case,
        {
            "rows": {"lead": (5,), "bias": True, "deterministic": False, "pn": 8, "dtype": "bf16", "wide": True},
            "deterministic": {"lead": (7, 2), "bias": False, "deterministic": True, "pn": 2, "offset": False},
            "empty_k": {"lead": (3, 2), "bias": True, "deterministic": False, "pn": 2, "empty_last": True},
            "one_row": {"lead": (1,), "bias": True, "deterministic": True, "pn": 4, "dtype": "fp16"},
        },
    ),
}
SHAPE_CASES = {
    "all_gather": ("dim0_3d", "one_row_blocks", "4d", "4d_neg", "empty"),
    "reduce_scatter": ("seq_dim_neg", "dim0_3d", "4d", "4d_neg"),
    "all_reduce": ("one_row",),
}


def cases_of(pattern: str, backend: str) -> list[str]:
    """The cases ``pattern`` runs on ``backend``: all of them on the scripted backends, the fused backend
    leaving out the shape sweeps (:data:`SHAPE_CASES`)."""
    names = list(CASES[pattern][1])
    return names if backend in SCRIPTED else [n for n in names if n not in SHAPE_CASES[pattern]]


def pattern_body(
    rank: int, world: int, pattern: str, backend: str, formats: tuple[str, ...] = FORMATS, device: str | None = None
) -> dict[str, str | None]:
    """Every (format, case) of ``pattern`` on ``backend``: ``{"<format> <case>": None or the failure}``.
    ``device="cuda"``: the operands on this rank's GPU (TF32 off: the bounds are fp32's)."""
    fn, cases = CASES[pattern]
    dev = None
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        dev = torch.device("cuda", torch.cuda.current_device())
    results: dict[str, str | None] = {}
    _RATIOS.clear()
    with torch.no_grad():
        for fmt in formats:
            for name in cases_of(pattern, backend):
                _RUNNING[0] = f"{fmt} {name}"
                try:
                    results[f"{fmt} {name}"] = fn(rank, world, fmt, backend, cases[name], dev)
                except Exception as e:  # reported per case; the other cases still run
                    results[f"{fmt} {name}"] = f"raised {type(e).__name__}: {e}"
    return results


def failures(per_rank: list[dict[str, str | None]]) -> dict[str, str]:
    """The failed cases of every rank, ``{"rank r <format> <case>": failure}``."""
    return {f"rank {r} {case}": problem for r, res in enumerate(per_rank) for case, problem in res.items() if problem}


def check_pattern(pattern: str, per_rank: list[dict[str, str | None]], backend: str, formats=FORMATS) -> None:
    """Every rank ran every (format, case) of ``pattern`` on ``backend``, and none failed."""
    want = [f"{fmt} {case}" for fmt in formats for case in cases_of(pattern, backend)]
    assert all(list(res) == want for res in per_rank), [list(res) for res in per_rank]
    problems = failures(per_rank)
    assert not problems, problems


def pattern_ratios(rank: int, world: int, pattern: str, backend: str) -> dict[str, tuple[str | None, float]]:
    """:func:`pattern_body` with each case's worst |error| / bound: ``{"<format> <case>": (failure, ratio)}``."""
    results = pattern_body(rank, world, pattern, backend)
    return {key: (problem, _RATIOS.get(key, 0.0)) for key, problem in results.items()}


# The per-op tests' grid: (backend, world). The fused kernels run under the Triton interpreter, where every launch
# costs seconds: worlds 1 and 2.
GRID = [
    ("sequential", 1),
    ("sequential", 2),
    ("sequential", 3),
    ("sequential", 4),
    ("chunked", 1),
    ("chunked", 2),
    ("chunked", 3),
    ("chunked", 4),
    ("fused", 1),
    ("fused", 2),
]
OPS = {
    "all_gather": "all_gather_scaled_matmul",
    "reduce_scatter": "scaled_matmul_reduce_scatter",
    "all_reduce": "scaled_matmul_all_reduce",
}


def fp8_table() -> str:
    """docs/fp8.md's measured table: the worst |error| / bound over elements, ranks, worlds and cases of every FP8
    op x mode x backend x out dtype of the grid, as markdown (raises if a case fails)."""
    from kernels.testing import run_ranks

    worst: dict[tuple[str, str, str, str], float] = {}
    for pattern in PATTERNS:
        for backend, world in GRID:
            for rank, res in enumerate(run_ranks(pattern_ratios, world, pattern, backend, timeout=900)):
                for key, (problem, ratio) in res.items():
                    if problem:
                        raise AssertionError(f"{pattern} {backend} W={world} rank {rank} {key}: {problem}")
                    fmt, case = key.split(" ")
                    if fmt.startswith("fp8"):
                        cell = (pattern, fmt.split(":")[1], backend, CASES[pattern][1][case].get("dtype", "fp32"))
                        worst[cell] = max(worst.get(cell, 0.0), ratio)
    columns = [(b, dt) for dt in ("fp32", "bf16") for b in ("sequential", "chunked", "fused")]
    lines = [
        "| op | mode | " + " | ".join(f"{b} {dt} out" for b, dt in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for pattern in PATTERNS:
        for mode in ("tensor", "row", "block"):
            cells = [f"{worst[(pattern, mode) + c]:.3f}" if (pattern, mode) + c in worst else "-" for c in columns]
            lines.append(f"| {OPS[pattern]} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chunked_on_one_gpu(pattern: str) -> None:
    """World 1 on CUDA (no process group): the chunked path's collectives over one rank are local copies on the
    current stream (kernels.comm), and every piece must be read only after its copy (large pieces would make a
    race visible). At W = 1 every op is the one GEMM, checked against :func:`kernels.testing.reference` within its
    tolerance."""
    from kernels.testing import assert_close, reference

    fn = {"all_gather": kernels.all_gather_matmul, "reduce_scatter": kernels.matmul_reduce_scatter}.get(
        pattern, kernels.matmul_all_reduce
    )
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(8192, 1024, device=dev, generator=g)
    w = torch.randn(256, 1024, device=dev, generator=g)
    ref = reference("ar", [x], [w], None, 0)
    for flags in ({},) if pattern == "all_gather" else ({"deterministic": False}, {"deterministic": True}):
        # Freed NaN blocks of these sizes are what an early read of a fresh buffer would see.
        torch.full_like(x, float("nan"))
        torch.full_like(x[:, :256], float("nan"))
        got = fn(x, w, backend="chunked", parallel_num=8, **flags)
        assert_close(f"{pattern} {flags}", got, ref, torch.float32)


if __name__ == "__main__":
    from tests.kernels import op_cases  # the rank pool ships functions by reference: not __main__'s

    print(op_cases.fp8_table())
