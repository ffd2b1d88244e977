"""The CUDA-IPC heap on processes sharing one GPU: teardown frees every mapping and byte, and a peer
whose process ends makes the next call fail by name within COC_TIMEOUT (gpu-check ran these itself
before; they are tests now)."""

import pytest

from kernels.testing import run_ranks
from tests.kernels.fused import cases as fused_cases

TIMEOUT_S = 3.0


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_destroy_heap_frees_mappings_and_device_memory(world):
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    results = run_ranks(fused_cases.gpu_teardown_body, world, device="cuda", timeout=240)
    assert results[0].startswith("freed") and results[1:] == [""] * (world - 1), results


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["ag", "rs", "ar_two"])
def test_peer_process_exit_fails_the_next_call_by_name(op):
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    results = run_ranks(fused_cases.departed_peer_body, 3, op, TIMEOUT_S, device="cuda", allow_dead=True, timeout=240)
    elapsed, message = results[0]
    assert results[1:] == [None, None]
    assert TIMEOUT_S * 0.9 <= elapsed <= TIMEOUT_S + 5, elapsed
    assert "rank 1" in message and "COC_TIMEOUT" in message, message
