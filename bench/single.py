"""Single-GPU mode: the fixed costs of the design with communication taken away.

For each local GEMM shape of the chosen cases:

* the Triton GEMM core (``kernels.fused.matmul``) against ``torch.nn.functional.linear`` (cuBLAS);
* each op with ``backend="fused"`` at world size 1 against the bare GEMM (the fusion's overhead);
* each op with ``backend="chunked", parallel_num=4`` at world size 1 against ``"sequential"``
  (what splitting the GEMM costs);
* on shapes whose k or n is not tensor-core aligned, ``matmul_soc_friendly``'s padded GEMM
  (``kernels.padding.linear``) against the unpadded one (what the padding buys or costs).

GPU only: on CPU the Triton kernels run in the interpreter and their times mean nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from bench.model import chunk_rows
from bench.runner import FUSED_FALLBACK, TORCH_DTYPES, Progress, RunOptions, agreement, fallback_reason
from bench.suites import OP_SHORT, Case
from bench.timing import Timer

# The Triton GEMM core's launcher: kernels/fused/matmul.py linear(x [m, k], weight [n, k], bias=None).


def gemm_core() -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, str]:
    """The Triton GEMM core's launcher ``f(x [m, k], weight [n, k]) -> [m, n]``, or why there is none."""
    try:
        from kernels.fused import matmul
    except ImportError as e:
        return None, f"kernels.fused.matmul is not available ({e})"
    fn = getattr(matmul, "linear", None)
    if not callable(fn):
        return None, "kernels.fused.matmul has no linear()"
    return fn, "kernels.fused.matmul.linear"


def _check(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: str) -> bool:
    """``out`` and torch's ``ref`` of ``x @ w.T`` agree (bench.runner.agreement, one process)."""
    from kernels.testing import row_norm_bound

    magnitude = row_norm_bound([x.double().norm(dim=-1)], [w.double().norm(dim=-1)])
    return agreement(out, ref, magnitude, dtype, x.shape[1], 1)[0]


def _soc_effect(
    rec: dict[str, Any],
    x: torch.Tensor,
    w: torch.Tensor,
    ref: torch.Tensor,
    dtype: str,
    timer: Timer,
    opts: RunOptions,
    t_torch: float,
) -> None:
    """Time the padded GEMM of ``matmul_soc_friendly`` where the padding changes the shape."""
    from kernels import padding
    from kernels.config import get_config

    config = get_config()
    k, n = x.shape[1], w.shape[0]
    if padding.padded_shape(k, n, x.dtype, config.k_min, config.k_max) == (k, n):
        return
    out = padding.linear(x, w, force=True)
    rec["soc_correct"] = _check(out, ref, x, w, dtype)
    if rec["soc_correct"]:
        t_soc = timer.run(lambda: padding.linear(x, w, force=True), opts.warmup, opts.repeats)
        rec["soc_ms"] = t_soc.to_ms()
        rec["soc_speedup"] = t_torch / t_soc.median


def run_single(rank: int, world: int, device: torch.device, cases: list[Case], opts: RunOptions) -> dict[str, Any]:
    import kernels

    timer = Timer(device)
    core, core_name = gemm_core()
    by_shape: dict[tuple[int, int, int, str], list[str]] = {}
    for c in cases:
        by_shape.setdefault(c.gemm_shape + (c.dtype,), [])
        if c.op != "quantized_matmul_all_reduce" and c.op not in by_shape[c.gemm_shape + (c.dtype,)]:
            by_shape[c.gemm_shape + (c.dtype,)].append(c.op)
    progress = Progress(len(by_shape), "single", opts.progress)
    records = []
    for (m, k, n, dtype), ops in sorted(by_shape.items()):
        g = torch.Generator().manual_seed(opts.seed)
        x = torch.randn(m, k, generator=g).to(device=device, dtype=TORCH_DTYPES[dtype])
        w = (torch.randn(n, k, generator=g) / k**0.5).to(device=device, dtype=TORCH_DTYPES[dtype])
        ref = torch.nn.functional.linear(x, w)
        rec: dict[str, Any] = {"gemm_shape": [m, k, n], "dtype": dtype, "flops": 2 * m * k * n}
        t_torch = timer.run(partial(torch.nn.functional.linear, x, w), opts.warmup, opts.repeats)
        rec["torch_ms"] = t_torch.to_ms()
        rec["torch_tflops"] = 2 * m * k * n / t_torch.median / 1e12
        if core is not None:
            out = core(x, w)
            rec["core"] = core_name
            rec["core_correct"] = _check(out, ref, x, w, dtype)
            if rec["core_correct"]:
                t_core = timer.run(partial(core, x, w), opts.warmup, opts.repeats)
                rec["core_ms"] = t_core.to_ms()
                rec["core_tflops"] = 2 * m * k * n / t_core.median / 1e12
                rec["core_vs_torch"] = t_torch.median / t_core.median
        else:
            rec["core_skipped"] = core_name
        _soc_effect(rec, x, w, ref, dtype, timer, opts, t_torch.median)
        # The model's view of 4-way chunking at world 1: the four smaller GEMMs, timed bare.
        chunk_ms = 0.0
        for rows in chunk_rows(m, 4):
            xc = x[:rows]
            chunk_ms += timer.run(partial(torch.nn.functional.linear, xc, w), opts.warmup, opts.repeats).median * 1e3
        rec["model_chunked4_over_gemm"] = chunk_ms / rec["torch_ms"]["median"]
        rec["ops"] = []
        functions = {
            "all_gather_matmul": kernels.all_gather_matmul,
            "matmul_reduce_scatter": kernels.matmul_reduce_scatter,
            "matmul_all_reduce": kernels.matmul_all_reduce,
        }
        for op in ops:
            fn = functions[op]
            row: dict[str, Any] = {"op": op}
            for label, kw in (
                ("fused", {"backend": "fused"}),
                ("chunked4", {"backend": "chunked", "parallel_num": 4}),
                ("sequential", {"backend": "sequential"}),
            ):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        out = fn(x, w, **kw)
                    except (NotImplementedError, ImportError) as e:
                        row[f"{label}_skipped"] = str(e)
                        continue
                if label == "fused":
                    reason = fallback_reason(caught)
                    if reason:
                        FUSED_FALLBACK[op] = reason
                    if op in FUSED_FALLBACK:
                        row["fused_fallback"] = FUSED_FALLBACK[op]
                if not _check(out, ref, x, w, dtype):
                    row[f"{label}_skipped"] = "result differs from torch linear beyond tolerance"
                    continue
                row[f"{label}_ms"] = timer.run(partial(fn, x, w, **kw), opts.warmup, opts.repeats).to_ms()
            if "fused_ms" in row:
                row["fused_over_gemm"] = row["fused_ms"]["median"] / rec["torch_ms"]["median"]
            if "chunked4_ms" in row and "sequential_ms" in row:
                row["chunked4_over_sequential"] = row["chunked4_ms"]["median"] / row["sequential_ms"]["median"]
                row["model_chunked4_over_sequential"] = rec["model_chunked4_over_gemm"]
            rec["ops"].append(row)
        records.append(rec)
        progress.step(f"[{m}, {k}, {n}] {dtype}")
    return {"records": records}


def single_table(records: list[dict[str, Any]]) -> str:
    head = [
        "gemm [m, k, n]",
        "dtype",
        "torch ms",
        "core ms",
        "core/torch speed",
        "soc pad speed",
        "op",
        "fused/gemm",
        "chunked4/seq",
        "model chunked4/seq",
    ]
    lines = [head]
    for rec in records:
        core_ms = rec.get("core_ms", {}).get("median")
        first = [
            str(rec["gemm_shape"]),
            rec["dtype"],
            f"{rec['torch_ms']['median']:.3f}",
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
                    f"{row['chunked4_over_sequential']:.3f}" if "chunked4_over_sequential" in row else "-",
                    f"{row['model_chunked4_over_sequential']:.3f}" if "model_chunked4_over_sequential" in row else "-",
                ]
            )
    widths = [max(len(r[c]) for r in lines) for c in range(len(head))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=False)) for r in lines]
    out.insert(1, "-" * len(out[0]))
    out.append("")
    out.append(
        "core/torch speed = t_torch / t_core (target >= 0.95 on bf16 LLaMA-70B TP8 shapes); soc pad "
        "speed = t_torch / t_padded for shapes matmul_soc_friendly pads (k within [k_min, k_max] or n "
        "not 128-byte aligned; '-' = already aligned); "
        "fused/gemm = fused op at world 1 / bare GEMM (target <= 1.03); chunked4/seq = 4-way "
        "chunked / sequential at world 1 (target <= 1.05 at M >= 4096); model chunked4/seq = MODEL: the "
        "four quarter-row GEMMs timed bare over the whole GEMM (leaves out per-chunk host cost)"
    )
    for rec in records:
        if rec.get("soc_correct") is False:
            out.append(f"{rec['gemm_shape']} soc padding: result differs from torch linear beyond tolerance")
    for rec in records:
        if "core_skipped" in rec:
            out.append(f"Triton GEMM core skipped: {rec['core_skipped']}")
            break
    for rec in records:
        for row in rec["ops"]:
            if "fused_fallback" in row:
                out.append(f"{rec['gemm_shape']} {row['op']} fused fell back: {row['fused_fallback']}")
            for key in ("fused_skipped", "chunked4_skipped", "sequential_skipped"):
                if key in row:
                    out.append(f"{rec['gemm_shape']} {row['op']} {key[:-8]}: skipped: {row[key]}")
    return "\n".join(out)
