"""The repairs of Triton's interpreter: scalar ``__index__`` under NumPy >= 2.4 (3.6), the language patched once per
launch, fp32 -> bf16 conversions rounded to nearest even as a GPU's ``cvt.rn.bf16.f32`` (3.6 and 3.9 truncate), and
dots whose rows do not depend on the other rows (NumPy's BLAS may make them: OpenBLAS on AMD EPYC does).

The repairs live in kernels/fused/interpreter_compat.py.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernels.fused import interpreter_compat


def _patcher(index: Any) -> Any:
    def patch_tensor(tensor: Any, scope: Any) -> None:
        scope.set_attr(tensor, "__index__", index)

    return patch_tensor


def test_probe_tells_a_broken_index_from_a_working_one():
    # Triton 3.6's definition, and the conversion later releases use.
    assert interpreter_compat._index_fails_on_scalars(_patcher(lambda self: int(self.handle.data))) == (
        tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4)
    )
    assert not interpreter_compat._index_fails_on_scalars(_patcher(lambda self: int(self.handle.data.item())))
    # An interpreter this repair does not know is left alone.
    assert not interpreter_compat._index_fails_on_scalars(_patcher(None))


def test_installed_interpreter_indexes_scalars():
    from triton.runtime import interpreter

    interpreter_compat.install()
    assert not interpreter_compat._index_fails_on_scalars(interpreter._patch_lang_tensor)
    assert interpreter_compat.install() is False  # nothing left to repair, whatever the Triton version


@triton.jit
def _count_kernel(out_ptr, K, STEP: tl.constexpr):
    total = 0
    for _ in range(0, K, STEP):
        total += 1
    tl.store(out_ptr, total)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the repair concerns the interpreter")
def test_loop_with_a_runtime_bound_runs_under_the_interpreter():
    out = torch.zeros(1, dtype=torch.int32)
    _count_kernel[(1,)](out, 10, STEP=3)
    assert int(out) == 4


@triton.jit
def _add_one(x):
    return x + 1


@triton.jit
def _device_calls_kernel(out_ptr, n, CALLS: tl.constexpr):
    offs = tl.arange(0, 4)
    value = tl.zeros((4,), tl.int32) + tl.cdiv(n, 2)
    for _ in tl.static_range(CALLS):
        value = _add_one(value)
    tl.store(out_ptr + offs, value)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the repair concerns the interpreter")
def test_language_is_patched_once_per_launch_and_restored_after_it(monkeypatch):
    from triton.runtime import interpreter

    assert interpreter_compat.install_launch_scoped_patching() is False  # installed at import
    patched: list[str] = []
    patch_builtin = interpreter._patch_builtin

    def counting(pkg: Any, builder: Any, scope: Any) -> None:
        patched.append(pkg.__name__)
        patch_builtin(pkg, builder, scope)

    monkeypatch.setattr(interpreter, "_patch_builtin", counting)
    per_launch = []
    for calls in (1, 12):
        patched.clear()
        out = torch.zeros(4, dtype=torch.int32)
        _device_calls_kernel[(2,)](out, 7, CALLS=calls)
        assert out.tolist() == [4 + calls] * 4
        per_launch.append(sorted(patched))
    # The same patches whatever the number of device-function calls: tl, tl.tensor, tl.math, tl.core, ...
    assert per_launch[0] == per_launch[1]
    assert "triton.language.core" in per_launch[0] and "triton.language" in per_launch[0]
    # Both languages are back to Triton's own builtins after the launch (tl.core's included).
    assert tl.core.is_builtin(tl.program_id) and tl.core.is_builtin(tl.core.program_id)
    assert tl.core.is_builtin(tl.core.tensor.__add__)
    assert interpreter_compat._launches_patched == []


# fp32 bit patterns whose bf16 truncation and rounding to nearest even differ, and a few where they agree: above the
# halfway point, ties to an odd and to an even last bit, a carry into the exponent, the largest finite fp32 (rounds to
# Inf), subnormals (tie and above), both signs; then zeros and infinities.
_ROUNDING_BITS = [
    0x3F80C000, 0x3F818000, 0x3F808000, 0x3F80FFFF, 0x3F817FFF, 0x3FFFFFFF, 0x3FFF8000, 0x7F7FFFFF, 0x7F7F8000,
    0x0000C000, 0x00018000, 0x00008000, 0x00007FFF, 0x007FFFFF, 0x42F6E979, 0x3DCCCCCD,
]  # fmt: skip
_ROUNDING_BITS += [b | 0x80000000 for b in _ROUNDING_BITS] + [0, 0x80000000, 0x7F800000, 0xFF800000]
# NaNs, quiet and signalling, both signs, payloads that truncation turns into Inf (0x7F800001) and that a carry would
# wrap (0x7FFFFFFF).
_NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F808000, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF800001]


def _fp32(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _rounding_cases() -> torch.Tensor:
    """:data:`_ROUNDING_BITS` and random fp32 values of every magnitude, about half of them off bf16's grid."""
    gen = torch.Generator().manual_seed(0)
    random = torch.randint(-(2**31), 2**31 - 1, (4000,), generator=gen, dtype=torch.int64).to(torch.int32)
    finite = random.view(torch.float32).isfinite()
    return torch.cat([_fp32(_ROUNDING_BITS), random.view(torch.float32)[finite]])


def test_probe_tells_a_truncating_bf16_cast_from_a_rounding_one():
    from triton.runtime import interpreter

    def cast_with(convert: Any) -> Any:
        def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
            return interpreter.TensorHandle(convert(src.data), dst_type.scalar)

        return cast_impl

    truncate = cast_with(lambda data: (data.view(np.uint32) >> 16).astype(np.uint16))
    nearest = cast_with(lambda data: interpreter_compat._fp32_to_bf16_bits(data))
    assert interpreter_compat._bf16_cast_truncates(truncate)
    assert not interpreter_compat._bf16_cast_truncates(nearest)
    # An interpreter this repair does not know is left alone: one that fails, or converts some third way.
    assert not interpreter_compat._bf16_cast_truncates(cast_with(lambda data: 1 / 0))
    assert not interpreter_compat._bf16_cast_truncates(cast_with(lambda data: np.zeros(data.shape, np.uint16)))


def test_installed_interpreter_rounds_bf16_casts():
    from triton.runtime import interpreter

    interpreter_compat.install_bf16_rounding()
    assert not interpreter_compat._bf16_cast_truncates(interpreter.InterpreterBuilder.cast_impl)
    assert interpreter_compat.install_bf16_rounding() is False  # nothing left to repair, whatever the Triton version


def test_bf16_bits_match_torch():
    # The repair's conversion itself, beside torch's, on the cases and on every NaN.
    cases = _rounding_cases()
    ours = interpreter_compat._fp32_to_bf16_bits(cases.numpy())
    assert ours.dtype == np.uint16
    assert torch.equal(torch.from_numpy(ours.view(np.int16)), cases.to(torch.bfloat16).view(torch.int16))
    nans = interpreter_compat._fp32_to_bf16_bits(_fp32(_NAN_BITS).numpy())
    assert torch.from_numpy(nans.view(np.int16)).view(torch.bfloat16).isnan().all()


@triton.jit
def _convert_kernel(x_ptr, cast_ptr, stored_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    # An explicit cast, and the implicit one of a store into a pointer of another dtype.
    tl.store(cast_ptr + offs, x.to(cast_ptr.dtype.element_ty), mask=mask)
    tl.store(stored_ptr + offs, x, mask=mask)


def _convert(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cast = torch.empty(x.shape, dtype=dtype, device=x.device)
    stored = torch.empty(x.shape, dtype=dtype, device=x.device)
    _convert_kernel[(1,)](x, cast, stored, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return cast, stored


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int8)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the repair concerns the interpreter")
def test_interpreted_fp32_to_bf16_rounds_to_nearest_even_like_torch():
    x = _rounding_cases()
    expected = _bits(x.to(torch.bfloat16))
    cast, stored = _convert(x, torch.bfloat16)
    assert torch.equal(_bits(cast), expected)
    assert torch.equal(_bits(stored), expected)
    # Inf and NaN keep their class (and Inf its sign); NaN bits are not specified (torch: 0x7FC0, a GPU: 0x7FFF).
    specials = torch.cat([_fp32(_NAN_BITS), _fp32([0x7F800000, 0xFF800000])])
    for out in _convert(specials, torch.bfloat16):
        assert out[: len(_NAN_BITS)].isnan().all()
        assert out[len(_NAN_BITS) :].tolist() == [float("inf"), float("-inf")]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the repair concerns the interpreter")
def test_interpreted_fp16_conversions_round_like_torch():
    # fp32 -> fp16 already rounded (NumPy's cast) and stays so; fp16 -> bf16 goes through fp32 and now rounds once.
    x = _rounding_cases()
    x = x[x.abs() < 60000]
    for out in _convert(x, torch.float16):
        assert torch.equal(_bits(out), _bits(x.to(torch.float16)))
    h = x.to(torch.float16)
    h = h[h.isfinite()]
    for out in _convert(h, torch.bfloat16):
        assert torch.equal(_bits(out), _bits(h.to(torch.bfloat16)))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the repair concerns the interpreter")
@pytest.mark.parametrize("fp8", [tl.float8e4nv, tl.float8e5], ids=["e4m3", "e5m2"])
def test_interpreted_fp8_conversions_are_triton_own(fp8):
    # The bf16 repair leaves FP8 to Triton's conversion (with its known defects: kernels/fp8/quantize_triton.py).
    from triton.runtime import interpreter

    x = _rounding_cases()
    torch_fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}[fp8]
    x = x[x.abs() < torch.finfo(torch_fp8).max]
    own = interpreter._convert_float(x.numpy(), tl.float32, fp8, interpreter._ir.ROUNDING_MODE.RTNE)
    for out in _convert(x, torch_fp8):
        assert torch.equal(_bits(out), torch.from_numpy(own.view(np.int8)))


# The position-independent dot. The interpreter's tl.dot is np.matmul, whose BLAS (OpenBLAS on AMD EPYC among others)
# may give a row other bits at another position in the matrix or among another number of rows; a GPU does not.


@triton.jit
def _rows_kernel(
    x_ptr, w_ptr, out_ptr, M, K, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr
):
    # One tile of x[:M] @ w, rows past M masked, in k steps of BLOCK_K (the last one masked): a fused GEMM's k loop.
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, N)
    acc = tl.zeros((BLOCK_M, N), ACC)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0
        )
        b = tl.load(w_ptr + offs_k[:, None] * N + offs_n[None, :], mask=offs_k[:, None] < K, other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=ACC)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=offs_m[:, None] < M)


def _tile_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.empty(x.shape[0], w.shape[1], dtype=acc)
    tl_acc = tl.float64 if acc == torch.float64 else tl.float32
    _rows_kernel[(1,)](x, w, out, x.shape[0], x.shape[1], N=w.shape[1], BLOCK_M=16, BLOCK_K=16, ACC=tl_acc)
    return out


def _same_bits(u: torch.Tensor, v: torch.Tensor) -> bool:
    return u.shape == v.shape and torch.equal(u.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the repair concerns the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_interpreted_tile_gives_a_row_the_same_bits_whatever_rows_are_beside_it(dtype):
    # A 16-row tile, k = 40 in three 16-deep steps (the last masked): each row's output bits must not depend on the
    # other rows of the tile (the masked ones are zeros), their count, or where the row sits.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 40, generator=g).to(dtype)
    w = torch.randn(40, 16, generator=g).to(dtype)
    full = _tile_rows(x, w)
    for i in range(16):
        assert _same_bits(_tile_rows(x[i : i + 1], w)[0], full[i]), f"row {i} among masked rows"
    assert _same_bits(_tile_rows(x[3:], w), full[3:]), "rows 3.. among 13 rows"
    assert _same_bits(_tile_rows(x.roll(5, 0), w), full.roll(5, 0)), "rows moved 5 positions"
    # And the bits are a dot's: within the fp32 accumulation bound of the fp64 product.
    want = x.double() @ w.double()
    bound = (40 + 2) * torch.finfo(full.dtype).eps * (x.double().abs() @ w.double().abs())
    assert bool(((full.double() - want).abs() <= bound).all())


def _position_dependent(a: Any, b: Any, d: Any) -> np.ndarray:
    """What a BLAS may do: the same products, summed forward for rows at even positions and backward at odd ones."""
    out = d.copy()
    for i in range(a.shape[0]):
        order = range(a.shape[1]) if i % 2 == 0 else reversed(range(a.shape[1]))
        for k in order:
            out[i] += a[i, k] * b[k]
    return out


def _dot_with(compute: Any) -> Any:
    from triton.runtime import interpreter

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        return interpreter.TensorHandle(compute(a.data, b.data, d.data), d.dtype.scalar)

    return create_dot


def test_probe_tells_a_position_dependent_dot_from_a_fixed_one():
    probe = interpreter_compat._position_dependent_dots
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    assert probe(_dot_with(_position_dependent)) == {f32, f64}
    assert probe(_dot_with(interpreter_compat.fixed_order_dot)) == frozenset()
    # Only the dtypes that depend on position are reported.
    fp32_only = _dot_with(
        lambda a, b, d: (_position_dependent if a.dtype == f32 else interpreter_compat.fixed_order_dot)(a, b, d)
    )
    assert probe(fp32_only) == {f32}
    # An interpreter this repair does not know is left alone: one that fails, or answers in another dtype or shape.
    assert probe(_dot_with(lambda a, b, d: 1 / 0)) == frozenset()
    assert probe(_dot_with(lambda a, b, d: _position_dependent(a, b, d).astype(np.float16))) == frozenset()
    assert probe(_dot_with(lambda a, b, d: _position_dependent(a, b, d)[:1])) == frozenset()


def _triton_create_dot() -> Any:
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot
    return getattr(dot, "__wrapped__", dot)


def test_installed_interpreter_dots_rows_independently():
    from triton.runtime import interpreter

    interpreter_compat.install_position_independent_dot()
    assert interpreter_compat._position_dependent_dots(interpreter.InterpreterBuilder.create_dot) == frozenset()
    assert interpreter_compat.install_position_independent_dot() is False  # nothing left to repair


def _handle(values: Any, dtype: Any) -> Any:
    from triton.runtime import interpreter

    return interpreter.TensorHandle(np.asarray(values), dtype)


@pytest.mark.parametrize(
    "operands, acc",
    [
        ("float32", "float32"),
        ("float16", "float32"),
        ("float64", "float64"),
        ("float8e4nv", "float32"),
        ("float8e5", "float32"),
        ("int8", "int32"),
        ("float16", "float16"),
    ],
)
def test_fixed_order_create_dot_keeps_triton_semantics_on_exact_sums(operands, acc):
    # Small integers: every product and partial sum is exact, so any order gives the exact result; the repaired dot
    # (asked to repair every float accumulator) must give Triton's bits, FP8 operands and other accumulators included.
    from triton.runtime import interpreter

    original = _triton_create_dot()
    repaired = interpreter_compat.fixed_order_create_dot(
        original, frozenset({np.dtype(np.float32), np.dtype(np.float64)})
    )
    g = torch.Generator().manual_seed(2)
    fp8 = {"float8e4nv": torch.float8_e4m3fn, "float8e5": torch.float8_e5m2}
    torch_dtype = fp8[operands] if operands in fp8 else getattr(torch, operands)
    a = torch.randint(-8, 9, (2, 24), generator=g).to(torch_dtype)
    b = torch.randint(-8, 9, (24, 5), generator=g).to(torch_dtype)
    d = torch.randint(-8, 9, (2, 5), generator=g).to(getattr(torch, acc)).numpy()
    tl_op, tl_acc = getattr(tl, operands), getattr(tl, acc)

    def data(t: torch.Tensor) -> np.ndarray:
        return t.view(torch.uint8).numpy() if t.element_size() == 1 and t.is_floating_point() else t.numpy()

    args = (_handle(data(a), tl_op), _handle(data(b), tl_op), _handle(d, tl_acc), "ieee", 0)
    want = original(interpreter.InterpreterBuilder(), *args)
    got = repaired(interpreter.InterpreterBuilder(), *args)
    assert got.dtype == want.dtype and got.data.dtype == want.data.dtype
    assert np.array_equal(got.data, want.data)
    assert np.array_equal(got.data, (a.double() @ b.double()).numpy() + d)


@pytest.mark.parametrize("k", [1, 7, 16, 40, 64])
def test_fixed_order_dot_is_the_exact_sum_rounded_once(k):
    # Random fp32: products are exact in fp64 and the fp64 pairwise sum errs by (ceil(log2 k) + 1) fp64 ulps of
    # S + |d| at most, so the result is the correctly rounded fp32 of the exact sum up to that.
    import math

    rng = np.random.default_rng(k)
    a = rng.standard_normal((2, 9, k)).astype(np.float32)  # a batch of two
    b = rng.standard_normal((2, k, 5)).astype(np.float32)
    d = rng.standard_normal((2, 9, 5)).astype(np.float32)
    got = interpreter_compat.fixed_order_dot(a, b, d)
    assert got.dtype == np.float32 and got.shape == (2, 9, 5)
    for idx in np.ndindex(got.shape):
        z, i, j = idx
        terms = [float(a[z, i, t]) * float(b[z, t, j]) for t in range(k)] + [float(d[idx])]
        exact = math.fsum(terms)  # the exact sum rounded once to fp64
        slack = (math.ceil(math.log2(k)) + 2) * 2.0**-53 * math.fsum(abs(t) for t in terms)
        lo, hi = np.float32(exact - slack), np.float32(exact + slack)  # the roundings the slack allows
        assert lo <= got[idx] <= hi, (idx, got[idx], exact)
    # Each batch element is its own dot, and a row's bits are its own.
    assert np.array_equal(got[1], interpreter_compat.fixed_order_dot(a[1], b[1], d[1]))
    assert np.array_equal(got[0, 4:5], interpreter_compat.fixed_order_dot(a[0, 4:5], b[0], d[0, 4:5]))


def test_fixed_order_dot_keeps_inf_and_nan():
    a = np.array([[1.0, np.inf], [np.nan, 1.0], [3e38, 3e38], [3e38, -3e38]], np.float32)
    b = np.array([[2.0], [1.0]], np.float32)
    got = interpreter_compat.fixed_order_dot(a, b, np.zeros((4, 1), np.float32))
    assert got[0, 0] == np.inf and np.isnan(got[1, 0]) and got[2, 0] == np.inf
    assert got[3, 0] == np.float32(3e38)  # 6e38 - 3e38: no overflow on the way
