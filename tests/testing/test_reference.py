"""The toolkit's fp64 reference, its one tolerance rule and the heap scrambling."""

import pytest
import torch
import torch.distributed as dist

from kernels.testing import (
    assert_close,
    make_inputs,
    presize,
    quantized_weights,
    reference,
    rows_of,
    scramble,
    seeded_randn,
    tolerance,
)


def test_tolerance_follows_dtype_k_and_world():
    eps32 = torch.finfo(torch.float32).eps
    assert tolerance(torch.float32, 24, 2) == pytest.approx((24 + 2 + 2) * eps32 + 2 * eps32)
    bf16 = torch.finfo(torch.bfloat16).eps
    assert tolerance(torch.bfloat16, 24, 2) == pytest.approx(28 * eps32 + 2 * bf16)
    assert tolerance(torch.float16, 4096) > tolerance(torch.float16, 64)  # grows with the reduced length
    with pytest.raises(ValueError, match="k=-1"):
        tolerance(torch.float32, -1)


@pytest.mark.parametrize("op", ["ag", "ag_v2", "rs", "ar_one", "ar_two"])
def test_reference_matches_the_ops_semantics(op):
    world, m_local, k, n = 3, 4, 8, 5
    xs, ws, b = make_inputs(op, world, m_local, k, n, bias=True, seed=0)
    assert xs[0].shape == (rows_of(op, world, m_local), k)
    for rank in range(world):
        want, bound, gathered = reference(op, xs, ws, b, rank)
        if op.startswith("ag"):
            y = torch.cat(xs).double() @ ws[0].double().T + b.double()
        else:
            y = sum(x.double() @ w.double().T for x, w in zip(xs, ws, strict=True)) + b.double()
            if op == "rs":
                y = y[rank * m_local : (rank + 1) * m_local]
        assert torch.equal(want, y)
        assert (bound > 0).all()
        assert (gathered is not None) == (op == "ag_v2")


@pytest.mark.parametrize("op", ["ag_v2", "rs", "ar"])
def test_reference_keeps_leading_dims(op):
    """``[rows, 2, k]`` inputs: the reference of the ``[-1, k]`` rows, shaped ``[rows', 2, n]``; rs keeps
    the rank's slice of dim 0 (its flattened rows are contiguous)."""
    world, n = 2, 5
    xs3 = [seeded_randn(4, 2, 8, seed=r) for r in range(world)]
    ws = [seeded_randn(n, 8, seed=10 + r) for r in range(world)]
    flat = reference(op, [x.reshape(-1, 8) for x in xs3], ws, None, 1)
    want, bound, gathered = reference(op, xs3, ws, None, 1)
    rows = {"ag_v2": 8, "rs": 2, "ar": 4}[op]
    assert want.shape == bound.shape == (rows, 2, n)
    assert torch.equal(want.reshape(-1, n), flat[0]) and torch.equal(bound.reshape(-1, n), flat[1])
    assert (gathered is None) == (op != "ag_v2")
    if gathered is not None:
        assert torch.equal(gathered, torch.cat(xs3))


def test_assert_close_accepts_fp32_math_and_rejects_a_wrong_result():
    xs, ws, b = make_inputs("ar", 2, 6, 64, 9, bias=True, seed=1)
    ref = reference("ar", xs, ws, b, 0)
    fp32 = xs[0] @ ws[0].T + xs[1] @ ws[1].T + b  # another summation order, within the bound
    assert_close("fp32", fp32, ref, torch.float32)
    wrong = fp32.clone()
    wrong[2, 3] += 1e-3 * wrong.abs().max()
    with pytest.raises(AssertionError, match="exceeds the bound .* at flat index 21"):
        assert_close("wrong", wrong, ref, torch.float32)
    nan = fp32.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(AssertionError, match="exceeds the bound by inf at flat index 0"):
        assert_close("nan", nan, ref, torch.float32)
    with pytest.raises(AssertionError, match="got .* torch.float16"):
        assert_close("dtype", fp32.half(), ref, torch.float32)


def test_gathered_x_must_be_exact():
    xs, ws, b = make_inputs("ag_v2", 2, 3, 4, 5, bias=False, seed=2)
    ref = reference("ag_v2", xs, ws, b, 0)
    y = torch.cat(xs) @ ws[0].T
    assert_close("ok", (y, torch.cat(xs)), ref, torch.float32)
    off = torch.cat(xs).clone()
    off[0, 0] = torch.nextafter(off[0, 0], torch.tensor(10.0))
    with pytest.raises(AssertionError, match="gathered x differs"):
        assert_close("off", (y, off), ref, torch.float32)


def test_half_precision_result_within_the_bound_of_its_rounding():
    xs, ws, b = make_inputs("rs", 2, 5, 32, 7, bias=True, seed=3, dtype=torch.bfloat16)
    ref = reference("rs", xs, ws, b, 1)
    partials = [(x.float() @ w.float().T).to(torch.bfloat16) for x, w in zip(xs, ws, strict=True)]
    y = (partials[0].float() + partials[1].float() + b.float()).to(torch.bfloat16)[5:]
    assert_close("bf16 rounded partials", y, ref, torch.bfloat16)


def test_noncontiguous_inputs_are_strided_views():
    xs, ws, b = make_inputs("ar", 2, 3, 6, 4, bias=True, seed=4, noncontig=True)
    assert not xs[0].is_contiguous() and not ws[0].is_contiguous() and b.stride() == (2,)


def test_quantized_weights_are_the_rounded_dequantized_values():
    ws = [torch.randn(5, 8, generator=torch.Generator().manual_seed(5))]
    quantized, deq = quantized_weights(ws, torch.float16)
    (q, s), deq = quantized[0], deq[0]
    assert q.dtype == torch.int8 and deq.dtype == torch.float16
    assert torch.equal(deq, (q.float() * s[:, None]).to(torch.float16))


def _scramble_body(rank, world):
    group = dist.group.WORLD
    assert scramble(group, "cpu") == 0  # no heap yet: nothing to scramble
    presize(group, "cpu", 4096)
    from kernels.heap import peek_heap

    heap = peek_heap(group, torch.device("cpu"))
    view = heap.data_view(heap.rank, torch.float32, (heap.data_bytes // 4,))
    view.zero_()
    scrambled = scramble(group, "cpu")
    return scrambled, int((view != 0).sum()), view.numel()


def test_scramble_fills_this_ranks_heap():
    # A pool of its own: the shared pools' ranks may hold a heap from earlier tests (the body checks
    # that a rank without one has nothing to scramble).
    from kernels.testing.ranks import RankPool, Task

    pool = RankPool(2)
    try:
        for scrambled, nonzero, numel in pool.run(Task(_scramble_body, (), {}, {}), timeout=120, allow_dead=False):
            assert scrambled >= 4096 and nonzero > 0.99 * numel
    finally:
        pool.close()


def test_seeded_randn_is_the_same_for_a_seed():
    assert torch.equal(seeded_randn(3, 4, seed=7), seeded_randn(3, 4, seed=7))
    assert not torch.equal(seeded_randn(3, 4, seed=7), seeded_randn(3, 4, seed=8))


def test_assert_no_errors_names_each_rank():
    from kernels.testing import assert_no_errors

    assert_no_errors([[], []])
    with pytest.raises(AssertionError, match="rank 1: grad differs"):
        assert_no_errors([[], ["grad differs"]])


def test_tolerance_covers_reductions_in_the_output_dtype_and_tf32_operands():
    eps32, bf16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    # W partials rounded and summed in bf16 (NCCL / gloo): W / 2 eps(bf16) once W / 2 exceeds 2.
    assert tolerance(torch.bfloat16, 64, 8) == pytest.approx((64 + 8 + 2) * eps32 + 4 * bf16)
    assert tolerance(torch.float32, 64, 2, operand_eps=2.0**-10) == pytest.approx(
        tolerance(torch.float32, 64, 2) + 2**-9
    )
    with pytest.raises(ValueError, match="operand_eps"):
        tolerance(torch.float32, 64, 2, operand_eps=-1.0)


def test_row_norm_bound_bounds_the_magnitude_of_every_element():
    from kernels.testing import row_norm_bound

    xs = [seeded_randn(5, 7, seed=s) for s in (1, 2)]
    ws = [seeded_randn(3, 7, seed=s) for s in (3, 4)]
    exact = sum(x.double().abs() @ w.double().abs().T for x, w in zip(xs, ws, strict=True))
    bound = row_norm_bound([x.norm(dim=-1) for x in xs], [w.norm(dim=-1) for w in ws])
    assert bound.shape == exact.shape and bool((bound >= exact * (1 - 1e-12)).all())
    assert float((bound / exact).max()) < 3  # a bound, not a blanket
    with pytest.raises(ValueError, match="equally many"):
        row_norm_bound([xs[0].norm(dim=-1)], [])
