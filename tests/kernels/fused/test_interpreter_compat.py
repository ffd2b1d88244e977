"""The repairs of Triton's interpreter: scalar ``__index__`` under NumPy >= 2.4 (3.6), the language patched once per
launch, and fp32 -> bf16 conversions rounded to nearest even as a GPU's ``cvt.rn.bf16.f32`` (3.6 and 3.9 truncate).

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
