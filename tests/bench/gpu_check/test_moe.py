"""gpu-check's MoE rows (bench/gpu_check/moe.py): a CPU run's rows, and what a GPU run's records become."""

import os
import time

import pytest
import torch

from bench.gpu_check import moe
from bench.model.moe import AG, GROUPED, RS

# Bounds on hangs only (the tiny run takes seconds; a loaded 2-core machine is slower): nothing here is timed.
HANG_S = 600


def test_gpu_check_rows_on_cpu(monkeypatch):
    """The MoE rows of gpu-check's speed section, as a CPU run gives them (tiny, the kernel interpreted)."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    threads = torch.get_num_threads()
    items = []
    try:
        moe.gpu_check_items("cpu", time.time() + HANG_S, items.append)
    finally:
        torch.set_num_threads(threads)
    names = [it["name"].split()[1] for it in items]
    assert names == [GROUPED, GROUPED, AG, RS], items
    assert all(it["status"] == "pass" for it in items), items
    assert items[0]["detail"] == "checked in the interpreter, not timed"
    assert all(it["kind"] == "moe_fused_w1" and it["ratio"] > 0 for it in items[2:]), items


def test_gpu_check_items_and_summary_from_gpu_records():
    """What a GPU run's records become: the two targets as ratios, a wrong result as a failure."""
    grouped = {
        "op": GROUPED,
        "suite": "qwen3-30b-a3b",
        "layer": "up",
        "dtype": "bf16",
        "tokens": 4096,
        "experts": 128,
        "parts_ms": {},
        "backends": [
            {"backend": "loop", "status": "ok", "ms": {"median": 4.0}},
            {"backend": "torch._grouped_mm", "status": "ok", "ms": {"median": 1.1}},
            {"backend": "kernel", "status": "ok", "ms": {"median": 1.0}},
        ],
    }
    tp = {
        **grouped,
        "op": AG,
        "parts_ms": {"gemm@4096": {"median": 2.0}},
        "backends": [
            {"backend": "sequential", "status": "ok", "ms": {"median": 2.2}},
            {"backend": "fused", "status": "ok", "ms": {"median": 2.1}},
        ],
    }
    wrong = {**tp, "op": RS, "backends": [{"backend": "fused", "status": "incorrect", "reason": "differs"}]}
    no_torch = {**grouped, "backends": [dict(grouped["backends"][2])]}
    no_torch["backends"].insert(0, {"backend": "torch._grouped_mm", "status": "skipped", "reason": "not in this torch"})
    items = moe.moe_items([grouped, tp, wrong, no_torch])
    assert [it["status"] for it in items] == ["pass", "pass", "fail", "pass"]
    assert items[3]["detail"] == "kernel 1.000 ms; torch._grouped_mm: not in this torch"
    assert items[0]["ratio"] == pytest.approx(1.1) and items[1]["ratio"] == pytest.approx(1.05)
    assert moe.moe_summary(items[:3]) == (
        "MoE grouped GEMM / torch._grouped_mm speed min 1.10x (target >= 1.0); "
        "MoE fused W=1 / grouped GEMM max 1.050 (target <= 1.05)"
    )
