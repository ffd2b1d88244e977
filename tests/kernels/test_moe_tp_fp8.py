"""The FP8 operand format of the tensor-parallel MoE ops (kernels/ops/moe.py): ``all_gather_grouped_matmul`` and
``grouped_matmul_reduce_scatter`` with FP8 payloads and scales on every backend, against fp64 computed here on the
dequantized operands (every rank's, regenerated from seeds) and against the sequential reference; the named errors;
ranks that disagree on the format; the registered operators' fakes.

Worlds: the fused backend in block mode at W = 1, 2, 3, 4 (the sweep); every backend in row, tensor and block
mode at W = 2. Shapes are not tile multiples: k = 144 (two 128-column scale blocks, the last partial), n_local =
24 / W, k_out = 10, m_local = 5 or 3. Routing: "skewed" (70 % of the pairs to one expert, two experts without
tokens) and "single" (every pair to one expert, three experts empty). In tensor mode each rank's x is scaled
differently, so its scalar must travel with its rows.

Bounds (per element; ``g = 2^-24`` the fp32 unit roundoff, ``eps`` one whole ulp of ``out_dtype`` at the value:
2^-7 bf16, 2^-10 fp16, 2^-23 fp32). The truth multiplies the dequantized fp32 operands (``dequantize_fp8``, as the
reference does) in fp64. The kernels instead sum the exact FP8 products of a 128-deep scale block in fp32 and scale
each block sum (two roundings), so relative to the truth each product carries the dequantization's two roundings
too; with at most ``k`` additions that is below ``2 (k + 2) g S`` for ``S = sum |a| |b|`` (``k >= 2``):

- gather GEMM ``y = dequant(x_t) @ dequant(w1[e]).T``, rounded once to out_dtype:
  ``|y - y64| <= eps |y64| + 2 (k + 2) g S1``, ``S1 = |x_t| @ |w1[e]|.T``;
- reducing op: fp32 partials (``2 (n_local + 2) g``), each times its fp32 top-k weight and summed over the slots
  then the W ranks in fp32 (``topk + W + 2`` roundings), rounded once: ``|out - out64| <= eps |out64| + (2 n_local
  + topk + W + 6) g S2``, ``S2 = sum_r sum_s |w_ts| |h_r| @ |w2_r[e]|.T``.

Each backend is also compared with the sequential reference of the same call: both obey the bound, so they differ
by at most twice it. Bitwise equality is not promised (the reference multiplies the dequantized values with
torch's fp32 GEMM; the chunked and fused backends sum FP8 products per scale block in the grouped GEMM kernel):
the test prints whether they happened to agree bitwise.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kernels
from kernels.ops.moe.routing import MoeCall
from kernels.testing import run_ranks

G = 2.0**-24
EPS = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}
K, N, K_OUT = 144, 24, 10  # N splits over W = 1, 2, 3, 4
CASES = {"skewed": (5, 6, 2), "single": (3, 4, 2)}  # (m_local, E, topk)
W_MODE = {"block": "block2d", "row": "row", "tensor": "tensor"}
FP8 = torch.float8_e4m3fn


def _quantize_experts(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's weight shard quantized on its own: ``(payload [E, n, k], w_scale)`` in grouped_matmul's
    layout (``[E, ceil(n / 128), ceil(k / 128)]``, ``[E, n, 1]``, ``[E]``)."""
    pairs = [kernels.quantize_fp8(w[e].contiguous(), mode=W_MODE[mode]) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s.reshape(()) if mode == "tensor" else s for _, s in pairs])


def _inputs(world: int, rank: int, case: str, mode: str) -> dict[str, Any]:
    """This rank's FP8 operands of both ops, and every rank's raw values (the same on every rank: seeded)."""
    m_local, num_e, topk = CASES[case]
    g = torch.Generator().manual_seed(1000 * world + 10 * len(case) + len(mode))
    tokens = m_local * world
    if case == "skewed":
        ids = torch.tensor([0, 1, 3])[torch.randint(0, 3, (tokens, topk), generator=g)]
        ids = torch.where(torch.rand(tokens, topk, generator=g) < 0.7, 2, ids)
    else:
        ids = torch.ones(tokens, topk, dtype=torch.int64)
    # Rank r's tokens scaled by r + 1: its tensorwise scale differs from its peers'.
    x = torch.randn(tokens, K, generator=g) * torch.arange(1, world + 1).repeat_interleave(m_local)[:, None]
    w1 = torch.randn(num_e, N, K, generator=g) / K**0.5
    w2 = torch.randn(num_e, K_OUT, N, generator=g) / N**0.5
    h = torch.randn(tokens * topk, N, generator=g)
    tw = torch.rand(tokens, topk, generator=g)
    n_local = N // world
    own, cols = slice(rank * m_local, (rank + 1) * m_local), slice(rank * n_local, (rank + 1) * n_local)
    xq, xs = kernels.quantize_fp8(x[own].contiguous(), mode=mode)
    w1q, w1s = _quantize_experts(w1[:, cols], mode)
    hq, hs = kernels.quantize_fp8(h[:, cols].contiguous(), mode=mode)
    w2q, w2s = _quantize_experts(w2[:, :, cols], mode)
    return {
        "ids": ids.to(torch.int32),
        "tw": tw,
        "own": own,
        "gather": (xq, xs, w1q, w1s),
        "scatter": (hq, hs, w2q, w2s),
    }


def _ranks_body(rank: int, world: int, runs: list[tuple[str, str, str, str]]) -> list:
    """Each run ``(backend, mode, case, out_dtype name)``: both ops on that backend and on the sequential one."""
    out = []
    for backend, mode, case, dtype_name in runs:
        inp = _inputs(world, rank, case, mode)
        xq, xs, w1q, w1s = inp["gather"]
        hq, hs, w2q, w2s = inp["scatter"]
        got = {}
        for name in (backend, "sequential"):
            opts = {"backend": name, "parallel_num": 2 if name == "chunked" else None}
            opts["out_dtype"] = getattr(torch, dtype_name)
            with torch.no_grad():
                y, routing = kernels.all_gather_grouped_matmul(
                    xq, inp["ids"][inp["own"]], w1q, x_scale=xs, w_scale=w1s, **opts
                )
                o = kernels.grouped_matmul_reduce_scatter(hq, w2q, routing, inp["tw"], x_scale=hs, w_scale=w2s, **opts)
            got[name] = (y, tuple(routing), o)
        out.append(got)
    return out


def _dequantized(world: int, case: str, mode: str) -> dict[str, list[torch.Tensor]]:
    """Every rank's dequantized operands in fp64: x [m_local, k], w1 [E, n_local, k], h [rows, n_local], w2."""
    out: dict[str, list[torch.Tensor]] = {"x": [], "w1": [], "h": [], "w2": []}
    for r in range(world):
        inp = _inputs(world, r, case, mode)
        xq, xs, w1q, w1s = inp["gather"]
        hq, hs, w2q, w2s = inp["scatter"]
        out["x"].append(kernels.dequantize_fp8(xq, xs, mode).double())
        out["h"].append(kernels.dequantize_fp8(hq, hs, mode).double())
        for key, q, s in (("w1", w1q, w1s), ("w2", w2q, w2s)):
            out[key].append(torch.stack([kernels.dequantize_fp8(q[e], s[e], W_MODE[mode]) for e in range(q.shape[0])]))
    return {key: [t.double() for t in ts] for key, ts in out.items()}


def _bounds(world: int, rank: int, run: tuple, deq: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{op: (truth, bound)}`` for this rank (module docstring)."""
    _, mode, case, dtype_name = run
    eps = EPS[getattr(torch, dtype_name)]
    m_local, _, topk = CASES[case]
    inp = _inputs(world, rank, case, mode)
    ids = inp["ids"].long()
    pairs = sorted((int(ids[t, s]), t, s) for t in range(ids.shape[0]) for s in range(topk))
    xg = torch.cat(deq["x"])
    w1 = deq["w1"][rank][[e for e, _, _ in pairs]]  # [rows, n_local, k]
    x_rows = xg[[t for _, t, _ in pairs]]
    y64 = torch.einsum("rnk,rk->rn", w1, x_rows)
    s1 = torch.einsum("rnk,rk->rn", w1.abs(), x_rows.abs())
    row = {(t, s): j for j, (_, t, s) in enumerate(pairs)}
    out64, s2 = torch.zeros(m_local, K_OUT, dtype=torch.float64), torch.zeros(m_local, K_OUT, dtype=torch.float64)
    tw = inp["tw"].double()
    for r in range(world):
        for i, t in enumerate(range(rank * m_local, (rank + 1) * m_local)):
            for s in range(topk):
                hj, we = deq["h"][r][row[(t, s)]], deq["w2"][r][int(ids[t, s])]
                out64[i] += tw[t, s] * (we @ hj)
                s2[i] += tw[t, s] * (we.abs() @ hj.abs())
    n_local = N // world
    return {
        "y": (y64, eps * y64.abs() + 2 * (K + 2) * G * s1),
        "out": (out64, eps * out64.abs() + (2 * n_local + topk + world + 6) * G * s2),
    }


def _check_runs(world: int, runs: list, per_rank: list) -> None:
    worst: dict[str, float] = {}
    bitwise: dict[str, bool] = {}
    for rank, outs in enumerate(per_rank):
        for run, got in zip(runs, outs, strict=True):
            backend, mode, case, dtype_name = run
            tag = f"{run} W={world} rank={rank}"
            truth = _bounds(world, rank, run, _dequantized(world, case, mode))
            seq = got["sequential"]
            mine = got[backend]
            assert all(torch.equal(a, b) for a, b in zip(mine[1], seq[1], strict=True)), (tag, "routing")
            for key, i in (("y", 0), ("out", 2)):
                want, bound = truth[key]
                for name, value in ((backend, mine[i]), ("sequential", seq[i])):
                    assert value.dtype == getattr(torch, dtype_name), (tag, key, name)
                    err = (value.double() - want).abs()
                    assert (err <= bound).all(), (tag, key, name, (err - bound).max().item())
                    share = (err / bound.clamp_min(1e-300)).max().item() if err.numel() else 0.0
                    label = f"{name} {mode} {dtype_name} {key}"
                    worst[label] = max(worst.get(label, 0.0), share)
                diff = (mine[i].double() - seq[i].double()).abs()
                assert (diff <= 2 * bound).all(), (tag, key, "vs sequential", diff.max().item())
                label = f"{backend} vs sequential {mode} {key}"
                bitwise[label] = bitwise.get(label, True) and torch.equal(mine[i], seq[i])
    print(f"W={world} worst |error| / bound: {worst}; bitwise equal to the reference: {bitwise}")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fp8_fused_block_mode_matches_fp64_and_the_reference(world: int) -> None:
    """The fused backend (gather of packed rows over the heap, the grouped GEMM's FP8 path, the fused combine and
    reduce-scatter) in block mode, skewed and single-expert routing, bf16 out; the chunked backend (two pieces)
    on the skewed routing; the sequential backend is every run's reference."""
    runs = [("fused", "block", case, "bfloat16") for case in CASES] + [("chunked", "block", "skewed", "bfloat16")]
    _check_runs(world, runs, run_ranks(_ranks_body, world, runs, timeout=600))


def test_fp8_every_backend_and_mode_at_two_ranks() -> None:
    """Chunked (two pieces) and fused in row, tensor and block mode, with fp16, fp32 and bf16 outputs; tensor mode's
    per-rank scalars travel with their rows."""
    runs = [
        ("chunked", "row", "skewed", "float16"),
        ("chunked", "tensor", "single", "float32"),
        ("chunked", "block", "skewed", "bfloat16"),
        ("fused", "row", "single", "float16"),
        ("fused", "tensor", "skewed", "bfloat16"),
    ]
    _check_runs(2, runs, run_ranks(_ranks_body, 2, runs, timeout=600))


def _fp8_one_rank() -> dict[str, Any]:
    inp = _inputs(1, 0, "skewed", "row")
    xq, xs, w1q, w1s = inp["gather"]
    hq, hs, w2q, w2s = inp["scatter"]
    with torch.no_grad():
        _, routing = kernels.all_gather_grouped_matmul(xq, inp["ids"], w1q, x_scale=xs, w_scale=w1s)
    return {**inp, "routing": routing}


def _bad_calls() -> list[tuple[str, Any, type, str]]:
    inp = _fp8_one_rank()
    xq, xs, w1q, w1s = inp["gather"]
    hq, hs, w2q, w2s = inp["scatter"]
    ids, tw, routing = inp["ids"], inp["tw"], inp["routing"]
    agg, grs = kernels.all_gather_grouped_matmul, kernels.grouped_matmul_reduce_scatter
    x32, w32 = xq.float(), w1q.float()
    return [
        (
            "x without scale",
            lambda: agg(xq, ids, w1q, w_scale=w1s),
            TypeError,
            r"x_scale must be a torch.Tensor for FP8 x",
        ),
        ("h without scale", lambda: grs(hq, w2q, routing, tw, w_scale=w2s), TypeError, r"x_scale must be .* FP8 h"),
        (
            "scale, plain x",
            lambda: agg(x32, ids, w32, x_scale=xs),
            ValueError,
            r"x_scale is given but x is torch.float32",
        ),
        (
            "plain weight",
            lambda: agg(xq, ids, w32, x_scale=xs, w_scale=w1s),
            TypeError,
            r"weight dtype torch.float32 is not FP8",
        ),
        (
            "x_scale shape",
            lambda: agg(xq, ids, w1q, x_scale=xs[:2], w_scale=w1s),
            ValueError,
            r"x_scale shape \[2, 1\] .* fit no scaling mode",
        ),
        (
            "w_scale shape",
            lambda: grs(hq, w2q, routing, tw, x_scale=hs, w_scale=w2s[0]),
            ValueError,
            r"fit no scaling mode for h",
        ),
        (
            "plain out_dtype",
            lambda: agg(x32, ids, w32, out_dtype=torch.float16),
            ValueError,
            r"out_dtype=torch.float16 is not accepted",
        ),
        (
            "fp8 out_dtype",
            lambda: agg(xq, ids, w1q, x_scale=xs, w_scale=w1s, out_dtype=FP8),
            ValueError,
            r"out_dtype=.* is not accepted",
        ),
    ]


def test_bad_fp8_arguments_raise_by_name() -> None:
    with torch.no_grad():
        for name, call, cls, pattern in _bad_calls():
            with pytest.raises(cls, match=pattern):
                call()
                pytest.fail(f"{name}: no error")


def test_fp8_is_forward_only_and_refuses_gradients_by_name() -> None:
    """As the dense FP8 ops: a gradient through an FP8 payload or scale cannot be given, so asking for one is an
    error (before any communication), never a result without it."""
    inp = _fp8_one_rank()
    xq, xs, w1q, w1s = inp["gather"]
    hq, hs, w2q, w2s = inp["scatter"]
    with pytest.raises(TypeError, match=r"^x requires grad, but the FP8 format of the MoE ops is forward-only"):
        kernels.all_gather_grouped_matmul(xq.clone().requires_grad_(), inp["ids"], w1q, x_scale=xs, w_scale=w1s)
    with pytest.raises(TypeError, match=r"^w_scale requires grad"):
        kernels.all_gather_grouped_matmul(xq, inp["ids"], w1q, x_scale=xs, w_scale=w1s.clone().requires_grad_())
    tw = inp["tw"].clone().requires_grad_()
    with pytest.raises(TypeError, match=r"^topk_weights requires grad, but the FP8 format"):
        kernels.grouped_matmul_reduce_scatter(hq, w2q, inp["routing"], tw, x_scale=hs, w_scale=w2s)
    out = kernels.grouped_matmul_reduce_scatter(hq, w2q, inp["routing"], inp["tw"], x_scale=hs, w_scale=w2s)
    assert not out.requires_grad and out.dtype == torch.bfloat16


def test_fp8_registered_operators_and_fakes() -> None:
    """The operators with scales give the public call's bits; their fakes the FP8 call's shapes and out_dtype; the
    four-field call string of a plain call (before formats) still decodes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kernels.format import fp8

    inp = _fp8_one_rank()
    xq, xs, w1q, w1s = inp["gather"]
    hq, hs, w2q, w2s = inp["scatter"]
    call = MoeCall(op="all_gather_grouped_matmul", backend="sequential", fmt=fp8("row"), out_dtype=torch.float16)
    call = call.encode()
    assert MoeCall.decode(call).out_dtype == torch.float16 and MoeCall.decode(call).fmt == fp8("row")
    with torch.no_grad():
        y, routing = kernels.all_gather_grouped_matmul(
            xq, inp["ids"], w1q, x_scale=xs, w_scale=w1s, out_dtype=torch.float16, backend="sequential"
        )
        out = kernels.grouped_matmul_reduce_scatter(
            hq, w2q, routing, inp["tw"], x_scale=hs, w_scale=w2s, out_dtype=torch.float16, backend="sequential"
        )
    oy, *orouting = torch.ops.coc.all_gather_grouped_matmul(xq, inp["ids"], w1q, xs, w1s, call)
    oout = torch.ops.coc.grouped_matmul_reduce_scatter(hq, w2q, orouting, inp["tw"], hs, w2s, call)
    assert torch.equal(oy, y) and torch.equal(oout, out)
    with FakeTensorMode() as mode:
        fx, fids, fw1, fxs, fw1s, fh, fw2, fhs, fw2s, ftw = (
            mode.from_tensor(t) for t in (xq, inp["ids"], w1q, xs, w1s, hq, w2q, hs, w2s, inp["tw"])
        )
        fy, fo, fi, fs = torch.ops.coc.all_gather_grouped_matmul(fx, fids, fw1, fxs, fw1s, call)
        fout = torch.ops.coc.grouped_matmul_reduce_scatter(fh, fw2, [fo, fi, fs], ftw, fhs, fw2s, call)
    assert fy.shape == y.shape and fy.dtype == torch.float16 and fo.shape == (6,)
    assert fout.shape == out.shape and fout.dtype == torch.float16


def _disagreeing_body(rank: int, world: int, what: str) -> str:
    mode = "row" if rank == 1 and what == "mode" else "block"
    inp = _inputs(world, rank, "skewed", mode)
    xq, xs, w1q, w1s = inp["gather"]
    x_scale, weight, w_scale = xs, w1q, w1s
    out_dtype = torch.float16 if rank == 1 and what == "out_dtype" else torch.bfloat16
    if rank == 1 and what == "plain":
        x_scale, weight, w_scale = None, w1q.to(torch.bfloat16), None
        xq = xq.to(torch.bfloat16)
        out_dtype = None
    try:
        with torch.no_grad():
            kernels.all_gather_grouped_matmul(
                xq, inp["ids"][inp["own"]], weight, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype,
                backend="chunked",
            )  # fmt: skip
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("mode", r"rank 0 has format=fp8:block, rank 1 has format=fp8:row"),
        ("out_dtype", r"rank 0 has out_dtype=torch.bfloat16, rank 1 has out_dtype=torch.float16"),
        ("plain", r"rank 0 has x.dtype=torch.float8_e4m3fn, rank 1 has x.dtype=torch.bfloat16"),
    ],
)
def test_ranks_that_disagree_on_the_format_are_refused_by_name(what: str, message: str) -> None:
    for text in run_ranks(_disagreeing_body, 2, what, timeout=120, env={"COC_CHECK": "1"}):
        assert re.search(r"all_gather_grouped_matmul: ranks disagree: .*" + message, text), text
