"""w8A16: quantize_weight round trips, the inferred group size, bad input, the offset convention, and the fused
all-reduce kernel (the int8 ops on every backend are the per-op tests': tests/kernels/test_all_gather.py,
test_reduce_scatter.py, test_all_reduce.py).

Tolerances: a round trip errs by at most half a quantization step (``scale / 2``) plus the
rounding of the stored scale (``127 * eps(dtype) * scale``). The op is the all-reduce of
``x @ dequant(qweight).T`` plus bias: checked against the toolkit's fp64 reference of that
all-reduce with the dequantized weights, within its one tolerance rule.
"""

import math
import warnings

import pytest
import torch

import kernels
from kernels.quant import dequantize
from kernels.testing import assert_close, reference, run_ranks

K_LOCAL, N = 12, 10
# (mode, group_size used to quantize, group_size passed to the op)
# group 16 is a multiple of the interpreter's BLOCK_K (16): the fused kernel's one-scale-row path.
LAYOUTS = [
    ("per_tensor", None, None),
    ("per_channel", None, None),
    ("per_group", 4, None),
    ("per_group", 5, 5),
    ("per_group", 16, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "mode,group_size",
    [("per_tensor", None), ("per_channel", None), ("per_group", 4), ("per_group", 5), ("per_group", 64)],
)
def test_round_trip_error_bound(mode, group_size, dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(9, 23, generator=g) * torch.logspace(-3, 1, 23)).to(dtype)
    w[2] = 0  # an all-zero row must survive (scale 1, q 0)
    q, scale = kernels.quantize_weight(w, mode, group_size)
    assert q.dtype == torch.int8 and q.shape == w.shape and q.is_contiguous()
    assert int(q.abs().max()) <= 127
    assert scale.dtype == dtype
    expected = {
        "per_tensor": (),
        "per_channel": (9,),
        "per_group": (9, math.ceil(23 / group_size) if group_size else 0),
    }[mode]
    assert tuple(scale.shape) == expected
    deq = dequantize(q, scale, group_size, dtype=torch.float32)
    if mode == "per_tensor":
        step = scale.float().expand(9, 23)
    elif mode == "per_channel":
        step = scale.float()[:, None].expand(9, 23)
    else:
        step = scale.float().repeat_interleave(group_size, dim=1)[:, :23]
    bound = step * (0.5 + 127 * torch.finfo(dtype).eps) + 1e-12
    err = (deq - w.float()).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    assert torch.equal(deq[2], torch.zeros(23))


def test_quantize_weight_bad_arguments():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="mode='per_row'"):
        kernels.quantize_weight(w, "per_row")
    with pytest.raises(ValueError, match="group_size=None"):
        kernels.quantize_weight(w, "per_group")
    with pytest.raises(ValueError, match="group_size=0"):
        kernels.quantize_weight(w, "per_group", 0)
    with pytest.raises(ValueError, match="group_size=4"):
        kernels.quantize_weight(w, "per_channel", 4)
    with pytest.raises(TypeError, match="floating point"):
        kernels.quantize_weight(w.to(torch.int8))
    with pytest.raises(ValueError, match="2-D"):
        kernels.quantize_weight(w[0])


def _bad_call(**over):
    x = torch.randn(3, 12)
    q, s = kernels.quantize_weight(torch.randn(10, 12), "per_group", 4)
    args = dict(x=x, qweight=q, scale=s)
    args.update(over)
    kw = {k: v for k, v in args.items() if k not in ("x", "qweight", "scale")}
    return kernels.quantized_matmul_all_reduce(args["x"], args["qweight"], args["scale"], **kw)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(qweight=torch.randn(10, 12)), TypeError, "qweight must be int8"),
        (dict(qweight=torch.zeros(10, 12, dtype=torch.int32)), TypeError, "qweight must be int8"),
        (dict(scale=torch.ones(9)), ValueError, r"scale shape \(9,\)"),
        (dict(scale=torch.ones(10, 3, 1)), ValueError, r"scale shape \(10, 3, 1\)"),
        (dict(scale=torch.ones(10, 3, dtype=torch.int32)), TypeError, "scale must be floating point"),
        (dict(scale=torch.ones(10, 5)), ValueError, "k=12 is not divisible by the 5 groups"),
        (dict(group_size=3), ValueError, "group_size=3 does not match"),
        (dict(group_size=0), ValueError, "group_size=0"),
        (dict(scale=torch.ones(10), group_size=4), ValueError, "group_size=4 needs a per_group scale"),
        (dict(offset=torch.zeros(10)), ValueError, "offset shape"),
        (dict(x=torch.randn(3, 12, dtype=torch.float64)), TypeError, "x dtype torch.float64"),
        (dict(x=torch.randn(3, 11)), ValueError, "k mismatch"),
        (dict(bias=torch.ones(10, dtype=torch.float16)), TypeError, "bias dtype"),
        (dict(backend="nope"), ValueError, "backend='nope'"),
        (dict(parallel_num=3), ValueError, "parallel_num=3"),
    ],
)
def test_quantized_op_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        _bad_call(**over)


@pytest.mark.parametrize(
    "op",
    [kernels.quantized_all_gather_matmul, kernels.quantized_matmul_reduce_scatter, kernels.quantized_matmul_all_reduce],
    ids=lambda f: f.__name__,
)
def test_group_size_is_inferred_from_the_scale(op):
    """A per_group scale ``[n, G]`` without group_size: k / G columns per scale (k = 12, G = 3: 4), bitwise the
    call that names it, and the product of the weight dequantized with groups of 4 (W = 1: every op is the GEMM)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, K_LOCAL, generator=g)
    q, s = kernels.quantize_weight(torch.randn(N, K_LOCAL, generator=g), "per_group", 4)
    offset = torch.randint(-3, 4, s.shape, generator=g).float()
    y = op(x, q, s, offset=offset, backend="sequential")
    assert torch.equal(y, op(x, q, s, group_size=4, offset=offset, backend="sequential"))
    ref = reference("ar", [x], [dequantize(q, s, 4, offset, torch.float32)], None, 0)
    assert_close("inferred group_size", y, ref, torch.float32)


def _inputs(world, rows, mode, group_size, with_offset, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, 2, K_LOCAL, generator=g) for _ in range(world)]
    qs, scales, offsets = [], [], []
    for _ in range(world):
        q, s = kernels.quantize_weight(torch.randn(N, K_LOCAL, generator=g), mode, group_size)
        qs.append(q)
        scales.append(s)
        offsets.append(torch.randint(-3, 4, s.shape, generator=g).float() if with_offset else None)
    bias = torch.randn(N, generator=g)
    return xs, qs, scales, offsets, bias


def _cases(world):
    """(layout, rows, with_offset, with_bias, deterministic) combinations of the fused kernel.

    The fused kernels run under the Triton interpreter at a fraction of a second per launch, so
    they get every layout once with and once without offset and bias, on rows crossing no tile
    boundary (1) and crossing the 16-row tile of the two-shot owners' split (7 * 2 = 14 rows).
    The dequantizing GEMM is each rank's own, the same at every world size: beyond W = 2, where every
    case runs, the cases with offset and bias (the bias added by the exchange) on every layout; the
    exchange without a bias runs there too (the k = 40 and bitwise calls of :func:`_check_quantized_fused`).
    """
    extras = ((7, False), (7, True)) if world == 2 else ((7, True),)
    return [(layout, rows, extra, extra, False) for layout in LAYOUTS for rows, extra in extras] + [
        (LAYOUTS[3], 1, True, True, False)
    ]


def _check_quantized(rank, world, backend):
    done = 0
    for (mode, qgs, op_gs), rows, with_offset, with_bias, det in _cases(world):
        xs, qs, scales, offsets, bias = _inputs(world, rows, mode, qgs, with_offset, seed=rows)
        b = bias if with_bias else None
        y = kernels.quantized_matmul_all_reduce(
            xs[rank],
            qs[rank],
            scales[rank],
            b,
            group_size=op_gs,
            offset=offsets[rank],
            backend=backend,
            deterministic=det,
        )
        deq = [dequantize(qs[r], scales[r], qgs, offsets[r], torch.float32) for r in range(world)]
        assert_close(f"{mode} rows={rows}", y, reference("ar", xs, deq, b, rank), torch.float32)
        done += 1
    return done


def _check_quantized_fused(rank, world, algorithm):
    """The fused kernel itself (a fallback would be a failure here), one-shot or two-shot."""
    from kernels.fused import all_reduce

    real, threshold = all_reduce.all_reduce_partials, all_reduce.ONE_SHOT_MAX_BYTES
    launched = []

    def spy(op, group, partials, chosen, descriptor):
        launched.append(chosen)
        return real(op, group, partials, chosen, descriptor)

    all_reduce.all_reduce_partials = spy
    all_reduce.ONE_SHOT_MAX_BYTES = threshold if algorithm == "one_shot" else 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            done = _check_quantized(rank, world, "fused")
            # k = 40 spans three 16-wide k-tiles and groups of 16 (the last one partial), with
            # offsets: the one-scale-row-per-tile path over several tiles.
            g = torch.Generator().manual_seed(5)
            xs = [torch.randn(9, 40, generator=g) for _ in range(world)]
            qs = [kernels.quantize_weight(torch.randn(N, 40, generator=g), "per_group", 16) for _ in range(world)]
            offs = [torch.randint(-2, 3, s.shape, generator=g).float() for _, s in qs]
            y40 = kernels.quantized_matmul_all_reduce(
                xs[rank], *qs[rank], group_size=16, offset=offs[rank], backend="fused"
            )
            deq = [dequantize(*qs[r], 16, offs[r], torch.float32) for r in range(world)]
            assert_close("k = 40", y40, reference("ar", xs, deq, None, rank), torch.float32)
            # Bitwise identical outputs on every rank (the fused all-reduce is deterministic).
            x = torch.randn(5, K_LOCAL, generator=torch.Generator().manual_seed(rank))
            q, s = kernels.quantize_weight(torch.randn(N, K_LOCAL), "per_group", 5)
            y = kernels.quantized_matmul_all_reduce(x, q, s, group_size=5, backend="fused")
    finally:
        all_reduce.all_reduce_partials, all_reduce.ONE_SHOT_MAX_BYTES = real, threshold
    assert launched == [algorithm] * (done + 2), launched
    return done, y


@pytest.mark.parametrize("world,algorithm", [(2, "one_shot"), (3, "one_shot"), (3, "two_shot")])
def test_quantized_matmul_all_reduce_fused(world, algorithm):
    res = run_ranks(_check_quantized_fused, world, algorithm, timeout=300)
    assert res[0][0] > 0
    for _, y in res[1:]:
        assert torch.equal(y, res[0][1])


def _check_offset_convention(rank, world):
    """dequant = (q - offset) * scale: an offset of q itself cancels the weight to zero."""
    x = torch.randn(4, K_LOCAL)
    q, s = kernels.quantize_weight(torch.randn(N, K_LOCAL), "per_tensor")
    offset = torch.tensor(float(q[0, 0]))
    q_const = torch.full_like(q, int(q[0, 0]))
    y = kernels.quantized_matmul_all_reduce(x, q_const, s, offset=offset, backend="sequential")
    return bool(torch.equal(y, torch.zeros(4, N)))


def test_offset_convention():
    assert all(run_ranks(_check_offset_convention, 2))
