"""bench/gpu_check/decode.py, gpu-check's decode rows: on CPU they run tiny and interpreted (checked against fp64,
not timed); from GPU-like records they report the fused / separate ratio against the target, and a result
outside the bound is a failed row whatever its time."""

from __future__ import annotations

import os
import time

import pytest

from bench.gpu_check import decode

HANG_S = 300  # bounds a hang of the one-rank group; the rows take seconds


@pytest.mark.triton
def test_rows_on_cpu_are_checked_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    items: list[dict] = []
    decode.gpu_check_items("cpu", time.time() + HANG_S, items.append)
    assert len(items) == len(decode.CPU_CASES) * len(decode.QUANTS) * 2, items
    for item in items:
        assert item["status"] == "pass" and "not timed" in item["detail"], item
    names = " ".join(item["name"] for item in items)
    assert "all_reduce_rmsnorm" in names and "matmul_all_reduce+rmsnorm" in names and "quant=row" in names


def _record(**fields: object) -> dict:
    base = {"op": "all_reduce_rmsnorm", "tokens": 8, "hidden": 4096, "quant": None, "dtype": "bfloat16"}
    return {**base, "error": 0.01, "bound": 0.1, "correct": True, **fields}


def test_items_from_gpu_records() -> None:
    items = decode.decode_items(
        [
            _record(fused_ms=0.010, separate_ms=0.020),
            _record(quant="row", fused_ms=0.030, separate_ms=0.020),
            _record(op="matmul_all_reduce+rmsnorm", error=0.5, correct=False),
        ]
    )
    assert [i["status"] for i in items] == ["pass", "warn", "fail"]
    assert "0.500 (target <= 1.0)" in items[0]["detail"] and "10.0 us" in items[0]["detail"]
    assert "1.500" in items[1]["detail"] and "quant=row" in items[1]["name"]
    assert "differs from fp64 by 0.5" in items[2]["detail"]


def test_bound_grows_with_the_dtype_and_the_quantization() -> None:
    import torch

    fp32 = decode._bound(torch.float32, None, peak=4.0, k=64)
    bf16 = decode._bound(torch.bfloat16, None, peak=4.0, k=64)
    fp8 = decode._bound(torch.bfloat16, "row", peak=4.0, k=64)
    assert 0 < fp32 < 1e-4 < bf16 < fp8 <= 4.0 * (4 * 2**-8 + 4 * 64 * 2**-24 + 2**-4)
