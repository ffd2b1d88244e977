"""The GEMM core: persistent variants (TMA and pointer loads), their tile walk, the config space and
the tuned-file lookup the kernels read (interpreter; the sm_90a properties are in test_compile_sm90)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from kernels.format import PLAIN
from kernels.fused import blocks, gemm_configs, gemm_persistent, matmul, tile, tuned
from kernels.fused.gemm_configs import GemmConfig

try:
    from kernels.testing import program_order
except ImportError:  # the toolkit's move from tests/ to kernels.testing
    from kernels.testing import program_order

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter test")


def _reference(x, w, bias):
    """F.linear in fp32 from the exact operands, then one rounding to x's dtype (what the core does)."""
    y = x.float() @ w.float().T
    if bias is not None:
        y = y + bias.float()
    return y


def _assert_close(y, x, w, bias):
    """One rounding to the output dtype (half an ulp, eps * |ref| is two) plus reordered fp32 sums."""
    ref = _reference(x, w, bias)
    k = x.shape[1]
    magnitude = x.float().abs() @ w.float().abs().T + (bias.float().abs() if bias is not None else 0)
    bound = torch.finfo(y.dtype).eps * ref.abs() + 2 * (k + 1) * 2.0**-24 * magnitude
    diff = (y.float() - ref).abs()
    assert bool((diff <= bound).all()), f"max diff {diff.max().item()} over bound {bound.max().item()}"


CPU_CFG = {v: GemmConfig(16, 16, 16, 1, 1, 2, v) for v in gemm_configs.VARIANTS}


@pytest.mark.parametrize("variant", ["tma", "persistent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_persistent_variants_match_linear(variant, dtype):
    torch.manual_seed(0)
    # 37 x 40 output: 3 x 3 tiles of 16, partial in both dims; k = 48 three k steps.
    x = torch.randn(37, 48).to(dtype)
    w = torch.randn(40, 48).to(dtype)
    bias = torch.randn(40).to(dtype)
    for b in (bias, None):
        _assert_close(matmul.linear(x, w, b, config=CPU_CFG[variant]), x, w, b)


def test_tma_falls_back_to_pointer_loads_where_tma_cannot_address():
    torch.manual_seed(1)
    x = torch.randn(20, 24)
    w_t = torch.randn(24, 40).t()  # a transposed weight: last stride is not 1
    x_odd = torch.randn(20, 25)[:, :23]  # rows of 23 fp32: not 16-byte aligned
    w_odd = torch.randn(40, 23)
    assert not gemm_persistent.tma_usable(x, w_t, torch.empty(20, 40))
    assert not gemm_persistent.tma_usable(x_odd, w_odd, torch.empty(20, 40))
    _assert_close(matmul.linear(x, w_t, config=CPU_CFG["tma"]), x, w_t, None)
    _assert_close(matmul.linear(x_odd, w_odd, config=CPU_CFG["tma"]), x_odd, w_odd, None)


def test_empty_and_k0():
    x = torch.randn(5, 0)
    w = torch.randn(7, 0)
    bias = torch.randn(7)
    assert torch.equal(matmul.linear(x, w, bias, config=CPU_CFG["tma"]), bias.expand(5, 7))
    assert matmul.linear(torch.randn(0, 8), torch.randn(3, 8), config=CPU_CFG["tma"]).shape == (0, 3)


@interpreted
@pytest.mark.parametrize("order", ["grid", "reverse", "shuffle:3"])
@pytest.mark.parametrize("variant", ["tma", "persistent"])
@pytest.mark.parametrize(("m", "n", "group_m"), [(80, 48, 2), (16, 112, 1), (112, 16, 4)])
def test_persistent_walk_covers_every_tile_once(monkeypatch, order, variant, m, n, group_m):
    """Every output tile is computed by exactly one program, whatever order the programs run in
    (grid of 3 programs under the interpreter: several tiles per program, partial last groups)."""
    if variant == "tma" and not gemm_persistent.interpreter_supports_tma():
        pytest.skip("this Triton's interpreter cannot run descriptor loads at runtime offsets (3.6)")
    monkeypatch.setenv(program_order.ENV, order)
    program_order.install()
    cfg = GemmConfig(16, 16, 16, 1, 1, group_m, variant)
    x, w = torch.randn(m, 16), torch.randn(n, 16)
    tiles = -(-m // 16) * -(-n // 16)
    walk = torch.zeros(tiles, dtype=torch.int32)
    out = torch.full((m, n), float("nan"))
    gemm_persistent.launch(x, w, None, out, cfg, math=tile.Math(blocks.acc_dtype(x.dtype), "ieee"), walk=walk)
    assert walk.tolist() == [1] * tiles
    _assert_close(out, x, w, None)


def test_space_fits_hopper():
    """GPU entries: wgmma tiles (block_m >= 64, 4 warps per 64 rows at most), sm_90 shared memory with
    the TMA epilogue's staging tile, every family populated, no duplicates within a family."""
    for fam in gemm_configs.FAMILIES:
        space = gemm_configs.space(fam)
        assert space and len(set(space)) == len(space)
        assert {c.variant for c in space} == set(gemm_configs.VARIANTS)
        for c in space:
            assert c.block_m >= 64 and c.block_m // 16 >= c.num_warps, c
            assert c.smem_bytes(2) <= gemm_configs.SMEM_BYTES, c
    assert all(c.block_m == 64 for c in gemm_configs.space("decode"))
    assert [gemm_configs.family(m) for m in (1, 64, 65, 1024, 1025)] == ["decode"] * 2 + ["medium"] * 2 + ["large"]
    with pytest.raises(ValueError, match="variant"):
        GemmConfig(64, 64, 64, 4, 3, 8, "fast")
    with pytest.raises(ValueError, match="block_n"):
        GemmConfig(64, 96, 64, 4, 3, 8)


def test_no_tuned_file_keeps_todays_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(tmp_path))
    x = torch.randn(40, 32)
    cfg = matmul.matmul_config(x, 24)
    b = blocks.CPU_BLOCKS
    assert cfg == GemmConfig(b.block_m, b.block_n, b.block_k, b.num_warps, b.num_stages, b.group_m, "plain")
    assert blocks.block_config(PLAIN, x.device, 40, 32, dtype=x.dtype, op="all_gather_matmul", n=24) == b
    monkeypatch.delenv(tuned.ENV_TUNED_DIR)
    # CPU never reads the repository's configs/tuned: a CPU tuning run must not change CI's tiles.
    assert tuned.tuned_path(torch.device("cpu")) is None


def test_tuned_dir_that_is_no_directory_is_named(monkeypatch, tmp_path):
    """A COC_TUNED_DIR naming no directory raises ValueError naming the variable and the value (the
    README's rule for every COC_* variable) instead of leaving the kernels on the default tiles; a blank
    value means unset, and a directory created later is accepted."""
    x = torch.randn(40, 32)
    missing, a_file = tmp_path / "missing", tmp_path / "a-file"
    a_file.write_text("")
    for bad in (missing, a_file):
        monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(bad))
        for ask in (
            lambda: matmul.matmul_config(x, 24),
            lambda: blocks.block_config(PLAIN, x.device, 40, 32, dtype=x.dtype, op="matmul_reduce_scatter", n=24),
            lambda: tuned.tuned_path(torch.device("cpu")),
        ):
            with pytest.raises(ValueError, match=f"COC_TUNED_DIR={str(bad)!r} is not accepted: no such directory"):
                ask()
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, " ")
    assert tuned.tuned_path(torch.device("cpu")) is None
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(missing))
    missing.mkdir()
    assert tuned.tuned_path(torch.device("cpu")) == missing / "cpu.yaml"
    assert matmul.matmul_config(x, 24) == matmul.default_config(x)


def _write(path, entries):
    tuned.write(path, entries, {"gpu": "test"})


def test_lookup_nearest_in_family_and_fused_ignores_k(monkeypatch, tmp_path):
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(tmp_path))
    a = GemmConfig(32, 32, 16, 1, 1, 2, "plain")
    b = GemmConfig(16, 32, 16, 1, 1, 1, "plain")
    c = GemmConfig(32, 16, 16, 1, 1, 2, "tma")
    _write(
        tmp_path / "cpu.yaml",
        [
            tuned.Entry("matmul", "bfloat16", 4096, 8192, 1024, c),
            tuned.Entry("all_gather_matmul", "bfloat16", 4096, 1280, 8192, a),
            tuned.Entry("all_gather_matmul", "bfloat16", 4096, 1280, 1024, b),
            tuned.Entry("all_gather_matmul", "bfloat16", 16, 1280, 8192, b),
        ],
    )
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert tuned.lookup(tuned.Query("matmul", bf16, 2048, 8192, 1024), cpu) == c
    assert tuned.lookup(tuned.Query("matmul", bf16, 16, 8192, 1024), cpu) is None  # another family
    assert tuned.lookup(tuned.Query("matmul", torch.float16, 4096, 8192, 1024), cpu) is None  # another dtype
    # Fused: k is not part of the distance, so uneven k shards get the same tiles (first entry wins a tie).
    assert {tuned.lookup(tuned.Query("all_gather_matmul", bf16, 2000, 1280, k), cpu) for k in (1024, 1025, 8192)} == {a}
    assert tuned.lookup(tuned.Query("all_gather_matmul", bf16, 8, 1280, 3), cpu) == b
    found = {blocks.block_config(PLAIN, cpu, 2000, k, dtype=bf16, op="all_gather_matmul", n=1280) for k in (1024, 1025)}
    assert {(c.block_m, c.block_n, c.ag_splits) for c in found} == {(32, 32, blocks.CPU_BLOCKS.ag_splits)}


def test_tuned_matmul_config_runs_and_bad_files_are_named(monkeypatch, tmp_path):
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(tmp_path))
    cfg = GemmConfig(16, 32, 16, 1, 1, 1, "persistent")
    _write(tmp_path / "cpu.yaml", [tuned.Entry("matmul", "float32", 24, 40, 32, cfg)])
    x, w = torch.randn(24, 32), torch.randn(40, 32)
    assert matmul.matmul_config(x, 40) == cfg
    seen = []
    real = gemm_persistent.launch
    monkeypatch.setattr(gemm_persistent, "launch", lambda *a, **kw: (seen.append(a[4]), real(*a, **kw)))
    _assert_close(matmul.linear(x, w), x, w, None)
    assert seen == [cfg]
    (tmp_path / "cpu.yaml").write_text("version: 1\nentries:\n- {op: matmul, dtype: float32, m: 0, n: 1, k: 1}\n")
    with pytest.raises(ValueError, match=r"cpu.yaml: entries\[0\].m: 0"):
        matmul.matmul_config(x, 40)
    (tmp_path / "cpu.yaml").write_text(
        "version: 1\nentries:\n- {op: all_gather_matmul, dtype: float32, m: 1, n: 1, k: 1, config: "
        "{block_m: 16, block_n: 16, block_k: 16, num_warps: 1, num_stages: 1, group_m: 1, variant: tma}}\n"
    )
    with pytest.raises(ValueError, match="tile core is 'plain'"):
        blocks.block_config(PLAIN, x.device, 24, 32, dtype=x.dtype, op="all_gather_matmul", n=40)


def test_failing_variant_warns_and_falls_back(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(gemm_persistent, "launch", broken)
    monkeypatch.setattr(matmul, "_failed", set())
    cfg = GemmConfig(16, 16, 16, 1, 1, 2, "persistent")
    x, w = torch.randn(20, 16), torch.randn(24, 16)
    with pytest.raises(RuntimeError, match="out of resources"):
        matmul.linear(x, w, config=cfg, fallback=False)
    with pytest.warns(RuntimeWarning, match="persistent:16x16x16.*running the default plain kernel"):
        y = matmul.linear(x, w, config=cfg)
    _assert_close(y, x, w, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per config: the second call goes straight to the default
        _assert_close(matmul.linear(x, w, config=cfg), x, w, None)
