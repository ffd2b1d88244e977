"""Tensor-parallel MoE (kernels/ops/moe.py): all_gather_grouped_matmul and grouped_matmul_reduce_scatter on the
sequential and chunked backends at W = 1, 2, 3 (4 for one case) against fp64 computed here from every rank's
inputs (regenerated from seeds), the two chained against a one-process dense MoE MLP, and the named errors.

Bounds (per element; ``eps``: one whole ulp of the output dtype, 2^-23 fp32, 2^-7 bf16, where one rounding to
nearest needs half of one: the margin dates from when the interpreted kernel truncated fp32 to bf16,
kernels/fused/interpreter_compat.py; ``g = 2^-24``, the fp32 unit roundoff):

- gather GEMM, ``y = x_t @ w1[e].T`` summed in fp32 in some order, rounded once:
  ``|y - y64| <= eps |y64| + 2 (k + 1) g S1`` with ``S1 = |x_t| @ |w1[e]|.T``;
- GEMM + combine + reduce-scatter: fp32 partials (a reordered sum of n_local terms: ``2 (n_local + 1) g``),
  each times its fp32 top-k weight (one rounding) and summed over topk slots then W ranks in fp32, rounded once:
  ``|out - out64| <= eps |out64| + (2 n_local + topk + W + 4) g S2``, ``S2 = sum_r sum_s |w_ts| |h_r| @ |w2_r[e]|.T``;
- the chain (``h = silu(y)`` in the dtype) against the dense fp64 MLP ``sum_s w_ts w2[e] @ silu(w1[e] @ x_t)``:
  y's bound above passes through silu (Lipschitz 1.1) and silu's result is rounded (``2 eps |h64|``, torch
  computes it in fp32 and rounds once), giving ``dh``; the second GEMM carries it as
  ``sum_s |w_ts| |w2[e]| @ dh`` on top of its own bound.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.ops.moe.routing import MoeCall
from kernels.testing import run_ranks

DTYPES = {"float32": (torch.float32, 2.0**-23), "bfloat16": (torch.bfloat16, 2.0**-7)}
G = 2.0**-24
K, N, K_OUT = 16, 12, 10  # N (the intermediate) splits over W = 1, 2, 3, 4
# name: (m_local, E, topk); "skewed" sends ~70 % of the pairs to expert 2 and none to experts 4 and 5; "single"
# (the fused tests, tests/kernels/fused/test_moe.py) sends every pair to expert 1.
CASES = {"skewed": (5, 6, 2), "top1": (3, 3, 1), "even": (4, 4, 2), "single": (7, 4, 2)}
BASE_CASES = ("skewed", "top1", "even")


def _inputs(world: int, case: str, dtype: torch.dtype) -> dict[str, Any]:
    """Every rank's tokens, routing and weights, the same on every rank (seeded by the case and world)."""
    m_local, num_e, topk = CASES[case]
    g = torch.Generator().manual_seed(100 * world + len(case))
    tokens = m_local * world
    if case == "skewed":
        ids = torch.tensor([0, 1, 3])[torch.randint(0, 3, (tokens, topk), generator=g)]
        ids = torch.where(torch.rand(tokens, topk, generator=g) < 0.7, 2, ids)
    elif case == "single":
        ids = torch.ones(tokens, topk, dtype=torch.int64)
    else:
        ids = torch.randint(0, num_e, (tokens, topk), generator=g)
    return {
        "x": torch.randn(tokens, K, generator=g).to(dtype),
        "ids": ids.to(torch.int32),
        "tw": torch.rand(tokens, topk, generator=g),
        "w1": (torch.randn(num_e, N, K, generator=g) / K**0.5).to(dtype),
        "w2": (torch.randn(num_e, K_OUT, N, generator=g) / N**0.5).to(dtype),
        "h": torch.randn(tokens * topk, N, generator=g).to(dtype),  # op 2 alone: h's columns of every rank
    }


def _shard(world: int, rank: int) -> slice:
    n_local = N // world
    return slice(rank * n_local, (rank + 1) * n_local)


def _ranks_body(rank: int, world: int, runs: list[tuple[str, str, str, int]]) -> list:
    out = []
    for backend, dtype_name, case, parallel_num in runs:
        inp = _inputs(world, case, DTYPES[dtype_name][0])
        m_local = CASES[case][0]
        own, cols = slice(rank * m_local, (rank + 1) * m_local), _shard(world, rank)
        opts = {"backend": backend, "parallel_num": parallel_num}
        w1, w2 = inp["w1"][:, cols].contiguous(), inp["w2"][:, :, cols].contiguous()
        with torch.no_grad():
            y, routing = kernels.all_gather_grouped_matmul(inp["x"][own], inp["ids"][own], w1, **opts)
            alone = kernels.grouped_matmul_reduce_scatter(inp["h"][:, cols], w2, routing, inp["tw"], **opts)
            chained = kernels.grouped_matmul_reduce_scatter(F.silu(y), w2, routing, inp["tw"], **opts)
        out.append((y, tuple(routing), alone, chained))
    return out


def _routing(ids: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """The routing spelled out: pairs sorted by (expert, token, slot)."""
    topk = ids.shape[1]
    pairs = sorted((int(ids[t, s]), t, s) for t in range(ids.shape[0]) for s in range(topk))
    return [e for e, _, _ in pairs], [t for _, t, _ in pairs], [s for _, _, s in pairs]


def _check(world: int, rank: int, run: tuple, got: tuple) -> dict[str, float]:
    backend, dtype_name, case, _ = run
    dtype, eps = DTYPES[dtype_name]
    m_local, num_e, topk = CASES[case]
    inp = _inputs(world, case, dtype)
    y, (offsets, token_index, slot), alone, chained = got
    tag = f"{run} W={world} rank={rank}"
    experts, tokens, slots = _routing(inp["ids"])
    assert token_index.tolist() == tokens and slot.tolist() == slots, tag
    assert offsets.tolist() == [sum(1 for e in experts if e <= i) for i in range(num_e)], tag
    x64, w1, w2, tw = inp["x"].double(), inp["w1"].double(), inp["w2"].double(), inp["tw"].double()
    cols = _shard(world, rank)
    # Op 1: every row against its token and expert, this rank's columns.
    w1_rows = w1[experts][:, cols]  # [rows, n_local, k]
    x_rows = x64[tokens]
    y64 = torch.einsum("rnk,rk->rn", w1_rows, x_rows)
    s1 = torch.einsum("rnk,rk->rn", w1_rows.abs(), x_rows.abs())
    err = {"y": ((y.double() - y64).abs() / (s1 + 1e-30)).max().item()}
    assert y.dtype == dtype and ((y.double() - y64).abs() <= eps * y64.abs() + 2 * (K + 1) * G * s1).all(), tag
    # Op 2 alone: the sum over ranks of their columns' partials, combined per token.
    own = slice(rank * m_local, (rank + 1) * m_local)
    row = {(t, s): j for j, (t, s) in enumerate(zip(tokens, slots, strict=True))}
    h64 = inp["h"].double()
    out64, s2 = torch.zeros(m_local, K_OUT, dtype=torch.float64), torch.zeros(m_local, K_OUT, dtype=torch.float64)
    for i, t in enumerate(range(own.start, own.stop)):
        for s in range(topk):
            hj, we = h64[row[(t, s)]], w2[int(inp["ids"][t, s])]
            out64[i] += tw[t, s] * (we @ hj)
            s2[i] += tw[t, s] * (we.abs() @ hj.abs())
    n_local = N // world
    bound = eps * out64.abs() + (2 * n_local + topk + world + 4) * G * s2
    assert alone.shape == (m_local, K_OUT) and alone.dtype == dtype, tag
    assert ((alone.double() - out64).abs() <= bound).all(), (tag, (alone.double() - out64).abs().max())
    err["alone"] = ((alone.double() - out64).abs() / (s2 + 1e-30)).max().item()
    # The chain against the dense MLP of the full weights, with y's error carried through silu and w2.
    dense, carried, s_out = (torch.zeros(m_local, K_OUT, dtype=torch.float64) for _ in range(3))
    for i, t in enumerate(range(own.start, own.stop)):
        for s in range(topk):
            e = int(inp["ids"][t, s])
            pre, pre_mag = w1[e] @ x64[t], w1[e].abs() @ x64[t].abs()
            act = F.silu(pre)
            dh = 1.1 * (eps * pre.abs() + 2 * (K + 1) * G * pre_mag) + 2 * eps * act.abs()
            dense[i] += tw[t, s] * (w2[e] @ act)
            carried[i] += tw[t, s] * (w2[e].abs() @ dh)
            s_out[i] += tw[t, s] * (w2[e].abs() @ (act.abs() + dh))
    bound = carried + eps * dense.abs() + (2 * n_local + topk + world + 4) * G * s_out
    assert ((chained.double() - dense).abs() <= bound).all(), (tag, (chained.double() - dense).abs().max())
    err["chain"] = ((chained.double() - dense).abs() / (s_out + 1e-30)).max().item()
    return err


def _runs(dtypes: tuple[str, ...], cases: tuple[str, ...]) -> list[tuple[str, str, str, int]]:
    return [
        (backend, d, c, num)
        for d in dtypes
        for c in cases
        for backend, num in (("sequential", 1), ("chunked", 2 if c != "top1" else 4))
    ]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_both_ops_and_their_chain_match_fp64(world: int) -> None:
    """Every case (skewed routing with empty experts, top-1, odd m_local) in fp32 and bf16, both backends; the
    chunked path runs the grouped GEMM kernel (interpreted) on 2 pieces (4 asked for 3 tokens per rank: 3)."""
    runs = _runs(tuple(DTYPES), BASE_CASES)
    per_rank = run_ranks(_ranks_body, world, runs, timeout=300)
    worst: dict[str, float] = {}
    for rank, outs in enumerate(per_rank):
        for run, got in zip(runs, outs, strict=True):
            for key, value in _check(world, rank, run, got).items():
                name = f"{run[1]} {key}"
                worst[name] = max(worst.get(name, 0.0), value)
    print(f"W={world} worst |error| / magnitude: {worst}")


def test_four_ranks_skewed_routing() -> None:
    runs = _runs(("bfloat16",), ("skewed",))
    for rank, outs in enumerate(run_ranks(_ranks_body, 4, runs, timeout=300)):
        for run, got in zip(runs, outs, strict=True):
            _check(4, rank, run, got)


def test_reference_twins_and_registered_operators() -> None:
    inp = _inputs(1, "skewed", torch.float32)
    with torch.no_grad():
        y, routing = kernels.all_gather_grouped_matmul(inp["x"], inp["ids"], inp["w1"], backend="sequential")
        y_ref, routing_ref = kernels.all_gather_grouped_matmul(
            inp["x"], inp["ids"], inp["w1"], num_experts=6, backend="sequential"
        )
        out = kernels.grouped_matmul_reduce_scatter(y, inp["w2"], routing, inp["tw"], backend="sequential")
        out_ref = kernels.grouped_matmul_reduce_scatter(y, inp["w2"], routing_ref, inp["tw"], backend="sequential")
    assert torch.equal(y, y_ref) and all(torch.equal(a, b) for a, b in zip(routing, routing_ref, strict=True))
    assert torch.equal(out, out_ref)
    assert isinstance(routing, kernels.MoeRouting) and routing.expert_offsets.dtype == torch.int64
    from torch._subclasses.fake_tensor import FakeTensorMode

    call = MoeCall(op="all_gather_grouped_matmul", backend="sequential", parallel_num=1).encode()
    with FakeTensorMode() as mode:
        x, ids, w1 = (mode.from_tensor(inp[k]) for k in ("x", "ids", "w1"))
        fy, fo, fi, fs = torch.ops.coc.all_gather_grouped_matmul(x, ids, w1, None, None, call)
        fout = torch.ops.coc.grouped_matmul_reduce_scatter(
            fy[:, :N], mode.from_tensor(inp["w2"]), [fo, fi, fs], mode.from_tensor(inp["tw"]), None, None, call
        )
    assert fy.shape == (10, N) and fo.shape == (6,) and fi.shape == fs.shape == (10,)
    assert fout.shape == (5, K_OUT)


def test_fused_request_runs_fused_and_warns_by_name_where_it_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the fused kernels run (here: W = 1 under the interpreter) ``"fused"`` runs them without a warning;
    where they cannot, the call warns once with the reason and runs chunked (the same result)."""
    import warnings

    from kernels.ops.moe import tp
    from kernels.protocol import backend as backend_choice
    from kernels.protocol import decide

    inp = _inputs(1, "even", torch.float32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        y, routing = kernels.all_gather_grouped_matmul(inp["x"], inp["ids"], inp["w1"], backend="fused")
        out = kernels.grouped_matmul_reduce_scatter(y, inp["w2"], routing, inp["tw"], backend="fused")
    assert decide(tp.GATHER_SPEC, MoeCall(op="op", backend="fused"), y.device).backend == "fused"
    monkeypatch.setattr(backend_choice, "_warned", set())
    monkeypatch.setattr(backend_choice, "fused_unavailable", lambda call, device: "no peer access (test)")
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"all_gather_grouped_matmul: the fused backend cannot"):
        y2, routing2 = kernels.all_gather_grouped_matmul(inp["x"], inp["ids"], inp["w1"], backend="fused")
    monkeypatch.setenv("USE_COC_FUSED_KERNEL", "1")
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"reduce_scatter: .*\(no peer access \(test\)\)"):
        out2 = kernels.grouped_matmul_reduce_scatter(y2, inp["w2"], routing2, inp["tw"])
    assert all(torch.equal(a, b) for a, b in zip(routing, routing2, strict=True))
    # The same grouped GEMM kernel (W = 1) on both paths; the combines add in the same order.
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    torch.testing.assert_close(out2, out, rtol=2**-22, atol=1e-6)


def _bad_calls() -> list[tuple[str, Any, type, str]]:
    """(name, call, error class, message pattern) on rank-0-sized inputs of the "even" case."""
    inp = _inputs(1, "even", torch.float32)
    x, ids, w1, w2, tw = inp["x"], inp["ids"], inp["w1"], inp["w2"], inp["tw"]
    agg, grs = kernels.all_gather_grouped_matmul, kernels.grouped_matmul_reduce_scatter
    y, routing = agg(x, ids, w1)
    bad_ids = ids.clone()
    bad_ids[2, 1] = 4
    short = kernels.MoeRouting(routing.expert_offsets[:3], routing.token_index, routing.slot)
    swapped = kernels.MoeRouting(routing.expert_offsets, routing.token_index, routing.slot.flip(0))
    return [
        ("id too large", lambda: agg(x, bad_ids, w1), ValueError, r"topk_ids\[2, 1\]=4 is out of range.*\[0, 4\)"),
        ("negative id", lambda: agg(x, -ids - 1, w1), ValueError, r"out of range"),
        ("float ids", lambda: agg(x, ids.float(), w1), TypeError, "topk_ids dtype torch.float32"),
        ("ids rows", lambda: agg(x, ids[:3], w1), ValueError, r"topk_ids shape \(3, 2\) does not fit x"),
        ("num_experts", lambda: agg(x, ids, w1, num_experts=5), ValueError, "E mismatch: num_experts=5"),
        ("weight k", lambda: agg(x, ids, w1[:, :, :8]), ValueError, "k mismatch"),
        ("weight dtype", lambda: agg(x, ids, w1.double()), TypeError, "weight dtype torch.float64"),
        ("backend", lambda: agg(x, ids, w1, backend="nccl"), ValueError, "backend='nccl'"),
        ("tw shape", lambda: grs(y, w2, routing, tw[:, :1]), ValueError, r"topk_weights shape \(4, 1\)"),
        ("E of routing", lambda: grs(y, w2, short, tw), ValueError, "E mismatch: routing.expert_offsets"),
        ("pairs", lambda: grs(y, w2, swapped, tw), ValueError, r"do not name every \(token, slot\) pair"),
        ("not routing", lambda: grs(y, w2, tuple(routing), tw), TypeError, "routing must be the kernels.MoeRouting"),
        ("h width", lambda: grs(y[:, :6], w2, routing, tw), ValueError, r"weight must be \[E, k_out, n_local\]"),
    ]


def test_bad_routing_input_raises_by_name() -> None:
    with torch.no_grad():
        for name, call, cls, pattern in _bad_calls():
            with pytest.raises(cls, match=pattern):
                call()
                pytest.fail(f"{name}: no error")


def _disagreeing_body(rank: int, world: int, what: str) -> str:
    inp = _inputs(world, "even", torch.float32)
    x, ids, w1 = inp["x"][rank * 4 : rank * 4 + 4], inp["ids"][rank * 4 : rank * 4 + 4], inp["w1"][:, :6]
    if rank == 1 and what == "E":
        w1 = torch.cat([w1, w1[:1]])
    if rank == 1 and what == "topk":
        ids = ids[:, :1].contiguous()
    if rank == 1 and what == "id":
        ids = ids.clone()
        ids[0, 0] = 9
    try:
        with torch.no_grad():
            kernels.all_gather_grouped_matmul(x, ids, w1, backend="chunked", parallel_num=2)
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("E", "ranks disagree: rank 0 has num_experts=4, rank 1 has num_experts=5"),
        ("topk", "ranks disagree: rank 0 has topk=2, rank 1 has topk=1"),
        ("id", r"ValueError: all_gather_grouped_matmul: rank 1 refused its arguments: topk_ids\[0, 0\]=9"),
    ],
)
def test_ranks_that_disagree_are_refused_by_name(what: str, message: str) -> None:
    # COC_CHECK=1: the pooled ranks may have seen rank 0's signature pass in an earlier test.
    for text in run_ranks(_disagreeing_body, 2, what, timeout=120, env={"COC_CHECK": "1"}):
        assert re.search(message, text), text
