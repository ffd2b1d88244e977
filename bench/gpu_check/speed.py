"""gpu-check's speed section: one process on one GPU, the GEMM core against its library GEMM, fused and
chunked at W = 1 (:func:`bench.dense.single.run_single`, every operand format through the same code).

Each shape's result becomes report items (``{"name", "status", "detail", ...}``) as soon as it is
measured, so a section stopped at its deadline keeps the shapes it finished. Timings of several
processes sharing one GPU (the gpu-marked tests) are correctness checks, not speedups; this section
is where speed is measured. Order: the bf16 shapes (the targets' dtype), then the FP8 rows (the FP8
core and the FP8 ops with ``backend="fused"`` at W = 1 against ``torch._scaled_mm``, the unfused
baseline's GEMM, with the model's TP8 predictions from those GEMM times; :func:`fp8_items`), then fp16.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Emit = Callable[[dict], None]
FP8_WORLD = 8  # the TP degree of the FP8 rows' shapes, which the model rows predict for


def shape_name(rec: dict, label: str) -> str:
    """``<dtype> <label> gemm [m, k, n]`` (FP8: ``fp8-<mode> ...``), the name of a record's shape in the report."""
    m, k, n = rec["gemm_shape"]
    fmt = rec.get("format", "plain")
    kind = rec["dtype"] if fmt == "plain" else fmt.replace(":", "-")
    return f"{kind} {label} gemm [{m}, {k}, {n}]"


def speed_items(rec: dict, label: str) -> list[dict]:
    """Report items of one :func:`bench.dense.single.run_single` record."""
    if rec.get("format", "plain").startswith("fp8"):
        return fp8_items(rec, label)
    m, k, n = rec["gemm_shape"]
    shape = shape_name(rec, label)
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
    """GPU: the LLaMA-2/3-70B TP8 per-rank shapes and 8192^3, bf16 (the targets' dtype) first; then the FP8
    rows: LLaMA-3-70B at M = 8192, QKV (all-gather) and fc2 (reduce-scatter, all-reduce) with block scales
    (the DeepSeek-V3 recipe), then QKV with row and with tensor scales, bf16 outputs; then fp16. CPU: two
    tiny shapes and one tiny rowwise FP8 shape (the mode CPU torch's ``_scaled_mm`` runs) that test the
    code path (their times mean nothing)."""
    from bench.harness.suites import Case, load_suite

    if not cuda:
        return [
            Case("tiny", "qkv", "all_gather_matmul", 64, 32, 96, 2, "fp16"),
            Case("tiny", "out", "matmul_reduce_scatter", 64, 64, 32, 2, "fp16"),
            Case("tiny", "out", "matmul_all_reduce", 16, 128, 16, 1, "bf16", "fp8:row"),
        ]
    out: list[Case] = []
    for suite, tokens in (("llama2-70b", 4096), ("llama3-70b", 8192)):
        out += [
            c
            for c in load_suite(suite).cases(ops=None, tokens=[tokens], world_sizes=[8], dtypes=["bf16", "fp16"])
            if c.fmt == "plain"
        ]
    out += [Case("square", "8192^3", "matmul_all_reduce", 8192, 8192, 8192, 1, d) for d in ("bf16", "fp16")]
    fp8 = []
    llama3 = load_suite("llama3-70b")
    for fmt, layers in (("fp8:block", ("qkv", "fc2")), ("fp8:row", ("qkv",)), ("fp8:tensor", ("qkv",))):
        ops = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]
        found = llama3.cases(ops=ops, tokens=[8192], world_sizes=[FP8_WORLD], dtypes=["bf16"], formats=[fmt])
        fp8 += [c for c in found if c.layer in layers]
    return [c for c in out if c.dtype == "bf16"] + fp8 + [c for c in out if c.dtype != "bf16"]


def run(device_type: str, deadline: float, emit: Emit) -> None:
    """Time every shape of :func:`cases` in this process until ``deadline`` (``time.time()`` seconds): one
    :func:`bench.dense.single.run_single` per GEMM shape, dtype and format, in :func:`cases`' order."""
    from bench.dense.runner import RunOptions
    from bench.dense.single import run_single
    from bench.harness import launch

    cuda = device_type == "cuda"
    opts = RunOptions(backends=[], warmup=5 if cuda else 1, repeats=30 if cuda else 2, seed=0, progress=False)
    groups: dict[tuple, list] = {}
    for c in cases(cuda):
        groups.setdefault(c.gemm_shape + (c.dtype, c.fmt), []).append(c)
    plan = list(groups.values())
    for done, work in enumerate(plan):
        left = deadline - time.time()
        if left < 10:
            emit({"name": "speed: shapes not timed", "status": "skip", "detail": f"{len(plan) - done} (no time)"})
            return
        label = f"{work[0].suite}/{work[0].layer} M={work[0].tokens}"
        if work[0].kind == "fp8":
            # An FP8 build or torch that cannot run a shape is reported, and the rows after it still run.
            try:
                res = launch.run_in_process(run_single, device_type, left, work, opts)
            except Exception as e:  # noqa: BLE001 - whatever failed, the report names it and the section continues
                shape = shape_name({"gemm_shape": list(work[0].gemm_shape), "dtype": "", "format": work[0].fmt}, label)
                emit({"name": f"fp8 {shape}", "status": "fail", "detail": f"{type(e).__name__}: {str(e)[-1200:]}"})
                continue
        else:
            res = launch.run_in_process(run_single, device_type, left, work, opts)
        for rec in res["records"]:
            for it in speed_items(rec, label):
                emit(it)


def fp8_items(rec: dict, label: str) -> list[dict]:
    """Report items of one FP8 record: ``torch._scaled_mm`` skipped (with torch's reason), the FP8 core
    against it (``fp8_core``), each FP8 op fused at world 1 (``fp8_fused_w1``, with the MODEL's TP times)."""
    shape = shape_name(rec, label)
    common = {"shape": shape, "dtype": rec["format"].replace(":", "-"), "m": rec["gemm_shape"][0]}
    out = []
    if "torch_skipped" in rec:
        out.append({"name": f"torch._scaled_mm {shape}", "status": "skip", "detail": rec["torch_skipped"]})
    if "core_skipped" in rec:
        out.append({"name": f"fp8 core {shape}", "status": "skip", "detail": rec["core_skipped"]})
    elif not rec.get("core_correct"):
        detail = "FP8 core differs from the dequantized product beyond its bound (kernels.fp8.numerics)"
        out.append({"name": f"fp8 core {shape}", "status": "fail", "detail": detail})
    else:
        detail = f"FP8 core {rec['core_tflops']:.1f} TFLOP/s"
        if rec.get("torch_tflops"):
            detail += (
                f", torch._scaled_mm {rec['torch_tflops']:.1f} TFLOP/s, "
                f"core/_scaled_mm speed {rec['core_vs_torch']:.3f}x"
            )
        out.append(
            {
                "name": f"fp8 core {shape}",
                "status": "pass",
                "detail": detail,
                "kind": "fp8_core",
                **common,
                "core_tflops": rec["core_tflops"],
                "scaled_mm_tflops": rec.get("torch_tflops"),
                "core_vs_scaled_mm": rec.get("core_vs_torch"),
            }
        )
    for row in rec["ops"]:
        name = f"fp8 fused_w1 {row['op']} {shape}"
        if "fused_ms" not in row:
            why = row.get("fused_skipped", "not timed")
            out.append({"name": name, "status": "fail" if "differs" in why else "skip", "detail": why})
            continue
        parts = [f"fused at world 1 {row['fused_ms']['median']:.3f} ms"]
        if "fused_over_gemm" in row:
            parts.append(f"/ torch._scaled_mm = {row['fused_over_gemm']:.3f}")
        if "fused_over_core" in row:
            parts.append(f"/ FP8 core = {row['fused_over_core']:.3f}")
        detail = " ".join(parts)
        model = row.get("model_ms")
        if model:
            detail += (
                f"; MODEL, not measured: TP{model['world']} from the measured GEMMs + links.yaml: _scaled_mm + NCCL "
                f"{model['baseline']:.3f} ms, fused {model['fused']:.3f} ms"
            )
        out.append(
            {
                "name": name,
                "status": "pass",
                "detail": detail,
                "kind": "fp8_fused_w1",
                **common,
                "op": row["op"],
                "ratio": row.get("fused_over_gemm"),
                "over_core": row.get("fused_over_core"),
                "model_tp_ms": model,
            }
        )
    return out


def fp8_summary(report_items: list[dict]) -> list[str]:
    """FP8 parts of the speed verdict line (benchmarks, not pass/fail targets)."""
    out = []
    core = [
        it["core_vs_scaled_mm"] for it in report_items if it.get("kind") == "fp8_core" and it.get("core_vs_scaled_mm")
    ]
    if core:
        out.append(f"FP8 core/_scaled_mm min {min(core):.2f}x")
    fused = [it["ratio"] for it in report_items if it.get("kind") == "fp8_fused_w1" and it.get("ratio")]
    if fused:
        out.append(f"FP8 fused W=1 / _scaled_mm max {max(fused):.3f}")
    return out


def fp8_table(report_items: list[dict]) -> list[str]:
    """Markdown rows per FP8 shape (no lines if nothing was timed)."""
    from bench.harness.suites import OP_SHORT

    rows: dict[str, dict[str, str]] = {}
    worlds = sorted({it["model_tp_ms"]["world"] for it in report_items if it.get("model_tp_ms")}) or [FP8_WORLD]
    for it in report_items:
        if it.get("kind") == "fp8_core":
            row = rows.setdefault(it["shape"], {})
            row["core"] = f"{it['core_tflops']:.0f}"
            if it.get("scaled_mm_tflops"):
                row.update(base=f"{it['scaled_mm_tflops']:.0f}", ratio=f"{it['core_vs_scaled_mm']:.3f}")
        elif it.get("kind") == "fp8_fused_w1":
            row = rows.setdefault(it["shape"], {})
            op = OP_SHORT.get(it["op"], it["op"])
            model = it.get("model_tp_ms")
            for key, cell in (
                ("fused", f"{it['ratio']:.3f}" if it.get("ratio") else "-"),
                ("model", f"{model['baseline']:.3f} / {model['fused']:.3f}" if model else "-"),
            ):
                row[key] = f"{row[key]}, {op} {cell}" if key in row else f"{op} {cell}"
    if not rows:
        return []
    tp = "/".join(f"TP{w}" for w in worlds)
    out = [
        "",
        f"FP8 (one process on one GPU; inputs already quantized, bf16 outputs). The {tp} columns are the "
        f"performance MODEL's predictions from the GEMM times measured here: nothing at {tp} was measured.",
        "",
        "| mode, shape, local GEMM [m, k, n] | torch._scaled_mm TFLOP/s | FP8 core TFLOP/s | core / _scaled_mm "
        f"speed | fused W=1 / _scaled_mm time | MODEL {tp} ms: _scaled_mm + NCCL / fused |",
        "|---|---|---|---|---|---|",
    ]
    for shape, row in rows.items():
        cells = " | ".join(row.get(k, "-") for k in ("base", "core", "ratio", "fused", "model"))
        out.append(f"| {shape} | {cells} |")
    return out + [""]


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
    return "; ".join(out + fp8_summary(items))


def table(items: list[dict]) -> list[str]:
    """One markdown row per GEMM shape and dtype (no lines if nothing was timed)."""
    from bench.harness.suites import OP_SHORT

    rows: dict[str, dict[str, str]] = {}
    for it in items:
        if "shape" not in it or str(it.get("kind", "")).startswith("fp8"):
            continue  # FP8 rows: their own table (fp8_table)
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
        return fp8_table(items)
    out = [
        "| dtype, shape, local GEMM [m, k, n] | cuBLAS TFLOP/s | core TFLOP/s | core / cuBLAS speed | "
        "fused W=1 / GEMM time | chunked x4 / unchunked time |",
        "|---|---|---|---|---|---|",
    ]
    for shape, row in rows.items():
        cells = " | ".join(row.get(k, "-") for k in ("cublas", "core", "ratio", "fused", "chunked"))
        out.append(f"| {shape} | {cells} |")
    return out + [""] + fp8_table(items)
