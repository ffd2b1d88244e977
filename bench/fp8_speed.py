"""gpu-check's FP8 speed rows: one process on one GPU, the FP8 GEMMs against ``torch._scaled_mm``.

The unfused baseline of an FP8 tensor-parallel op is ``torch._scaled_mm`` (cuBLASLt) followed by an
NCCL collective over the TP group. One process on one GPU can run its GEMM, not its collective, so
per local GEMM shape of the LLaMA-70B TP8 layers (:func:`cases`) this measures (CUDA events, L2
flushed, median of the repeats; inputs already quantized):

* ``torch._scaled_mm`` at that shape (the baseline's GEMM), where this torch supports the mode;
* the fused backend's FP8 GEMM core (``kernels.fused.matmul.gemm`` with the FP8 format, the W == 1 kernel);
* each FP8 op with ``backend="fused"`` at world 1 (the fused kernel without peers);

and, labelled as a MODEL, the TP8 times the performance model (bench/model.py) predicts from the
measured GEMM times and the links.yaml link model of this GPU generation: the baseline as
``t(_scaled_mm) + NCCL collective`` and the fused op's overlapped schedule. No TP8 time is measured.
Every timed path is first checked against the fp32 product of the dequantized inputs
(relative Frobenius error at most :data:`CHECK_REL`; inputs carry power-of-2 magnitudes per row and
per 128-block so that a misread scale layout fails the check; the element-wise bound is the gpu
tests' job, tests/kernels/fused/test_fp8_gpu.py).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from bench.timing import Timer

# bf16 output rounding is 2**-9 relative; a misread scale layout errs by orders of magnitude more.
CHECK_REL = 1e-2
QUANT_MODES = {"block": ("block", "block2d"), "row": ("row", "row"), "tensor": ("tensor", "tensor")}
TP = 8  # the world size the model rows predict for


@dataclass(frozen=True)
class Fp8Case:
    """One local GEMM ``[m, k, n]`` of a TP layer, the ops that run it and the scaling mode."""

    label: str
    m: int
    k: int
    n: int
    ops: tuple[str, ...]
    mode: str

    @property
    def shape(self) -> str:
        return f"fp8-{self.mode} {self.label} gemm [{self.m}, {self.k}, {self.n}]"


def cases(cuda: bool) -> list[Fp8Case]:
    """GPU: LLaMA-3-70B at M = 8192 tokens, TP8 per-rank GEMMs (configs/bench/llama3-70b.yaml): QKV
    (all-gather) and fc2 (reduce-scatter, all-reduce) with block scales (the DeepSeek-V3 recipe),
    then QKV with row and tensor scales. CPU: one tiny shape that tests the code path only (rowwise:
    the mode CPU torch's ``_scaled_mm`` runs; the interpreter makes every call cost ~0.2 s)."""
    if not cuda:
        return [Fp8Case("tiny/out M=16", 16, 128, 16, ("matmul_all_reduce",), "row")]
    qkv = ("llama3-70b/qkv M=8192", 8192, 8192, 10240 // TP, ("all_gather_matmul",))
    fc2 = ("llama3-70b/fc2 M=8192", 8192, 28672 // TP, 8192, ("matmul_reduce_scatter", "matmul_all_reduce"))
    return [Fp8Case(*qkv, "block"), Fp8Case(*fc2, "block"), Fp8Case(*qkv, "row"), Fp8Case(*qkv, "tensor")]


def _inputs(c: Fp8Case, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """Quantized ``x [m, k]`` and ``w [n, k]`` whose magnitudes differ by powers of 2 per row and per
    128-column block (per 128 x 128 block for w), so that each scale matters."""
    import kernels

    g = torch.Generator().manual_seed(seed)
    kb, nb = math.ceil(c.k / 128), math.ceil(c.n / 128)

    def powers(*shape: int) -> torch.Tensor:
        return torch.exp2(torch.randint(-3, 4, shape, generator=g).float())

    col = powers(1, kb).repeat_interleave(128, dim=1)[:, : c.k]
    x = torch.randn(c.m, c.k, generator=g) * powers(c.m, 1) * col
    wblk = powers(nb, kb).repeat_interleave(128, dim=0)[: c.n].repeat_interleave(128, dim=1)[:, : c.k]
    w = torch.randn(c.n, c.k, generator=g) / c.k**0.5 * wblk
    x_mode, w_mode = QUANT_MODES[c.mode]
    xq, xs = kernels.quantize_fp8(x.to(device), mode=x_mode)
    wq, ws = kernels.quantize_fp8(w.to(device), mode=w_mode)
    ref = torch.nn.functional.linear(
        kernels.dequantize_fp8(xq, xs, x_mode), kernels.dequantize_fp8(wq, ws, w_mode)
    )  # fp32: the dequantized product
    return xq, xs, wq, ws, ref


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp(min=1e-30))


def scaled_mm_layouts(mode: str, xs: torch.Tensor, ws: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(scale_a, scale_b)`` candidates for ``torch._scaled_mm(x, w.t(), ...)``: tensorwise scalars,
    rowwise ``[m, 1]`` / ``[1, n]``; blockwise 1x128 / 128x128 layouts differ between torch versions
    (row- or column-major, ``w`` blocks as ``[n/128, k/128]`` or transposed), so each is tried and the
    first that runs and passes the check is timed."""
    if mode == "tensor":
        return [(xs, ws)]
    if mode == "row":
        return [(xs, ws.reshape(1, -1))]
    col_major = xs.t().contiguous().t()
    return [(xs, ws.t()), (col_major, ws.t()), (col_major, ws), (xs, ws), (col_major, ws.t().contiguous())]


def _scaled_mm(xq: torch.Tensor, wq: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(xq, wq.t(), scale_a, scale_b, out_dtype=torch.bfloat16)


def _baseline(rec: dict, c: Fp8Case, xq, xs, wq, ws, ref, timer: Timer, opts: Any) -> float | None:
    errors = []
    for scale_a, scale_b in scaled_mm_layouts(c.mode, xs, ws):
        try:
            out = _scaled_mm(xq, wq, scale_a, scale_b)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            errors.append(str(e).splitlines()[0][:200])
            continue
        err = rel_error(out, ref)
        if err > CHECK_REL:
            errors.append(f"scales {tuple(scale_a.shape)} / {tuple(scale_b.shape)}: relative error {err:.3g}")
            continue
        t = timer.run(partial(_scaled_mm, xq, wq, scale_a, scale_b), opts.warmup, opts.repeats)
        rec["scaled_mm_ms"] = t.to_ms()
        return t.median
    rec["scaled_mm_skipped"] = f"torch._scaled_mm ({torch.__version__}) cannot run {c.mode} scales: " + (
        "; ".join(errors[-2:]) or "no layout"
    )
    return None


def _model(c: Fp8Case, op: str, t_gemm: float, t_core: float, link: Any) -> dict[str, float]:
    """MODEL: TP8 times from the measured GEMMs (baseline: torch._scaled_mm; fused: our core)."""
    from bench import model

    comm_elems = c.m * (c.k if op == "all_gather_matmul" else c.n)
    shape = (c.m, c.k, c.n)
    out = {}
    for key, backend, t in (("baseline", "baseline", t_gemm), ("fused", "fused", t_core)):
        gemm = model.GemmTimes({shape: t})
        t = model.predict(
            op, backend, TP, shape, comm_elems, dtype=model.FP8, gemm_time=gemm, link=link, fp8_mode=c.mode
        )
        out[key] = t or float("nan")
    return out


def run_fp8_single(rank: int, world: int, device: torch.device, fp8_cases: list[Fp8Case], opts: Any) -> dict:
    """Rank body for :func:`bench.launch.run_in_process`: one record per case (module docstring)."""
    import kernels
    from bench import model

    functions = {
        "all_gather_matmul": kernels.all_gather_scaled_matmul,
        "matmul_reduce_scatter": kernels.scaled_matmul_reduce_scatter,
        "matmul_all_reduce": kernels.scaled_matmul_all_reduce,
    }
    from bench.runner import fallback_reason
    from kernels.call import Operands
    from kernels.format import fp8
    from kernels.fused.matmul import gemm

    timer = Timer(device)
    link = None
    if device.type == "cuda":
        gen = model.detect_generation(torch.cuda.get_device_name(device))
        link = model.load_gpu(gen)[0] if gen else None
    records = []
    for i, c in enumerate(fp8_cases):
        xq, xs, wq, ws, ref = _inputs(c, device, opts.seed + i)
        rec: dict[str, Any] = {"case": c.label, "mode": c.mode, "gemm_shape": [c.m, c.k, c.n], "shape": c.shape}
        t_base = _baseline(rec, c, xq, xs, wq, ws, ref, timer, opts)
        core = partial(gemm, fp8(c.mode), Operands(xq, (wq,), (None,), xs, (ws,)), out_dtype=torch.bfloat16)
        err = rel_error(core(), ref)
        t_core = None
        if err > CHECK_REL:
            rec["core_error"] = f"FP8 core differs from the dequantized product: relative error {err:.3g}"
        else:
            t_core = timer.run(core, opts.warmup, opts.repeats).median
            rec["core_ms"] = t_core * 1e3
            rec["core_tflops"] = 2 * c.m * c.k * c.n / t_core / 1e12
            if t_base is not None:
                rec["core_vs_scaled_mm"] = t_base / t_core
        rec["ops"] = []
        for op in c.ops:
            row: dict[str, Any] = {"op": op}
            fn = partial(functions[op], xq, xs, wq, ws, out_dtype=torch.bfloat16, backend="fused")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = fn()
            reason = fallback_reason(caught)
            err = rel_error(out, ref)
            if reason:
                row["skipped"] = f"the dispatcher did not run the fused kernel: {reason}"
            elif err > CHECK_REL:
                row["error"] = f"fused at world 1 differs from the dequantized product: relative error {err:.3g}"
            else:
                t = timer.run(fn, opts.warmup, opts.repeats).median
                row["fused_ms"] = t * 1e3
                if t_base is not None:
                    row["fused_over_scaled_mm"] = t / t_base
                if t_core is not None:
                    row["fused_over_core"] = t / t_core
                if link is not None and t_base is not None and t_core is not None:
                    row["model_tp8_ms"] = {k: v * 1e3 for k, v in _model(c, op, t_base, t_core, link).items()}
            rec["ops"].append(row)
        records.append(rec)
    return {"records": records, "link_model": link.name if link is not None else None}


# ------------------------------------------------------------------------------ report items


def items(rec: dict) -> list[dict]:
    """gpu-check report items of one :func:`run_fp8_single` record."""
    shape, m = rec["shape"], rec["gemm_shape"][0]
    common = {"shape": shape, "dtype": f"fp8-{rec['mode']}", "m": m}
    out = []
    if "scaled_mm_skipped" in rec:
        out.append({"name": f"torch._scaled_mm {shape}", "status": "skip", "detail": rec["scaled_mm_skipped"]})
    base = rec.get("scaled_mm_ms", {}).get("median")
    if "core_error" in rec:
        out.append({"name": f"fp8 core {shape}", "status": "fail", "detail": rec["core_error"]})
    else:
        flops = 2 * math.prod(rec["gemm_shape"])
        detail = f"FP8 core {rec['core_tflops']:.1f} TFLOP/s"
        if base:
            detail += (
                f", torch._scaled_mm {flops / base / 1e9:.1f} TFLOP/s, "
                f"core/_scaled_mm speed {rec['core_vs_scaled_mm']:.3f}x"
            )
        out.append(
            {
                "name": f"fp8 core {shape}",
                "status": "pass",
                "detail": detail,
                "kind": "fp8_core",
                **common,
                "core_tflops": rec["core_tflops"],
                "scaled_mm_tflops": flops / base / 1e9 if base else None,
                "core_vs_scaled_mm": rec.get("core_vs_scaled_mm"),
            }
        )
    for row in rec["ops"]:
        name = f"fp8 fused_w1 {row['op']} {shape}"
        if "skipped" in row or "error" in row:
            status = "skip" if "skipped" in row else "fail"
            out.append({"name": name, "status": status, "detail": row.get("skipped") or row["error"]})
            continue
        parts = [f"fused at world 1 {row['fused_ms']:.3f} ms"]
        if "fused_over_scaled_mm" in row:
            parts.append(f"/ torch._scaled_mm = {row['fused_over_scaled_mm']:.3f}")
        if "fused_over_core" in row:
            parts.append(f"/ FP8 core = {row['fused_over_core']:.3f}")
        detail = " ".join(parts)
        tp8 = row.get("model_tp8_ms")
        if tp8:
            detail += (
                f"; MODEL, not measured: TP{TP} from the measured GEMMs + links.yaml: _scaled_mm + NCCL "
                f"{tp8['baseline']:.3f} ms, fused {tp8['fused']:.3f} ms"
            )
        out.append(
            {
                "name": name,
                "status": "pass",
                "detail": detail,
                "kind": "fp8_fused_w1",
                **common,
                "op": row["op"],
                "ratio": row.get("fused_over_scaled_mm"),
                "over_core": row.get("fused_over_core"),
                "model_tp8_ms": tp8,
            }
        )
    return out


def summary(report_items: list[dict]) -> list[str]:
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


def table(report_items: list[dict]) -> list[str]:
    """Markdown rows per FP8 shape (no lines if nothing was timed)."""
    from bench.suites import OP_SHORT

    rows: dict[str, dict[str, str]] = {}
    for it in report_items:
        if it.get("kind") == "fp8_core":
            row = rows.setdefault(it["shape"], {})
            row["core"] = f"{it['core_tflops']:.0f}"
            if it.get("scaled_mm_tflops"):
                row.update(base=f"{it['scaled_mm_tflops']:.0f}", ratio=f"{it['core_vs_scaled_mm']:.3f}")
        elif it.get("kind") == "fp8_fused_w1":
            row = rows.setdefault(it["shape"], {})
            op = OP_SHORT.get(it["op"], it["op"])
            for key, cell in (
                ("fused", f"{it['ratio']:.3f}" if it.get("ratio") else "-"),
                (
                    "model",
                    f"{it['model_tp8_ms']['baseline']:.3f} / {it['model_tp8_ms']['fused']:.3f}"
                    if it.get("model_tp8_ms")
                    else "-",
                ),
            ):
                row[key] = f"{row[key]}, {op} {cell}" if key in row else f"{op} {cell}"
    if not rows:
        return []
    out = [
        "",
        "FP8 (one process on one GPU; inputs already quantized, bf16 outputs). The TP8 columns are the "
        "performance MODEL's predictions from the GEMM times measured here: nothing at TP8 was measured.",
        "",
        "| mode, shape, local GEMM [m, k, n] | torch._scaled_mm TFLOP/s | FP8 core TFLOP/s | core / _scaled_mm "
        f"speed | fused W=1 / _scaled_mm time | MODEL TP{TP} ms: _scaled_mm + NCCL / fused |",
        "|---|---|---|---|---|---|",
    ]
    for shape, row in rows.items():
        cells = " | ".join(row.get(k, "-") for k in ("base", "core", "ratio", "fused", "model"))
        out.append(f"| {shape} | {cells} |")
    return out + [""]
