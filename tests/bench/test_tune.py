"""``python -m bench --mode tune``: selection logic with a fake timer, the CPU flow end to end, and the
kernels reading what the tuner wrote."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import tune
from kernels.format import PLAIN
from kernels.fused import blocks, gemm_persistent, tuned
from kernels.fused import matmul as matmul_module
from kernels.fused.gemm_configs import GemmConfig
from kernels.testing import REPO_ROOT

pytestmark = pytest.mark.triton
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the --allow-cpu flow; a GPU tunes its own shapes")
CHECKOUT_CPU_FILE = Path(REPO_ROOT) / "configs" / "tuned" / "cpu.yaml"

FAST = GemmConfig(16, 32, 16, 1, 1, 1, "persistent")
FAST_PLAIN = GemmConfig(16, 32, 16, 1, 1, 1, "plain")
WRONG = GemmConfig(16, 16, 16, 1, 1, 1, "tma")


def test_fake_timer_configs_are_in_the_cpu_space():
    from kernels.fused import gemm_configs

    assert {FAST, FAST_PLAIN, WRONG} <= set(gemm_configs.space(gemm_configs.family(tune.cpu_shapes()[0].m), "cpu"))


def _fake_timer(times: dict[str, float], calls: list):
    """Seconds per config label (cuBLAS 1 s, unlisted configs 0.5 s); runs nothing, records the keys."""

    def timer(fn, key):
        calls.append(key)
        return 1.0 if key[2] == tune._CUBLAS else times.get(key[2], 0.5)

    return timer


def test_select_fastest_first_on_ties_and_none_for_all_failed():
    a, b, c = (GemmConfig(16, 16, 16, 1, 1, 1, v) for v in ("tma", "persistent", "plain"))
    label = GemmConfig.label
    assert tune.select({label(a): 2.0, label(b): 1.0, label(c): 1.0}, [a, b, c], label) == b
    assert tune.select({label(a): None, label(b): 3.0}, [a, b, c], label) == b
    assert tune.select({label(a): None}, [a, b, c], label) is None


def test_tune_picks_per_op_skips_wrong_configs_and_kernels_read_the_file(monkeypatch, tmp_path):
    """Fake timer: ``FAST`` (persistent) wins for matmul, ``FAST_PLAIN`` for the fused ops (their tile
    core is plain); a config whose result is wrong is never timed nor chosen even when it would be
    fastest. Then the written file changes the config in use: matmul launches ``FAST``, the fused
    ops' block_config returns ``FAST_PLAIN``'s tiles."""
    real_matmul = matmul_module.linear

    def fake_linear(x, w, bias=None, *, config=None, fallback=True):
        y = real_matmul(x, w, bias, config=config, fallback=fallback)
        return y + 1 if config == WRONG else y

    monkeypatch.setattr(matmul_module, "linear", fake_linear)
    calls = []
    timer = _fake_timer({FAST.label(): 0.1, FAST_PLAIN.label(): 0.2, WRONG.label(): 0.01}, calls)
    shape = tune.cpu_shapes()[0]
    logged = []
    entries, rows, skipped = tune.tune([shape], [torch.bfloat16], torch.device("cpu"), timer, log=logged.append)
    monkeypatch.setattr(matmul_module, "linear", real_matmul)
    assert skipped == []
    assert (shape.label, "bfloat16", WRONG.label()) not in calls
    assert (shape.label, "bfloat16", tune._CUBLAS) in calls
    by_op = {e.op: e for e in entries}
    assert set(by_op) == set(shape.ops)
    assert by_op["matmul"].config == FAST
    assert all(by_op[op].config == FAST_PLAIN for op in tuned.FUSED_OPS)
    assert all(e.cublas_ms == 1000.0 and (e.m, e.n, e.k) == (shape.m, shape.n, shape.k) for e in entries)
    matmul_row = next(r for r in rows if r["op"] == "matmul")
    assert matmul_row["vs_cublas"] == pytest.approx(10.0)
    assert "wrong result" in matmul_row["failed"][WRONG.label()]

    x = torch.randn(shape.m, shape.k)
    before = matmul_module.matmul_config(x, shape.n)
    before_blocks = blocks.block_config(
        PLAIN, x.device, shape.m, shape.k, dtype=x.dtype, op="all_gather_matmul", n=shape.n
    )
    tuned.write(tmp_path / "cpu.yaml", entries, {"gpu": "cpu"})
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(tmp_path))
    xb, wb = x.to(torch.bfloat16), torch.randn(shape.n, shape.k).to(torch.bfloat16)
    assert before == matmul_module.default_config(xb) != FAST
    assert matmul_module.matmul_config(xb, shape.n) == FAST
    seen = []
    monkeypatch.setattr(gemm_persistent, "launch", lambda *a, **kw: (seen.append(a[4]), real_launch(*a, **kw)))
    y = matmul_module.linear(xb, wb)
    assert seen == [FAST]
    assert torch.equal(
        y, real_matmul(xb, wb, config=matmul_module.default_config(xb))
    )  # same sums: fp32, k = 32 = 2 steps
    after = blocks.block_config(PLAIN, xb.device, shape.m, shape.k, dtype=xb.dtype, op="all_gather_matmul", n=shape.n)
    assert before_blocks == blocks.CPU_BLOCKS
    assert (after.block_m, after.block_n, after.group_m) == (FAST_PLAIN.block_m, FAST_PLAIN.block_n, FAST_PLAIN.group_m)
    assert after != before_blocks


real_launch = gemm_persistent.launch


def test_budget_skips_remaining_shapes():
    ticks = iter([0, 10, 100, 200, 300])  # start, first shape within budget, second past it
    shapes = tune.cpu_shapes()[:1] * 2
    entries, _, skipped = tune.tune(
        shapes,
        [torch.bfloat16],
        torch.device("cpu"),
        _fake_timer({}, []),
        budget_s=50,
        clock=lambda: float(next(ticks)),
        log=lambda s: None,
    )
    assert skipped == [f"{shapes[1].label} bfloat16"]
    assert {e.op for e in entries} == set(shapes[0].ops)


def test_gpu_shapes_are_llama70b_tp8_and_8192_cubed():
    shapes = {(s.m, s.n, s.k) for s in tune.gpu_shapes()}
    assert (8192, 8192, 8192) in shapes
    assert {(4096, 1280, 8192), (4096, 7168, 8192), (4096, 8192, 1024), (4096, 8192, 3584)} <= shapes
    assert {op for s in tune.gpu_shapes() for op in s.ops} == set(tuned.OPS)


def test_allow_cpu_runs_end_to_end_and_the_kernels_read_its_file(tmp_path, monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", tuned.ENV_TUNED_DIR)}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--mode", "tune", "--allow-cpu", "--out-dir", str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tmp_path / "cpu.yaml"
    assert f"wrote {path}" in proc.stdout
    entries = tuned.load(path)
    assert {e.op for e in entries} == set(tuned.OPS)
    assert {(e.m, e.n, e.k) for e in entries} == {(s.m, s.n, s.k) for s in tune.cpu_shapes()}
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(tmp_path))
    for e in entries:
        x = torch.empty(e.m, e.k, dtype=getattr(torch, e.dtype))
        if e.op == "matmul":
            assert matmul_module.matmul_config(x, e.n) == e.config
        else:
            b = blocks.block_config(PLAIN, x.device, e.m, e.k, dtype=x.dtype, op=e.op, n=e.n)
            assert (b.block_m, b.block_n, b.num_warps, b.group_m) == (
                e.config.block_m,
                e.config.block_n,
                e.config.num_warps,
                e.config.group_m,
            )


def _cells(line: str) -> list[tuple[int, int, str]]:
    """(start, end, text) of each cell: cells are separated by two spaces or more."""
    return [(m.start(), m.end(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", line)]


def test_table_has_a_header_over_every_column():
    row = dict(
        op="matmul_reduce_scatter",
        shape="gate_up m4096",
        dtype="bfloat16",
        config=GemmConfig(128, 256, 64, 8, 3, 8, "persistent").label(),
        ms=1.2345,
        cublas_ms=1.2,
        vs_cublas=0.97,
        tflops=812.3,
    )
    head, line = tune.table([row]).splitlines()
    heads, cells = _cells(head), _cells(line)
    assert [h[2] for h in heads][-1] == "TFLOP/s" and len(heads) == len(cells), (head, line)
    for h, c in zip(heads, cells, strict=True):  # left-aligned cells start under their header, the others end there
        assert h[0] == c[0] or h[1] == c[1], (h, c)


def _checkout_cpu_file() -> int | None:
    return CHECKOUT_CPU_FILE.stat().st_mtime_ns if CHECKOUT_CPU_FILE.exists() else None


@no_gpu
def test_run_prints_each_winner_once_under_one_header(tmp_path, capsys):
    result = tune.run(str(tmp_path), allow_cpu=True, timer=_fake_timer({}, []))
    out = capsys.readouterr().out.splitlines()
    head, *_ = tune.table([]).splitlines()
    assert out.count(head) == 1 and result["rows"], out
    for row in result["rows"]:
        assert out.count(tune.table([row]).splitlines()[1]) == 1, out


@no_gpu
def test_cpu_run_writes_into_out_dir_never_into_configs(tmp_path):
    """``--mode tune --allow-cpu`` without ``--out-dir``, from another directory: the file goes to the
    default report folder (./bench_results, ignored by git), not into the checkout's configs/tuned
    (where the kernels never read a CPU file)."""
    before = _checkout_cpu_file()
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", tuned.ENV_TUNED_DIR)}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--mode", "tune", "--allow-cpu"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = tmp_path / "bench_results" / "cpu.yaml"
    assert f"wrote {written.relative_to(tmp_path)}" in proc.stdout and tuned.load(written)
    assert _checkout_cpu_file() == before
    with pytest.raises(ValueError, match="out_dir: a CPU run of the tuner needs one"):
        tune.run(None, allow_cpu=True)
