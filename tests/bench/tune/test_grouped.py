"""The tuner's grouped GEMM (``grouped_matmul``, :mod:`bench.tune.grouped`): the fastest correct tile-core config
with a fake timer becomes the file's entry, ``kernels.grouped_matmul`` launches its tiles and stays right, and an
entry of a variant the grouped kernel does not run is never launched."""

from __future__ import annotations

import pytest
import torch

import kernels
from bench.tune import grouped as tune_grouped
from bench.tune import tuner
from kernels.fused import blocks, grouped, tuned
from kernels.fused.gemm_configs import GemmConfig

pytestmark = pytest.mark.triton

NARROW = GemmConfig(16, 16, 16, 1, 1, 1, "plain")
WIDE = GemmConfig(16, 32, 16, 1, 1, 1, "plain")
CPU = torch.device("cpu")


def _tiles(c) -> tuple[int, ...]:
    return (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.group_m)


def _spy_config(monkeypatch) -> list:
    """The tiles every grouped launch chooses (``grouped.config``, called by ``grouped.launch``)."""
    seen, real = [], grouped.config
    monkeypatch.setattr(grouped, "config", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    return seen


def _call_and_check(shape: tuner.TuneShape) -> None:
    """``kernels.grouped_matmul`` on ``shape``'s uniform routing, within the tuner's bound of the fp32 product."""
    problem = tune_grouped.problem(tuner.Case(kernels.format.PLAIN, torch.bfloat16), shape, CPU)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape.m, shape.k, generator=gen).to(torch.bfloat16)
    w = torch.randn(shape.experts, shape.n, shape.k, generator=gen).to(torch.bfloat16)
    offsets = torch.arange(1, shape.experts + 1, dtype=torch.int32) * shape.rows
    # The same operands as the problem's (same seed and draws), so its check holds the kernel's result.
    assert problem.check(kernels.grouped_matmul(x, w, offsets, backend="fused")) is None
    assert problem.check(torch.zeros(shape.m, shape.n)) is not None


def test_tuner_picks_the_fastest_correct_grouped_config_and_the_kernel_launches_it(monkeypatch, tmp_path):
    """Fake timer: ``NARROW`` is fastest but made wrong (never timed nor chosen), ``WIDE`` wins; no other
    variant than the tile core's is run. The entry is keyed by the rows per expert; then the kernel
    launches ``WIDE``'s tiles (the defaults before) and matches the reference."""
    real_launch = grouped.launch

    def launch(fmt, x, w, offsets, out, **kw):
        y = real_launch(fmt, x, w, offsets, out, **kw)
        return y + 1 if kw.get("cfg") is not None and _tiles(kw["cfg"]) == _tiles(NARROW) else y

    monkeypatch.setattr(grouped, "launch", launch)
    calls = []

    def timer(fn, key):
        calls.append(key)
        return 1.0 if key[2] == tuner._CUBLAS else {NARROW.label(): 0.01, WIDE.label(): 0.2}.get(key[2], 0.5)

    (shape,) = tune_grouped.cpu_shapes()
    assert shape.rows == shape.m // shape.experts == 16
    entries, rows, skipped = tuner.tune([shape], [torch.bfloat16], CPU, timer, log=lambda s: None)
    monkeypatch.setattr(grouped, "launch", real_launch)
    assert skipped == [] and (shape.label, "bfloat16", tuner._CUBLAS) in calls
    assert {key[2].split(":")[0] for key in calls} == {"plain", tuner._CUBLAS}
    assert (shape.label, "bfloat16", NARROW.label()) not in calls
    assert "wrong result" in rows[0]["failed"][NARROW.label()]
    (entry,) = entries
    assert (entry.op, entry.m, entry.n, entry.k, entry.config) == ("grouped_matmul", 16, shape.n, shape.k, WIDE)

    seen = _spy_config(monkeypatch)
    _call_and_check(shape)
    tuned.write(tmp_path / "cpu.yaml", entries, {"gpu": "cpu"})
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(tmp_path))
    _call_and_check(shape)
    assert seen[0] == blocks.CPU_BLOCKS and _tiles(seen[1]) == _tiles(WIDE)


def test_an_entry_of_a_variant_the_grouped_kernel_cannot_run_is_never_launched(monkeypatch, tmp_path):
    """A ``persistent`` grouped entry (the tuner never writes one) is skipped by the lookup: the defaults
    alone, or the nearest plain entry beside it, even a farther one."""
    (shape,) = tune_grouped.cpu_shapes()
    persistent = GemmConfig(16, 32, 16, 1, 1, 1, "persistent")
    near = tuned.Entry("grouped_matmul", "bfloat16", shape.rows, shape.n, shape.k, persistent)
    path = tmp_path / "cpu.yaml"
    tuned.write(path, [near], {"gpu": "cpu"})
    assert tuned.load(path) == [near]  # the file accepts it; the lookup does not use it
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(tmp_path))
    seen = _spy_config(monkeypatch)
    _call_and_check(shape)
    assert seen == [blocks.CPU_BLOCKS]
    far = tuned.Entry("grouped_matmul", "bfloat16", 2 * shape.rows, 2 * shape.n, shape.k, NARROW)
    tuned.write(path, [near, far], {"gpu": "cpu"})
    _call_and_check(shape)
    assert _tiles(seen[1]) == _tiles(NARROW)


def test_gpu_shapes_are_qwen3_30b_a3b_experts():
    """128 experts, hidden 2048, intermediate 768, top-8 of 4096 tokens: 256 rows per expert."""
    grouped_shapes = [s for s in tuner.gpu_shapes() if s.experts]
    assert [(s.m, s.n, s.k, s.experts, s.rows, s.ops) for s in grouped_shapes] == [
        (4096 * 8, 2 * 768, 2048, 128, 256, ("grouped_matmul",)),
        (4096 * 8, 2048, 768, 128, 256, ("grouped_matmul",)),
    ]
    assert tune_grouped.cpu_shapes()[0] in tuner.cpu_shapes()
