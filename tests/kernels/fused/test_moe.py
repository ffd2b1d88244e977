"""The fused backend of the tensor-parallel MoE ops (kernels/fused/moe.py), interpreted over the shared-memory heap:
both ops and their chain against fp64 at W = 1, 2, 3 (4 for two cases), the routing bit for bit, the fused reduce
bitwise repeatable, the autograd chain at W = 2, the reducing op replayed as a captured graph, and ranks that
disagree refused by the heap's call check.

Bounds: :mod:`tests.kernels.test_moe_tp`'s (its docstring derives them). They hold for the fused path unchanged: the
gather copies rows bit for bit and its grouped GEMM is the chunked backend's kernel (fp32 accumulation of k
products, one rounding); the reduce's partials are that kernel's fp32 sums of n_local products (``2 (n_local + 1)
g``), the combine one fp32 product-add per slot in slot order (``topk + 1`` roundings) and the slots' sum W - 1
fp32 additions in rank order, rounded once to the dtype (``eps``, a whole ulp: twice a rounding to nearest's).
Cases: "skewed" (70 % of the pairs to one expert, two experts without tokens), "top1", "even" and "single" (every
pair to expert 1, three experts empty, m_local = 7); the shapes are not tile multiples (k_out = 10, n_local =
12 / W, rows 7 W topk against 16-row GEMM and 8-row push tiles).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import kernels
from kernels.heap import peek_heap
from kernels.testing import run_ranks, scramble
from tests.kernels.fused.graph_replay import InterpretedGraph
from tests.kernels.test_moe_tp import CASES, DTYPES, _check, _inputs, _ranks_body, _shard

FUSED_CASES = ("skewed", "top1", "even", "single")


def _fused_calls() -> int:
    """How many fused calls the default group's heap has opened (0 before its first)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    heap = peek_heap(dist.group.WORLD, torch.device("cpu"))
    return 0 if heap is None else heap.calls


def _fused_body(rank: int, world: int, runs: list[tuple[str, str, str, int]]) -> tuple[list, int]:
    """The shared rank body on the fused runs, and how many fused calls it opened (3 per run at W > 1: no run
    fell back to the chunked path)."""
    before = _fused_calls()
    outs = _ranks_body(rank, world, runs)
    return outs, _fused_calls() - before


def _runs(dtypes: tuple[str, ...], cases: tuple[str, ...]) -> list[tuple[str, str, str, int]]:
    return [("fused", d, c, 1) for d in dtypes for c in cases]


def _check_all(world: int, runs: list, per_rank: list) -> None:
    worst: dict[str, float] = {}
    for rank, (outs, calls) in enumerate(per_rank):
        assert calls == (3 * len(runs) if world > 1 else 0), (rank, calls)
        for run, got in zip(runs, outs, strict=True):
            for key, value in _check(world, rank, run, got).items():
                worst[f"{run[1]} {key}"] = max(worst.get(f"{run[1]} {key}", 0.0), value)
    print(f"fused W={world} worst |error| / magnitude: {worst}")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fused_both_ops_and_their_chain_match_fp64(world: int) -> None:
    runs = _runs(tuple(DTYPES), FUSED_CASES)
    _check_all(world, runs, run_ranks(_fused_body, world, runs, timeout=300))


def test_fused_four_ranks_uneven_routing() -> None:
    runs = _runs(("bfloat16",), ("skewed", "single"))
    _check_all(4, runs, run_ranks(_fused_body, 4, runs, timeout=300))


def _repeat_body(rank: int, world: int) -> list[bool]:
    """The chain twice, fused, then once sequential: whether each output of the second call has the bits of the
    first (routing, y, the reduce) and whether the fused reduce of the sequential op's y has the bits of the first."""
    m_local = CASES["skewed"][0]
    inp = _inputs(world, "skewed", torch.float32)
    own, cols = slice(rank * m_local, (rank + 1) * m_local), _shard(world, rank)
    w1, w2 = inp["w1"][:, cols].contiguous(), inp["w2"][:, :, cols].contiguous()
    results = []
    with torch.no_grad():
        for _ in range(2):
            y, routing = kernels.all_gather_grouped_matmul(inp["x"][own], inp["ids"][own], w1, backend="fused")
            out = kernels.grouped_matmul_reduce_scatter(F.silu(y), w2, routing, inp["tw"], backend="fused")
            results.append((y, tuple(routing), out))
        y_seq, routing_seq = kernels.all_gather_grouped_matmul(inp["x"][own], inp["ids"][own], w1, backend="sequential")
    (y0, r0, o0), (y1, r1, o1) = results
    same_routing = all(torch.equal(a, b) for a, b in zip(r0 + r1, r1 + tuple(routing_seq), strict=True))
    return [torch.equal(y0, y1), same_routing, torch.equal(o0, o1), bool(torch.isfinite(o1).all())]


@pytest.mark.parametrize("world", [2, 3])
def test_fused_reduce_is_bitwise_repeatable(world: int) -> None:
    for rank, flags in enumerate(run_ranks(_repeat_body, world, timeout=300)):
        assert all(flags), (rank, flags)


def test_fused_gradients_match_one_process_dense_moe() -> None:
    """The autograd chain on the fused backend (forward fused; the backward's reduce-scatter of dx fused too)."""
    from tests.kernels.test_moe_tp_grad import TOL, _dense, _rank_grads

    runs = [("fused", "skewed", 1), ("fused", "top1", 1)]
    for rank, per_run in enumerate(run_ranks(_rank_grads, 2, runs, timeout=300)):
        for (_, case, _), got in zip(runs, per_run, strict=True):
            ref = _dense(2, case)
            m_local = CASES[case][0]
            own, cols = slice(rank * m_local, (rank + 1) * m_local), _shard(2, rank)
            want = {"out": ref["out"][own], "x": ref["x"][own], "w1": ref["w1"][:, cols]}
            want.update({"w2": ref["w2"][:, :, cols], "tw": ref["tw"]})
            for key, value in want.items():
                err = (got[key].double() - value).abs().max().item()
                assert err < TOL, (f"rank={rank} {case} {key}", err)


def _mismatch_body(rank: int, world: int, op: str) -> str:
    """On a fresh group (its heap made by a first, matching call), rank 1 passes topk = 1 instead of 2: the
    admission refuses it by name on every rank before any kernel runs."""
    group = dist.new_group(list(range(world)))
    inp = _inputs(world, "even", torch.float32)
    own = slice(rank * 4, rank * 4 + 4)
    w1, w2 = inp["w1"][:, :6].contiguous(), inp["w2"][:, :, :6].contiguous()
    opts = {"backend": "fused", "group": group}
    with torch.no_grad():
        y, routing = kernels.all_gather_grouped_matmul(inp["x"][own], inp["ids"][own], w1, **opts)
        kernels.grouped_matmul_reduce_scatter(y, w2, routing, inp["tw"], **opts)
        ids, tw = inp["ids"], inp["tw"]
        if rank == 1:
            ids, tw = ids[:, :1].contiguous(), tw[:, :1].contiguous()
        try:
            if op == "gather":
                kernels.all_gather_grouped_matmul(inp["x"][own], ids[own], w1, **opts)
            else:
                y1 = y if rank != 1 else y.view(-1, 2, y.shape[1])[:, 0].contiguous()
                h, r = (y, routing) if rank != 1 else (y1, _routing_of(ids, 4))
                kernels.grouped_matmul_reduce_scatter(h, w2, r, tw, **opts)
        except RuntimeError as e:
            return str(e)
    return "no error"


def _routing_of(ids: torch.Tensor, num_experts: int) -> kernels.MoeRouting:
    from kernels.ops.moe.routing import route

    return route(ids.long(), num_experts)


@pytest.mark.parametrize("op", ["gather", "reduce_scatter"])
def test_fused_ranks_that_disagree_on_topk_are_refused_by_name(op: str) -> None:
    for text in run_ranks(_mismatch_body, 2, op, timeout=120, env={"COC_CHECK": None}):
        assert re.search(r"^grouped_matmul_reduce_scatter|^all_gather_grouped_matmul", text), text
        assert "ranks disagree: rank 0 has " in text and "before any communication of the op" in text, text
        if op == "gather":
            assert "rank 0 has topk=2, rank 1 has topk=1" in text, text
        else:  # h holds rank 1's rows of its one slot: the rows already differ
            assert "rank 0 has h.shape[0] (rows)=16, rank 1 has h.shape[0] (rows)=8" in text, text


def _graph_body(rank: int, world: int) -> list[str]:
    """The fused reducing op captured once (:class:`InterpretedGraph`: its launches recorded, then rerun as they
    were) and replayed on new h copied in place, the heap scrambled before each replay and each eager call after
    it: every replay must give the eager call's bits on the same h (no per-call host value in the launches, no
    stale heap read). The gather op is not replayed: its routing runs torch ops between its launches, which this
    stand-in cannot replay (a GPU graph would)."""
    group = dist.new_group(list(range(world)))
    m_local = CASES["skewed"][0]
    inp = _inputs(world, "skewed", torch.float32)
    own, cols = slice(rank * m_local, (rank + 1) * m_local), _shard(world, rank)
    w1, w2 = inp["w1"][:, cols].contiguous(), inp["w2"][:, :, cols].contiguous()
    opts = {"backend": "fused", "group": group}
    problems = []
    with torch.no_grad():
        y, routing = kernels.all_gather_grouped_matmul(inp["x"][own], inp["ids"][own], w1, **opts)
        static_h = y.clone()
        kernels.grouped_matmul_reduce_scatter(static_h, w2, routing, inp["tw"], **opts)  # warm-up: the heap exists
        graph = InterpretedGraph()
        with graph.capture():
            static_out = kernels.grouped_matmul_reduce_scatter(static_h, w2, routing, inp["tw"], **opts)
        for i in range(1, 4):
            new_h = torch.randn(y.shape, generator=torch.Generator().manual_seed(10 * i + rank))
            static_h.copy_(new_h)
            scramble(group, "cpu")
            graph.replay()
            replayed = static_out.clone()
            scramble(group, "cpu")
            eager = kernels.grouped_matmul_reduce_scatter(new_h, w2, routing, inp["tw"], **opts)
            if not torch.equal(replayed, eager):
                problems.append(f"replay {i}: {(replayed - eager).abs().max().item()} from the eager call")
    kernels.check_errors(group)
    return problems


def test_fused_reduce_replays_as_a_captured_graph() -> None:
    for rank, problems in enumerate(run_ranks(_graph_body, 2, timeout=300)):
        assert not problems, (rank, problems)


def _gpu_body(rank: int, world: int, runs: list[tuple[str, str, str, int]]) -> list:
    """:func:`tests.kernels.test_moe_tp._ranks_body` with every tensor on this rank's GPU (compiled kernels, the
    CUDA IPC heap), the results brought back to the CPU for the same checks."""
    from tests.kernels.fused.cases import gpu_device

    dev = gpu_device()
    out = []
    for backend, dtype_name, case, parallel_num in runs:
        inp = {key: t.to(dev) for key, t in _inputs(world, case, DTYPES[dtype_name][0]).items()}
        m_local = CASES[case][0]
        own, cols = slice(rank * m_local, (rank + 1) * m_local), _shard(world, rank)
        opts = {"backend": backend, "parallel_num": parallel_num}
        w1, w2 = inp["w1"][:, cols].contiguous(), inp["w2"][:, :, cols].contiguous()
        with torch.no_grad():
            y, routing = kernels.all_gather_grouped_matmul(inp["x"][own], inp["ids"][own], w1, **opts)
            alone = kernels.grouped_matmul_reduce_scatter(inp["h"][:, cols], w2, routing, inp["tw"], **opts)
            chained = kernels.grouped_matmul_reduce_scatter(F.silu(y), w2, routing, inp["tw"], **opts)
        torch.cuda.synchronize(dev)
        kernels.check_errors()
        out.append(
            tuple(
                t.cpu() if isinstance(t, torch.Tensor) else tuple(r.cpu() for r in t)
                for t in (y, tuple(routing), alone, chained)
            )
        )
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_fused_on_gpu_matches_fp64(world: int) -> None:
    """The fused cases on one GPU shared by W processes (gloo between them, the CUDA IPC heap), bf16 and fp32,
    against the same fp64 bounds."""
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    from tests.kernels.fused.cases import run_gpu_ranks

    runs = _runs(tuple(DTYPES), FUSED_CASES)
    for rank, outs in enumerate(run_gpu_ranks(_gpu_body, world, runs, timeout=300)):
        for run, got in zip(runs, outs, strict=True):
            _check(world, rank, run, got)
