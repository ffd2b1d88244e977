"""The toolkit's FP8 reference: the quantizer twin's layouts, the ops' semantics, the bound's checks."""

import pytest
import torch

import kernels
from kernels.fp8 import numerics
from kernels.testing import fp8 as fp8_reference


@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
@pytest.mark.parametrize("weight", [False, True])
def test_quantize_matches_the_products_layout_and_round_trips(mode, weight):
    t = torch.randn(130, 200, generator=torch.Generator().manual_seed(0))
    payload, scale = fp8_reference.quantize(t, mode, weight)
    product_mode = "block2d" if weight and mode == "block" else mode
    want_payload, want_scale = kernels.quantize_fp8(t, product_mode)
    assert scale.shape == want_scale.shape and payload.dtype == torch.float8_e4m3fn
    back = fp8_reference.dequant(payload, scale, mode, weight)
    # The product dequantizes in fp32 (one rounding of each fp8 x scale product); fp64 is exact.
    product = kernels.dequantize_fp8(payload, scale, product_mode, dtype=torch.float64)
    torch.testing.assert_close(back, product, rtol=2**-24, atol=0)
    expanded = fp8_reference.expand(scale, mode, weight, *t.shape)
    limit = numerics.quantization_error_bound(t, expanded, torch.float8_e4m3fn)
    assert ((back - t.double()).abs() <= limit).all()


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_reference_is_the_dequantized_ops_semantics(op):
    world, rank = 2, 1
    xs, ws, b = fp8_reference.make_inputs(
        op, world, 3, 136, 20, mode="block", bias=True, out_dtype=torch.float32, seed=4
    )
    y, bound = fp8_reference.reference(op, xs, ws, b, rank, mode="block", out_dtype=torch.float32, accumulation="fp32")
    dx = [fp8_reference.dequant(p, s, "block", False) for p, s in xs]
    dw = [fp8_reference.dequant(p, s, "block", True) for p, s in ws]
    if op == "ag":
        want = torch.cat(dx) @ dw[0].T + b.double()
    else:
        want = dx[0] @ dw[0].T + dx[1] @ dw[1].T + b.double()
        if op == "rs":
            want = want[3:]
    assert torch.equal(y, want)
    assert (bound > 0).all() and bound.shape == y.shape


def test_bound_follows_the_accumulation_model():
    xs, ws, b = fp8_reference.make_inputs("ar", 1, 5, 300, 8, mode="row", bias=False, out_dtype=torch.float32, seed=1)
    _, fp32 = fp8_reference.reference("ar", xs, ws, b, 0, mode="row", out_dtype=torch.float32, accumulation="fp32")
    _, hopper = fp8_reference.reference(
        "ar",
        xs,
        ws,
        b,
        0,
        mode="row",
        out_dtype=torch.float32,
        accumulation="promoted",
        u_acc=numerics.HOPPER_FP8_ACCUMULATOR,
    )
    assert (hopper > fp32).all()  # a 14-bit accumulator errs more than fp32's


def test_assert_close_and_error_ratio_reject_wrong_results():
    xs, ws, b = fp8_reference.make_inputs(
        "ar", 1, 4, 136, 6, mode="tensor", bias=True, out_dtype=torch.bfloat16, seed=2
    )
    want, bound = fp8_reference.reference("ar", xs, ws, b, 0, mode="tensor", out_dtype=torch.bfloat16)
    fp32 = fp8_reference.dequant(*xs[0], "tensor", False) @ fp8_reference.dequant(*ws[0], "tensor", True).T
    got = (fp32 + b.double()).to(torch.bfloat16)  # one rounding to the output: within the bound
    fp8_reference.assert_close("fp64 rounded", got, want, bound, torch.bfloat16)
    assert fp8_reference.error_ratio(got, want, bound) <= 1
    wrong = got.clone()
    wrong[1, 2] += 0.05 * float(want.abs().max())
    with pytest.raises(AssertionError, match="exceeds the bound .* at flat index 8"):
        fp8_reference.assert_close("wrong", wrong, want, bound, torch.bfloat16)
    nan = got.clone()
    nan[0, 0] = float("nan")
    assert fp8_reference.error_ratio(nan, want, bound) == float("inf")
    with pytest.raises(AssertionError, match="by inf"):
        fp8_reference.assert_close("nan", nan, want, bound, torch.bfloat16)
    with pytest.raises(AssertionError, match="want .* torch.float32"):
        fp8_reference.assert_close("dtype", got, want, bound, torch.float32)
