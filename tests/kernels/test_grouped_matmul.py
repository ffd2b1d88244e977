"""kernels.grouped_matmul: the persistent grouped GEMM (Triton interpreter on CPU) against its reference twin, torch's
``_grouped_mm`` where this build has it, and an fp64 per-expert loop; the named errors of every bad argument.

Tolerances, from the arithmetic. The ground truth is the fp64 product of the very operands the kernel reads (for
FP8 the dequantized ones, which are exact in fp32: an e4m3 payload times an fp32 power-of-two-ish scale). The kernel
sums fp32 products in some order and rounds once to the output dtype, so per element::

    |y - truth| <= eps(out) * |truth| + 2 (k + 1) 2^-24 (|x| @ |w|^T)

The first term is one rounding to the output dtype (eps = 2^-7 for bf16, 2^-10 for fp16, 2^-23 for fp32: a whole
ulp, where one rounding to nearest needs half of one; the margin dates from when the interpreter truncated fp32 to
bf16, kernels/fused/interpreter_compat.py); the second bounds a reordered fp32 sum of k terms.
For bf16 inputs this is the "compare with the fp32 reference of the same bf16 inputs within ~2^-8 relative" rule
made precise. torch's loop (the reference twin) and ``torch._grouped_mm`` obey the same bound.

Kernel tests carry "fused" in their names, so ``make test-triton36`` reruns them under Triton 3.6 (tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels
from kernels.fused import blocks, grouped
from kernels.protocol import kernel_runs_on

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="needs the Triton interpreter"
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"

# (dtype, relative rounding bound of the output: one ulp) for the plain formats.
PLAIN = [(torch.float32, 2.0**-23), (torch.bfloat16, 2.0**-7), (torch.float16, 2.0**-10)]
# (m, n, k, rows per expert): m off the 16-row CPU tile, empty experts first / middle / last, E = 1 and E = 5.
SHAPES = [
    (37, 33, 40, (5, 0, 25, 7)),
    (20, 16, 32, (20,)),
    (30, 48, 24, (0, 7, 0, 23, 0)),
    (64, 70, 256, (17, 15, 32)),
]


def _offsets(rows: tuple[int, ...], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype, device=DEVICE).cumsum(0).to(dtype)


def _truth(xd: torch.Tensor, wd: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 per-expert product and ``|x| @ |w|^T`` (the magnitude the fp32 sums' error scales with)."""
    truth = torch.zeros(xd.shape[0], wd.shape[1], dtype=torch.float64, device=xd.device)
    magnitude = torch.zeros_like(truth)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        xe, we = xd[start:end].double(), wd[e].double()
        truth[start:end] = xe @ we.T
        magnitude[start:end] = xe.abs() @ we.abs().T
        start = end
    return truth, magnitude


def _assert_within(y: torch.Tensor, truth: torch.Tensor, magnitude: torch.Tensor, rounding: float) -> str:
    """The module docstring's bound; returns the largest error and the largest share of the bound it uses."""
    assert not torch.isnan(y).any(), "rows left unwritten (NaN-filled output)"
    k_term = 2 * (magnitude.shape[1] + 1) * 2.0**-24
    bound = rounding * truth.abs() + k_term * magnitude
    diff = (y.double() - truth).abs()
    assert bool((diff <= bound).all()), f"max diff {diff.max().item()} over bound {bound.max().item()}"
    if not diff.numel():
        return "empty"
    return (
        f"max |error| {diff.max().item():.3g}, at most {(diff / bound.clamp_min(1e-300)).max().item():.2f} of the bound"
    )


def _fp8_operands(shape: tuple, mode: str) -> tuple:
    """FP8 e4m3 ``x``, ``weight`` and their scales of ``mode`` (weight scales stacked per expert)."""
    m, n, k, num_experts = shape
    x = torch.randn(m, k, device=DEVICE) * 3
    w = torch.randn(num_experts, n, k, device=DEVICE)
    xq, xs = kernels.quantize_fp8(x, mode=mode)
    pairs = [kernels.quantize_fp8(w[e], mode="block2d" if mode == "block" else mode) for e in range(num_experts)]
    wq = torch.stack([q for q, _ in pairs])
    ws = torch.stack([s.reshape(()) if mode == "tensor" else s for _, s in pairs])
    return xq, xs, wq, ws


@interpreted
@pytest.mark.parametrize(("dtype", "rounding"), PLAIN, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"m{s[0]}-n{s[1]}-k{s[2]}-E{len(s[3])}")
def test_fused_plain_matches_the_reference_and_grouped_mm(shape, dtype, rounding):
    torch.manual_seed(0)
    m, n, k, rows = shape
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = torch.randn(len(rows), n, k, device=DEVICE).to(dtype)
    offsets = _offsets(rows)
    truth, magnitude = _truth(x, w, offsets)
    err = _assert_within(kernels.grouped_matmul(x, w, offsets, backend="fused"), truth, magnitude, rounding)
    _assert_within(kernels.grouped_matmul(x, w, offsets, backend="sequential"), truth, magnitude, rounding)
    print(f"{dtype} {shape}: fused vs fp64 truth: {err}")
    if hasattr(torch, "_grouped_mm"):
        try:
            theirs = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
        except (RuntimeError, NotImplementedError):  # dtype or device this build's kernel lacks
            return
        _assert_within(theirs, truth, magnitude, rounding)


@interpreted
@pytest.mark.parametrize(
    ("mode", "out_dtype", "shape"),
    [
        ("block", torch.float32, (50, 140, 200, (20, 0, 30))),  # two weight scale rows, a partial k block, k % 16
        ("block", torch.bfloat16, (40, 64, 256, (9, 31))),  # whole scale blocks (64-deep k steps)
        ("row", torch.float16, (33, 48, 64, (0, 33))),
        ("tensor", torch.bfloat16, (24, 32, 96, (10, 4, 10))),
    ],
    ids=["block-fp32", "block-bf16", "row-fp16", "tensor-bf16"],
)
def test_fused_fp8_matches_the_dequantized_reference(mode, out_dtype, shape):
    torch.manual_seed(1)
    m, n, k, rows = shape
    xq, xs, wq, ws = _fp8_operands((m, n, k, len(rows)), mode)
    offsets = _offsets(rows, torch.int64)
    scaled = dict(x_scale=xs, w_scale=ws, out_dtype=out_dtype)
    y = kernels.grouped_matmul(xq, wq, offsets, backend="fused", **scaled)
    assert y.dtype == out_dtype
    xd = kernels.dequantize_fp8(xq, xs, mode)
    wmode = "block2d" if mode == "block" else mode
    wd = torch.stack([kernels.dequantize_fp8(wq[e], ws[e], wmode) for e in range(len(rows))])
    truth, magnitude = _truth(xd, wd, offsets)
    rounding = torch.finfo(out_dtype).eps
    err = _assert_within(y, truth, magnitude, rounding)
    _assert_within(kernels.grouped_matmul(xq, wq, offsets, **scaled, backend="sequential"), truth, magnitude, rounding)
    print(f"fp8 {mode} -> {out_dtype} {shape}: fused vs fp64 truth: {err}")


@interpreted
@pytest.mark.parametrize("cfg", [(16, 16, 16, 1), (32, 16, 16, 4), (16, 32, 32, 2)], ids=str)
def test_fused_walk_writes_every_row_once_for_any_tiles(cfg):
    """NaN-filled output: a tile the walk skips stays NaN; tile sizes and group orders other than the defaults."""
    torch.manual_seed(2)
    rows = (0, 19, 1, 0, 33, 2)
    x, w = torch.randn(55, 24, device=DEVICE), torch.randn(6, 40, 24, device=DEVICE)
    offsets = _offsets(rows)
    out = torch.full((55, 40), float("nan"), device=DEVICE)
    bm, bn, bk, gm = cfg
    tiles = blocks.BlockConfig(bm, bn, bk, num_warps=1, num_stages=1, ag_splits=1, group_m=gm)
    grouped.launch(kernels.format.PLAIN, x, w, offsets, out, cfg=tiles)
    _assert_within(out, *_truth(x, w, offsets), 2.0**-23)


@interpreted
def test_fused_empty_shapes_and_bad_offsets_stay_in_bounds():
    x, w = torch.randn(9, 8, device=DEVICE), torch.randn(2, 5, 8, device=DEVICE)
    assert kernels.grouped_matmul(x[:0], w, _offsets((0, 0)), backend="fused").shape == (0, 5)
    assert kernels.grouped_matmul(x, w[:, :0], _offsets((4, 5)), backend="fused").shape == (9, 0)
    assert torch.equal(
        kernels.grouped_matmul(x[:, :0], w[:, :, :0], _offsets((4, 5)), backend="fused"),
        torch.zeros(9, 5, device=DEVICE),
    )
    # Unchecked offsets (a CUDA call reads none on the host): clamped into [0, m], non-decreasing, on the device.
    out = torch.full((9, 5), float("nan"), device=DEVICE)
    grouped.launch(kernels.format.PLAIN, x, w, torch.tensor([6, 3], device=DEVICE), out)
    truth, magnitude = _truth(x, w, torch.tensor([6, 9]))
    _assert_within(out[:6], truth[:6], magnitude[:6], 2.0**-23)
    assert torch.isnan(out[6:]).all()  # expert 1 clamped to no rows: rows past the last end are not written
    out = torch.full((9, 5), float("nan"), device=DEVICE)
    grouped.launch(kernels.format.PLAIN, x, w, torch.tensor([-4, 50], device=DEVICE), out)
    _assert_within(out, *_truth(x, w, torch.tensor([0, 9])), 2.0**-23)


def test_without_the_interpreter_cpu_calls_run_the_reference(monkeypatch):
    x, w, offsets = torch.randn(6, 8), torch.randn(2, 4, 8), torch.tensor([2, 6])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernel_runs_on(torch.device("cpu"))
    monkeypatch.setattr(grouped, "launch", None)  # the kernel is not reached
    assert torch.equal(
        kernels.grouped_matmul(x, w, offsets), kernels.grouped_matmul(x, w, offsets, backend="sequential")
    )
    with pytest.raises(ValueError, match="backend='fused': the Triton kernel cannot run on cpu"):
        kernels.grouped_matmul(x, w, offsets, backend="fused")


def test_registered_operator_has_a_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kernels.format import fp8
    from kernels.ops.grouped_matmul import GroupedCall

    with FakeTensorMode():
        x, w = torch.empty(7, 8, dtype=torch.float8_e4m3fn), torch.empty(3, 5, 8, dtype=torch.float8_e4m3fn)
        call = GroupedCall(op="grouped_matmul", backend="fused", fmt=fp8("row"), out_dtype=torch.float16).encode()
        args = (torch.empty(7, 1), torch.empty(3, 5, 1), call)
        y = torch.ops.coc.grouped_matmul(x, w, torch.empty(3, dtype=torch.int32), *args)
    assert (y.shape, y.dtype) == ((7, 5), torch.float16)


X, W, OFFS = torch.randn(6, 8), torch.randn(2, 4, 8), torch.tensor([2, 6])
XQ, XS, WQ, WS = (
    torch.zeros(6, 256, dtype=torch.float8_e4m3fn),
    torch.ones(6, 2),
    torch.zeros(2, 4, 256),
    torch.ones(2, 1, 2),
)
WQ = WQ.to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            (X, W, torch.tensor([4, 2])),
            {},
            ValueError,
            r"non-decreasing.*expert_offsets\[1\]=2 < expert_offsets\[0\]=4",
        ),
        ((X, W, torch.tensor([-1, 6])), {}, ValueError, r"non-decreasing.*expert_offsets\[0\]=-1 < 0"),
        ((X, W, torch.tensor([2, 5])), {}, ValueError, r"expert_offsets\[-1\]=5 must equal m=6"),
        ((X, W, torch.tensor([2.0, 6.0])), {}, TypeError, r"expert_offsets dtype torch.float32"),
        ((X, W, torch.tensor([1, 2, 6])), {}, ValueError, r"E mismatch: expert_offsets has shape \(3,\).*E=2"),
        ((X, torch.randn(2, 4, 7), OFFS), {}, ValueError, r"k mismatch: x has k=8 .* weight has k=7"),
        ((X, W.double(), OFFS), {}, TypeError, r"weight dtype torch.float64 does not match x dtype torch.float32"),
        ((X.int(), W, OFFS), {}, TypeError, r"x dtype torch.int32 is not accepted"),
        ((X[None], W, OFFS), {}, ValueError, r"x must be 2-D \[m, k\]"),
        ((X, W[0], OFFS), {}, ValueError, r"weight must be 3-D \[E, n, k\]"),
        ((X, W, OFFS), {"x_scale": torch.ones(6, 1)}, ValueError, r"x_scale is given but x is torch.float32"),
        ((X, W, OFFS), {"out_dtype": torch.float16}, ValueError, r"out_dtype=torch.float16 is not accepted"),
        ((X, W, OFFS), {"backend": "chunked"}, ValueError, r"backend='chunked' is not accepted"),
        ((XQ, WQ, OFFS), {"x_scale": XS, "w_scale": WS[0]}, ValueError, r"w_scale shape \[1, 2\] fit no scaling mode"),
        ((XQ, WQ, OFFS), {"x_scale": XS[:, :1], "w_scale": WS}, ValueError, r"x_scale shape \[6, 1\] .* block: x_sc"),
        ((XQ, WQ, OFFS), {"x_scale": XS}, TypeError, r"w_scale must be a torch.Tensor for FP8 x"),
        ((XQ, WQ, OFFS), {"x_scale": XS.double(), "w_scale": WS}, TypeError, r"x_scale dtype torch.float64"),
        ((XQ, WQ, OFFS), {"x_scale": XS, "w_scale": -WS}, ValueError, r"w_scale\[0, 0, 0\]=-1.0 is not accepted"),
        ((XQ, WQ.float(), OFFS), {"x_scale": XS, "w_scale": WS}, TypeError, r"weight dtype torch.float32 is not FP8"),
        ((XQ, WQ, OFFS), {"x_scale": XS, "w_scale": WS, "out_dtype": torch.int8}, ValueError, r"out_dtype=torch.int8"),
    ],
)
def test_bad_arguments_raise_naming_them(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        kernels.grouped_matmul(*args, **kwargs)
    if "backend" not in kwargs:
        with pytest.raises(error, match=match):
            kernels.grouped_matmul(*args, **kwargs, backend="sequential")


@interpreted
def test_fused_call_traces_whole_under_torch_compile():
    """fullgraph: no graph break (the value checks read nothing on the host while compiling; the fake gives the
    output's shape and dtype)."""
    x, w, offsets = torch.randn(20, 32, device=DEVICE), torch.randn(3, 16, 32, device=DEVICE), _offsets((5, 0, 15))
    compiled = torch.compile(kernels.grouped_matmul, fullgraph=True, backend="eager")
    _assert_within(compiled(x, w, offsets), *_truth(x, w, offsets), 2.0**-23)
