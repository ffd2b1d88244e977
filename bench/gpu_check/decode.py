"""gpu-check's decode rows: the decode path's fused calls at W = 1 against the same work as separate kernels.

One process on one device (``bench.harness.launch.run_in_process``), ``backend="fused"``, for ``x [tokens, hidden]``:

* ``all_reduce_rmsnorm``: one fused call (the reduce kernel adds the residual, then the norm kernel, and the
  FP8 quantization with ``quant``) against the separate steps a model runs without it: ``x + residual``, an
  RMSNorm written as torch ops (HF's ``LlamaRMSNorm``), and ``kernels.fp8.quantize_fp8`` with ``quant``;
* ``matmul_all_reduce`` + epilogue: ``matmul_all_reduce(x, w, residual=, norm_weight=, quant=)`` against
  ``matmul_all_reduce(x, w)`` followed by the same separate steps.

At W = 1 nothing travels: the rows measure the launches and the epilogue's own cost, which is what the fused
call must not lose against separate kernels (the target: fused <= separate). Every row is first checked
against fp64 math (bounds below); a wrong result is a failed row, never a time. On CPU the rows run tiny and
interpreted (``TRITON_INTERPRET=1``): they test the code path, and are not timed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

GPU_CASES = [(tokens, 4096) for tokens in (1, 8, 32, 128)]
CPU_CASES = [(3, 64)]
QUANTS: tuple[str | None, ...] = (None, "row")
EPS = 1e-6


def _rmsnorm(h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # HF's LlamaRMSNorm: fp32 statistics, the normalized rows rounded to the activation dtype, times the weight.
    h32 = h.to(torch.float32)
    return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)


def _separate(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, quant: str | None) -> tuple:
    from kernels.fp8.quantize import quantize_fp8

    h = y + residual
    out = _rmsnorm(h, weight, y.dtype)
    return (quantize_fp8(out, quant) if quant else (out, None)), h


def _bound(dtype: torch.dtype, quant: str | None, *, peak: float, k: int) -> float:
    """Max |error| of the normalized output against fp64, whose largest value is ``peak``.

    Relative to ``peak``: up to four roundings to ``dtype`` on the way (the GEMM's partial, the normalized
    row, the product with the weight, and the separate steps' sum; unit roundoff u = 2^-8 bf16, 2^-24 fp32),
    the GEMM's fp32 accumulation over ``k`` terms (k * 2^-24, its sum of |x w| below the output's peak
    for these unit-variance rows and 1 / sqrt(k)-scaled weights, up to a factor 4), and with ``quant`` the
    e4m3 rounding (3 mantissa bits: relative 2^-4 of the row's largest value, which is at most ``peak``).
    """
    u = {torch.bfloat16: 2**-8, torch.float16: 2**-11}.get(dtype, 2**-24)
    return peak * (4 * u + 4 * k * 2**-24 + (2**-4 if quant else 0.0))


def _dequantized(outputs: Any) -> torch.Tensor:
    out, _, scale = outputs
    return out.to(torch.float32) * scale if scale is not None else out.to(torch.float32)


def _runs(
    x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, g: torch.Tensor, quant: str | None
) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Each op's (fused call, separate steps) on these operands."""
    import kernels

    def epilogue() -> Any:
        return kernels.matmul_all_reduce(x, w, residual=residual, norm_weight=g, eps=EPS, quant=quant, backend="fused")

    return {
        "all_reduce_rmsnorm": (
            lambda: kernels.all_reduce_rmsnorm(x, residual, g, EPS, quant=quant, backend="fused"),
            lambda: _separate(x, residual, g, quant),
        ),
        "matmul_all_reduce+rmsnorm": (
            epilogue,
            lambda: _separate(kernels.matmul_all_reduce(x, w, backend="fused"), residual, g, quant),
        ),
    }


def run_world(rank: int, world: int, device: torch.device, cases: list[tuple[int, int]], timed: bool) -> list[dict]:
    """Records of every (case, quant, op): correctness against fp64 and, when ``timed``, both medians."""
    from bench.harness.timing import Timer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    records = []
    for tokens, hidden in cases:
        x, residual = (torch.randn(tokens, hidden, generator=gen).to(device, dtype) for _ in range(2))
        w = (torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(device, dtype)
        g = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
        for quant in QUANTS:
            want_ar = _rmsnorm(x.double() + residual.double(), g.double(), torch.float64)
            want_mm = _rmsnorm(x.double() @ w.double().T + residual.double(), g.double(), torch.float64)
            runs = _runs(x, w, residual, g, quant)
            wants = {"all_reduce_rmsnorm": want_ar, "matmul_all_reduce+rmsnorm": want_mm}
            for op, (fused, separate) in runs.items():
                want = wants[op]
                rec: dict[str, Any] = {"op": op, "tokens": tokens, "hidden": hidden, "quant": quant}
                rec["dtype"] = str(dtype).removeprefix("torch.")
                err = (_dequantized(fused()).double() - want).abs().max().item()
                bound = _bound(dtype, quant, peak=want.abs().max().item(), k=hidden)
                rec.update(error=err, bound=bound, correct=err <= bound)
                if timed and rec["correct"]:
                    rec["fused_ms"] = timer.run(fused, warmup=5, repeats=50).median * 1e3
                    rec["separate_ms"] = timer.run(separate, warmup=5, repeats=50).median * 1e3
                records.append(rec)
    return records


def decode_items(records: list[dict]) -> list[dict]:
    """Report items (gpu-check's ``speed`` section) of :func:`run_world`'s records."""
    items = []
    for rec in records:
        quant = f" quant={rec['quant']}" if rec["quant"] else ""
        name = f"decode {rec['op']} {rec['dtype']} [{rec['tokens']}, {rec['hidden']}]{quant} W=1"
        if not rec["correct"]:
            detail = f"differs from fp64 by {rec['error']:.3g} (bound {rec['bound']:.3g})"
            items.append({"name": name, "status": "fail", "detail": detail})
        elif "fused_ms" in rec:
            ratio = rec["fused_ms"] / rec["separate_ms"]
            detail = (
                f"fused {rec['fused_ms'] * 1e3:.1f} us, separate kernels {rec['separate_ms'] * 1e3:.1f} us: "
                f"{ratio:.3f} (target <= 1.0)"
            )
            items.append(
                {"name": name, "status": "pass" if ratio <= 1.0 else "warn", "detail": detail, "kind": "decode"}
            )
        else:
            detail = f"checked (error {rec['error']:.3g} <= {rec['bound']:.3g}), not timed: interpreted on CPU"
            items.append({"name": name, "status": "pass", "detail": detail})
    return items


def gpu_check_items(device_type: str, deadline: float, emit: Callable[[dict], None]) -> None:
    """gpu-check's decode items, in this process (module docstring)."""
    from bench.harness import launch

    left = deadline - time.time()
    if left < 5:
        emit({"name": "decode: not run", "status": "skip", "detail": "no time left"})
        return
    cuda = device_type == "cuda"
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        records = launch.run_in_process(run_world, device_type, left, GPU_CASES if cuda else CPU_CASES, cuda)
    except Exception as e:  # noqa: BLE001 - the report names it and gpu-check goes on
        emit({"name": "decode rows", "status": "fail", "detail": f"{type(e).__name__}: {str(e)[-1200:]}"})
        return
    for item in decode_items(records):
        emit(item)
