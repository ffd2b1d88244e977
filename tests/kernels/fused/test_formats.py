"""Every pattern for every operand format through one implementation (``run(call, operands)``), under the
interpreter on gloo ranks: the combinations the per-format copies never had (FP8 with gather_dim /
scatter_dim > 0 and several weights, int8 all-gather and reduce-scatter, int8 one- and two-shot), the
FP8 tiles from the tuned file (chunk waits over every chunk a tile overlaps, the tiles in the call
descriptor), the tuned file's format key; the local GEMM's strided bias in every format and the
all-reduce's choice of algorithm by ``ONE_SHOT_MAX_BYTES``."""

from __future__ import annotations

import pytest
import torch

from kernels.testing import run_ranks
from tests.kernels.fused import format_cases

# Formats by name (kernels.format.OperandFormat.encode): every FP8 scaling mode and int8 scale layout.
FP8 = ("fp8:tensor", "fp8:row", "fp8:block")
INT8 = ("int8:per_tensor:0", "int8:per_channel:0:offset", "int8:per_group:16:offset")


@pytest.mark.parametrize("name", ("plain",) + FP8 + INT8)
def test_all_gather_every_format_gather_dim_and_weights(name):
    assert run_ranks(format_cases.all_gather_body, 2, name, timeout=600) == [2, 2]


@pytest.mark.parametrize("name", FP8 + INT8)
def test_reduce_scatter_every_format_scatter_dim(name):
    assert run_ranks(format_cases.reduce_scatter_body, 2, name, timeout=600) == [1, 1]


@pytest.mark.parametrize("name", ("int8:per_channel:0:offset", "int8:per_group:16:offset"))
def test_int8_all_reduce_one_and_two_shot(name):
    outs = run_ranks(format_cases.all_reduce_body, 2, name, timeout=600)
    for algorithm in ("one_shot", "two_shot"):
        assert torch.equal(outs[0][algorithm], outs[1][algorithm]), f"{name} {algorithm}: ranks differ"


@pytest.mark.parametrize("name", ("plain", "fp8:row", "int8:per_channel:0", "int8:per_group:16:offset"))
def test_local_gemm_honours_a_strided_bias(name):
    format_cases.local_gemm_strided_bias(name)


@pytest.mark.parametrize("world", [2, 3])
def test_int8_all_reduce_picks_one_or_two_shot_by_one_shot_max_bytes(world):
    """ "auto" runs one-shot while the partials fit ``ONE_SHOT_MAX_BYTES`` (at the limit too) and two-shot
    past it, through the public op on the fused backend; every rank chooses the same and the ranks'
    outputs agree bit for bit (W = 3: two-shot owners of 3 rows each)."""
    results = run_ranks(format_cases.int8_all_reduce_choice_body, world, timeout=600)
    for chosen, _ in results:
        assert chosen == ["one_shot", "one_shot", "two_shot", "two_shot"], chosen
    for _, outs in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs, results[0][1], strict=True)), "ranks differ"


@pytest.mark.one_triton  # W = 3 index arithmetic; the kernels rerun at W = 2 under Triton 3.6
@pytest.mark.parametrize("name", ("fp8:block", "int8:per_group:16:offset"))
def test_every_pattern_world3(name):
    assert run_ranks(format_cases.all_gather_body, 3, name, timeout=600) == [2] * 3
    assert run_ranks(format_cases.reduce_scatter_body, 3, name, timeout=600) == [1] * 3


def _fp8_entries(ops_and_n, config):
    from kernels.fused import tuned

    return [tuned.Entry(op, "float8_e4m3fn", 24, n, 20, config, format="fp8:row") for op, n in ops_and_n]


def test_fp8_all_gather_with_tiles_that_differ_by_rank(tmp_path):
    """FP8 tiles come from the tuned file too, looked up by each rank's n: a 32-row tile waits for both
    16-row chunks of a peer's shard (the FP8 kernel used to wait for the first one only)."""
    from kernels.fused import tuned
    from kernels.fused.gemm_configs import GemmConfig

    tall, short = GemmConfig(32, 32, 64, 1, 1, 2), GemmConfig(16, 16, 64, 1, 1, 1)
    entries = _fp8_entries([("all_gather_matmul", 16)], short) + _fp8_entries([("all_gather_matmul", 64)], tall)
    tuned.write(tmp_path / "cpu.yaml", entries, {"gpu": "test"})
    env = {tuned.ENV_TUNED_DIR: str(tmp_path)}
    assert run_ranks(format_cases.fp8_per_rank_tiles_body, 2, env=env) == [[16], [32]]
    errors = run_ranks(format_cases.fp8_withheld_chunk_body, 2, env={**env, "COC_TIMEOUT": "5"}, timeout=120)
    assert "rank 1 (group rank 1) waited more than COC_TIMEOUT=5 s for rank 0" in errors[1], errors[1]
    assert "to push its input shard" in errors[1], errors[1]


def test_fp8_ranks_with_other_tuned_tiles_raise_naming_the_tiles(tmp_path):
    """The FP8 reducing ops' tiles are in the call descriptor (they were not): ranks whose tuned files
    give other tiles are refused by name instead of counting other targets."""
    from kernels.fused import tuned
    from kernels.fused.gemm_configs import GemmConfig

    tall = GemmConfig(32, 32, 64, 1, 1, 2)
    entries = [
        tuned.Entry(op, "float8_e4m3fn", 4, 6, 8, tall, format="fp8:row")
        for op in ("matmul_reduce_scatter", "matmul_all_reduce")
    ]
    tuned.write(tmp_path / "cpu.yaml", entries, {"gpu": "test"})
    for messages in run_ranks(format_cases.fp8_tuned_tiles_body, 2, str(tmp_path), timeout=300):
        assert len(messages) == 4, messages
        for message in messages:
            assert "ranks disagree" in message and "tiles=16x16" in message and "tiles=32x32" in message, message
            assert "scaled_matmul_" in message and "same tuned file" in message, message


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
