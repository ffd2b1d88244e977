"""FP8 payloads of the expert-parallel dispatch (kernels/ops/moe_ep.py, kernels/ops/moe_ep_payload.py): rows that
carry their per-row or per-1x128 scales, on every backend, exact and bounded.

Movement is exact, so the checks are bitwise: each dispatched row and scale row are the bytes of their source
token's (from the handle's ``src_rank`` / ``src_token``), equal to the sequential reference's, and equal to a plain
dispatch of the same bytes (payload then scale bytes of each row, viewed as fp32); bounded mode's padding rows are
zero with scale 1.0. Routing is uneven: expert 1 takes every token's first slot, expert 0 never gets a pair.

End to end (dispatch -> ``kernels.grouped_matmul`` on the FP8 rows as they come -> combine), against fp64 of the
*dequantized* operands, so the quantization error is on both sides and the bound is the arithmetic's
(``u = 2^-24``, ``b = 2^-8`` bf16's unit roundoff, ``S1 = |xd_t| @ |wd_e|.T``): the grouped GEMM is
:func:`kernels.fp8.numerics.op_error_bound` of its accumulation (``|y - y64| <= b |y64| + (1 + b) E S1``, one bf16
rounding); the combine's fp32 products and ``topk - 1`` fp32 sums add ``gamma(topk, u) sum_s |w_ts| |y_ts|`` and
its one bf16 rounding ``b |out64|`` (plus half a subnormal step of each rounding).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kernels
from kernels.format import fp8
from kernels.fp8 import numerics
from kernels.ops.moe import ep as moe_ep
from kernels.ops.moe.layout import EpCall
from kernels.testing import assert_no_errors, outcomes, run_ranks
from kernels.testing import fp8 as f8

M, K, N, TOPK = 5, 160, 8, 2  # K: two scale blocks, the second partial
CAP = 48  # max_tokens of the bounded runs: above every rank's receive count here (at most M * W * TOPK = 40)
# (payload dtype, scale layout)
FORMATS = [(torch.float8_e4m3fn, "row"), (torch.float8_e5m2, "block")]
BACKENDS = ("sequential", "chunked", "fused")


def _num_experts(world: int) -> int:
    return 2 * world if world > 1 else 4


def _inputs(world: int, dtype: torch.dtype, mode: str) -> dict[str, Any]:
    """Every rank's tokens (rank r holds rows ``[r M, (r + 1) M)``): expert 1 takes every first slot, the second
    slot goes to experts 2 .. E - 1, expert 0 gets nothing."""
    num_e = _num_experts(world)
    g = torch.Generator().manual_seed(3 + world)
    tokens = M * world
    ids = torch.stack([torch.ones(tokens, dtype=torch.int64), torch.randint(2, num_e, (tokens,), generator=g)], 1)
    xq, xs = f8.quantize(torch.randn(tokens, K, generator=g) * 3, mode, False, dtype)
    return {"xq": xq, "xs": xs, "ids": ids, "tw": torch.rand(tokens, TOPK, generator=g), "E": num_e}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _check_rows(tag: str, got: tuple, inp: dict[str, Any], cap: int | None, where: tuple[int, int]) -> list[str]:
    """The rows against the bytes of their source tokens, the padding against zeros and 1.0."""
    (rows, scale), h = got
    rank, world = where
    valid = int(h.valid)
    want_rows = int((inp["ids"] // (inp["E"] // world) == rank).sum())
    src = h.src_rank[:valid] * M + h.src_token[:valid]
    errors = []
    if valid != want_rows or rows.shape != (cap or valid, K) or scale.shape != (cap or valid, inp["xs"].shape[1]):
        errors.append(f"{tag}: valid {valid} (want {want_rows}), rows {tuple(rows.shape)}, scale {tuple(scale.shape)}")
    elif rows.dtype != inp["xq"].dtype or scale.dtype != torch.float32:
        errors.append(f"{tag}: dtypes {rows.dtype} {scale.dtype}")
    elif not torch.equal(_bytes(rows[:valid]), _bytes(inp["xq"][src])):
        errors.append(f"{tag}: payload rows are not their source tokens' bytes")
    elif not torch.equal(_bytes(scale[:valid]), _bytes(inp["xs"][src])):
        errors.append(f"{tag}: scale rows are not their source tokens' scales")
    elif _bytes(rows[valid:]).any() or not bool((scale[valid:] == 1.0).all()):
        errors.append(f"{tag}: padding rows are not zero payload with scale 1.0")
    return errors


def _moves_body(rank: int, world: int, backends: tuple[str, ...]) -> list[str]:
    errors = []
    for dtype, mode in FORMATS:
        inp = _inputs(world, dtype, mode)
        own = slice(rank * M, (rank + 1) * M)
        x, xs, ids, tw, num_e = inp["xq"][own], inp["xs"][own], inp["ids"][own], inp["tw"][own], inp["E"]
        for cap in (None, CAP):
            ref = kernels.moe_dispatch((x, xs), ids, tw, num_e, max_tokens=cap, backend="sequential")
            errors += _check_rows(f"{mode} cap={cap} reference", ref, inp, cap, (rank, world))
            # The same bytes as plain rows: payload then scale bytes, viewed as fp32 (k + 4 s is a multiple of 4).
            packed = torch.cat([_bytes(x), _bytes(xs).view(M, -1)], 1).view(torch.float32)
            plain, plain_h = kernels.moe_dispatch(packed, ids, tw, num_e, max_tokens=cap, backend="sequential")
            valid = int(plain_h.valid)
            (ref_rows, ref_scale), ref_h = ref
            moved = torch.cat([_bytes(ref_rows), _bytes(ref_scale)], 1)[:valid]
            if not torch.equal(moved, _bytes(plain)[:valid]):
                errors.append(f"{mode} cap={cap}: the reference's rows differ from the plain dispatch of their bytes")
            for backend in backends:
                got = kernels.moe_dispatch((x, xs), ids, tw, num_e, max_tokens=cap, backend=backend, parallel_num=2)
                (rows, scale), h = got
                tag = f"{mode} cap={cap} {backend}"
                if not (torch.equal(_bytes(rows), _bytes(ref_rows)) and torch.equal(_bytes(scale), _bytes(ref_scale))):
                    errors.append(f"{tag}: rows or scales differ from the reference's bits")
                for field in ("expert_offsets", "src_rank", "src_token", "src_slot", "valid", "pair_dest"):
                    if not torch.equal(getattr(h, field), getattr(ref_h, field)):
                        errors.append(f"{tag}: handle.{field} differs from the reference's")
                ran = EpCall.decode(h.call)
                if (str(ran.fmt), ran.backend) != (f"fp8:{mode}", backend):
                    errors.append(f"{tag}: the handle's call carries format {ran.fmt}, backend {ran.backend}")
    return errors


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fp8_rows_and_scales_move_bit_exact(world: int) -> None:
    """Every backend at W = 1 .. 4 (W = 1: the local movement): e4m3 rows with row scales and e5m2 rows with block
    scales, exact and bounded, bitwise (module docstring)."""
    assert_no_errors(run_ranks(_moves_body, world, BACKENDS, timeout=240))


def _dequantized_weights(world: int, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w_fp8 [E, N, K], w_scale, w64 dequantized [E, N, K])`` for ``mode`` (row: ``[E, N, 1]``, block: 128 x 128)."""
    g = torch.Generator().manual_seed(17)
    w = torch.randn(_num_experts(world), N, K, generator=g) / K**0.5
    pairs = [f8.quantize(w[e], mode, True) for e in range(w.shape[0])]
    wq, ws = torch.stack([p for p, _ in pairs]), torch.stack([s for _, s in pairs])
    return wq, ws, torch.stack([f8.dequant(p, s, mode, True) for p, s in pairs])


def _layer_body(rank: int, world: int, runs: list[tuple[str, int | None]]) -> list[torch.Tensor]:
    inp = _inputs(world, torch.float8_e4m3fn, "block")
    wq, ws, _ = _dequantized_weights(world, "block")
    own, e_l = slice(rank * M, (rank + 1) * M), inp["E"] // world
    mine = slice(rank * e_l, (rank + 1) * e_l)
    outs = []
    for backend, cap in runs:
        (rows, scale), h = kernels.moe_dispatch(
            (inp["xq"][own], inp["xs"][own]), inp["ids"][own], inp["tw"][own], inp["E"], max_tokens=cap, backend=backend
        )
        y = kernels.grouped_matmul(rows, wq[mine], h.expert_offsets, x_scale=scale, w_scale=ws[mine])
        outs.append(kernels.moe_combine(y, h, backend=backend))
    return outs


def test_fp8_dispatch_grouped_matmul_combine_against_fp64() -> None:
    """W = 2, every backend, exact and bounded (bounded: the padding rows' scale 1.0 passes grouped_matmul's scale
    checks): the layer within the bound of the module docstring, and the same bits on every backend and mode."""
    world = 2
    runs = [(backend, cap) for backend in BACKENDS for cap in (None, CAP)]
    inp = _inputs(world, torch.float8_e4m3fn, "block")
    _, _, w64 = _dequantized_weights(world, "block")
    xd = f8.dequant(inp["xq"], inp["xs"], "block", False)
    tw = inp["tw"].double()
    y64 = torch.stack([xd[t] @ w64[inp["ids"][t]].transpose(1, 2) for t in range(xd.shape[0])])  # [T, topk, N]
    s1 = torch.stack([xd[t].abs() @ w64[inp["ids"][t]].abs().transpose(1, 2) for t in range(xd.shape[0])])
    b, tiny = 2.0**-8, torch.finfo(torch.bfloat16).smallest_normal * 2.0**-8
    # The grouped GEMM's bound per pair (the looser of its accumulation models), then the combine's.
    e_gemm = max(numerics.relative_bound(K, 1, acc) for acc in ("fp32", "promoted"))
    y_err = b * y64.abs() + (1 + b) * e_gemm * s1 + tiny
    out64 = (tw[:, :, None] * y64).sum(1)
    weighted = tw[:, :, None].abs()
    sums = numerics.gamma(TOPK, numerics.U32) * (weighted * (y64.abs() + y_err)).sum(1)
    bound = b * out64.abs() + (1 + b) * ((weighted * y_err).sum(1) + sums) + tiny
    per_rank = run_ranks(_layer_body, world, runs, timeout=240)
    for rank, outs in enumerate(per_rank):
        own = slice(rank * M, (rank + 1) * M)
        for run, out in zip(runs, outs, strict=True):
            assert out.dtype == torch.bfloat16 and out.shape == (M, N), run
            err = (out.double() - out64[own]).abs()
            assert (err <= bound[own]).all(), (run, rank, float((err / bound[own]).max()))
            assert torch.equal(out, outs[0]), (run, rank)


def _overflow_body(rank: int, world: int, backend: str) -> list[str]:
    xq, xs = f8.quantize(torch.randn(4, K), "block", False)
    ids, tw = torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2)
    ids[:, 1] = 1  # every pair to rank 0's experts: it receives 8 * world rows
    seen = []
    try:
        kernels.moe_dispatch((xq, xs), ids, tw, 2 * world, max_tokens=5, backend=backend)
    except RuntimeError as e:
        seen.append(str(e))
    (rows, scale), h = kernels.moe_dispatch((xq, xs), ids, tw, 2 * world, max_tokens=8 * world + 2, backend=backend)
    seen.append(f"valid {int(h.valid)}, padding scales {scale[int(h.valid) :].unique().tolist()}")
    original = moe_ep.wanted
    moe_ep.wanted = lambda device: False  # CUDA eager: no host read, the flag is kept
    try:
        kernels.moe_dispatch((xq, xs), ids, tw, 2 * world, max_tokens=5, backend=backend)
    finally:
        moe_ep.wanted = original
    try:
        kernels.moe_check_overflow()
    except RuntimeError as e:
        seen.append(str(e))
    return seen


@pytest.mark.parametrize("backend", ["sequential", "fused"])
def test_fp8_bounded_overflow_raises_by_name_on_every_rank(backend: str) -> None:
    world = 2
    for rank, seen in enumerate(run_ranks(_overflow_body, world, backend, timeout=120)):
        assert len(seen) == 3, (rank, seen)
        assert re.search(rf"max_tokens=5 overflow: rank 0 would receive {8 * world} rows", seen[0]), seen[0]
        assert seen[1] == (f"valid {8 * world}, padding scales [1.0]" if rank == 0 else "valid 0, padding scales [1.0]")
        assert "max_tokens overflow in an earlier bounded call" in seen[2], seen[2]


def _errors_body(rank: int, world: int) -> list[str]:
    xq, xs = f8.quantize(torch.randn(3, K), "block", False)
    rows_scale = xs[:, :1].contiguous()
    ids, tw = torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    calls = [
        lambda: kernels.moe_dispatch(xq, ids, tw, 4),
        lambda: kernels.moe_dispatch((xq.float(), xs), ids, tw, 4),
        lambda: kernels.moe_dispatch((xq, xs, xs), ids, tw, 4),
        lambda: kernels.moe_dispatch((xq, xs[0, 0]), ids, tw, 4),
        lambda: kernels.moe_dispatch((xq, xs[:, :1].expand(3, 3)), ids, tw, 4),
        lambda: kernels.moe_dispatch((xq, xs.double()), ids, tw, 4),
        lambda: kernels.moe_dispatch((xq, xs.to("meta")), ids, tw, 4),
        lambda: kernels.moe_dispatch((xq, xs.clone().requires_grad_()), ids, tw, 4),
        # torch lets an FP8 tensor require grad (a quantization inside a training graph): refused, not dropped
        lambda: kernels.moe_dispatch((xq.float().requires_grad_().to(xq.dtype), xs), ids, tw, 4),
        lambda: kernels.moe_dispatch((xq, rows_scale if rank else xs), ids, tw, 4),  # row vs block layout
        lambda: kernels.moe_dispatch((xq.view(torch.float8_e5m2) if rank else xq, xs), ids, tw, 4),
        lambda: kernels.moe_dispatch(xq.float() if rank else (xq, xs), ids, tw, 4),  # FP8 vs fp32
    ]
    seen = outcomes(calls)
    (rows, _), h = kernels.moe_dispatch((xq, xs), ids, tw, 4)
    try:
        kernels.moe_combine(rows, h)
    except TypeError as e:
        seen.append(f"TypeError: {e}")
    return seen


def test_fp8_named_errors_before_any_communication() -> None:
    expected = [
        r"TypeError: .*x is torch.float8_e4m3fn without its scale: pass x = \(x_fp8, x_scale\)",
        r"ValueError: .*x carries a scale but x is torch.float32: scales go with FP8 payloads only",
        r"TypeError: .*x must be a torch.Tensor or an \(x_fp8, x_scale\) pair of tensors, got a tuple of 3",
        r"ValueError: .*x_scale of shape \[\] is tensor-wise .* could not apply their senders' scalars",
        r"ValueError: .*x_scale shape \[3, 3\] does not fit x \[m_local=3, k=160\]: use \[3, 1\] .* or \[3, 2\]",
        r"TypeError: .*x_scale dtype torch.float64 is not accepted",
        r"ValueError: .*x_scale is on meta but x is on cpu",
        r"TypeError: .*x_scale requires grad; an FP8 dispatch is not differentiable",
        r"TypeError: .*x \(torch.float8_e4m3fn\) requires grad; an FP8 dispatch is not differentiable",
        r"RuntimeError: moe_dispatch: ranks disagree: rank 0 has format=fp8:block, rank 1 has format=fp8:row",
        r"RuntimeError: moe_dispatch: ranks disagree: rank 0 has x.dtype=torch.float8_e4m3fn, rank 1 has "
        r"x.dtype=torch.float8_e5m2",
        r"RuntimeError: moe_dispatch: ranks disagree: rank 0 has x.dtype=torch.float8_e4m3fn, rank 1 has "
        r"x.dtype=torch.float32",
        r"TypeError: .*y dtype torch.float8_e4m3fn is not accepted.* its payloads are never FP8",
    ]
    for rank, seen in enumerate(run_ranks(_errors_body, 2, timeout=60, env={"COC_CHECK": "1"})):
        assert len(seen) == len(expected), seen
        for pattern, message in zip(expected, seen, strict=True):
            assert re.search(pattern, message), (rank, pattern, message)


def _fused_mismatch_body(rank: int, world: int) -> str:
    """On a fresh group (its heap made by a first, matching call), rank 1 sends row scales where rank 0 sends block
    scales: the admission refuses it by name on every rank, before the heap's check (which would only see the call
    digests differ)."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    xq, xs = f8.quantize(torch.randn(3, K), "block", False)
    ids, tw = torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    kernels.moe_dispatch((xq, xs), ids, tw, 4, max_tokens=16, backend="fused", group=group)
    scale = xs[:, :1].contiguous() if rank else xs
    try:
        kernels.moe_dispatch((xq, scale), ids, tw, 4, max_tokens=16, backend="fused", group=group)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_fp8_fused_ranks_that_disagree_on_the_layout_are_refused_by_name() -> None:
    for text in run_ranks(_fused_mismatch_body, 2, timeout=120, env={"COC_CHECK": None}):
        assert text.startswith("moe_dispatch: ranks disagree: rank 0 has format=fp8:block, rank 1 has format=fp8:row")
        assert "before any communication of the op" in text, text


def test_fp8_fakes_and_compiled_dispatch() -> None:
    """The operator's fake gives the scale output's shape (bounded and exact: a dynamic row count), and
    ``torch.compile(fullgraph=True)`` traces an FP8 bounded dispatch (group of one) into one ``coc`` call that
    gives the eager bits."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    inp = _inputs(1, torch.float8_e4m3fn, "block")
    for cap in (16, 0):
        call = EpCall(
            op="moe_dispatch",
            backend="sequential",
            parallel_num=1,
            num_experts=inp["E"],
            max_tokens=cap,
            fmt=fp8("block"),
        ).encode()
        with FakeTensorMode(shape_env=ShapeEnv()) as mode:
            x, xs, ids = (mode.from_tensor(inp[k]) for k in ("xq", "xs", "ids"))
            out = torch.ops.coc.moe_dispatch(x[:M], xs[:M], ids[:M], call)
        rows = 16 if cap else out[0].shape[0]
        assert out[0].shape == (rows, K) and out[0].dtype == torch.float8_e4m3fn, cap
        assert out[1].shape == (rows, 2) and out[1].dtype == torch.float32, cap
        assert len(out) == 13, cap
    graphs: list[torch.fx.GraphModule] = []

    def layer(xq: torch.Tensor, xs: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor) -> tuple:
        (rows, scale), h = kernels.moe_dispatch((xq, xs), ids, tw, inp["E"], max_tokens=16)
        return rows.view(torch.uint8), scale, h.expert_offsets, h.valid

    def record(gm: torch.fx.GraphModule, _: object) -> Any:
        graphs.append(gm)
        return gm.forward

    args = (inp["xq"], inp["xs"], inp["ids"], inp["tw"])
    compiled = torch.compile(layer, backend=record, fullgraph=True)(*args)
    assert all(torch.equal(a, b) for a, b in zip(compiled, layer(*args), strict=True))
    calls = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.coc.moe_dispatch.default]
    assert len(calls) == 1 and int(compiled[3]) == M * TOPK
