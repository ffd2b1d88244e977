"""Fused FP8 ops compiled for the GPU on the CUDA-IPC heap (gpu-check runs these; skipped without CUDA).

W processes on the GPU(s) at hand, sharing one through CUDA IPC when only one exists (a correctness
check: the processes time-slice the SMs). Every op (all-gather + scaled GEMM with and without the
gathered output, scaled GEMM + reduce-scatter, + all-reduce one-shot, two-shot and auto) in each
scaling mode, against the fp64 product of the dequantized inputs within kernels.fp8.numerics'
promoted bound at Hopper's FP8 accumulator precision; the gathered payload and scales bit-exact;
the public ops with ``backend="fused"`` reach the kernels without a fallback warning.
"""

import pytest
import torch

from kernels.testing import run_ranks
from tests.kernels.fused import fp8_gpu_cases

# Block (the DeepSeek-V3 recipe) first: gpu-check's time budget may end the run early.
MODES = ("block", "row", "tensor")
PER_MODE = 2 * len(fp8_gpu_cases.OPS) + 3


def _needs_fp8_gpu() -> None:
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        pytest.skip(f"FP8 tensor cores need sm_89 or newer; this GPU is sm_{major}{minor}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_fused_fp8_ops_gpu(mode):
    _needs_fp8_gpu()
    assert run_ranks(fp8_gpu_cases.gpu_ops_body, 2, mode, device="cuda", timeout=240) == [PER_MODE] * 2


@pytest.mark.gpu
def test_fused_fp8_ops_gpu_world4_block():
    _needs_fp8_gpu()
    assert run_ranks(fp8_gpu_cases.gpu_ops_body, 4, "block", device="cuda", timeout=240) == [PER_MODE] * 4


def test_fused_fp8_gpu_body_runs_on_cpu():
    """The GPU body itself on CPU under the interpreter at one small shape (the odd tile of
    :func:`fp8_gpu_cases.shapes`), so a change of the kernels' entry points shows here without a GPU."""
    shape = [(13, 200, 20, False, torch.float32)]
    # device positionally: run_ranks's own device keyword picks the rank pool.
    done = run_ranks(fp8_gpu_cases.gpu_ops_body, 2, "row", "cpu", shape, timeout=600)
    assert done == [len(fp8_gpu_cases.OPS) + 3] * 2
