"""``python -m bench --mode gpu-check``: the driver's flow on CPU (--allow-cpu), its budget, its pytest plugin."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels.testing import REPO_ROOT
from tests.bench.shared import completed, run_once

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the --allow-cpu flow; a GPU runs the real one")


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, **extra)
    env.pop("TRITON_INTERPRET", None)  # the command sets it for its own sections
    env.pop("COC_TUNED_DIR", None)
    return env


@pytest.fixture(scope="module")
def cpu_gpu_check(tmp_path_factory):
    """One ``--mode gpu-check --allow-cpu`` run of the env, tune and speed sections (minutes under the
    interpreter), shared by the tests below: ``(process, report, Markdown, out dir)``; the process also holds
    the checkout's configs/tuned/cpu.yaml mtime before and after."""
    checkout_file = Path(REPO_ROOT) / "configs" / "tuned" / "cpu.yaml"

    def mtime():
        return checkout_file.stat().st_mtime_ns if checkout_file.exists() else None

    def run(out_dir: Path) -> dict:
        before = mtime()
        r = subprocess.run(
            [sys.executable, "-m", "bench", "--mode", "gpu-check", "--allow-cpu", "--out-dir", str(out_dir)]
            + ["--sections", "env,tune,speed"],
            cwd=REPO_ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        return {**completed(r), "before": before, "after": mtime()}

    r, out_dir = run_once(tmp_path_factory, "gpu-check-cpu", run)
    reports = sorted(out_dir.glob("cpu-gpu-check-*.json"))
    assert len(reports) == 1, (r.stdout, r.stderr[-3000:])
    md = reports[0].with_suffix(".md")
    return r, json.loads(reports[0].read_text()), md.read_text(), out_dir


@no_gpu
def test_allow_cpu_reports_environment_and_speed(cpu_gpu_check):
    r, doc, md, _ = cpu_gpu_check
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    sections = {s["section"]: s for s in doc["sections"]}
    assert [s["section"] for s in doc["sections"]] == ["env", "tune", "speed"]
    env = {it["name"]: it for it in sections["env"]["items"]}
    assert env["CUDA GPU"]["status"] == "skip" and "--allow-cpu" in env["CUDA GPU"]["detail"]
    assert doc["environment"]["source_sha256"] and doc["environment"]["torch"] == torch.__version__
    speed = sections["speed"]
    assert speed["verdict"] == "PASS" and any(it.get("kind") == "core" for it in speed["items"])
    assert "| core / cuBLAS speed |" in md and "No GPU: this run used `--allow-cpu`" in md
    # The table is printed last: a header and its rule, one line per section, then the overall verdict; the
    # total counts from the process start (cold import torch included).
    tail = r.stdout.strip().splitlines()
    assert tail[-1].startswith("overall: PASS") and len(tail) == 2 + len(sections) + 1, r.stdout
    assert 0 < doc["meta"]["seconds"] <= doc["meta"]["total_budget_s"]


@no_gpu
def test_allow_cpu_tuner_writes_into_out_dir_not_configs(cpu_gpu_check):
    """The tune section of a CPU run writes cpu.yaml beside the report (--out-dir), never into the
    checkout's configs/tuned, where the kernels would not read it anyway."""
    r, doc, _, out_dir = cpu_gpu_check
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    (tune,) = (s for s in doc["sections"] if s["section"] == "tune")
    items = {it["name"]: it for it in tune["items"]}
    assert items["tuned file"]["detail"].startswith(f"{out_dir / 'cpu.yaml'} in "), items["tuned file"]
    assert (out_dir / "cpu.yaml").is_file()
    assert r.after == r.before


@pytest.mark.skipif(
    shutil.which("git") is None or not os.path.isdir(os.path.join(REPO_ROOT, ".git")), reason="needs a git checkout"
)
def test_gitignore_covers_what_cpu_runs_write():
    """What the CPU runs of the tools write in a checkout stays out of git status: reports and the CPU
    tuned file in the default --out-dir, a CPU tuned file put into configs/tuned by hand, and a CPU
    gpu-check run into bench/results (the committed example report stays tracked)."""
    paths = [
        "bench_results/cpu.yaml",
        "bench_results/cpu-gpu-check-20990101-000000.md",
        "configs/tuned/cpu.yaml",
        "bench/results/cpu-gpu-check-20990101-000000.json",
        "bench/results/cpu-gpu-check-20990101-000000.md",
        "bench/results/cpu.yaml",
    ]
    r = subprocess.run(["git", "check-ignore", *paths], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert sorted(r.stdout.split()) == sorted(paths), r.stdout + r.stderr
    tracked = ["bench/results/cpu-gpu-check-20261123-093557.md", "configs/tuned/README.md"]
    r = subprocess.run(["git", "check-ignore", *tracked], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == [], r.stdout


def test_budget_keeps_the_speed_reserve_and_caps_the_tuner():
    from bench.gpu_check import driver as gpu_check

    chosen = list(gpu_check.SECTIONS)
    assert gpu_check.budget_for("tune", "cuda", 500, chosen) == gpu_check.TUNE_BUDGET_S["cuda"]
    assert gpu_check.budget_for("tune", "cuda", 250, chosen) == 250 - gpu_check.SPEED_RESERVE_S["cuda"] - 120
    assert gpu_check.budget_for("tests", "cuda", 400, chosen) == 400 - gpu_check.SPEED_RESERVE_S["cuda"]
    assert gpu_check.budget_for("speed", "cuda", 70, chosen) == 70
    assert gpu_check.budget_for("tests", "cuda", 400, ["tests"]) == 400
    # 9 minutes on a GPU, the cold import torch included: sections never get more than that in all.
    assert gpu_check.TOTAL_BUDGET_S["cuda"] <= 540 - 10


def test_process_start_counts_time_before_main():
    import time

    from bench.gpu_check.driver import process_start

    assert time.time() - 120 <= process_start() <= time.time()


def test_section_past_its_budget_is_reported_as_timeout(tmp_path):
    from bench.gpu_check import driver as gpu_check

    # 50 ms cannot even start the section's own Python process, on any machine: killed, TIMEOUT, nothing checked
    # (a budget of seconds depended on how fast this machine imports torch).
    sec = gpu_check.run_section("speed", "cpu", 0.05, str(tmp_path))
    assert sec["verdict"] == "TIMEOUT" and sec["seconds"] < 30
    assert any("TIMED OUT" in n for n in sec["notes"])


_FAKE_TESTS = """
import pytest

def test_plain():
    pass

@pytest.mark.gpu
def test_later():
    pass

@pytest.mark.gpu
def test_fails():
    assert 1 == 2, "wrong on purpose"

@pytest.mark.gpu
def test_skips():
    pytest.skip("needs a CUDA GPU")
"""


def test_plugin_orders_priority_tests_first_and_streams_each_result(tmp_path, monkeypatch):
    from bench.gpu_check import driver as gpu_check

    (tmp_path / "test_fake.py").write_text(textwrap.dedent(_FAKE_TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers = gpu: needs a GPU\n")
    out = tmp_path / "results.jsonl"
    monkeypatch.setattr(gpu_check, "PRIORITY", ("test_fake.py::test_skips", "test_fake.py::test_fails"))
    monkeypatch.setenv(gpu_check.RESULTS_ENV, str(out))
    import pytest as pytest_mod

    rc = pytest_mod.main(
        ["-q", "-m", "gpu", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        plugins=[gpu_check],
    )
    assert rc == 1
    items = [json.loads(line)["item"] for line in out.read_text().splitlines()]
    assert [(it["name"].split("::")[-1], it["status"]) for it in items] == [
        ("test_skips", "skip"),
        ("test_fails", "fail"),
        ("test_later", "pass"),
    ]
    assert items[0]["detail"] == "needs a CUDA GPU" and "wrong on purpose" in items[1]["detail"]


def test_priority_names_existing_gpu_tests():
    # A renamed test would silently lose its place at the front of the GPU run.
    from bench.gpu_check import driver as gpu_check

    for prefix in gpu_check.PRIORITY:
        path, _, name = prefix.partition("::")
        text = open(os.path.join(REPO_ROOT, path), encoding="utf-8").read()
        assert not name or f"def {name}(" in text, prefix
        assert "pytest.mark.gpu" in text, prefix


def test_gpu_check_without_gpu_or_allow_cpu_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    from bench.gpu_check import driver as gpu_check

    assert gpu_check.main(str(tmp_path), False) == 2
    assert not list(tmp_path.iterdir())


def test_mps_detected_from_the_pipe_variable(monkeypatch):
    from bench.gpu_check.env import mps_status

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/some-mps-pipe")
    on, why = mps_status()
    assert on and "CUDA_MPS_PIPE_DIRECTORY=/tmp/some-mps-pipe" in why
