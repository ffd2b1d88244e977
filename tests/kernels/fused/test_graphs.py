"""Fused calls captured once and replayed many times (CUDA graphs; the interpreter stands in on CPU).

A replay reruns the captured launches with the arguments they had at capture. These tests fail if
any launch carries a per-call host value (an epoch, a cumulative counter target): a replay would
then wait for flags the previous call already raised and read a peer's stale data, or wait for a
value no peer will write again. Replays are interleaved with eager calls on the same heap, and
the heap is scrambled before each, so a stale read shows as a wrong result.

Rank bodies live in this module (the rank pools import them by reference).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from kernels.testing import run_ranks, scramble
from tests.kernels.fused import cases as fused_cases
from tests.kernels.fused.graph_replay import InterpretedGraph, new_graph

OPS = ("ag", "ag_v2", "rs", "ar_one", "ar_two", "w8a16")


def _inputs(
    op: str, world: int, seed: int, dtype: torch.dtype, device: str
) -> tuple[list[torch.Tensor], list[Any], torch.Tensor | None, list[torch.Tensor]]:
    """Every rank's x, its weight operand (quantized for w8a16), the bias, and the weights the
    reference multiplies by. Weights and bias depend on the op only (fixed across replays, as a
    model's are); x on ``seed``."""
    m_local, k, n = 13, 24, 20
    _, ws, b = fused_cases.make_inputs(
        "ar" if op == "w8a16" else op, world, m_local, k, n, bias=True, seed=0, dtype=dtype, device=device
    )
    xs, _, _ = fused_cases.make_inputs(
        "ar" if op == "w8a16" else op, world, m_local, k, n, bias=True, seed=100 + seed, dtype=dtype, device=device
    )
    if op != "w8a16":
        return xs, ws, b, ws
    from kernels.quant import dequantize, quantize_weight

    quantized = [quantize_weight(w.float(), mode="per_channel") for w in ws]
    return xs, quantized, b, [dequantize(q, s).to(dtype) for q, s in quantized]


def _call(op: str, x: torch.Tensor, weight: Any, b: torch.Tensor | None, group: Any) -> Any:
    if op != "w8a16":
        return fused_cases.run_op(op, x, weight, b, group)
    from kernels.fused.gemm_ar_w8a16 import matmul_all_reduce_w8a16

    q, s = weight
    return matmul_all_reduce_w8a16(x, q, s, None, x.shape[1], b, group, deterministic=True)


def _reference(
    op: str, xs: list[torch.Tensor], ws: list[torch.Tensor], b: torch.Tensor | None, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return fused_cases.reference("ar" if op == "w8a16" else op, xs, ws, b, rank)


def _snapshot(out: Any) -> Any:
    # A graph's outputs are overwritten by its next replay: compare a copy.
    return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def replay_body(
    rank: int, world: int, op: str, replays: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> int:
    """Warm up, capture one call, then ``replays`` replays on new inputs, each followed by an eager
    call on other inputs; every result against fp64 torch math. Returns the checks made."""
    import kernels

    # The heap is keyed by the indexed device ("cuda:0"), which scramble must name.
    dev = fused_cases.gpu_device() if device == "cuda" else torch.device(device)
    group = dist.new_group(list(range(world)))
    xs, weight, b, ref_ws = _inputs(op, world, 0, dtype, device)
    static_x = xs[rank].clone()
    # The group's first call creates its heap (collectives): never inside capture.
    fused_cases.assert_close(
        f"{op} warm-up", _call(op, static_x, weight[rank], b, group), _reference(op, xs, ref_ws, b, rank), dtype
    )
    graph = new_graph(dev)
    with graph.capture():
        static_out = _call(op, static_x, weight[rank], b, group)
    checks = 1
    for i in range(1, replays + 1):
        xs, _, _, _ = _inputs(op, world, 2 * i, dtype, device)
        static_x.copy_(xs[rank])
        assert scramble(group, dev) > 0, "no heap to scramble"
        graph.replay()
        fused_cases.assert_close(
            f"{op} W={world} replay {i} rank={rank}", _snapshot(static_out), _reference(op, xs, ref_ws, b, rank), dtype
        )
        eager_xs, _, _, _ = _inputs(op, world, 2 * i + 1, dtype, device)
        assert scramble(group, dev) > 0, "no heap to scramble"
        fused_cases.assert_close(
            f"{op} W={world} eager after replay {i} rank={rank}",
            _call(op, eager_xs[rank], weight[rank], b, group),
            _reference(op, eager_xs, ref_ws, b, rank),
            dtype,
        )
        checks += 2
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    kernels.check_errors(group)
    return checks


def capture_refusals_body(rank: int, world: int) -> list[str]:
    """Inside capture, a group's first call (through the public API, whose backend check is a
    collective, and through the fused op itself) and a call that outgrows the heap raise,
    launching nothing."""
    import kernels

    messages = []
    group = dist.new_group(list(range(world)))
    xs, weight, b, _ = _inputs("rs", world, 0, torch.float32, "cpu")
    graph = InterpretedGraph()
    calls = (
        (
            "public first",
            xs[rank],
            lambda x: kernels.matmul_reduce_scatter(x, weight[rank], b, group=group, backend="fused"),
        ),
        ("first", xs[rank], lambda x: _call("rs", x, weight[rank], b, group)),
        ("growth", torch.cat([xs[rank]] * 64), lambda x: _call("rs", x, weight[rank], b, group)),
    )
    for label, x, call in calls:
        with graph.capture():
            try:
                call(x)
            except RuntimeError as e:
                messages.append(f"{label}: {e}")
        assert not graph.launches, f"{label}: a refused call launched {len(graph.launches)} kernels"
        if label == "first":
            call(x)  # the warm-up the message asks for
    return messages


def _captured(group: Any, static_x: torch.Tensor, weight: Any, b: torch.Tensor | None) -> tuple[InterpretedGraph, Any]:
    """A warm-up call on ``group``, then one call captured; ``(graph, its output)``."""
    _call("rs", static_x, weight, b, group)
    graph = InterpretedGraph()
    with graph.capture():
        out = _call("rs", static_x, weight, b, group)
    return graph, out


def heap_outlives_capture_body(rank: int, world: int) -> list[str]:
    """A heap a graph captured is kept mapped when an eager call grows the group's heap (the graph
    replays on it correctly) and after a failure on it (replays then skip their work: NaN, no
    hang); destroy_heap frees it. Failures as text."""
    import kernels
    from kernels.heap import destroy_heap, heaps_of, peek_heap

    failures = []
    dev = torch.device("cpu")
    xs, weight, b, ref_ws = _inputs("rs", world, 0, torch.float32, "cpu")
    static_x = xs[rank].clone()

    group = dist.new_group(list(range(world)))
    graph, static_out = _captured(group, static_x, weight[rank], b)
    captured = peek_heap(group, dev)
    _call("rs", torch.cat([xs[rank]] * 64), weight[rank], b, group)
    if peek_heap(group, dev) is captured or captured.closed or captured not in heaps_of(group):
        failures.append("growth did not retire the captured heap (replaced and kept mapped)")
    xs, _, _, _ = _inputs("rs", world, 2, torch.float32, "cpu")
    static_x.copy_(xs[rank])
    graph.replay()
    fused_cases.assert_close(
        f"replay after growth rank={rank}", _snapshot(static_out), _reference("rs", xs, ref_ws, b, rank), torch.float32
    )
    dist.barrier(group)
    destroy_heap(group)
    if not captured.closed or heaps_of(group):
        failures.append("destroy_heap left the retired heap mapped")

    # A failure on the captured heap: rank 0 replays while the peers make another call on it.
    group = dist.new_group(list(range(world)))
    graph, static_out = _captured(group, static_x, weight[rank], b)
    captured = peek_heap(group, dev)
    try:
        if rank == 0:
            graph.replay()
            kernels.check_errors(group)
        else:
            _call("rs", static_x[:-world], weight[rank], b, group)
        failures.append("ranks making different calls did not raise")
    except RuntimeError as e:
        if "disagree" not in str(e):
            failures.append(f"unexpected error: {e}")
    if captured.closed or captured not in heaps_of(group):
        failures.append("a failure freed the captured heap")
    graph.replay()
    if not bool(torch.isnan(static_out).all()):
        failures.append("a replay after the failure returned numbers, not NaN")
    dist.barrier(group)
    destroy_heap(group)
    return failures


# Capture and replay reuse one call's heap slots and epochs whatever the world size; world 3's
# index arithmetic is tests/kernels/fused/test_ops.py's.
@pytest.mark.parametrize("op", OPS)
def test_captured_call_replays_interleaved_with_eager(op: str) -> None:
    assert run_ranks(replay_body, 2, op, 3, timeout=240) == [7, 7]


def test_capture_refuses_first_call_and_growth() -> None:
    for messages in run_ranks(capture_refusals_body, 2, timeout=120):
        assert len(messages) == 3, messages
        for message, label in zip(messages, ("public first: ", "first: ", "growth: "), strict=False):
            assert message.startswith(label) and "warm-up" in message, message
        assert "first fused call" in messages[0] and "first fused call" in messages[1], messages
        assert "needs a heap of" in messages[2], messages


@pytest.mark.one_triton  # host-side heap retirement; the replayed kernels rerun under 3.6 in the cases above
def test_captured_heap_outlives_growth_and_failure() -> None:
    assert run_ranks(heap_outlives_capture_body, 2, env={"COC_TIMEOUT": "5"}, timeout=120) == [[], []]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_captured_call_replays_on_gpu(world: int) -> None:
    """Every op captured in a real CUDA graph and replayed 20 times, interleaved with eager calls,
    W processes sharing the GPU over gloo (the fused path needs no collective after the warm-up)."""
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    for op in OPS:
        assert (
            fused_cases.run_gpu_ranks(replay_body, world, op, 20, torch.bfloat16, "cuda", timeout=300) == [41] * world
        ), op
