"""Fused calls captured once and replayed many times (CUDA graphs; the interpreter stands in on CPU).

A replay reruns the captured launches with the arguments they had at capture. These tests fail if
any launch carries a per-call host value (an epoch, a cumulative counter target): a replay would
then wait for flags the previous call already raised and read a peer's stale data, or wait for a
value no peer will write again. Replays are interleaved with eager calls on the same heap, and
the heap is scrambled before each, so a stale read shows as a wrong result.

Rank bodies live in this module (the rank pools import them by reference).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kernels.format import OperandFormat
from kernels.testing import fp8 as fp8_testing
from kernels.testing import run_ranks, scramble
from tests.kernels.fused import cases as fused_cases
from tests.kernels.fused.graph_replay import InterpretedGraph, new_graph

# (format, op) cases of the replay test (formats by kernels.format.OperandFormat.encode): every plain op;
# FP8 every op in row mode and the others once each; int8 per-channel weights under every pattern (``ar``:
# the all-reduce picks its algorithm). FP8 leaves ag_v2 out: its gathered payload and scale rows are
# unpacked by torch ops after the launches, which the CPU stand-in does not replay (a CUDA graph does).
CASES = (
    [("plain", op) for op in ("ag", "ag_v2", "rs", "ar_one", "ar_two")]
    + [("fp8:row", op) for op in ("ag", "rs", "ar_one", "ar_two")]
    + [("fp8:block", op) for op in ("ag", "rs", "ar_two")]
    + [("fp8:tensor", op) for op in ("ag", "rs", "ar_one")]
    + [
        (f"int8:{layout}", op)
        for layout in ("per_channel:0", "per_tensor:0", "per_group:8")
        for op in ("ag_v2", "rs", "ar")
    ]
)
Pair = tuple[torch.Tensor, Any]  # (x or weight payload, its scale or None)


def _to(device: str, pair: tuple[Any, ...]) -> Any:
    return tuple(None if t is None else t.to(device) for t in pair)


def _inputs(
    name: str, op: str, world: int, seed: int, dtype: torch.dtype, device: str
) -> tuple[list[Pair], list[Pair], torch.Tensor | None]:
    """Every rank's ``(x, x scale)`` and ``(weight, weight scale)`` in format ``name`` (scales None where the
    format has none), and the bias (``dtype``: x's, FP8's output dtype). Weights and bias depend on the case
    only (fixed across replays, as a model's are); x on ``seed``."""
    fmt = OperandFormat.decode(name)
    if fmt.kind == "fp8":

        def draw(s: int) -> Any:
            return fp8_testing.make_inputs(op, world, 5, 136, 20, mode=fmt.mode, bias=True, out_dtype=dtype, seed=s)

        (_, ws, b), (xs, _, _) = draw(0), draw(100 + seed)
        return [_to(device, x) for x in xs], [_to(device, w) for w in ws], _to(device, (b,))[0]
    m_local, k, n = 13, 24, 20
    _, ws, b = fused_cases.make_inputs(op, world, m_local, k, n, bias=True, seed=0, dtype=dtype, device=device)
    xs, _, _ = fused_cases.make_inputs(op, world, m_local, k, n, bias=True, seed=100 + seed, dtype=dtype, device=device)
    if fmt.kind == "int8":
        from kernels.quant import quantize_weight

        return [(x, None) for x in xs], [quantize_weight(w.float(), fmt.mode, fmt.group_size or None) for w in ws], b
    return [(x, None) for x in xs], [(w, None) for w in ws], b


def _call(name: str, op: str, x: Pair, weight: Pair, b: torch.Tensor | None, group: Any, dtype: torch.dtype) -> Any:
    """One fused call through the pattern modules' ``run`` (``dtype``: FP8's output dtype)."""
    fmt = OperandFormat.decode(name)
    out_dtype = dtype if fmt.kind == "fp8" else None
    return fused_cases.run_op(op, x[0], weight[0], b, group, fmt, x_scale=x[1], w_scale=weight[1], out_dtype=out_dtype)


def _check(
    what: str,
    name: str,
    op: str,
    got: Any,
    inputs: tuple[list[Pair], list[Pair], torch.Tensor | None],
    rank: int,
    dtype: torch.dtype,
) -> None:
    """``got`` against fp64 torch math on the dequantized operands: FP8 within kernels.fp8.numerics' bound
    (at Hopper's FP8 accumulator on a GPU), plain and int8 within kernels.testing's (int8 weights as
    ``dequantize`` gives them, rounded to x's dtype as the kernels round them)."""
    xs, ws, b = inputs
    fmt = OperandFormat.decode(name)
    if fmt.kind == "fp8":
        from kernels.fp8.numerics import HOPPER_FP8_ACCUMULATOR

        def cpu(pairs: list[Pair]) -> list[Any]:
            return [_to("cpu", p) for p in pairs]

        want, bound = fp8_testing.reference(
            op,
            cpu(xs),
            cpu(ws),
            None if b is None else b.cpu(),
            rank,
            mode=fmt.mode,
            out_dtype=dtype,
            u_acc=HOPPER_FP8_ACCUMULATOR if got.is_cuda else None,
        )
        fp8_testing.assert_close(what, got.cpu(), want, bound, dtype)
        return
    if fmt.kind == "int8":
        from kernels.quant import dequantize

        weights = [dequantize(q, s).to(dtype) for q, s in ws]
    else:
        weights = [w for w, _ in ws]
    fused_cases.assert_close(what, got, fused_cases.reference(op, [x for x, _ in xs], weights, b, rank), dtype)


def _snapshot(out: Any) -> Any:
    # A graph's outputs are overwritten by its next replay: compare a copy.
    return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def replay_body(
    rank: int,
    world: int,
    name: str,
    op: str,
    replays: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> int:
    """Warm up, capture one call of ``op`` in format ``name``, then ``replays`` replays on new inputs copied
    into the captured x (and x scale), each followed by an eager call on other inputs; every result
    against fp64 torch math. Returns the checks made."""
    import kernels

    # The heap is keyed by the indexed device ("cuda:0"), which scramble must name.
    dev = fused_cases.gpu_device() if device == "cuda" else torch.device(device)
    group = dist.new_group(list(range(world)))
    inputs = _inputs(name, op, world, 0, dtype, device)
    xs, ws, b = inputs
    static_x = _to(device, tuple(None if t is None else t.clone() for t in xs[rank]))
    # The group's first call creates its heap (collectives): never inside capture.
    _check(f"{name} {op} warm-up", name, op, _call(name, op, static_x, ws[rank], b, group, dtype), inputs, rank, dtype)
    graph = new_graph(dev)
    with graph.capture():
        static_out = _call(name, op, static_x, ws[rank], b, group, dtype)
    checks = 1
    for i in range(1, replays + 1):
        new_xs, _, _ = _inputs(name, op, world, 2 * i, dtype, device)
        # The weights stay those captured; only x and its scale change, in place.
        for static, new in zip(static_x, new_xs[rank], strict=True):
            if static is not None:
                static.copy_(new)
        assert scramble(group, dev) > 0, "no heap to scramble"
        graph.replay()
        what = f"{name} {op} W={world}"
        _check(f"{what} replay {i} rank={rank}", name, op, _snapshot(static_out), (new_xs, ws, b), rank, dtype)
        eager_xs, _, _ = _inputs(name, op, world, 2 * i + 1, dtype, device)
        assert scramble(group, dev) > 0, "no heap to scramble"
        eager = _call(name, op, eager_xs[rank], ws[rank], b, group, dtype)
        _check(f"{what} eager after replay {i} rank={rank}", name, op, eager, (eager_xs, ws, b), rank, dtype)
        checks += 2
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    kernels.check_errors(group)
    return checks


def _rs(x: torch.Tensor, weight: Pair, b: torch.Tensor | None, group: Any) -> torch.Tensor:
    """A plain reduce-scatter of x's rows (the capture bodies' call)."""
    return _call("plain", "rs", (x, None), weight, b, group, torch.float32)


def _plain_rs_inputs(world: int, seed: int) -> tuple[list[torch.Tensor], list[Pair], torch.Tensor | None]:
    xs, ws, b = _inputs("plain", "rs", world, seed, torch.float32, "cpu")
    return [x for x, _ in xs], ws, b


def capture_refusals_body(rank: int, world: int) -> list[str]:
    """Inside capture, a group's first call (through the public API, whose backend check is a
    collective, and through the fused op itself) and a call that outgrows the heap raise,
    launching nothing."""
    import kernels

    messages = []
    group = dist.new_group(list(range(world)))
    xs, weight, b = _plain_rs_inputs(world, 0)
    graph = InterpretedGraph()
    calls = (
        (
            "public first",
            xs[rank],
            lambda x: kernels.matmul_reduce_scatter(x, weight[rank][0], b, group=group, backend="fused"),
        ),
        ("first", xs[rank], lambda x: _rs(x, weight[rank], b, group)),
        ("growth", torch.cat([xs[rank]] * 64), lambda x: _rs(x, weight[rank], b, group)),
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


def _captured(group: Any, static_x: torch.Tensor, weight: Pair, b: torch.Tensor | None) -> tuple[InterpretedGraph, Any]:
    """A warm-up call on ``group``, then one call captured; ``(graph, its output)``."""
    _rs(static_x, weight, b, group)
    graph = InterpretedGraph()
    with graph.capture():
        out = _rs(static_x, weight, b, group)
    return graph, out


def heap_outlives_capture_body(rank: int, world: int) -> list[str]:
    """A heap a graph captured is kept mapped when an eager call grows the group's heap (the graph
    replays on it correctly) and after a failure on it (replays then skip their work: NaN, no
    hang); destroy_heap frees it. Failures as text."""
    import kernels
    from kernels.heap import destroy_heap, heaps_of, peek_heap

    failures = []
    dev = torch.device("cpu")
    xs, weight, b = _plain_rs_inputs(world, 0)
    static_x = xs[rank].clone()

    group = dist.new_group(list(range(world)))
    graph, static_out = _captured(group, static_x, weight[rank], b)
    captured = peek_heap(group, dev)
    _rs(torch.cat([xs[rank]] * 64), weight[rank], b, group)
    if peek_heap(group, dev) is captured or captured.closed or captured not in heaps_of(group):
        failures.append("growth did not retire the captured heap (replaced and kept mapped)")
    xs, _, _ = _plain_rs_inputs(world, 2)
    static_x.copy_(xs[rank])
    # Both ranks replay from here: the grown call above may keep one rank busy for long on a loaded machine, and a
    # replay's wait for its peer is bounded by COC_TIMEOUT (long in this part, short only where a wait must fail).
    dist.barrier(group)
    graph.replay()
    inputs = ([(x, None) for x in xs], weight, b)
    _check(f"replay after growth rank={rank}", "plain", "rs", _snapshot(static_out), inputs, rank, torch.float32)
    dist.barrier(group)
    destroy_heap(group)
    if not captured.closed or heaps_of(group):
        failures.append("destroy_heap left the retired heap mapped")

    # A failure on the captured heap: rank 0 replays while the peers make another call on it. Its wait must time
    # out, so the graph captures a short COC_TIMEOUT (read when the call is captured).
    os.environ["COC_TIMEOUT"] = "5"
    group = dist.new_group(list(range(world)))
    graph, static_out = _captured(group, static_x, weight[rank], b)
    captured = peek_heap(group, dev)
    try:
        if rank == 0:
            graph.replay()
            kernels.check_errors(group)
        else:
            _rs(static_x[:-world], weight[rank], b, group)
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
@pytest.mark.parametrize(("name", "op"), CASES)
def test_captured_call_replays_interleaved_with_eager(name: str, op: str) -> None:
    assert run_ranks(replay_body, 2, name, op, 3, timeout=240) == [7, 7]


def test_capture_refuses_first_call_and_growth() -> None:
    for messages in run_ranks(capture_refusals_body, 2, timeout=120):
        assert len(messages) == 3, messages
        for message, label in zip(messages, ("public first: ", "first: ", "growth: "), strict=False):
            assert message.startswith(label) and "warm-up" in message, message
        assert "first fused call" in messages[0] and "first fused call" in messages[1], messages
        assert "needs a heap of" in messages[2], messages


@pytest.mark.one_triton  # host-side heap retirement; the replayed kernels rerun under 3.6 in the cases above
def test_captured_heap_outlives_growth_and_failure() -> None:
    assert run_ranks(heap_outlives_capture_body, 2, env={"COC_TIMEOUT": "120"}, timeout=400) == [[], []]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_captured_call_replays_on_gpu(world: int) -> None:
    """Every case captured in a real CUDA graph and replayed 20 times, interleaved with eager calls,
    W processes sharing the GPU over gloo (the fused path needs no collective after the warm-up); bf16
    x (FP8: bf16 output)."""
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    for name, op in CASES:
        got = fused_cases.run_gpu_ranks(replay_body, world, name, op, 20, torch.bfloat16, "cuda", timeout=300)
        assert got == [41] * world, (name, op)
