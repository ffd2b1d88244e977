"""GEMM + all-reduce (kernels/ops/all_reduce.py) in every operand format on every backend, worlds 1-4 (fused: 1-2),
against the fp64 reference (tests/kernels/op_cases.py has the cases and their bounds), and on GPUs: the plain
format over NCCL, the chunked backend on one GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.testing import run_ranks
from tests.kernels import graph_cases, op_cases

PATTERN = "all_reduce"


@pytest.mark.parametrize(("backend", "world"), op_cases.GRID, ids=[f"{b}-W{w}" for b, w in op_cases.GRID])
def test_every_format_matches_the_reference(backend: str, world: int) -> None:
    per_rank = run_ranks(op_cases.pattern_body, world, PATTERN, backend, timeout=900)
    op_cases.check_pattern(PATTERN, per_rank, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", op_cases.SCRIPTED)
def test_plain_format_over_nccl(backend: str) -> None:
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("NCCL needs one GPU per rank; fewer than 2 GPUs")
    per_rank = run_ranks(op_cases.pattern_body, world, PATTERN, backend, ("plain",), "cuda", backend="nccl")
    op_cases.check_pattern(PATTERN, per_rank, backend, ("plain",))


@pytest.mark.gpu
def test_chunked_on_one_gpu_reads_each_piece_after_its_copy() -> None:
    op_cases.chunked_on_one_gpu(PATTERN)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", op_cases.SCRIPTED)
def test_fp8_and_int8_calls_replay_in_a_cuda_graph(backend: str) -> None:
    """Every FP8 mode and int8 layout on a scripted backend, captured and replayed (tests/kernels/graph_cases.py)."""
    graph_cases.check_scripted_capture(PATTERN, backend)
