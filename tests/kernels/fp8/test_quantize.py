"""``kernels.quantize_fp8``: scale shapes per mode, partial blocks, the scale rule, the round-trip bound."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.fp8 import numerics
from kernels.fp8.quantize import expand_scale, quantize_fp8_reference
from kernels.fp8.scales import EPS, FP8_MAX

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _data(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.logspace(-4, 4, cols)[torch.randperm(cols, generator=g)]


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    ("mode", "shape", "scale_shape"),
    [
        ("block", (5, 200), (5, 2)),
        ("block", (3, 128), (3, 1)),
        ("block2d", (130, 200), (2, 2)),
        ("row", (5, 200), (5, 1)),
        ("tensor", (5, 200), ()),
    ],
)
def test_shapes_rule_and_round_trip_bound(mode: str, shape: tuple, scale_shape: tuple, dtype: torch.dtype) -> None:
    t = _data(*shape)
    q, s = kernels.quantize_fp8(t, mode, dtype=dtype)
    assert q.dtype == dtype and q.shape == t.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape
    assert torch.isfinite(q.float()).all()
    # The scale rule, block by block: max(amax, EPS) / FP8_MAX over exactly the block's elements.
    expanded = expand_scale(s, mode, *shape)
    if mode == "block":
        amax = torch.stack([t[:, i : i + 128].abs().amax(1) for i in range(0, shape[1], 128)], 1)
    elif mode == "block2d":
        amax = torch.tensor(
            [
                [t[i : i + 128, j : j + 128].abs().max() for j in range(0, shape[1], 128)]
                for i in range(0, shape[0], 128)
            ]
        )
    elif mode == "row":
        amax = t.abs().amax(1, keepdim=True)
    else:
        amax = t.abs().max()
    assert torch.equal(s, amax.clamp_min(EPS) / FP8_MAX[dtype])
    # The largest element of every block lands on (or one ulp below) FP8_MAX.
    assert float(q.float().abs().max()) == FP8_MAX[dtype]
    err = (kernels.dequantize_fp8(q, s, mode, dtype=torch.float64) - t.double()).abs()
    bound = numerics.quantization_error_bound(t, expanded.expand(shape) if s.dim() else s, dtype)
    assert (err <= bound).all(), float((err / bound).max())


def test_leading_dims_and_zero_blocks() -> None:
    t = _data(6, 260).view(2, 3, 260)
    t[0, 1, 128:256] = 0
    q, s = kernels.quantize_fp8(t, "block")
    assert q.shape == (2, 3, 260) and s.shape == (2, 3, 3)
    assert float(s[0, 1, 1]) == pytest.approx(EPS / 448) and (q[0, 1, 128:256].float() == 0).all()
    q2, s2 = kernels.quantize_fp8(t.view(6, 260), "block")
    assert torch.equal(q.view(6, 260).view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s.view(6, 3), s2)


def test_non_finite_inputs_give_nan_scales() -> None:
    t = _data(3, 200)
    t[0, 5] = float("nan")
    t[2, 150] = float("inf")
    _, s = kernels.quantize_fp8(t, "block")
    assert torch.isnan(s[0, 0]) and torch.isnan(s[2, 1]) and torch.isfinite(s[1]).all()
    assert torch.isfinite(s[0, 1]) and torch.isfinite(s[2, 0])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "blocks"}, ValueError, "mode='blocks'"),
        ({"block": 0}, ValueError, "block=0"),
        ({"dtype": torch.float16}, ValueError, "dtype=torch.float16"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        kernels.quantize_fp8(torch.ones(2, 4), **kwargs)


def test_bad_tensors_are_named() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        kernels.quantize_fp8(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="block2d"):
        kernels.quantize_fp8(torch.ones(2, 3, 4), "block2d")


def test_transposed_block2d_is_block2d_of_transpose() -> None:
    # The FP8 linears reuse the weight's 128 x 128 quantization, transposed, for the dgrad.
    w = _data(300, 200)
    q, s = quantize_fp8_reference(w, "block2d")
    qt, st = quantize_fp8_reference(w.t().contiguous(), "block2d")
    assert torch.equal(q.t().contiguous().view(torch.uint8), qt.view(torch.uint8)) and torch.equal(s.t(), st)
