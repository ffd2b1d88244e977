"""python -m bench end to end on CPU: the tiny suite on its own ranks and under torchrun, model and
single modes, and the correctness gate that runs before any timing."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from bench.dense.runner import Reference, check_backend, magnitude_bound, make_inputs, op_call
from bench.harness.suites import Case
from bench.harness.timing import Timer
from kernels.testing import REPO_ROOT

# Bounds on hangs only, generous for a loaded 2-core machine (the tiny suite took 2 min 14 s on one):
# no test here passes or fails on speed.
HANG_S = 900


def _bench(args, tmp_path, timeout=HANG_S, launcher=None):
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = (launcher or [sys.executable, "-m", "bench"]) + args + ["--out-dir", str(tmp_path), "--name", "out"]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_help_documents_the_tool():
    r = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    for word in ("--suite", "--backends", "--world-sizes", "overlap", "torchrun", "--mode", "PREDICTION", "tiny"):
        assert word in r.stdout, word


def test_help_lists_choices_as_words_not_python_values():
    from bench.__main__ import build_parser

    text = " ".join(build_parser().format_help().split())  # argparse wraps lines at the terminal's width
    assert "--dtypes LIST comma list from fp32, fp16, bf16 (default: the suite's)" in text, text
    assert not re.search(r"[(\[{]'", text), text  # no tuple, list or dict printed as Python shows it


def _check_report(tmp_path, worlds):
    doc = json.loads((tmp_path / "out.json").read_text())
    meta = doc["meta"]
    assert meta["device"]["type"] == "cpu" and meta["versions"]["torch"] == torch.__version__
    assert "revision" in meta["git"] and meta["dist_backend"] == "gloo"
    records = doc["records"]
    assert {r["world"] for r in records} == set(worlds)
    for rec in records:
        by = {b["backend"]: b for b in rec["backends"]}
        assert by["sequential"]["status"] == "ok" and by["sequential"]["speedup"] == 1.0
        assert rec["gemm_ms"]["median"] > 0
        for b in rec["backends"]:
            assert b["status"] in ("ok", "skipped"), (rec["label"], b)
            if b["status"] == "skipped":
                assert b["reason"]
                continue
            # The correctness gate ran and passed before the timing.
            assert 0 <= b["error_over_bound"] <= 1.0 and b["max_abs_err"] >= 0
            if b.get("interpreted"):  # fused under Triton's interpreter: checked, not timed
                assert b["backend"] == "fused" and "ms" not in b
                continue
            assert b["ms"]["median"] > 0 and b["ms"]["n"] >= 1
        if rec["world"] > 1:
            assert rec["comm_ms"]["median"] > 0 and rec["comm_busbw_GBps"] > 0
            chunked = by.get("chunked2")
            if chunked and chunked["status"] == "ok":
                # CPU: gloo's collective and the GEMM share the cores, so no overlap figure.
                assert chunked["overlap_eff"] is None and chunked["model_ms"] > 0
    rows = list(
        csv.DictReader(line for line in (tmp_path / "out.csv").read_text().splitlines() if not line.startswith("#"))
    )
    assert len(rows) == sum(len(r["backends"]) for r in records)
    return doc


@pytest.mark.timeout(HANG_S + 60)
def test_tiny_suite_runs_checks_times_and_writes_reports(tmp_path):
    # 40 tokens: the suite's shapes with a quarter of the interpreted tiles.
    r = _bench(["--suite", "tiny", "--tokens", "40", "--no-progress", "--warmup", "1", "--repeats", "1"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "speedup" in r.stdout and "PREDICTION" in r.stdout
    # The overlap column says n/a on CPU instead of numbers like -9932 %.
    rows = [line for line in r.stdout.splitlines() if re.search(r"\schunked2\s+ok\s", line)]
    assert rows and all(" n/a" in line for line in rows), r.stdout
    doc = _check_report(tmp_path, [1, 2])
    assert doc["model"]["link_models"]["2"]["fits"], "the CPU run calibrates the gloo link model"
    assert doc["model"]["summary"]


@pytest.mark.timeout(HANG_S + 60)
@pytest.mark.skipif(
    shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
    reason="torchrun not installed",
)
def test_under_torchrun(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    launcher = [
        torchrun if os.path.exists(torchrun) else "torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "bench",
    ]
    r = _bench(
        [
            "--suite",
            "tiny",
            "--ops",
            "ag,rs",
            "--backends",
            "sequential,chunked2",
            "--tokens",
            "40",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--no-progress",
            "--format",
            "json,csv",
        ],
        tmp_path,
        launcher=launcher,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    doc = _check_report(tmp_path, [2])
    assert doc["meta"]["torchrun"] is True
    assert {r["op"] for r in doc["records"]} == {"all_gather_matmul", "matmul_reduce_scatter"}


def test_model_mode_predicts_without_measuring(tmp_path):
    r = _bench(["--mode", "model", "--gpu", "H800", "--suite", "flux-ref"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "MODEL PREDICTIONS" in r.stdout
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["link_model"]["kind"] == "model parameters (not measurements)"
    for rec in doc["records"]:
        fused = next(b for b in rec["backends"] if b["backend"] == "fused")
        assert fused["model_speedup"] > 1.0
    r = _bench(["--mode", "model", "--suite", "flux-ref"], tmp_path)
    assert r.returncode != 0 and "--gpu" in r.stderr


def test_operand_formats_run_through_the_same_runner(tmp_path):
    """FP8 cases get the unfused baseline row (torch._scaled_mm + the collective) and are checked with the FP8
    bounds; a mode this torch's _scaled_mm refuses (block on CPU) skips the baseline with torch's message and
    still checks the ops."""
    args = ["--suite", "tiny", "--tokens", "40", "--operand-formats", "fp8:tensor,fp8:block", "--ops", "ag,ar"]
    args += ["--world-sizes", "2"]
    r = _bench(args + ["--backends", "sequential,fused", "--repeats", "1", "--warmup", "0", "--no-progress"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    records = json.loads((tmp_path / "out.json").read_text())["records"]
    assert sorted((rec["op"], rec["format"]) for rec in records) == [
        ("all_gather_matmul", "fp8:block"),
        ("all_gather_matmul", "fp8:tensor"),
        ("matmul_all_reduce", "fp8:block"),
        ("matmul_all_reduce", "fp8:tensor"),
    ]
    for rec in records:
        status = {b["backend"]: b["status"] for b in rec["backends"]}
        assert list(status) == ["sequential", "baseline", "fused"], rec
        assert status["sequential"] == status["fused"] == "ok", rec
        baseline = next(b for b in rec["backends"] if b["backend"] == "baseline")
        if rec["format"] == "fp8:tensor":
            assert baseline["status"] == "ok" and baseline["speedup"] == 1.0, baseline
        else:
            assert baseline["status"] == "skipped" and "cannot run block scales" in baseline["reason"], baseline
            assert "cannot run block scales" in rec["gemm_skipped"]
    assert "fp8:tensor" in r.stdout and "speedup = t_baseline / t_op" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip message")
def test_single_mode_skips_cleanly_on_cpu(tmp_path):
    r = _bench(["--mode", "single"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "needs a CUDA GPU" in r.stdout


def test_single_mode_code_path_on_cpu(tmp_path):
    """--allow-cpu runs single mode end to end (interpreter times mean nothing; the checks do)."""
    r = _bench(
        [
            "--mode",
            "single",
            "--allow-cpu",
            "--suite",
            "tiny",
            "--tokens",
            "40",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--no-progress",
        ],
        tmp_path,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    records = json.loads((tmp_path / "out.json").read_text())["records"]
    shapes = {(tuple(rec["gemm_shape"]), rec["format"]): rec for rec in records}
    assert len(shapes) == len(records)
    # The tiny suite's quantized_matmul_all_reduce is matmul_all_reduce with int8 per-channel weights.
    plain = {(40, 96, 80), (40, 96, 160), (40, 192, 80)}
    int8 = {(40, 96, 80), (40, 192, 80)}
    assert set(shapes) == {(s, "plain") for s in plain} | {(s, "int8:per_channel") for s in int8}
    for ((_m, _k, n), fmt), rec in shapes.items():
        assert rec["core_correct"] is True and "torch_ms" in rec, rec
        # The padded GEMM is timed on plain records only: int8's library GEMM multiplies the dequantized
        # weight in x's dtype, the same F.linear as the plain record of its shape. fp32 rows are 128-byte
        # aligned at multiples of 32 elements: n = 80 is padded, 160 is not.
        assert ("soc_speedup" in rec) == (fmt == "plain" and n % 32 != 0), rec
        assert rec.get("soc_correct", True) is True
        for row in rec["ops"]:
            assert {"fused_ms", "chunked4_ms", "sequential_ms"} <= set(row), row
    assert [row["op"] for row in shapes[((40, 192, 80), "int8:per_channel")]["ops"]] == ["matmul_all_reduce"]
    assert "soc pad speed" in r.stdout


@pytest.mark.parametrize("fmt", ["plain", "int8:per_channel", "fp8:row"])
def test_correctness_gate_flags_a_wrong_result(fmt):
    case = Case("t", "l", "matmul_all_reduce", 37, 24, 19, 1, "fp32", fmt)
    timer = Timer(torch.device("cpu"))
    inputs = make_inputs(case, 0, 0, torch.device("cpu"))
    reference = Reference(op_call(case, "sequential", inputs)(), magnitude_bound(case, inputs, 0, 1))
    assert check_backend(case, "chunked4", inputs, reference=reference, timer=timer)["status"] == "ok"
    # 1e-4 relative is far above the fp32 bounds at k = 24 (plain / int8: about 60 eps32 of the magnitude;
    # FP8 with fp32 accumulation and output: gamma(k + 3, 2**-24) of it, twice).
    wrong = Reference(reference.out * (1 + 1e-4), reference.magnitude)
    bad = check_backend(case, "chunked4", inputs, reference=wrong, timer=timer)
    assert bad["status"] == "incorrect" and "exceeds the bound" in bad["reason"], bad
    unknown = check_backend(case, "chunked3", inputs, reference=reference, timer=timer)
    assert unknown["status"] == "skipped" and "3" in unknown["reason"]


def _records_for_plot():
    return [
        {
            "layer": "l",
            "op": "matmul_all_reduce",
            "tokens": 64,
            "world": 2,
            "backends": [
                {"backend": "sequential", "speedup": 1.0},
                {"backend": "chunked2", "speedup": 1.2},
                {"backend": "fused", "status": "skipped"},
            ],
        }
    ]


def test_plot_is_written_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.harness import report

    assert report.write_plot(str(tmp_path / "p.png"), _records_for_plot(), "t") is None
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_is_skipped_with_a_message_without_matplotlib(tmp_path, monkeypatch):
    from bench.harness import report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    why = report.write_plot(str(tmp_path / "p.png"), _records_for_plot(), "t")
    assert "matplotlib" in why and not (tmp_path / "p.png").exists()


@pytest.mark.gpu
def test_single_mode_on_gpu(tmp_path):
    r = _bench(
        [
            "--mode",
            "single",
            "--suite",
            "tiny",
            "--dtypes",
            "fp16",
            "--world-sizes",
            "2",
            "--repeats",
            "5",
            "--no-progress",
        ],
        tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "out.json").read_text())
    for rec in doc["records"]:
        assert rec["torch_ms"]["median"] > 0
        assert rec.get("core_correct", True), rec


@pytest.mark.gpu
def test_run_mode_on_one_gpu(tmp_path):
    r = _bench(
        ["--suite", "tiny", "--dtypes", "fp16", "--world-sizes", "1", "--no-progress", "--gpu", "H100"],
        tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["meta"]["device"]["type"] == "cuda" and doc["meta"]["dist_backend"] == "nccl"
    for rec in doc["records"]:
        assert all(b["status"] in ("ok", "skipped") for b in rec["backends"]), rec


def _launch_probe(rank, world, device, mode):
    if mode == "raise" and rank == 1:
        raise ValueError("rank 1 fails on purpose")
    if mode == "die" and rank == 1:
        os._exit(7)
    return (rank, world, device.type)


def test_spawned_ranks_report_results_errors_and_deaths():
    from bench.harness.launch import LaunchError, spawn

    assert spawn(_launch_probe, 2, "cpu", 60, "ok") == (0, 2, "cpu")
    with pytest.raises(LaunchError, match="(?s)rank 1 raised:.*fails on purpose"):
        spawn(_launch_probe, 2, "cpu", 60, "raise")
    with pytest.raises(LaunchError, match=r"rank 1: process died \(exit code 7\)"):
        spawn(_launch_probe, 2, "cpu", 60, "die")


def test_sigterm_leaves_no_temporary_folder(tmp_path):
    """A bench stopped by SIGTERM (a job scheduler, ``timeout``) removes its ``coc-bench-*`` and rank
    pools' ``coc-pool-*`` folders and stops its ranks, as a finished one does."""
    import signal
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "bench", "--suite", "tiny", "--no-progress", "--out-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + HANG_S
        while not any(p.name.startswith(("coc-bench-", "coc-pool-")) for p in tmp.iterdir()):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no temporary folder appeared"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out.decode()[-3000:]
    left = [p.name for p in tmp.iterdir() if p.name.startswith("coc-")]
    assert left == [], left
