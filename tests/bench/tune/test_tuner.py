"""``python -m bench --mode tune``: selection logic with a fake timer, the CPU flow end to end (plain, FP8
and int8 weights), the kernels reading what the tuner wrote for each format, and a file of the old tuner."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.tune import grouped, tuner
from kernels.format import PLAIN, OperandFormat, fp8, int8
from kernels.fused import blocks, gemm_persistent, tuned
from kernels.fused import matmul as matmul_module
from kernels.fused.gemm_configs import GemmConfig
from kernels.ops.gemm import Operands
from kernels.testing import REPO_ROOT
from kernels.testing import fp8 as fp8_reference
from tests.bench.shared import completed, run_once

pytestmark = pytest.mark.triton
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the --allow-cpu flow; a GPU tunes its own shapes")
CHECKOUT_CPU_FILE = Path(REPO_ROOT) / "configs" / "tuned" / "cpu.yaml"

FAST = GemmConfig(16, 32, 16, 1, 1, 1, "persistent")
FAST_PLAIN = GemmConfig(16, 32, 16, 1, 1, 1, "plain")
WRONG = GemmConfig(16, 16, 16, 1, 1, 1, "tma")


def test_fake_timer_configs_are_in_the_cpu_space():
    from kernels.fused import gemm_configs

    assert {FAST, FAST_PLAIN, WRONG} <= set(gemm_configs.space(gemm_configs.family(tuner.cpu_shapes()[0].m), "cpu"))


def _fake_timer(times: dict[str, float], calls: list):
    """Seconds per config label (cuBLAS 1 s, unlisted configs 0.5 s); runs nothing, records the keys."""

    def timer(fn, key):
        calls.append(key)
        return 1.0 if key[2] == tuner._CUBLAS else times.get(key[2], 0.5)

    return timer


def test_select_fastest_first_on_ties_and_none_for_all_failed():
    a, b, c = (GemmConfig(16, 16, 16, 1, 1, 1, v) for v in ("tma", "persistent", "plain"))
    label = GemmConfig.label
    assert tuner.select({label(a): 2.0, label(b): 1.0, label(c): 1.0}, [a, b, c], label) == b
    assert tuner.select({label(a): None, label(b): 3.0}, [a, b, c], label) == b
    assert tuner.select({label(a): None}, [a, b, c], label) is None


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
    shape = tuner.cpu_shapes()[0]
    logged = []
    entries, rows, skipped = tuner.tune([shape], [torch.bfloat16], torch.device("cpu"), timer, log=logged.append)
    monkeypatch.setattr(matmul_module, "linear", real_matmul)
    assert skipped == []
    assert (shape.label, "bfloat16", WRONG.label()) not in calls
    assert (shape.label, "bfloat16", tuner._CUBLAS) in calls
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
    shapes = tuner.cpu_shapes()[:1] * 2
    entries, _, skipped = tuner.tune(
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
    shapes = {(s.m, s.n, s.k) for s in tuner.gpu_shapes()}
    assert (8192, 8192, 8192) in shapes
    assert {(4096, 1280, 8192), (4096, 7168, 8192), (4096, 8192, 1024), (4096, 8192, 3584)} <= shapes
    assert {op for s in tuner.gpu_shapes() for op in s.ops} == set(tuned.OPS)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One ``python -m bench --mode tune --allow-cpu`` without ``--out-dir``, from another directory (the CPU
    tuner's whole space takes a while under the interpreter), shared by the tests below: ``(process, the
    folder it ran in)``, the process also holding the checkout's configs/tuned/cpu.yaml mtime before and
    after. On CPU a named ``--out-dir`` and the default take the same path (bench/__main__.py hands
    either to the tuner)."""

    def run(cwd: Path) -> dict:
        before = _checkout_cpu_file()
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", tuned.ENV_TUNED_DIR)}
        env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run(
            [sys.executable, "-m", "bench", "--mode", "tune", "--allow-cpu"],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        return {**completed(proc), "before": before, "after": _checkout_cpu_file()}

    return run_once(tmp_path_factory, "tune-cli", run)


@no_gpu
def test_allow_cpu_runs_end_to_end_and_the_kernels_read_its_file(cpu_run, monkeypatch):
    """The CPU run writes plain entries and, under ``format:``, FP8 (block, row, tensor) and int8 (per_group,
    per_channel, per_tensor) entries for every op and shape; the lookup returns each for its own format: the bare
    matmul's plain entry through ``matmul_config``, every other through ``block_config`` (the local GEMM
    and the fused ops)."""
    proc, cwd = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = cwd / "bench_results" / "cpu.yaml"
    assert f"wrote {path.relative_to(cwd)}" in proc.stdout
    assert "no config ran" not in proc.stdout, proc.stdout
    entries = tuned.load(path)
    cases = {(c.fmt.encode(), tuned.dtype_name(c.dtype)) for c in tuner.cpu_cases()}
    assert {
        "fp8:block",
        "fp8:row",
        "fp8:tensor",
        f"int8:per_group:{tuner.CPU_GROUP_SIZE}",
        "int8:per_channel:0",
        "int8:per_tensor:0",
    } < {f for f, _ in cases}
    for case in cases:
        # The grouped GEMM is tuned for plain operands only (bench.tune.grouped.FORMATS).
        has_grouped = OperandFormat.decode(case[0]).kind in grouped.FORMATS
        shapes = {(s.rows, s.n, s.k) for s in tuner.cpu_shapes() if has_grouped or not s.experts}
        mine = [e for e in entries if (e.format, e.dtype) == case]
        assert {e.op for e in mine} == set(tuned.OPS) - (set() if has_grouped else set(grouped.OPS)), case
        assert {(e.m, e.n, e.k) for e in mine} == shapes, case
    assert "format: fp8:block" in path.read_text() and "format: plain" not in path.read_text()
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(path.parent))
    for e in entries:
        fmt = OperandFormat.decode(e.format)
        x = torch.empty(e.m, e.k, dtype=getattr(torch, e.dtype))
        if e.op == "matmul" and fmt == PLAIN:
            assert matmul_module.matmul_config(x, e.n) == e.config
            continue
        b = blocks.block_config(fmt, x.device, e.m, e.k, dtype=x.dtype, op=e.op, n=e.n)
        assert _tiles(b) == _tiles(e.config), e


def _tiles(c) -> tuple[int, ...]:
    return (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.group_m)


FP8_BLOCK = fp8("block")
INT8_GROUP = int8("per_group", tuner.CPU_GROUP_SIZE, False)
SMALL = GemmConfig(16, 16, 16, 1, 1, 1, "plain")


def test_tune_writes_format_entries_the_lookup_returns_for_their_format_only(monkeypatch, tmp_path):
    """Fake timer per case: plain's winner is ``FAST`` / ``FAST_PLAIN``, FP8 block's and int8 per_group's
    ``SMALL``; an FP8 config whose result is wrong (made so here) is never timed nor chosen. In the written
    file the format entries carry their format; ``block_config`` returns them for that format and op (the
    local GEMM launches them), the plain lookups keep plain's winners, and another FP8 mode (no entry) keeps
    the FP8 defaults."""
    from kernels.fused import matmul as mm

    real_gemm = mm.gemm
    wrong = GemmConfig(16, 32, 16, 1, 1, 1, "plain")

    def fake_gemm(fmt, ops, index=0, *, out_dtype=None, cfg=None):
        y = real_gemm(fmt, ops, index, out_dtype=out_dtype, cfg=cfg)
        return y + 1 if fmt == FP8_BLOCK and cfg is not None and _tiles(cfg) == _tiles(wrong) else y

    monkeypatch.setattr(mm, "gemm", fake_gemm)
    calls = []

    fp8_name = tuner.Case(FP8_BLOCK, torch.float8_e4m3fn).name
    times = {
        "bfloat16": {FAST.label(): 0.1, FAST_PLAIN.label(): 0.1},
        fp8_name: {SMALL.label(): 0.1, wrong.label(): 0.01},
        tuner.Case(INT8_GROUP, torch.float16).name: {SMALL.label(): 0.1},
    }

    def timer(fn, key):
        calls.append(key)
        return 1.0 if key[2] == tuner._CUBLAS else times[key[1]].get(key[2], 0.5)

    shape = tuner.cpu_shapes()[0]
    cases = [torch.bfloat16, tuner.Case(FP8_BLOCK, torch.float8_e4m3fn), tuner.Case(INT8_GROUP, torch.float16)]
    entries, rows, skipped = tuner.tune([shape], cases, torch.device("cpu"), timer, log=lambda s: None)
    monkeypatch.setattr(mm, "gemm", real_gemm)
    assert skipped == []
    assert fp8_name == "fp8:block float8_e4m3fn"
    assert (shape.label, fp8_name, wrong.label()) not in calls
    assert (shape.label, fp8_name, SMALL.label()) in calls
    fp8_row = next(r for r in rows if r["format"] == "fp8:block" and r["op"] == "matmul")
    assert "wrong result" in fp8_row["failed"][wrong.label()] and fp8_row["config"] == SMALL.label()
    by = {(e.format, e.op): e for e in entries}
    assert len(by) == len(entries) == 3 * len(shape.ops)
    assert by[("plain", "matmul")].config == FAST
    for op in shape.ops:
        assert by[(FP8_BLOCK.encode(), op)].config == SMALL and by[(FP8_BLOCK.encode(), op)].dtype == "float8_e4m3fn"
        assert by[(INT8_GROUP.encode(), op)].config == SMALL and by[(INT8_GROUP.encode(), op)].dtype == "float16"
        assert op == "matmul" or by[("plain", op)].config == FAST_PLAIN

    tuned.write(tmp_path / "cpu.yaml", entries, {"gpu": "cpu"})
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(tmp_path))
    cpu, e4m3 = torch.device("cpu"), torch.float8_e4m3fn
    m, n, k = shape.m, shape.n, shape.k
    for op in shape.ops:
        assert _tiles(blocks.block_config(FP8_BLOCK, cpu, m, k, dtype=e4m3, op=op, n=n)) == _tiles(SMALL)
        assert _tiles(blocks.block_config(INT8_GROUP, cpu, m, k, dtype=torch.float16, op=op, n=n)) == _tiles(SMALL)
        # Another FP8 mode, another group size, another family: the defaults.
        assert blocks.block_config(fp8("row"), cpu, m, k, dtype=e4m3, op=op, n=n) == blocks.CPU_FP8_BLOCKS
        other = int8("per_group", 2 * tuner.CPU_GROUP_SIZE, False)
        assert blocks.block_config(other, cpu, m, k, dtype=torch.float16, op=op, n=n) == blocks.CPU_BLOCKS
        assert blocks.block_config(FP8_BLOCK, cpu, 500, k, dtype=e4m3, op=op, n=n) == blocks.CPU_FP8_BLOCKS
    xb = torch.empty(m, k, dtype=torch.bfloat16)
    assert matmul_module.matmul_config(xb, n) == FAST
    plain = blocks.block_config(PLAIN, cpu, m, k, dtype=torch.bfloat16, op="matmul_all_reduce", n=n)
    assert _tiles(plain) == _tiles(FAST_PLAIN)

    # The local GEMM of FP8 operands launches the tuned tiles, and its result is right.
    seen = []
    monkeypatch.setattr(mm, "block_config", lambda *a, **kw: seen.append(real_block_config(*a, **kw)) or seen[-1])
    x, xs = fp8_reference.quantize(torch.randn(m, k), "block", False)
    w, ws = fp8_reference.quantize(torch.randn(n, k), "block", True)
    y = mm.gemm(FP8_BLOCK, Operands(x, (w,), (None,), xs, (ws,)), out_dtype=torch.float32)
    assert [_tiles(c) for c in seen] == [_tiles(SMALL)]
    want, bound = fp8_reference.reference("ar", [(x, xs)], [(w, ws)], None, 0, mode="block", out_dtype=torch.float32)
    fp8_reference.assert_close("tuned FP8 local GEMM", y, want, bound, torch.float32)


real_block_config = blocks.block_config


# A file the tuner wrote before it tuned formats: no ``format`` key anywhere.
OLD_FILE = """version: 1
gpu: NVIDIA H100 80GB HBM3
triton: 3.6.0
torch: 2.9.0
created: '2025-01-01T00:00:00Z'
skipped_by_budget: []
entries:
- op: matmul
  dtype: bfloat16
  m: 16
  n: 32
  k: 32
  config: {block_m: 16, block_n: 32, block_k: 16, num_warps: 1, num_stages: 1, group_m: 1, variant: persistent}
  ms: 0.5
  cublas_ms: 1.0
- op: matmul_all_reduce
  dtype: bfloat16
  m: 16
  n: 32
  k: 32
  config: {block_m: 16, block_n: 32, block_k: 16, num_warps: 1, num_stages: 1, group_m: 1, variant: plain}
  ms: 0.5
  cublas_ms: 1.0
"""


def test_a_file_of_the_old_tuner_loads_as_plain_entries(monkeypatch, tmp_path):
    (tmp_path / "cpu.yaml").write_text(OLD_FILE)
    entries = tuned.load(tmp_path / "cpu.yaml")
    assert [(e.op, e.format, e.config) for e in entries] == [
        ("matmul", "plain", FAST),
        ("matmul_all_reduce", "plain", FAST_PLAIN),
    ]
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(tmp_path))
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert matmul_module.matmul_config(torch.empty(16, 32, dtype=bf16), 32) == FAST
    plain = blocks.block_config(PLAIN, cpu, 16, 32, dtype=bf16, op="matmul_all_reduce", n=32)
    assert _tiles(plain) == _tiles(FAST_PLAIN)
    # No format entries: the formats keep their defaults.
    for fmt, dtype, default in (
        (FP8_BLOCK, torch.float8_e4m3fn, blocks.CPU_FP8_BLOCKS),
        (int8("per_channel", 0, False), bf16, blocks.CPU_BLOCKS),
    ):
        assert tuned.lookup(tuned.Query("matmul_all_reduce", dtype, 16, 32, fmt=fmt.encode()), cpu) is None
        assert blocks.block_config(fmt, cpu, 16, 32, dtype=dtype, op="matmul_all_reduce", n=32) == default
    # Written back, the plain entries still carry no format key.
    tuned.write(tmp_path / "again.yaml", entries, {"gpu": "cpu"})
    assert "format" not in (tmp_path / "again.yaml").read_text()


def test_format_spaces():
    """FP8: tile-core configs only, ``block_n`` and ``block_k`` dividing 128, the two accumulators within
    the register budget, the FP8 defaults among them on GPU, within sm_90's shared memory; every one
    accepted by the tuned-file parser as an FP8 entry. int8: the tile-core tiles, per_group ones with the
    narrow ``block_k`` where a step would straddle a group (what ``block_config`` runs them with)."""
    from kernels.fused import gemm_configs as gc
    from kernels.fused import tile

    assert gc.FP8_SCALE_BLOCK == tile.SCALE_BLOCK and gc.GROUP_BLOCK_K == blocks.NARROW_BLOCK_K
    for device_type in ("cuda", "cpu"):
        for fam in gc.FAMILIES:
            assert gc.format_space(PLAIN, fam, device_type) == gc.space(fam, device_type)
            core = gc.tile_core_space(fam, device_type)
            fp8_space = gc.format_space(FP8_BLOCK, fam, device_type)
            assert fp8_space and all(gc.fp8_fits(c) and c.variant == "plain" for c in fp8_space), fam
            assert all(128 % c.block_n == 0 and 128 % c.block_k == 0 for c in fp8_space)
            assert [c for c in core if gc.fp8_fits(c)] == [c for c in fp8_space if c in core]
            assert len(set(fp8_space)) == len(fp8_space)
            entries = [
                tuned.Entry(op, "float8_e4m3fn", 64, 64, 64, c, format="fp8:row") for c in fp8_space for op in tuned.OPS
            ]
            assert tuned.parse({"version": 1, "entries": [e.to_dict() for e in entries]}, "test") == entries
            assert gc.format_space(int8("per_channel", 0, True), fam, device_type) == core
            aligned = gc.format_space(int8("per_group", 128, False), fam, device_type)
            assert aligned == core
            odd = gc.format_space(int8("per_group", 48, False), fam, device_type)
            assert all(48 % c.block_k == 0 for c in odd) and {c.block_m for c in odd} == {c.block_m for c in core}
            if device_type == "cuda":
                assert all(c.block_m >= 64 and c.smem_bytes(1) <= gc.SMEM_BYTES for c in fp8_space)
    # The FP8 defaults (blocks) are in the GPU space of their families, so the tuner can only improve on them.
    default = {"decode": blocks.GPU_FP8_SMALL_M_BLOCKS, "medium": blocks.GPU_FP8_BLOCKS, "large": blocks.GPU_FP8_BLOCKS}
    for fam, b in default.items():
        assert _tiles(b) in {_tiles(c) for c in gc.format_space(fp8("row"), fam)}, fam
    # A 256-row tile at 8 warps: 256 accumulator registers per thread for FP8's two accumulators.
    assert not gc.fp8_fits(GemmConfig(256, 128, 64, 8, 3, 8))


def _cells(line: str) -> list[tuple[int, int, str]]:
    """(start, end, text) of each cell: cells are separated by two spaces or more."""
    return [(m.start(), m.end(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", line)]


PLAIN_ROW = dict(
    op="matmul_reduce_scatter",
    shape="gate_up m4096",
    dtype="bfloat16",
    config=GemmConfig(128, 256, 64, 8, 3, 8, "persistent").label(),
    ms=1.2345,
    cublas_ms=1.2,
    vs_cublas=0.97,
    tflops=812.3,
)
# An FP8 winner without a baseline (torch._scaled_mm ran none of the scale layouts).
FORMAT_ROW = {
    **PLAIN_ROW,
    "dtype": "float8_e4m3fn",
    "format": "int8:per_group:128",
    "cublas_ms": None,
    "vs_cublas": None,
}


@pytest.mark.parametrize("row", [PLAIN_ROW, FORMAT_ROW], ids=["plain", "format"])
def test_table_has_a_header_over_every_column(row):
    head, line = tuner.table([row]).splitlines()
    heads, cells = _cells(head), _cells(line)
    assert [h[2] for h in heads][-1] == "TFLOP/s" and len(heads) == len(cells), (head, line)
    for h, c in zip(heads, cells, strict=True):  # left-aligned cells start under their header, the others end there
        assert h[0] == c[0] or h[1] == c[1], (h, c)
    assert [c[2] for c in cells][3] == row.get("format", "plain")


def _checkout_cpu_file() -> int | None:
    return CHECKOUT_CPU_FILE.stat().st_mtime_ns if CHECKOUT_CPU_FILE.exists() else None


@no_gpu
def test_run_prints_each_winner_once_under_one_header(tmp_path, capsys):
    # Two cases (the CPU space's plain and one format) are enough to print the header twice if it were per case.
    cases = [tuner.Case(PLAIN, torch.bfloat16), tuner.Case(fp8("row"), torch.float8_e4m3fn)]
    result = tuner.run(str(tmp_path), allow_cpu=True, timer=_fake_timer({}, []), cases=cases)
    out = capsys.readouterr().out.splitlines()
    head, *_ = tuner.table([]).splitlines()
    assert out.count(head) == 1 and result["rows"], out
    for row in result["rows"]:
        assert out.count(tuner.table([row]).splitlines()[1]) == 1, out


@no_gpu
def test_cpu_run_writes_into_out_dir_never_into_configs(cpu_run):
    """``--mode tune --allow-cpu`` without ``--out-dir``, from another directory: the file goes to the
    default report folder (./bench_results, ignored by git), not into the checkout's configs/tuned
    (where the kernels never read a CPU file)."""
    proc, cwd = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = cwd / "bench_results" / "cpu.yaml"
    assert f"wrote {written.relative_to(cwd)}" in proc.stdout and tuned.load(written)
    assert proc.after == proc.before
    with pytest.raises(ValueError, match="out_dir: a CPU run of the tuner needs one"):
        tuner.run(None, allow_cpu=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU torch's _scaled_mm: rowwise and tensorwise only")
def test_fp8_baseline_is_scaled_mm_where_torch_runs_the_mode():
    """The FP8 baseline is torch._scaled_mm in the layout bench.dense.formats picks, checked against the reference;
    a mode torch refuses (block scales on CPU) leaves the entry without one."""
    shape = tuner.TuneShape("s", 64, 48, 256, ("matmul",))
    for mode, has_baseline in (("row", True), ("tensor", True), ("block", False)):
        problem = tuner._problem(tuner.Case(fp8(mode), torch.float8_e4m3fn), shape, torch.device("cpu"))
        assert (problem.baseline is not None) == has_baseline, mode
        if has_baseline:
            assert problem.check(problem.baseline()) is None, mode
