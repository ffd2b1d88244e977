"""Fused calls captured once and replayed many times (CUDA graphs; the interpreter stands in on CPU).

A replay reruns the captured launches with the arguments they had at capture. These tests fail if
any launch carries a per-call host value (an epoch, a cumulative counter target): a replay would
then wait for flags the previous call already raised and read a peer's stale data, or wait for a
value no peer will write again. Replays are interleaved with eager calls on the same heap, and
the heap is scrambled before each, so a stale read shows as a wrong result.

Rank bodies live in this module (the rank pools import them by reference).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from bench.gpu_check_cases import scramble
from tests import fused_cases
from tests.graph_replay import InterpretedGraph, new_graph
from tests.harness import run_ranks

OPS = ("ag", "ag_v2", "rs", "ar_one", "ar_two", "w8a16")


def _inputs(op: str, world: int, seed: int, dtype: torch.dtype, device: str
            ) -> tuple[list[torch.Tensor], list[Any], Optional[torch.Tensor], list[torch.Tensor]]:
    """Every rank's x, its weight operand (quantized for w8a16), the bias, and the weights the
    reference multiplies by. Weights and bias depend on the op only (fixed across replays, as a
    model's are); x on ``seed``."""
    m_local, k, n = 13, 24, 20
    _, ws, b = fused_cases.make_inputs("ar" if op == "w8a16" else op, world, m_local, k, n, True, 0, False, dtype,
                                       device)
    xs, _, _ = fused_cases.make_inputs("ar" if op == "w8a16" else op, world, m_local, k, n, True, 100 + seed, False,
                                       dtype, device)
    if op != "w8a16":
        return xs, ws, b, ws
    from kernels.quant import dequantize, quantize_weight

    quantized = [quantize_weight(w.float(), mode="per_channel") for w in ws]
    return xs, quantized, b, [dequantize(q, s).to(dtype) for q, s in quantized]


def _call(op: str, x: torch.Tensor, weight: Any, b: Optional[torch.Tensor], group: Any) -> Any:
    if op != "w8a16":
        return fused_cases.run_op(op, x, weight, b, group)
    from kernels.fused.gemm_ar_w8a16 import matmul_all_reduce_w8a16

    q, s = weight
    return matmul_all_reduce_w8a16(x, q, s, None, x.shape[1], b, group, True)


def _reference(op: str, xs: list[torch.Tensor], ws: list[torch.Tensor], b: Optional[torch.Tensor], rank: int
               ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    return fused_cases.reference("ar" if op == "w8a16" else op, xs, ws, b, rank)


def _snapshot(out: Any) -> Any:
    # A graph's outputs are overwritten by its next replay: compare a copy.
    return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def replay_body(rank: int, world: int, op: str, replays: int, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> int:
    """Warm up, capture one call, then ``replays`` replays on new inputs, each followed by an eager
    call on other inputs; every result against fp64 torch math. Returns the checks made."""
    import kernels

    # The heap is keyed by the indexed device ("cuda:0"), which scramble must name.
    dev = fused_cases.gpu_device() if device == "cuda" else torch.device(device)
    group = dist.new_group(list(range(world)))
    xs, weight, b, ref_ws = _inputs(op, world, 0, dtype, device)
    static_x = xs[rank].clone()
    # The group's first call creates its heap (collectives): never inside capture.
    fused_cases.assert_close(f"{op} warm-up", _call(op, static_x, weight[rank], b, group),
                             _reference(op, xs, ref_ws, b, rank), dtype)
    graph = new_graph(dev)
    with graph.capture():
        static_out = _call(op, static_x, weight[rank], b, group)
    checks = 1
    for i in range(1, replays + 1):
        xs, _, _, _ = _inputs(op, world, 2 * i, dtype, device)
        static_x.copy_(xs[rank])
        assert scramble(group, dev) > 0, "no heap to scramble"
        graph.replay()
        fused_cases.assert_close(f"{op} W={world} replay {i} rank={rank}", _snapshot(static_out),
                                 _reference(op, xs, ref_ws, b, rank), dtype)
        eager_xs, _, _, _ = _inputs(op, world, 2 * i + 1, dtype, device)
        assert scramble(group, dev) > 0, "no heap to scramble"
        fused_cases.assert_close(f"{op} W={world} eager after replay {i} rank={rank}",
                                 _call(op, eager_xs[rank], weight[rank], b, group),
                                 _reference(op, eager_xs, ref_ws, b, rank), dtype)
        checks += 2
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    kernels.check_errors(group)
    return checks


def capture_refusals_body(rank: int, world: int) -> list[str]:
    """Inside capture, a group's first call and a call that outgrows the heap raise, launching nothing."""
    messages = []
    group = dist.new_group(list(range(world)))
    xs, weight, b, _ = _inputs("rs", world, 0, torch.float32, "cpu")
    graph = InterpretedGraph()
    for label, x in (("first", xs[rank]), ("growth", torch.cat([xs[rank]] * 64))):
        with graph.capture():
            try:
                _call("rs", x, weight[rank], b, group)
            except RuntimeError as e:
                messages.append(f"{label}: {e}")
        assert not graph.launches, f"{label}: a refused call launched {len(graph.launches)} kernels"
        if label == "first":
            _call("rs", x, weight[rank], b, group)  # the warm-up the message asks for
    return messages


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("op", OPS)
def test_captured_call_replays_interleaved_with_eager(op: str, world: int) -> None:
    assert run_ranks(replay_body, world, op, 3, timeout=240) == [7] * world


def test_capture_refuses_first_call_and_growth() -> None:
    for messages in run_ranks(capture_refusals_body, 2, timeout=120):
        assert len(messages) == 2, messages
        assert "first: " in messages[0] and "first fused call" in messages[0] and "warm-up" in messages[0]
        assert "growth: " in messages[1] and "needs a heap of" in messages[1] and "warm-up" in messages[1]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_captured_call_replays_on_gpu(world: int) -> None:
    """Every op captured in a real CUDA graph and replayed 20 times, interleaved with eager calls,
    W processes sharing the GPU over gloo (the fused path needs no collective after the warm-up)."""
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    for op in OPS:
        assert fused_cases.run_gpu_ranks(replay_body, world, op, 20, torch.bfloat16, "cuda",
                                         timeout=300) == [41] * world, op
