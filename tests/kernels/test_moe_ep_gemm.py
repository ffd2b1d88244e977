"""Dispatch fused with the first expert GEMM (kernels/ops/moe_ep_gemm.py): every backend against the two-call
sequence ``rows, handle = moe_dispatch(...); y = grouped_matmul(rows, weight, handle.expert_offsets)``.

Bitwise: the grouped GEMM here is the Triton kernel under the interpreter, whose tiles do not depend on the call's
row count, so each row's result depends only on the row and its expert's weight: the chunked backend's per-piece
GEMMs give the whole call's bits (``torch.equal``), exact and bounded, parallel_num 2 and 4, W = 2 and 3. Routing is
uneven (expert 1 takes every token's first slot, the last expert none) and rank 1 has no tokens. Shapes are not
tile multiples (k = 20, n = 6 against 16-wide tiles). fp32 on every backend, bf16 chunked (the reference twin, a
per-expert ``torch.mm``, within 1e-2: not the kernel's bits).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kernels
from kernels.ops.moe.layout import EpCall
from kernels.testing import outcomes, run_ranks

M, K, N, TOPK = 5, 20, 6, 2
CAP = 40  # max_tokens of the bounded runs: above every rank's receive count here
EMPTY_RANK = 1  # holds no tokens


def _inputs(world: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    num_e = 2 * world
    g = torch.Generator().manual_seed(11 + world)
    tokens = M * world
    ids = torch.randint(0, num_e - 1, (tokens, TOPK), generator=g)  # the last expert never chosen
    ids[:, 0] = 1
    ids[:, 1] = torch.where(ids[:, 1] == 1, 0, ids[:, 1])  # no token picks expert 1 twice
    return {
        "x": torch.randn(tokens, K, generator=g).to(dtype),
        "ids": ids,
        "tw": torch.rand(tokens, TOPK, generator=g),
        "w": (torch.randn(num_e, N, K, generator=g) / K**0.5).to(dtype),
        "E": num_e,
    }


def _own(inp: dict[str, Any], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    rows = slice(0, 0) if rank == EMPTY_RANK else slice(rank * M, (rank + 1) * M)
    e_l = inp["E"] // world
    return inp["x"][rows], inp["ids"][rows], inp["tw"][rows], inp["w"][rank * e_l : (rank + 1) * e_l]


def _handle_equal(a: kernels.MoeDispatchHandle, b: kernels.MoeDispatchHandle) -> bool:
    return all(torch.equal(s, t) for s, t in zip(a[:-2], b[:-2], strict=True))


def _backends_body(rank: int, world: int, runs: list[tuple[str, str, int | None]]) -> list[str]:
    errors = []
    for dtype_name in dict.fromkeys(d for d, _, _ in runs):
        inp = _inputs(world, getattr(torch, dtype_name))
        x, ids, tw, w = _own(inp, rank, world)
        for cap in (None, CAP):
            rows, want_h = kernels.moe_dispatch(x, ids, tw, inp["E"], max_tokens=cap, backend="sequential")
            want = kernels.grouped_matmul(rows, w, want_h.expert_offsets)
            ref, ref_h = kernels.moe_dispatch_grouped_matmul(
                x, ids, tw, inp["E"], w, max_tokens=cap, backend="sequential"
            )
            tag = f"W={world} rank={rank} {dtype_name} cap={cap}"
            if not torch.allclose(ref, want, rtol=1e-2, atol=1e-2) or not _handle_equal(ref_h, want_h):
                errors.append(f"{tag} reference")
            for _, backend, num in (r for r in runs if r[0] == dtype_name):
                opts = {"backend": backend, "parallel_num": num, "max_tokens": cap}
                y, h = kernels.moe_dispatch_grouped_matmul(x, ids, tw, inp["E"], w, **opts)
                if y.shape != want.shape or not torch.equal(y, want) or not _handle_equal(h, want_h):
                    errors.append(f"{tag} {backend} parallel_num={num}: y differs from the two-call sequence")
                if EpCall.decode(h.call).backend != backend:
                    errors.append(f"{tag} {backend} ran {h.call}")
            # The combine takes the handle as it takes moe_dispatch's.
            if not torch.equal(kernels.moe_combine(y, h), kernels.moe_combine(want, want_h)):
                errors.append(f"{tag} combine")
    return errors


W2_RUNS = [("float32", b, n) for b, n in (("sequential", None), ("chunked", 2), ("chunked", 4), ("fused", None))]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_backend_gives_the_two_call_bits(world: int) -> None:
    """W = 1 and 2: every backend (fused: a fused dispatch then the grouped GEMM) in fp32, chunked in bf16 at W = 2;
    W = 3: chunked in 4 pieces (pieces of 0 and 1 rows of some blocks); W = 4: every backend, chunked in 2. Exact
    and bounded; y, the handle and the combine bitwise."""
    runs = {
        1: W2_RUNS,
        2: [*W2_RUNS, ("bfloat16", "chunked", 4)],
        3: [("float32", "chunked", 4)],
        4: [r for r in W2_RUNS if r[2] != 4],
    }[world]
    for rank, errors in enumerate(run_ranks(_backends_body, world, runs, timeout=240)):
        assert errors == [], (rank, errors)


def _grad_body(rank: int, world: int, cap: int | None) -> dict[str, torch.Tensor]:
    inp = _inputs(world)
    x, ids, tw, w = _own(inp, rank, world)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, h = kernels.moe_dispatch_grouped_matmul(
        x, ids, tw, inp["E"], w, max_tokens=cap, backend="chunked", parallel_num=2
    )
    (kernels.moe_combine(y, h) * torch.linspace(-1, 1, N)).sum().backward()
    return {"x": x.grad, "w": w.grad}


def test_autograd_matches_a_dense_moe() -> None:
    """d x (grouped GEMM on the transposed weights, then the dispatch's dgrad) and d weight (per expert) through
    the combine, against torch.autograd of a one-process dense MoE, fp32, exact and bounded, W = 2."""
    world = 2
    inp = _inputs(world)
    keep = torch.ones(M * world, 1)
    keep[EMPTY_RANK * M : (EMPTY_RANK + 1) * M] = 0  # the empty rank's tokens are not in the layer
    x, w = inp["x"].clone().requires_grad_(), inp["w"].clone().requires_grad_()
    dense = sum(inp["tw"][:, s : s + 1] * torch.einsum("tnk,tk->tn", w[inp["ids"][:, s]], x) for s in range(TOPK))
    (keep * dense * torch.linspace(-1, 1, N)).sum().backward()
    e_l = inp["E"] // world
    for cap in (None, CAP):
        for rank, grads in enumerate(run_ranks(_grad_body, world, cap, timeout=120)):
            own = slice(0, 0) if rank == EMPTY_RANK else slice(rank * M, (rank + 1) * M)
            torch.testing.assert_close(grads["x"], x.grad[own], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grads["w"], w.grad[rank * e_l : (rank + 1) * e_l], rtol=1e-5, atol=1e-6)


def _errors_body(rank: int, world: int) -> list[str]:
    x, ids, tw = torch.randn(3, K), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    w = torch.randn(2, N, K)
    calls = [
        lambda: kernels.moe_dispatch_grouped_matmul(x, ids, tw, 4, w[:1] if rank == 1 else w),  # E_local on rank 1
        lambda: kernels.moe_dispatch_grouped_matmul(x, ids, tw, 4, w[:, :, 1:]),  # k
        lambda: kernels.moe_dispatch_grouped_matmul(x, ids, tw, 4, w.double()),
        lambda: kernels.moe_dispatch_grouped_matmul((x.to(torch.float8_e4m3fn), torch.ones(3, 1)), ids, tw, 4, w),
        lambda: kernels.moe_dispatch_grouped_matmul(x, ids, tw, 4 + 2 * rank, torch.randn(2 + rank, N, K)),
    ]
    seen = outcomes(calls)
    return seen


def test_named_errors_before_any_communication() -> None:
    expected = [
        r"ValueError: moe_dispatch_grouped_matmul: rank 1 refused its arguments: weight shape \(1, 6, 20\) does not "
        r"fit: it must be \[E_local, n, k\] with E_local = num_experts / W = 4 / 2 = 2",
        r"ValueError: .*k mismatch: x has k=20 .* but weight has k=19",
        r"TypeError: .*weight dtype torch.float64 does not match x dtype torch.float32",
        r"TypeError: .*moe_dispatch_grouped_matmul takes plain x only",
        r"RuntimeError: moe_dispatch_grouped_matmul: ranks disagree: rank 0 has num_experts=4, rank 1 has "
        r"num_experts=6",
    ]
    for rank, seen in enumerate(run_ranks(_errors_body, 2, timeout=60, env={"COC_CHECK": "1"})):
        assert len(seen) == len(expected), seen
        for pattern, message in zip(expected, seen, strict=True):
            assert re.search(pattern, message), (rank, pattern, message)


def test_chunked_runs_the_gemm_once_per_piece() -> None:
    """The chunked backend calls its GEMM on each piece's rows as the piece lands (group of one: the pieces are
    copies), with piece-local offsets ending at the piece's rows; bounded mode first runs the zero row's."""
    from kernels.ops.moe import ep_gemm as moe_ep_gemm

    inp = _inputs(1)
    for cap, extra in ((0, 0), (16, 1)):
        calls: list[tuple[int, list[int]]] = []

        def spy(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, calls: list = calls) -> torch.Tensor:
            calls.append((rows.shape[0], offsets.tolist()))
            return kernels.grouped_matmul(rows, weight, offsets)

        call = EpCall(
            op="moe_dispatch_grouped_matmul", backend="chunked", parallel_num=3, num_experts=inp["E"], max_tokens=cap
        )
        ops = moe_ep_gemm.DispatchGemmOperands.of(inp["x"][:M], inp["ids"][:M], inp["w"])
        y, rows, offsets, *_ = moe_ep_gemm.dispatch_gemm(call, ops, gemm=spy)
        assert torch.equal(y, kernels.grouped_matmul(rows, inp["w"], offsets)), cap
        pieces = calls[extra:]
        assert len(pieces) == 3 and all(o[-1] == n for n, o in pieces), calls
        # Exact: the rows received; bounded: every position of the max_tokens block (padding included).
        assert sum(n for n, _ in pieces) == rows.shape[0], calls


def test_fake_and_compiled_call() -> None:
    """The operator's fake (bounded: max_tokens rows; exact: a dynamic row count shared by y and rows), and
    ``torch.compile(fullgraph=True)`` traces a bounded chunked call (group of one) into one ``coc`` call with the
    eager bits."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    inp = _inputs(1)
    for cap in (16, 0):
        call = EpCall(
            op="moe_dispatch_grouped_matmul", backend="chunked", parallel_num=2, num_experts=inp["E"], max_tokens=cap
        ).encode()
        with FakeTensorMode(shape_env=ShapeEnv()) as mode:
            x, ids, w = (mode.from_tensor(inp[k]) for k in ("x", "ids", "w"))
            out = torch.ops.coc.moe_dispatch_grouped_matmul(x, ids, w, call)
        rows = 16 if cap else out[1].shape[0]
        assert len(out) == 13 and out[0].shape == (rows, N) and out[1].shape == (rows, K), cap
        assert out[0].shape[0] == out[1].shape[0] and out[2].shape == (inp["E"],), cap
    graphs: list[torch.fx.GraphModule] = []

    def layer(x: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, w: torch.Tensor) -> tuple:
        y, h = kernels.moe_dispatch_grouped_matmul(
            x, ids, tw, inp["E"], w, max_tokens=16, backend="chunked", parallel_num=2
        )
        return y, h.expert_offsets, h.valid

    def record(gm: torch.fx.GraphModule, _: object) -> Any:
        graphs.append(gm)
        return gm.forward

    args = (inp["x"], inp["ids"], inp["tw"], inp["w"])
    compiled = torch.compile(layer, backend=record, fullgraph=True)(*args)
    assert all(torch.equal(a, b) for a, b in zip(compiled, layer(*args), strict=True))
    op = torch.ops.coc.moe_dispatch_grouped_matmul.default
    assert len([n for gm in graphs for n in gm.graph.nodes if n.target is op]) == 1
    assert int(compiled[2]) == M * TOPK
