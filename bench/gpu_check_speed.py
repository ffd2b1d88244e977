"""gpu-check's speed section: one process on one GPU, the GEMM core against cuBLAS, fused and chunked at W = 1.

Each shape's result becomes report items (``{"name", "status", "detail", ...}``) as soon as it is
measured, so a section stopped at its deadline keeps the shapes it finished. Timings of several
processes sharing one GPU (the gpu-marked tests) are correctness checks, not speedups; this section
is where speed is measured. Order: the bf16 shapes (the targets' dtype), then the FP8 rows
(:mod:`bench.fp8_speed`: the FP8 core and fused ops at W = 1 against ``torch._scaled_mm``, with the
model's TP8 predictions from those GEMM times), then fp16.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench import fp8_speed

Emit = Callable[[dict], None]


def speed_items(rec: dict, label: str) -> list[dict]:
    """Report items of one :func:`bench.single.run_single` record."""
    m, k, n = rec["gemm_shape"]
    shape = f"{rec['dtype']} {label} gemm [{m}, {k}, {n}]"
    items = []
    if "core_skipped" in rec:
        items.append({"name": f"core {shape}", "status": "skip", "detail": rec["core_skipped"]})
    else:
        ok = rec.get("core_correct", False)
        detail = (
            f"core {rec['core_tflops']:.1f} TFLOP/s, cuBLAS {rec['torch_tflops']:.1f} TFLOP/s, "
            f"core/cuBLAS speed {rec['core_vs_torch']:.3f}x"
            if ok
            else "differs from torch beyond tolerance"
        )
        items.append(
            {
                "name": f"core {shape}",
                "status": "pass" if ok else "fail",
                "detail": detail,
                "kind": "core",
                "shape": shape,
                "dtype": rec["dtype"],
                "m": m,
                "core_vs_torch": rec.get("core_vs_torch"),
                "core_tflops": rec.get("core_tflops"),
                "torch_tflops": rec.get("torch_tflops"),
            }
        )
    for row in rec["ops"]:
        for key, ratio_key, kind in (
            ("fused", "fused_over_gemm", "fused_w1"),
            ("chunked4", "chunked4_over_sequential", "chunked4_w1"),
        ):
            name = f"{kind} {row['op']} {shape}"
            skipped = row.get(f"{key}_skipped")
            if skipped:
                items.append({"name": name, "status": "fail" if "differs" in skipped else "skip", "detail": skipped})
            elif ratio_key in row:
                what = "fused at world 1 / bare GEMM" if kind == "fused_w1" else "chunked x4 / unchunked at world 1"
                items.append(
                    {
                        "name": name,
                        "status": "pass",
                        "detail": f"{what} = {row[ratio_key]:.3f}",
                        "kind": kind,
                        "shape": shape,
                        "op": row["op"],
                        "dtype": rec["dtype"],
                        "m": m,
                        "ratio": row[ratio_key],
                    }
                )
    return items


def cases(cuda: bool) -> list[Any]:
    """GPU: the LLaMA-2/3-70B TP8 per-rank shapes and 8192^3, bf16 (the targets' dtype) first; CPU: two
    tiny shapes that test the code path (their times mean nothing)."""
    from bench.suites import Case, load_suite

    if not cuda:
        return [
            Case("tiny", "qkv", "all_gather_matmul", 64, 32, 96, 2, "fp16"),
            Case("tiny", "out", "matmul_reduce_scatter", 64, 64, 32, 2, "fp16"),
        ]
    out: list[Case] = []
    for suite, tokens in (("llama2-70b", 4096), ("llama3-70b", 8192)):
        out += [
            c
            for c in load_suite(suite).cases(ops=None, tokens=[tokens], world_sizes=[8], dtypes=["bf16", "fp16"])
            if c.op != "quantized_matmul_all_reduce"
        ]
    out += [Case("square", "8192^3", "matmul_all_reduce", 8192, 8192, 8192, 1, d) for d in ("bf16", "fp16")]
    return sorted(out, key=lambda c: c.dtype != "bf16")


def run(device_type: str, deadline: float, emit: Emit) -> None:
    """Time every shape of :func:`cases` in this process until ``deadline`` (``time.time()`` seconds)."""
    from bench import launch
    from bench.runner import RunOptions
    from bench.single import run_single

    cuda = device_type == "cuda"
    opts = RunOptions(backends=[], warmup=5 if cuda else 1, repeats=30 if cuda else 2, seed=0, progress=False)
    groups: dict[tuple, list] = {}
    for c in cases(cuda):
        groups.setdefault(c.gemm_shape + (c.dtype,), []).append(c)
    plan: list[tuple[str, Any]] = [("single", g) for g in groups.values() if g[0].dtype == "bf16"]
    plan += [("fp8", c) for c in fp8_speed.cases(cuda)]
    plan += [("single", g) for g in groups.values() if g[0].dtype != "bf16"]
    for done, (kind, work) in enumerate(plan):
        left = deadline - time.time()
        if left < 10:
            emit({"name": "speed: shapes not timed", "status": "skip", "detail": f"{len(plan) - done} (no time)"})
            return
        if kind == "fp8":
            run_fp8(device_type, left, work, opts, emit)
            continue
        res = launch.run_in_process(run_single, device_type, left, work, opts)
        label = f"{work[0].suite}/{work[0].layer} M={work[0].tokens}"
        for rec in res["records"]:
            for it in speed_items(rec, label):
                emit(it)


def run_fp8(device_type: str, left: float, case: Any, opts: Any, emit: Emit) -> None:
    """One FP8 case; an error (an FP8 build or torch that cannot run it) is reported, and the rows after go on."""
    from bench import launch

    try:
        res = launch.run_in_process(fp8_speed.run_fp8_single, device_type, left, [case], opts)
    except Exception as e:  # noqa: BLE001 - whatever failed, the report names it and the section continues
        emit({"name": f"fp8 {case.shape}", "status": "fail", "detail": f"{type(e).__name__}: {str(e)[-1200:]}"})
        return
    for rec in res["records"]:
        for it in fp8_speed.items(rec):
            emit(it)


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def summary(items: list[dict]) -> str:
    """The performance targets as numbers (benchmarks, not pass/fail tests)."""
    out = []
    core = [it for it in items if it.get("kind") == "core" and it.get("core_vs_torch")]
    # bf16 is the targets' dtype; the CPU flow has fp16 only.
    vals = [it["core_vs_torch"] for it in core if it["dtype"] == "bf16"] or [it["core_vs_torch"] for it in core]
    if vals:
        out.append(f"core/cuBLAS min {min(vals):.2f}x median {_median(vals):.2f}x (target >= 0.95, bf16)")
    fused = [it["ratio"] for it in items if it.get("kind") == "fused_w1"]
    if fused:
        out.append(f"fused W=1 / GEMM max {max(fused):.3f} (target <= 1.03)")
    chunk = [it["ratio"] for it in items if it.get("kind") == "chunked4_w1" and it["m"] >= 4096]
    if chunk:
        out.append(f"chunked x4 / unchunked at M >= 4096 max {max(chunk):.3f} (target <= 1.05)")
    return "; ".join(out + fp8_speed.summary(items))


def table(items: list[dict]) -> list[str]:
    """One markdown row per GEMM shape and dtype (no lines if nothing was timed)."""
    from bench.suites import OP_SHORT

    rows: dict[str, dict[str, str]] = {}
    for it in items:
        if "shape" not in it or str(it.get("kind", "")).startswith("fp8"):
            continue  # FP8 rows: their own table (bench.fp8_speed.table)
        row = rows.setdefault(it["shape"], {})
        if it.get("kind") == "core" and it.get("core_vs_torch"):
            row.update(
                cublas=f"{it['torch_tflops']:.0f}", core=f"{it['core_tflops']:.0f}", ratio=f"{it['core_vs_torch']:.3f}"
            )
        elif it.get("ratio") is not None:
            key = "fused" if it["kind"] == "fused_w1" else "chunked"
            cell = f"{OP_SHORT.get(it['op'], it['op'])} {it['ratio']:.3f}"
            row[key] = f"{row[key]}, {cell}" if key in row else cell
    if not rows:
        return fp8_speed.table(items)
    out = [
        "| dtype, shape, local GEMM [m, k, n] | cuBLAS TFLOP/s | core TFLOP/s | core / cuBLAS speed | "
        "fused W=1 / GEMM time | chunked x4 / unchunked time |",
        "|---|---|---|---|---|---|",
    ]
    for shape, row in rows.items():
        cells = " | ".join(row.get(k, "-") for k in ("cublas", "core", "ratio", "fused", "chunked"))
        out.append(f"| {shape} | {cells} |")
    return out + [""] + fp8_speed.table(items)
