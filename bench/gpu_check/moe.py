"""gpu-check's MoE rows (its ``speed`` section): the W = 1 cases of ``python -m bench --mode moe`` in one process.

On a GPU, Qwen3-30B-A3B's shapes (:func:`gpu_check_cases`): the grouped GEMM kernel against ``torch._grouped_mm``
(target >= 1.0x) and the TP ops with ``backend="fused"`` at W = 1 against the bare grouped GEMM (target <= 1.05x),
each checked first against plain torch math (:mod:`bench.moe.ranks`). On CPU the tiny suite's rows, interpreted:
they test the code path.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bench.model.moe import GROUPED, MoeCase
from bench.moe.mode import expand, load
from bench.moe.ranks import MoeOptions, run_world


def gpu_check_cases(cuda: bool) -> list[MoeCase]:
    """W = 1 rows: GPU: Qwen3-30B-A3B's grouped GEMMs and TP pair (the issue's targets' shape); CPU: the tiny
    suite's, which test the code path (their times mean nothing)."""
    suite = {**load("qwen3-30b-a3b" if cuda else "tiny"), "tp_world_sizes": [1], "ep_world_sizes": []}
    return expand(suite, worlds=[1])


def gpu_check_items(device_type: str, deadline: float, emit: Callable[[dict], None]) -> None:
    """gpu-check's MoE items, in one process on one device: the grouped GEMM kernel against
    ``torch._grouped_mm`` (target >= 1.0x, Qwen3-30B-A3B shape) and the TP ops with ``backend="fused"`` at
    W = 1 against the bare grouped GEMM (target <= 1.05x). On CPU the same rows run tiny and interpreted."""
    from bench.harness import launch

    left = deadline - time.time()
    if left < 10:
        emit({"name": "moe: not run", "status": "skip", "detail": "no time left"})
        return
    cuda = device_type == "cuda"
    opts = MoeOptions(backends=["sequential", "fused"], warmup=5 if cuda else 1, repeats=20 if cuda else 2)
    try:
        res = launch.run_in_process(run_world, device_type, left, gpu_check_cases(cuda), opts)
    except Exception as e:  # noqa: BLE001 - the report names it and gpu-check goes on
        emit({"name": "moe rows", "status": "fail", "detail": f"{type(e).__name__}: {str(e)[-1200:]}"})
        return
    for item in moe_items(res["records"]):
        emit(item)


def moe_items(records: list[dict]) -> list[dict]:
    """Report items of :func:`bench.moe.ranks.run_world`'s W = 1 records (gpu-check's ``speed`` section)."""
    items = []
    for rec in records:
        by = {b["backend"]: b for b in rec["backends"]}
        name = f"moe {rec['op']} {rec['suite']}/{rec['layer']} {rec['dtype']} T={rec['tokens']} E={rec['experts']}"
        bad = [f"{b}: {r.get('reason')}" for b, r in by.items() if r["status"] == "incorrect"]
        if bad:
            items.append({"name": name, "status": "fail", "detail": "; ".join(bad)})
            continue
        if rec["op"] == GROUPED:
            kernel, ref = by["kernel"], by["torch._grouped_mm"]
            if "ms" in kernel and "ms" in ref:
                ratio = ref["ms"]["median"] / kernel["ms"]["median"]
                detail = f"kernel {kernel['ms']['median']:.3f} ms, torch._grouped_mm {ref['ms']['median']:.3f} ms: "
                detail += f"{ratio:.3f}x (target >= 1.0)"
                items.append({"name": name, "status": "pass", "detail": detail, "kind": "moe_grouped", "ratio": ratio})
            else:
                parts = [f"kernel {kernel['ms']['median']:.3f} ms" if "ms" in kernel else kernel.get("reason", "")]
                if kernel.get("interpreted"):
                    parts = ["checked in the interpreter, not timed"]
                if ref["status"] == "skipped":
                    parts.append(f"torch._grouped_mm: {ref.get('reason')}")
                detail = "; ".join(p for p in parts if p)
                items.append({"name": name, "status": "pass" if kernel["status"] == "ok" else "skip", "detail": detail})
            continue
        fused, bare = by["fused"], rec["parts_ms"].get(f"gemm@{rec['tokens']}")
        if "ms" in fused and bare:
            ratio = fused["ms"]["median"] / bare["median"]
            detail = f"fused at W=1 {fused['ms']['median']:.3f} ms / bare grouped GEMM {bare['median']:.3f} ms = "
            detail += f"{ratio:.3f} (target <= 1.05)" + (" (ran chunked)" if fused.get("fallback") else "")
            items.append({"name": name, "status": "pass", "detail": detail, "kind": "moe_fused_w1", "ratio": ratio})
        else:
            items.append(
                {
                    "name": name,
                    "status": "skip" if fused["status"] == "skipped" else "pass",
                    "detail": fused.get("reason", "checked"),
                }
            )
    return items


def moe_summary(items: list[dict]) -> str:
    """The MoE targets as numbers for gpu-check's verdict line (benchmarks, not pass/fail tests)."""
    out = []
    grouped = [it["ratio"] for it in items if it.get("kind") == "moe_grouped"]
    if grouped:
        out.append(f"MoE grouped GEMM / torch._grouped_mm speed min {min(grouped):.2f}x (target >= 1.0)")
    fused = [it["ratio"] for it in items if it.get("kind") == "moe_fused_w1"]
    if fused:
        out.append(f"MoE fused W=1 / grouped GEMM max {max(fused):.3f} (target <= 1.05)")
    return "; ".join(out)
