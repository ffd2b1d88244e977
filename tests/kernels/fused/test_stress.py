"""Fused ops over many calls and with a missing peer: epochs, heap growth, bounded waits."""

import pytest
import torch

from kernels.testing import run_ranks
from tests.kernels.fused import cases as fused_cases

# The host protocol around the kernels test_ops.py checks under both Triton versions.
pytestmark = pytest.mark.one_triton

TIMEOUT_S = 2.0
# The raise must come at COC_TIMEOUT, not at the harness deadline; the slack is generous because the
# interpreted spin loop is slow on a loaded machine, and still far below the deadline.
SLACK_S = 30.0


def test_back_to_back_calls():
    # Four rounds of the six ops over all four shapes: every op follows every other op's epoch, and
    # the heap grows mid-run (back_to_back_body asserts it). World 2, a core per rank: the epochs and the
    # heap growth do not depend on the world size (the odd world's ops run in test_ops.py).
    assert run_ranks(fused_cases.back_to_back_body, 2, 24, timeout=240) == [24, 24]


@pytest.mark.parametrize("op", ["ag", "rs", "ar_two"])
def test_absent_peer_raises_within_timeout(op):
    results = run_ranks(fused_cases.absent_peer_body, 2, op, env={"COC_TIMEOUT": str(TIMEOUT_S)}, timeout=120)
    elapsed, message = results[0]
    assert results[1] is None
    assert TIMEOUT_S * 0.9 <= elapsed <= TIMEOUT_S + SLACK_S, elapsed
    assert "rank 1" in message and "rank 0" in message and "COC_TIMEOUT=2" in message, message


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["ag", "rs", "ar_two"])
def test_absent_peer_raises_within_timeout_gpu(op):
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    results = fused_cases.run_gpu_ranks(
        fused_cases.absent_peer_body,
        2,
        op,
        torch.float16,
        "cuda",
        TIMEOUT_S + 3,
        env={"COC_TIMEOUT": str(TIMEOUT_S)},
        timeout=120,
    )
    elapsed, message = results[0]
    assert TIMEOUT_S * 0.9 <= elapsed <= TIMEOUT_S + 5, elapsed
    assert "rank 1" in message and "COC_TIMEOUT=2" in message, message


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_fifty_back_to_back_calls_gpu(world):
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    assert (
        fused_cases.run_gpu_ranks(fused_cases.gpu_back_to_back_body, world, 50, torch.bfloat16, timeout=240)
        == [50] * world
    )


def test_gpu_spawner_reports_results_and_failures():
    # The GPU tests' process spawner works (and fails loudly) on any machine.
    assert fused_cases.run_gpu_ranks(fused_cases.spawn_probe_body, 2, -1, timeout=120) == [(0, 1, None), (1, 1, None)]
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        fused_cases.run_gpu_ranks(fused_cases.spawn_probe_body, 2, 1, timeout=120)


@pytest.mark.parametrize("op", ["rs", "ar_two"])
def test_call_after_a_failed_call_runs_normally(op):
    # Waiting for the abandoned call's signals would end in a COC_TIMEOUT error (a rank failure);
    # the timeout is long so that a slow, loaded machine cannot be mistaken for that.
    elapsed = run_ranks(fused_cases.failed_call_body, 2, op, env={"COC_TIMEOUT": "60"}, timeout=180)
    assert all(t < 60 for t in elapsed), elapsed


def test_late_increments_of_an_abandoned_call_do_not_leak_into_the_next():
    # A straggler's increments for a call this rank abandoned land after this rank began the
    # next call; with one counter bank they would satisfy its waits early (stale slots summed).
    assert run_ranks(fused_cases.interrupted_call_body, 2, 1.5, env={"COC_TIMEOUT": "10"}, timeout=120) == [None] * 2
