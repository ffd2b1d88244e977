"""gpu-check's FP8 parts on CPU: the speed section's FP8 rows (bench.dense.single's records of the fp8 formats:
shapes, order, budget, failures, report) and the gpu-marked FP8 tests' place in the pytest run (collected
by ``-m gpu``, ordered by the plugin)."""

import os
import time

import pytest

from bench.dense.runner import RunOptions
from bench.gpu_check import speed
from kernels.testing import REPO_ROOT


def _fp8_cases(cuda: bool) -> list:
    return [c for c in speed.cases(cuda) if c.kind == "fp8"]


def test_fp8_speed_cases_are_llama70b_tp8_local_gemms_block_first():
    from bench.harness.suites import load_suite

    suite = {(c.layer, c.op): c.gemm_shape for c in load_suite("llama3-70b").cases(tokens=[8192], world_sizes=[8])}
    cases = _fp8_cases(cuda=True)
    assert [(c.fmt, c.layer, c.op) for c in cases] == [
        ("fp8:block", "qkv", "all_gather_matmul"),
        ("fp8:block", "fc2", "matmul_reduce_scatter"),
        ("fp8:block", "fc2", "matmul_all_reduce"),
        ("fp8:row", "qkv", "all_gather_matmul"),
        ("fp8:tensor", "qkv", "all_gather_matmul"),
    ]
    for c in cases:
        assert c.gemm_shape == suite[(c.layer, c.op)] and c.dtype == "bf16" and c.world == 8, c
    assert all(c.flops < 2**21 for c in _fp8_cases(cuda=False))  # CPU: the code path only


class _FakeLaunch:
    """Stands in for bench.harness.launch.run_in_process: records what the speed section asked for."""

    def __init__(self, fail_fp8: bool = False):
        self.calls: list[tuple[str, object]] = []
        self.fail_fp8 = fail_fp8

    def __call__(self, fn, device_type, timeout_s, work, opts):
        if work[0].kind == "fp8":
            self.calls.append(("fp8", work[0].mode))
            if self.fail_fp8:
                raise RuntimeError("no FP8 here")
        else:
            self.calls.append((work[0].dtype, work[0].gemm_shape))
        return {"records": []}


def _run_speed(monkeypatch, deadline_s: float, fake: _FakeLaunch) -> list[dict]:
    from bench.harness import launch

    monkeypatch.setattr(launch, "run_in_process", fake)
    items: list[dict] = []
    speed.run("cuda", time.time() + deadline_s, items.append)
    return items


def test_speed_section_runs_bf16_then_fp8_then_fp16(monkeypatch):
    fake = _FakeLaunch()
    assert _run_speed(monkeypatch, 600, fake) == []
    kinds = [k for k, _ in fake.calls]
    first_fp8, last_fp8 = kinds.index("fp8"), len(kinds) - 1 - kinds[::-1].index("fp8")
    assert set(kinds[:first_fp8]) == {"bf16"} and set(kinds[last_fp8 + 1 :]) == {"fp16"}
    # One run per GEMM shape: fc2's reduce-scatter and all-reduce share theirs.
    assert [mode for k, mode in fake.calls if k == "fp8"] == ["block", "block", "row", "tensor"]


def test_speed_section_past_its_deadline_lists_fp8_rows_as_not_timed(monkeypatch):
    items = _run_speed(monkeypatch, 5, fake := _FakeLaunch())  # under the 10 s a shape needs
    assert fake.calls == []
    groups = len({c.gemm_shape + (c.dtype, c.fmt) for c in speed.cases(True)})
    (skip,) = items
    assert skip["status"] == "skip" and skip["detail"] == f"{groups} (no time)"


def test_fp8_row_that_fails_is_reported_and_later_rows_still_run(monkeypatch):
    fake = _FakeLaunch(fail_fp8=True)
    items = _run_speed(monkeypatch, 600, fake)
    assert [it["status"] for it in items] == ["fail"] * 4
    assert items[0]["name"].startswith("fp8 fp8-block llama3-70b/qkv") and "no FP8 here" in items[0]["detail"]
    assert fake.calls[-1][0] == "fp16"


# A bench.dense.single.run_single record of an FP8 shape (what the speed section reads).
_RECORD = {
    "gemm_shape": [8192, 3584, 8192],
    "dtype": "bf16",
    "format": "fp8:block",
    "flops": 2 * 8192 * 3584 * 8192,
    "library": "torch._scaled_mm",
    "torch_ms": {"median": 0.4},
    "torch_tflops": 2 * 8192 * 3584 * 8192 / 0.4e-3 / 1e12,
    "core": "kernels.fused.matmul.gemm",
    "core_correct": True,
    "core_ms": {"median": 0.5},
    "core_tflops": 962.0,
    "core_vs_torch": 0.8,
    "ops": [
        {
            "op": "matmul_reduce_scatter",
            "fused_ms": {"median": 0.52},
            "fused_over_gemm": 1.3,
            "fused_over_core": 1.04,
            "model_ms": {"world": 8, "baseline": 0.7, "fused": 0.8},
        },
        {"op": "matmul_all_reduce", "fused_skipped": "the dispatcher did not run the fused kernel: why"},
    ],
}
_SHAPE = "fp8-block llama3-70b/fc2 M=8192 gemm [8192, 3584, 8192]"


def test_fp8_record_becomes_items_table_and_summary():
    items = speed.speed_items(_RECORD, "llama3-70b/fc2 M=8192")
    assert [(it["status"], it.get("kind")) for it in items] == [
        ("pass", "fp8_core"),
        ("pass", "fp8_fused_w1"),
        ("skip", None),
    ]
    assert items[0]["name"] == f"fp8 core {_SHAPE}" and "core/_scaled_mm speed 0.800x" in items[0]["detail"]
    assert items[0]["scaled_mm_tflops"] == pytest.approx(2 * 8192 * 3584 * 8192 / 0.4e-3 / 1e12)
    assert "MODEL, not measured" in items[1]["detail"] and "TP8" in items[1]["detail"]
    assert "0.700 ms" in items[1]["detail"]
    table = "\n".join(speed.table(items))
    assert "MODEL TP8 ms" in table and "nothing at TP8 was measured" in table
    assert f"| {_SHAPE} | 1203 | 962 | 0.800 | rs 1.300 | rs 0.700 / 0.800 |" in table
    assert "cuBLAS TFLOP/s" not in table  # FP8 rows stay out of the bf16 table
    line = speed.summary(items)
    assert "FP8 core/_scaled_mm min 0.80x" in line and "FP8 fused W=1 / _scaled_mm max 1.300" in line
    broken = dict(_RECORD, core_correct=False, torch_skipped="cannot run block scales", ops=[])
    for key in ("torch_ms", "torch_tflops", "core_ms", "core_tflops", "core_vs_torch"):
        broken.pop(key)
    assert [(it["status"], it["name"].split()[0]) for it in speed.speed_items(broken, "x")] == [
        ("skip", "torch._scaled_mm"),
        ("fail", "fp8"),
    ]


def test_fp8_speed_rows_fused_on_cpu():
    """The real FP8 path on CPU (interpreter; times meaningless): quantize, torch._scaled_mm rowwise,
    the FP8 core and the fused all-reduce at world 1, each checked before it is timed."""
    import torch

    from bench.dense.single import run_single
    from bench.harness import launch

    opts = RunOptions(backends=[], warmup=0, repeats=1, seed=0, progress=False)
    (case,) = _fp8_cases(cuda=False)
    # run_in_process sets a rank's thread count and environment in this process: restored after.
    threads = torch.get_num_threads()
    saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "TRITON_INTERPRET")}
    try:
        res = launch.run_in_process(run_single, "cpu", 300, [case], opts)
    finally:
        torch.set_num_threads(threads)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    (rec,) = res["records"]
    items = speed.speed_items(rec, "tiny/out M=16")
    assert [(it["status"], it.get("kind")) for it in items] == [("pass", "fp8_core"), ("pass", "fp8_fused_w1")], items
    assert items[0]["core_vs_scaled_mm"] > 0 and items[1]["ratio"] > 0
    assert items[0]["name"] == "fp8 core fp8-row tiny/out M=16 gemm [16, 128, 16]"


def test_scaled_mm_block_layouts_are_tried_until_one_is_right():
    import torch

    from bench.dense import formats

    xs, ws = torch.rand(4, 3) + 1, torch.rand(2, 3) + 1
    layouts = formats.scaled_mm_layouts("block", xs, ws)
    assert len(layouts) == len({(a.shape, a.stride(), b.shape, b.stride()) for a, b in layouts})
    assert all(torch.equal(a, xs) for a, _ in layouts)
    assert formats.scaled_mm_layouts("row", xs[:, :1], ws[:, :1])[0][1].shape == (1, 2)
    # CPU torch runs rowwise and tensorwise scales; blockwise ones it refuses, and says so.
    assert formats.scaled_mm_layout("row", torch.bfloat16, "cpu") == 0
    with pytest.raises(formats.Unsupported, match="cannot run block scales"):
        formats.scaled_mm_layout("block", torch.bfloat16, "cpu")


def test_fp8_gpu_tests_are_collected_by_gpu_check_and_ordered_after_the_bf16_ops():
    import pytest as pytest_mod

    from bench.gpu_check import driver as gpu_check

    class Order:
        ids: list[str] = []

        def pytest_collection_finish(self, session):
            Order.ids = [item.nodeid for item in session.items]

    files = ["tests/kernels/fused/test_fp8_gpu.py", "tests/kernels/fused/test_gpu_heap.py"]
    files.append("tests/kernels/fused/test_ops.py")
    rc = pytest_mod.main(
        ["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--rootdir", REPO_ROOT]
        + [f"{REPO_ROOT}/{f}" for f in files],
        plugins=[gpu_check, Order()],
    )
    assert rc == 0
    ids = [i.split("tests/", 1)[-1] for i in Order.ids]
    fp8 = [i for i in ids if "test_fp8_gpu.py" in i]
    assert fp8 == [
        "kernels/fused/test_fp8_gpu.py::test_fused_fp8_ops_gpu[block]",
        "kernels/fused/test_fp8_gpu.py::test_fused_fp8_ops_gpu[row]",
        "kernels/fused/test_fp8_gpu.py::test_fused_fp8_ops_gpu[tensor]",
        "kernels/fused/test_fp8_gpu.py::test_fused_fp8_ops_gpu_world4_block",
    ]
    first = {name: min(n for n, i in enumerate(ids) if name in i) for name in ("test_ops", "fp8_gpu", "gpu_heap")}
    assert first["test_ops"] < first["fp8_gpu"] < first["gpu_heap"], ids
