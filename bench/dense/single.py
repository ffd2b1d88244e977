"""Single-GPU mode: the fixed costs of the design with communication taken away.

For each local GEMM shape, dtype and operand format of the chosen cases:

* the Triton GEMM core (``kernels.fused.matmul.gemm`` in the case's format: the fused backend's W == 1
  kernel) against the format's library GEMM, the unfused baseline's (``torch.nn.functional.linear``,
  cuBLAS; FP8 ``torch._scaled_mm``, where torch runs the mode; int8 ``kernels.quant.dequantize`` +
  ``F.linear``), recorded as ``torch_*``;
* each op with ``backend="fused"`` at world size 1 against the library GEMM and against the core (the
  fusion's overhead);
* plain and int8: each op with ``backend="chunked", parallel_num=4`` at world size 1 against
  ``"sequential"`` (what splitting the GEMM costs; FP8's ``sequential`` is an fp32 reference, not a
  fast path, so FP8 rows time the fused op only);
* plain, on shapes whose k or n is not tensor-core aligned: ``matmul_soc_friendly``'s padded GEMM
  (``kernels.padding.linear``) against the unpadded one (what the padding buys or costs). Plain only:
  int8's GEMM is ``F.linear`` of the dequantized weight in x's dtype, the plain record's GEMM, and
  FP8's padded GEMM is its fp32 reference's, not a fast path;
* on a GPU with a link model in configs/links.yaml, labelled MODEL: the case's TP time predicted by
  bench/model/dense.py from the GEMM times measured here (the unfused baseline from the library GEMM, the
  fused schedule from the core); no multi-GPU time is measured.

Every path is checked before it is timed: plain and int8 against ``F.linear`` of the dequantized
operands within twice ``kernels.testing.tolerance``; FP8 against the exact (fp64) product of the
dequantized operands within the path's bound of ``kernels.fp8.numerics`` (:func:`bench.dense.formats.fp8_bound`).
GPU only: on CPU the Triton kernels run in the interpreter and their times mean nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from bench.dense import formats
from bench.dense.runner import FUSED_FALLBACK, Progress, RunOptions, fallback_reason, predict
from bench.harness.suites import OP_SHORT, Case
from bench.harness.timing import Timer
from bench.model.dense import chunk_rows


def gemm_core() -> tuple[Callable[..., torch.Tensor] | None, str]:
    """The Triton GEMM core ``gemm(fmt, operands, out_dtype=...) -> [m, n]`` (``kernels.fused.matmul``), or
    why there is none."""
    try:
        from kernels.fused import matmul
    except ImportError as e:
        return None, f"kernels.fused.matmul is not available ({e})"
    fn = getattr(matmul, "gemm", None)
    if not callable(fn):
        return None, "kernels.fused.matmul has no gemm()"
    return fn, "kernels.fused.matmul.gemm"


@dataclass(frozen=True)
class Shape:
    """One local GEMM of a group of cases: its operands in the group's format, the reference and the
    magnitude its bound scales with. ``case``: the GEMM as a world-1 case (``k``, ``n`` local)."""

    case: Case
    ops: Any
    ref: torch.Tensor
    magnitude: torch.Tensor

    @classmethod
    def of(cls, first: Case, seed: int, device: torch.device) -> Shape:
        from kernels.testing import row_norm_bound

        m, k, n = first.gemm_shape
        case = Case(first.suite, first.layer, "matmul_all_reduce", m, k, n, 1, first.dtype, first.fmt)
        ops = formats.operands(case, (m, k, n), torch.Generator().manual_seed(seed), device)
        xd, wd = formats.dequantized(case, ops)
        if case.kind == "fp8":
            xd, wd = xd.double(), wd.double()
            return cls(case, ops, xd @ wd.T, xd.abs() @ wd.abs().T)
        magnitude = row_norm_bound([xd.double().norm(dim=-1)], [wd.double().norm(dim=-1)])
        return cls(case, ops, torch.nn.functional.linear(xd, wd), magnitude)

    def check(self, out: torch.Tensor, path: str) -> bool:
        """``out`` of ``path`` (``library``, or a backend; the core is ``fused``'s) within its bound of the
        reference (module docstring)."""
        device = out.device
        if self.case.kind == "fp8":
            allowed = formats.fp8_bound(self.magnitude, self.case, path, device)
        else:
            allowed = 2 * formats.plain_coefficient(self.case, device) * self.magnitude.to(device)
        return formats.within(out, self.ref, allowed)[0]

    @property
    def out_dtype(self) -> torch.dtype:
        return formats.TORCH_DTYPES[self.case.dtype]


def _soc_effect(rec: dict[str, Any], shape: Shape, timer: Timer, opts: RunOptions) -> None:
    """Time the padded GEMM of ``matmul_soc_friendly`` where the padding changes the shape (plain)."""
    from kernels import padding
    from kernels.config import get_config

    config = get_config()
    x, w = shape.ops.x, shape.ops.weights[0]
    k, n = x.shape[1], w.shape[0]
    if padding.padded_shape(k, n, x.dtype, config.k_min, config.k_max) == (k, n):
        return
    out = padding.linear(x, w, force=True)
    rec["soc_correct"] = shape.check(out, "sequential")
    if rec["soc_correct"]:
        t_soc = timer.run(lambda: padding.linear(x, w, force=True), opts.warmup, opts.repeats)
        rec["soc_ms"] = t_soc.to_ms()
        rec["soc_speedup"] = rec["torch_ms"]["median"] / t_soc.median


def _library(rec: dict[str, Any], shape: Shape, timer: Timer, opts: RunOptions) -> float | None:
    """Check and time the format's library GEMM (``torch_*`` keys); its median seconds, or None."""
    case = shape.case
    rec["library"] = {"plain": "torch.nn.functional.linear", "fp8": "torch._scaled_mm"}.get(
        case.kind, "kernels.quant.dequantize + torch.nn.functional.linear"
    )
    try:
        fn = formats.library_gemm(case, shape.ops)
    except formats.Unsupported as e:
        rec["torch_skipped"] = str(e)
        return None
    if case.kind != "plain" and not shape.check(fn(), "library"):
        rec["torch_skipped"] = f"{rec['library']} differs from the reference beyond its bound"
        return None
    t = timer.run(fn, opts.warmup, opts.repeats)
    rec["torch_ms"] = t.to_ms()
    rec["torch_tflops"] = rec["flops"] / t.median / 1e12
    return t.median


def _core(rec: dict[str, Any], shape: Shape, timer: Timer, opts: RunOptions) -> float | None:
    """Check and time the Triton GEMM core in the shape's format; its median seconds, or None."""
    core, core_name = gemm_core()
    if core is None:
        rec["core_skipped"] = core_name
        return None
    fn = partial(core, formats.operand_format(shape.case), shape.ops, out_dtype=shape.out_dtype)
    rec["core"] = core_name
    rec["core_correct"] = shape.check(fn(), "fused")
    if not rec["core_correct"]:
        return None
    t = timer.run(fn, opts.warmup, opts.repeats)
    rec["core_ms"] = t.to_ms()
    rec["core_tflops"] = rec["flops"] / t.median / 1e12
    if "torch_ms" in rec:
        rec["core_vs_torch"] = rec["torch_ms"]["median"] / t.median
    return t.median


def _op_row(op: str, shape: Shape, timer: Timer, opts: RunOptions) -> dict[str, Any]:
    """One op at world 1: fused, and for plain / int8 chunked x4 and sequential; each checked, then timed."""
    case = Case(shape.case.suite, shape.case.layer, op, *shape.case.gemm_shape, 1, shape.case.dtype, shape.case.fmt)
    row: dict[str, Any] = {"op": op}
    variants = [("fused", {"backend": "fused", "parallel_num": None})]
    if case.kind != "fp8":
        variants += [
            ("chunked4", {"backend": "chunked", "parallel_num": 4}),
            ("sequential", {"backend": "sequential", "parallel_num": None}),
        ]
    fallback_key = f"{op} {case.kind}"
    for label, kw in variants:
        fn = formats.op_call(case, shape.ops, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = fn()
            except (NotImplementedError, ImportError) as e:
                row[f"{label}_skipped"] = str(e)
                continue
        if label == "fused":
            reason = fallback_reason(caught)
            if reason:
                FUSED_FALLBACK[fallback_key] = reason
            if fallback_key in FUSED_FALLBACK:
                row["fused_fallback"] = FUSED_FALLBACK[fallback_key]
                if case.kind == "fp8":  # the FP8 rows time the fused kernel or nothing
                    row["fused_skipped"] = f"the dispatcher did not run the fused kernel: {row['fused_fallback']}"
                    continue
        if not shape.check(out, label):
            row[f"{label}_skipped"] = "result differs from the reference beyond tolerance"
            continue
        row[f"{label}_ms"] = timer.run(fn, opts.warmup, opts.repeats).to_ms()
    return row


def _model(rec: dict[str, Any], first: Case, link: Any, times: tuple[float | None, float | None]) -> None:
    """MODEL rows: ``first``'s TP time from the measured library GEMM (the unfused baseline) and core (fused)."""
    from bench.model.dense import GemmTimes

    t_library, t_core = times
    if link is None or t_library is None or t_core is None:
        return
    shape = first.gemm_shape
    for row in rec["ops"]:
        if "fused_ms" not in row:
            continue
        case = replace(first, op=row["op"])
        preds = {
            "baseline": predict(case, "baseline", GemmTimes({shape: t_library}), link),
            "fused": predict(case, "fused", GemmTimes({shape: t_core}), link),
        }
        if None not in preds.values():
            row["model_ms"] = {"world": first.world, **{k: v * 1e3 for k, v in preds.items()}}


def _link(device: torch.device) -> Any:
    """The links.yaml model of this GPU's generation (None on CPU or for an unknown GPU)."""
    from bench.model import dense as perf_model

    if device.type != "cuda":
        return None
    gen = perf_model.detect_generation(torch.cuda.get_device_name(device))
    return perf_model.load_gpu(gen)[0] if gen else None


def run_single(rank: int, world: int, device: torch.device, cases: list[Case], opts: RunOptions) -> dict[str, Any]:
    timer = Timer(device)
    link = _link(device)
    groups: dict[tuple[int, int, int, str, str], list[Case]] = {}
    for c in cases:
        groups.setdefault(c.gemm_shape + (c.dtype, c.fmt), []).append(c)
    progress = Progress(len(groups), "single", opts.progress)
    records = []
    for (m, k, n, dtype, fmt), group in groups.items():
        shape = Shape.of(group[0], opts.seed, device)
        rec: dict[str, Any] = {"gemm_shape": [m, k, n], "dtype": dtype, "format": fmt, "flops": 2 * m * k * n}
        t_library = _library(rec, shape, timer, opts)
        t_core = _core(rec, shape, timer, opts)
        if fmt == "plain" and t_library is not None:
            _soc_effect(rec, shape, timer, opts)
            # The model's view of 4-way chunking at world 1: the four smaller GEMMs, timed bare.
            x, w = shape.ops.x, shape.ops.weights[0]
            chunk_ms = 0.0
            for rows in chunk_rows(m, 4):
                t = timer.run(partial(torch.nn.functional.linear, x[:rows], w), opts.warmup, opts.repeats)
                chunk_ms += t.median * 1e3
            rec["model_chunked4_over_gemm"] = chunk_ms / rec["torch_ms"]["median"]
        ops = list(dict.fromkeys(c.op for c in group))
        rec["ops"] = [_op_row(op, shape, timer, opts) for op in ops]
        for row in rec["ops"]:
            if "fused_ms" in row and t_library is not None:
                row["fused_over_gemm"] = row["fused_ms"]["median"] / rec["torch_ms"]["median"]
            if "fused_ms" in row and t_core is not None:
                row["fused_over_core"] = row["fused_ms"]["median"] / rec["core_ms"]["median"]
            if "chunked4_ms" in row and "sequential_ms" in row:
                row["chunked4_over_sequential"] = row["chunked4_ms"]["median"] / row["sequential_ms"]["median"]
                if "model_chunked4_over_gemm" in rec:
                    row["model_chunked4_over_sequential"] = rec["model_chunked4_over_gemm"]
        _model(rec, group[0], link, (t_library, t_core))
        records.append(rec)
        progress.step(f"[{m}, {k}, {n}] {dtype} {fmt}")
    return {"records": records, "link_model": link.name if link is not None else None}


def single_table(records: list[dict[str, Any]]) -> str:
    head = [
        "gemm [m, k, n]",
        "dtype",
        "format",
        "torch ms",
        "core ms",
        "core/torch speed",
        "soc pad speed",
        "op",
        "fused/gemm",
        "fused/core",
        "chunked4/seq",
        "model chunked4/seq",
    ]
    lines = [head] + _single_rows(records)
    widths = [max(len(r[c]) for r in lines) for c in range(len(head))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=False)) for r in lines]
    out.insert(1, "-" * len(out[0]))
    out.append("")
    out.append(
        "torch = the format's library GEMM (F.linear; fp8 torch._scaled_mm; int8 dequantize + F.linear); "
        "core/torch speed = t_torch / t_core (target >= 0.95 on bf16 LLaMA-70B TP8 shapes); soc pad "
        "speed = t_torch / t_padded for shapes matmul_soc_friendly pads (k within [k_min, k_max] or n "
        "not 128-byte aligned; '-' = already aligned); "
        "fused/gemm = fused op at world 1 / library GEMM (target <= 1.03); fused/core = fused op at world 1 / "
        "GEMM core; chunked4/seq = 4-way "
        "chunked / sequential at world 1 (target <= 1.05 at M >= 4096); model chunked4/seq = MODEL: the "
        "four quarter-row GEMMs timed bare over the whole GEMM (leaves out per-chunk host cost)"
    )
    out += _single_notes(records)
    return "\n".join(out)


def _single_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """The table's cells: one row per op of each record, the record's own columns on its first row only."""
    lines: list[list[str]] = []
    for rec in records:
        core_ms = rec.get("core_ms", {}).get("median")
        torch_ms = rec.get("torch_ms", {}).get("median")
        first = [
            str(rec["gemm_shape"]),
            rec["dtype"],
            rec.get("format", "plain"),
            f"{torch_ms:.3f}" if torch_ms else "-",
            f"{core_ms:.3f}" if core_ms else "-",
            f"{rec['core_vs_torch']:.3f}x" if "core_vs_torch" in rec else "-",
            f"{rec['soc_speedup']:.3f}x" if "soc_speedup" in rec else "-",
        ]
        for i, row in enumerate(rec["ops"] or [{"op": "-"}]):
            lines.append(
                (first if i == 0 else [""] * len(first))
                + [
                    OP_SHORT.get(row["op"], row["op"]),
                    f"{row['fused_over_gemm']:.3f}" if "fused_over_gemm" in row else "-",
                    f"{row['fused_over_core']:.3f}" if "fused_over_core" in row else "-",
                    f"{row['chunked4_over_sequential']:.3f}" if "chunked4_over_sequential" in row else "-",
                    f"{row['model_chunked4_over_sequential']:.3f}" if "model_chunked4_over_sequential" in row else "-",
                ]
            )
    return lines


def _single_notes(records: list[dict[str, Any]]) -> list[str]:
    """The lines under the table: what was wrong, skipped, modelled rather than measured, or fell back."""
    out: list[str] = []
    for rec in records:
        if rec.get("soc_correct") is False:
            out.append(f"{rec['gemm_shape']} soc padding: result differs from torch linear beyond tolerance")
    for rec in records:
        if "core_skipped" in rec:
            out.append(f"Triton GEMM core skipped: {rec['core_skipped']}")
            break
    for rec in records:
        if "torch_skipped" in rec:
            out.append(f"{rec['gemm_shape']} {rec['format']}: {rec['library']} skipped: {rec['torch_skipped']}")
        if rec.get("core_correct") is False:
            out.append(
                f"{rec['gemm_shape']} {rec['format']}: the GEMM core differs from the reference beyond its bound"
            )
        for row in rec["ops"]:
            if "model_ms" in row:
                mod = row["model_ms"]
                out.append(
                    f"{rec['gemm_shape']} {rec['format']} {OP_SHORT.get(row['op'], row['op'])}: MODEL, not measured: "
                    f"TP{mod['world']} from the GEMM times measured here: unfused baseline {mod['baseline']:.3f} ms, "
                    f"fused {mod['fused']:.3f} ms"
                )
    return out + _op_fallback_notes(records)


def _op_fallback_notes(records: list[dict[str, Any]]) -> list[str]:
    """Per op row: the backends that fell back or were skipped, so a '-' in the table has its reason."""
    out: list[str] = []
    for rec in records:
        for row in rec["ops"]:
            if "fused_fallback" in row:
                out.append(f"{rec['gemm_shape']} {row['op']} fused fell back: {row['fused_fallback']}")
            for key in ("fused_skipped", "chunked4_skipped", "sequential_skipped"):
                if key in row:
                    out.append(f"{rec['gemm_shape']} {rec['format']} {row['op']} {key[:-8]}: skipped: {row[key]}")
    return out
