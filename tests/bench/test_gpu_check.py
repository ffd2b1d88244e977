"""``python -m bench --mode gpu-check --allow-cpu``: the GPU report's whole flow on CPU (CI runs it)."""

import json
import os
import subprocess
import sys

import pytest

from tests.harness import REPO_ROOT as ROOT


def _gpu_check(out_dir, *extra, env=None, timeout=660):
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    full_env.pop("TRITON_INTERPRET", None)  # the command sets it for its own sections
    r = subprocess.run(
        [sys.executable, "-m", "bench", "--mode", "gpu-check", "--allow-cpu", "--out-dir", str(out_dir), *extra],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    reports = sorted(out_dir.glob("cpu-gpu-check-*.json"))
    assert len(reports) == 1, (r.stdout, r.stderr[-3000:])
    md = reports[0].with_suffix(".md")
    assert md.exists()
    return r, json.loads(reports[0].read_text()), md.read_text()


def _items(section):
    return {it["name"]: it for it in section["items"]}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the --allow-cpu flow; a GPU runs the real one")
def test_gpu_check_allow_cpu_writes_both_reports(tmp_path):
    r, doc, md = _gpu_check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    sections = {s["section"]: s for s in doc["sections"]}
    assert sorted(sections) == ["a", "b", "c", "d", "e"]
    # The table is printed last, one line per section, then the overall verdict.
    tail = r.stdout.strip().splitlines()
    assert tail[-1].startswith("overall: PASS") and len(tail) == 8, r.stdout
    for name, sec in sections.items():
        assert sec["seconds"] <= sec["budget_s"] + 1
        assert f"## {name}. {sec['title']}" in md and f"Verdict: **{sec['verdict']}" in md
    # a: environment, with the GPU-only parts skipped and saying why.
    a = _items(sections["a"])
    assert a["CUDA GPU"]["status"] == "skip" and "--allow-cpu" in a["CUDA GPU"]["detail"]
    assert a["MPS"]["status"] == "skip"
    assert sections["a"]["info"]["source_sha256"] and "torch" in sections["a"]["info"]
    # b: every gpu-marked test listed, skipped on CPU with the reason.
    b = sections["b"]
    assert b["verdict"] == "SKIP" and b["counts"]["skip"] >= 10
    assert all(it["status"] == "skip" and "CUDA" in it["detail"] for it in b["items"])
    assert any("test_fused_ops_gpu" in it["name"] for it in b["items"])
    # c: every op at W = 2 and 4, back-to-back calls, heap teardown, both kinds of departing peer.
    c = sections["c"]
    assert c["verdict"] == "PASS", c
    names = list(_items(c))
    for op in ("ag", "ag_v2", "rs", "ar_one", "ar_two", "qar"):
        assert any(n.startswith(f"W=2 {op} float32") for n in names), op
        assert any(n.startswith(f"W=4 {op} float16") for n in names), op
    assert any("back-to-back" in n for n in names) and any("freed after destroy_heap" in n for n in names)
    assert any("peer stops calling" in n for n in names) and any("peer process exits" in n for n in names)
    assert any("bf16 is not run, it needs CUDA" in note for note in c["notes"])
    # d: chunked at W = 1 and 2; e: the code path of the speed section, whose times mean nothing on CPU.
    assert sections["d"]["verdict"] == "PASS" and any(n.startswith("W=2 chunked") for n in _items(sections["d"]))
    assert sections["e"]["verdict"] == "PASS" and sections["e"]["info"]["timings_meaningful"] is False
    assert "| core / cuBLAS speed |" in md and "fp16 tiny/qkv M=64 gemm [64, 32, 48]" in md
    assert "correctness check only" in md and "No GPU: this run used `--allow-cpu`" in md


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the --allow-cpu flow")
def test_gpu_check_reports_a_wrong_result_as_fail(tmp_path):
    # A negative tolerance scale makes every comparison of section d fail through the real check.
    r, doc, md = _gpu_check(tmp_path, "--sections", "d", env={"COC_GPU_CHECK_TOL_SCALE": "-1"})
    assert r.returncode == 1
    (d,) = doc["sections"]
    assert d["verdict"] == "FAIL" and doc["overall"] == "FAIL"
    failed = [it for it in d["items"] if it["status"] == "fail"]
    assert failed and all("exceeds the bound" in it["detail"] for it in failed)
    assert "| FAIL |" in md and r.stdout.strip().splitlines()[-1].startswith("overall: FAIL")


def test_section_timeout_is_reported_and_the_report_still_written(tmp_path, monkeypatch):
    import torch

    from bench import gpu_check

    if torch.cuda.is_available():
        pytest.skip("the --allow-cpu flow")
    # 7.5 s in all leave the section 2.5 s: too little to even import torch and run the chunked ops.
    monkeypatch.setitem(gpu_check.TOTAL_BUDGET_S, "cpu", 7.5)
    rc = gpu_check.main(str(tmp_path), True, ["d"])
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    (d,) = doc["sections"]
    assert rc == 1 and d["verdict"] == "TIMEOUT" and d["seconds"] < 10
    assert any("TIMED OUT" in n for n in d["notes"])


def test_tolerance_grows_with_k_and_dtype_eps():
    import torch

    from bench.gpu_check_cases import compare, tolerance

    a16, r16 = tolerance(torch.float16, 1024, 2, 4.0, 4.0)
    abf, rbf = tolerance(torch.bfloat16, 1024, 2, 4.0, 4.0)
    assert abf > a16 > 0 and rbf == torch.finfo(torch.bfloat16).eps
    assert tolerance(torch.float16, 4096, 2, 4.0, 4.0)[0] > a16
    want = torch.ones(3, 3)
    assert compare("x", want + a16 / 2, want, a16, 0.0)["status"] == "pass"
    bad = compare("x", want + 2 * a16, want, a16, 0.0)
    assert bad["status"] == "fail" and "exceeds the bound" in bad["detail"]
    assert compare("x", torch.ones(2, 3), want, 1.0, 1.0)["status"] == "fail"


def test_gpu_check_without_gpu_or_allow_cpu_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    from bench import gpu_check

    assert gpu_check.main(str(tmp_path), False) == 2
    assert not list(tmp_path.iterdir())


def test_mps_detected_from_the_pipe_variable(monkeypatch):
    from bench.gpu_check_sections import mps_status

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/some-mps-pipe")
    on, why = mps_status()
    assert on and "CUDA_MPS_PIPE_DIRECTORY=/tmp/some-mps-pipe" in why


def test_junit_results_per_test(tmp_path):
    # On CPU every gpu test is skipped, so pass and fail parsing is checked on a JUnit file of its own.
    from bench.gpu_check_sections import _junit_items

    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok[2]" time="1.5"/>'
        '<testcase classname="tests.test_a" name="test_bad" time="0.1"><failure message="assert 1 == 2">'
        "trace</failure></testcase>"
        '<testcase classname="tests.test_b" name="test_gone" time="0"><error message="Timeout >150.0s"/>'
        "</testcase>"
        '<testcase classname="tests.test_b" name="test_skip" time="0"><skipped message="needs a CUDA GPU"/>'
        "</testcase></testsuite></testsuites>"
    )
    got = {it["name"]: (it["status"], it["detail"]) for it in _junit_items(str(xml))}
    assert got == {
        "tests/test_a.py::test_ok[2]": ("pass", "1.5 s"),
        "tests/test_a.py::test_bad": ("fail", "assert 1 == 2"),
        "tests/test_b.py::test_gone": ("fail", "Timeout >150.0s"),
        "tests/test_b.py::test_skip": ("skip", "needs a CUDA GPU"),
    }
