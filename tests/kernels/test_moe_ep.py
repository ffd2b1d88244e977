"""Expert-parallel MoE (kernels/ops/moe_ep.py): moe_dispatch + a local expert GEMM + moe_combine against a
one-process dense MoE at W = 1, 2, 4, the row order, bitwise determinism, bounded mode and its overflow, autograd,
and the named errors.

Bounds (per element; ``eps``: one whole ulp of the dtype, 2^-23 fp32, 2^-7 bf16; ``g = 2^-24``): the expert
``y = x_t @ w[e].T`` is one ``torch.mm`` in the dtype (fp32 accumulation of k products, one rounding:
``|y - y64| <= eps |y64| + k g S1``, ``S1 = |x_t| @ |w[e]|.T``); the combine multiplies each y by its fp32
weight (one rounding), adds topk terms in fp32 (topk roundings) and rounds once to the dtype, so
``|out - out64| <= eps |out64| + (eps + (k + topk + 2) g) S``, ``S = sum_s |w_ts| S1_ts`` (``|y64| <= S1``).
Dispatch moves rows and combine sums in slot order, so for the same expert outputs the result has the same bits
on every run, backend (sequential / chunked) and mode (exact / bounded): tested with an elementwise expert.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kernels
from kernels.ops.moe import ep as moe_ep
from kernels.ops.moe.layout import EpCall
from kernels.testing import outcomes, run_ranks

DTYPES = {"float32": (torch.float32, 2.0**-23), "bfloat16": (torch.bfloat16, 2.0**-7)}
G = 2.0**-24
K, N = 8, 6
# name: (m_local, E per rank, topk); "skewed": ~70 % of the pairs to expert 1, experts 2 and 3 never chosen (at
# W = 2 rank 1 receives nothing).
CASES = {"skewed": (5, 2, 2), "top1": (4, 1, 1)}
CAP = 64  # max_tokens of the bounded runs: above every rank's receive count here


def _inputs(world: int, case: str, dtype: torch.dtype) -> dict[str, Any]:
    m, per_rank, topk = CASES[case]
    num_e = per_rank * world if world > 1 or case == "top1" else 4
    g = torch.Generator().manual_seed(7 * world + len(case))
    tokens = m * world
    ids = torch.randint(0, num_e, (tokens, topk), generator=g)
    if case == "skewed":
        ids = torch.where(torch.rand(tokens, topk, generator=g) < 0.7, 1, ids)
        ids = torch.where((ids == 2) | (ids == 3), 0, ids)
    return {
        "x": torch.randn(tokens, K, generator=g).to(dtype),
        "ids": ids.to(torch.int32),
        "tw": torch.rand(tokens, topk, generator=g),
        "w": (torch.randn(num_e, N, K, generator=g) / K**0.5).to(dtype),
        "E": num_e,
    }


def _experts(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The local expert GEMM: a per-expert ``torch.mm`` over the rows of ``expert_offsets`` (differentiable)."""
    outs, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        outs.append(rows[start:end] @ weight[e].T)
        start = end
    return torch.cat(outs)


def _run_body(rank: int, world: int, runs: list[tuple[str, str, int | None, str, int]]) -> list:
    out = []
    for dtype_name, case, cap, backend, num in runs:
        inp = _inputs(world, case, DTYPES[dtype_name][0])
        m, e_l = CASES[case][0], inp["E"] // world
        own = slice(rank * m, (rank + 1) * m)
        opts = {"backend": backend, "parallel_num": num}
        rows, h = kernels.moe_dispatch(inp["x"][own], inp["ids"][own], inp["tw"][own], inp["E"], max_tokens=cap, **opts)
        y = _experts(rows, inp["w"][rank * e_l : (rank + 1) * e_l], h.expert_offsets)
        res = kernels.moe_combine(y, h, **opts)
        again = kernels.moe_combine(y, h, **opts)
        elementwise = kernels.moe_combine(rows * 3 - 1, h, **opts)  # the same per-pair outputs in every mode
        out.append((rows, h._replace(topk_weights=None), res, torch.equal(res, again), elementwise))
    return out


def _check(world: int, rank: int, run: tuple, got: tuple) -> None:
    dtype_name, case, cap, _, _ = run
    dtype, eps = DTYPES[dtype_name]
    m, _, topk = CASES[case]
    inp = _inputs(world, case, dtype)
    rows, h, res, repeat_equal, _ = got
    tag = f"{run} W={world} rank={rank}"
    assert repeat_equal, tag
    e_l = inp["E"] // world
    # Row order: (local expert, source rank, token, slot), each row the source token's x, bit for bit.
    want = sorted(
        (int(inp["ids"][t, s]), t // m, t % m, s)
        for t in range(m * world)
        for s in range(topk)
        if int(inp["ids"][t, s]) // e_l == rank
    )
    valid = int(h.valid)
    assert valid == len(want), tag
    got_order = list(zip(*(t[:valid].tolist() for t in (h.src_rank, h.src_token, h.src_slot)), strict=True))
    assert got_order == [(r, t, s) for _, r, t, s in want], tag
    assert torch.equal(rows[:valid], inp["x"][[r * m + t for _, r, t, _ in want]]), tag
    ends = [sum(1 for e, *_ in want if e - rank * e_l <= i) for i in range(e_l)]
    if cap is None:
        assert h.expert_offsets.tolist() == ends and rows.shape[0] == valid, tag
    else:
        assert h.expert_offsets.tolist() == ends[:-1] + [cap] and rows.shape[0] == cap, tag
        assert not rows[valid:].any() and (h.src_rank[valid:] == -1).all(), tag
    # Against the dense one-process MoE in fp64.
    own = range(rank * m, (rank + 1) * m)
    x64, w64, tw = inp["x"].double(), inp["w"].double(), inp["tw"].double()
    out64, mag = torch.zeros(m, N, dtype=torch.float64), torch.zeros(m, N, dtype=torch.float64)
    for i, t in enumerate(own):
        for s in range(topk):
            we = w64[int(inp["ids"][t, s])]
            out64[i] += tw[t, s] * (we @ x64[t])
            mag[i] += tw[t, s] * (we.abs() @ x64[t].abs())
    bound = eps * out64.abs() + (eps + (K + topk + 2) * G) * mag
    assert res.shape == (m, N) and res.dtype == dtype, tag
    assert ((res.double() - out64).abs() <= bound).all(), (tag, (res.double() - out64).abs().max())


RUNS = [
    (d, c, cap, backend, num)
    for d in DTYPES
    for c in CASES
    for cap in (None, CAP)
    for backend, num in (("sequential", 1), ("chunked", 2))
]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dispatch_expert_gemm_combine_match_a_dense_moe(world: int) -> None:
    """Skewed routing (an expert with no tokens, one taking most) and top-1, fp32 and bf16, exact and bounded,
    sequential and chunked: row order and values, the dense MoE within the bound, and the same bits for
    repeated calls, for both backends and (elementwise expert) for both modes."""
    per_rank = run_ranks(_run_body, world, RUNS, timeout=120)
    for rank, outs in enumerate(per_rank):
        for run, got in zip(RUNS, outs, strict=True):
            _check(world, rank, run, got)
        by_run = dict(zip(RUNS, outs, strict=True))
        for d in DTYPES:
            for c in CASES:
                ref = by_run[(d, c, None, "sequential", 1)]
                for cap in (None, CAP):
                    other = by_run[(d, c, cap, "chunked", 2)]
                    assert torch.equal(other[4], ref[4]), (d, c, cap, world, rank)
                    same_mode = by_run[(d, c, cap, "sequential", 1)]
                    assert torch.equal(other[2], same_mode[2]), (d, c, cap, world, rank)


def _overflow_body(rank: int, world: int) -> list[str]:
    x, ids, tw = torch.randn(4, K), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2)
    ids[:, 1] = 1  # every pair to rank 0's experts: it receives 8 * world rows
    seen = []
    try:
        kernels.moe_dispatch(x, ids, tw, 2 * world, max_tokens=5)
    except RuntimeError as e:
        seen.append(str(e))
    rows, h = kernels.moe_dispatch(x, ids, tw, 2 * world, max_tokens=8 * world)  # the group stays usable
    seen.append(str(int(h.valid)))
    # Where no host read is allowed (CUDA eager), the flag is kept and read by the next check.
    original = moe_ep.wanted
    moe_ep.wanted = lambda device: False
    try:
        kernels.moe_dispatch(x, ids, tw, 2 * world, max_tokens=5)
    finally:
        moe_ep.wanted = original
    try:
        kernels.moe_check_overflow()
    except RuntimeError as e:
        seen.append(str(e))
    return seen


@pytest.mark.parametrize("world", [1, 2])
def test_bounded_overflow_raises_by_name_on_every_rank(world: int) -> None:
    for rank, seen in enumerate(run_ranks(_overflow_body, world, timeout=60)):
        assert len(seen) == 3, (rank, seen)
        assert re.search(rf"max_tokens=5 overflow: rank 0 would receive {8 * world} rows", seen[0]), seen[0]
        assert seen[1] == "0" if rank else seen[1] == str(8 * world)
        assert "max_tokens overflow in an earlier bounded call" in seen[2], seen[2]


def _grad_body(rank: int, world: int, cap: int | None) -> dict[str, torch.Tensor]:
    inp = _inputs(world, "skewed", torch.float32)
    m, e_l = CASES["skewed"][0], inp["E"] // world
    own = slice(rank * m, (rank + 1) * m)
    x = inp["x"][own].clone().requires_grad_()
    tw = inp["tw"][own].clone().requires_grad_()
    w = inp["w"][rank * e_l : (rank + 1) * e_l].clone().requires_grad_()
    rows, h = kernels.moe_dispatch(x, inp["ids"][own], tw, inp["E"], max_tokens=cap, backend="chunked", parallel_num=2)
    out = kernels.moe_combine(_experts(rows, w, h.expert_offsets), h)
    (out * torch.linspace(-1, 1, N)).sum().backward()
    return {"x": x.grad, "tw": tw.grad, "w": w.grad}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_autograd_matches_a_dense_moe(world: int) -> None:
    """d x (dispatch's backward: combine without weights), d topk_weights and d expert weights (combine's
    backward: dispatch of the weighted gradient) against torch.autograd through a one-process dense MoE, fp32."""
    inp = _inputs(world, "skewed", torch.float32)
    x, tw, w = (inp[k].clone().requires_grad_() for k in ("x", "tw", "w"))
    topk = CASES["skewed"][2]
    dense = sum(tw[:, s : s + 1] * torch.einsum("tnk,tk->tn", w[inp["ids"][:, s].long()], x) for s in range(topk))
    (dense * torch.linspace(-1, 1, N)).sum().backward()
    m, e_l = CASES["skewed"][0], inp["E"] // world
    for cap in (None, CAP):
        for rank, grads in enumerate(run_ranks(_grad_body, world, cap, timeout=120)):
            own = slice(rank * m, (rank + 1) * m)
            torch.testing.assert_close(grads["x"], x.grad[own], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grads["tw"], tw.grad[own], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grads["w"], w.grad[rank * e_l : (rank + 1) * e_l], rtol=1e-5, atol=1e-6)


def _errors_body(rank: int, world: int) -> list[str]:
    x, ids, tw = torch.randn(3, K), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    bad_ids = ids.clone()
    bad_ids[1, 1] = 9 if rank == world - 1 else 0
    calls = [
        lambda: kernels.moe_dispatch(x, bad_ids, tw, 4),
        lambda: kernels.moe_dispatch(x, ids.float(), tw, 4),
        lambda: kernels.moe_dispatch(x, ids[:2], tw, 4),
        lambda: kernels.moe_dispatch(x, ids, tw[:, :1], 4),
        lambda: kernels.moe_dispatch(x, ids, tw, 3),
        lambda: kernels.moe_dispatch(x, ids, tw, 4, max_tokens=0),
        lambda: kernels.moe_dispatch(x, ids, tw, 4 + 2 * rank),  # E differs
        lambda: kernels.moe_dispatch(x, ids[:, : 1 + rank % 2], tw[:, : 1 + rank % 2], 4),  # top-k differs
        lambda: kernels.moe_dispatch(x, ids, tw, 4, max_tokens=None if rank else 8),  # mode differs
    ]
    seen = outcomes(calls)
    rows, h = kernels.moe_dispatch(x, ids, tw, 4)
    try:
        kernels.moe_combine(rows[:, :1].repeat(2, 1), h)
    except ValueError as e:
        seen.append(f"ValueError: {e}")
    return seen


def test_named_errors_before_any_communication() -> None:
    world = 2
    expected = [
        r"ValueError: moe_dispatch: rank 1 refused its arguments: topk_ids\[1, 1\]=9 is out of range",
        r"TypeError: .*topk_ids dtype torch.float32 is not accepted",
        r"ValueError: .*topk_ids shape \(2, 2\) does not fit x shape \(3, 8\)",
        r"ValueError: .*topk_weights must be a floating tensor of topk_ids' shape",
        r"ValueError: .*num_experts=3 does not split evenly over W=2",
        r"ValueError: .*max_tokens must be None \(exact mode\) or an int >= 1",
        r"RuntimeError: moe_dispatch: ranks disagree: rank 0 has num_experts=4, rank 1 has num_experts=6",
        r"RuntimeError: moe_dispatch: ranks disagree: rank 0 has topk=1, rank 1 has topk=2",
        r"RuntimeError: moe_dispatch: ranks disagree: rank 0 has max_tokens=8, rank 1 has max_tokens=0",
        r"ValueError: .*y must be 2-D \[R, n\] with R = ",
    ]
    # COC_CHECK=1: every call checked, whatever the pool's earlier tests left seen.
    for rank, seen in enumerate(run_ranks(_errors_body, world, timeout=60, env={"COC_CHECK": "1"})):
        assert len(seen) == len(expected), seen
        for pattern, message in zip(expected, seen, strict=True):
            assert re.search(pattern, message), (rank, pattern, message)


def test_reference_twins_fused_request_and_fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    inp = _inputs(1, "skewed", torch.float32)
    args = (inp["x"], inp["ids"], inp["tw"], inp["E"])
    rows, h = kernels.moe_dispatch(*args, backend="sequential")
    rows_ref, h_ref = kernels.moe_dispatch(*args, backend="sequential")
    assert torch.equal(rows, rows_ref) and isinstance(h, kernels.MoeDispatchHandle)
    assert torch.equal(kernels.moe_combine(rows, h), kernels.moe_combine(rows_ref, h_ref, backend="sequential"))
    from kernels.protocol import backend as backend_choice

    monkeypatch.setattr(backend_choice, "_warned", set())
    rows_fused, h_fused = kernels.moe_dispatch(*args, backend="fused")  # a group of one: the local movement
    assert torch.equal(rows_fused, rows) and EpCall.decode(h_fused.call).backend == "fused"
    # Where the fused kernels cannot run, a fused request warns once by name and runs chunked.
    monkeypatch.setattr(backend_choice, "fused_unavailable", lambda call, device: "no peer memory here")
    with pytest.warns(RuntimeWarning, match=r"moe_dispatch: the fused backend cannot run here \(no peer memory"):
        rows_fused, h_fused = kernels.moe_dispatch(*args, backend="fused")
    assert torch.equal(rows_fused, rows) and EpCall.decode(h_fused.call).backend == "chunked"
    from torch._subclasses.fake_tensor import FakeTensorMode

    call = EpCall(op="moe_dispatch", backend="sequential", parallel_num=1, num_experts=inp["E"], max_tokens=16).encode()
    with FakeTensorMode() as mode:
        x, ids = mode.from_tensor(inp["x"]), mode.from_tensor(inp["ids"])
        out = torch.ops.coc.moe_dispatch(x, None, ids, call)
        handle = [*out[6:10], *out[11:13]]
        combined, returned = torch.ops.coc.moe_combine(out[0][:, :N], mode.from_tensor(inp["tw"]), handle, call)
    assert out[0].shape == (16, K) and out[1].shape == (16, 0) and out[2].shape == (inp["E"],)
    assert len(out) == 13 and out[6].shape == (16,) and out[11].shape == (10,) and out[12].shape == ()
    assert combined.shape == (5, N) and returned.shape == (10, N)
