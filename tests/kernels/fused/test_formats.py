"""The operand formats through one implementation: the tuned file's format key (every format reads the
tuned file through one block_config)."""

from __future__ import annotations

import pytest
import torch


def test_tuned_entries_are_looked_up_by_format(monkeypatch, tmp_path):
    """An entry serves only its own format (default plain); FP8 entries keep the 128-divisibility of the
    FP8 tiles, and a format the kernels do not know is named."""
    from kernels.format import PLAIN, fp8, int8
    from kernels.fused import blocks, tuned
    from kernels.fused.gemm_configs import GemmConfig

    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(tmp_path))
    plain_cfg, fp8_cfg, int8_cfg = (
        GemmConfig(32, 32, 16, 1, 1, 2),
        GemmConfig(32, 64, 128, 1, 1, 2),
        GemmConfig(16, 32, 32, 1, 1, 2),
    )
    entries = [
        tuned.Entry("matmul_reduce_scatter", "float32", 40, 24, 32, plain_cfg),
        tuned.Entry("matmul_reduce_scatter", "float8_e4m3fn", 40, 24, 32, fp8_cfg, format="fp8:block"),
        tuned.Entry("matmul_reduce_scatter", "float32", 40, 24, 32, int8_cfg, format="int8:per_group:32"),
    ]
    tuned.write(tmp_path / "cpu.yaml", entries, {"gpu": "test"})
    assert "format: fp8:block" in (tmp_path / "cpu.yaml").read_text()
    cpu, f32, e4m3 = torch.device("cpu"), torch.float32, torch.float8_e4m3fn

    def tiles(fmt, dtype):
        cfg = blocks.block_config(fmt, cpu, 40, 32, dtype=dtype, op="matmul_reduce_scatter", n=24)
        return cfg.block_m, cfg.block_n, cfg.block_k

    assert tiles(PLAIN, f32) == (32, 32, 16)
    assert tiles(fp8("block"), e4m3) == (32, 64, 128)
    assert tiles(fp8("row"), e4m3) == (16, 16, 64)  # no row-mode entry: the FP8 defaults
    assert tiles(int8("per_group", 32, False), f32) == (16, 32, 32)
    assert tiles(int8("per_group", 32, True), f32) == (16, 16, 16)  # with offset: another format
    header = "version: 1\nentries:\n- {op: matmul_all_reduce, dtype: float8_e4m3fn, m: 4, n: 4, k: 4, "
    config = "config: {block_m: 16, block_n: 256, block_k: 64, num_warps: 1, num_stages: 1, group_m: 1}"
    for text, match in (
        (header + config + ", format: fp8:block}\n", r"block_n 256 and block_k 64 must divide 128"),
        (
            header + config.replace("256", "16") + ", format: fp8:blocky}\n",
            r"format: 'fp8:blocky' is not an operand format",
        ),
        (header + config.replace("256", "16") + ", format: int8:per_group}\n", r"format: 'int8:per_group' is not"),
        (
            header + config.replace("256", "16").replace("}", ", variant: tma}") + ", format: fp8:row}\n",
            r"variant: 'tma'",
        ),
    ):
        (tmp_path / "cpu.yaml").write_text(text)
        with pytest.raises(ValueError, match=match):
            blocks.block_config(fp8("row"), cpu, 4, 4, dtype=e4m3, op="matmul_all_reduce", n=4)
