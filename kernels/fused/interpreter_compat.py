"""Three repairs of Triton's interpreter (3.6 through 3.9); compiled kernels never go through this code.

**Scalar ``__index__``**, a defect that breaks every loop of the fused kernels with a runtime bound.
The interpreter passes a scalar kernel argument as a one-element 1-D NumPy array. Triton 3.6
implements ``tensor.__index__`` as ``int(array)``, which NumPy 2.4 turned into a TypeError for
arrays with ``ndim > 0`` ("only 0-dimensional arrays can be converted to Python scalars"), so
``for k0 in range(0, K, BLOCK_K)`` with a runtime ``K`` fails at its first launch
(triton-lang/triton issue 9171; later Triton releases convert the single element explicitly).
The repair is applied only where a probe shows the installed interpreter's ``__index__`` fails on
a one-element array, so newer Triton is untouched.

**Language patching once per launch**, a cost. The interpreter replaces the builtins of
``triton.language`` with NumPy-backed ones (``_patch_lang``: ``inspect.getmembers`` over ``tl``,
``tl.tensor``, ``tl.math``, ``tl.core``) when a launch starts, and again at every call of a
``@triton.jit`` device function inside it, keeping no record of the second kind: those patches are
never undone (``tl.core``'s, made by the standard library's ``tl.cdiv`` or ``tl.zeros``, outlive the
launch). A repeat finds every builtin already replaced and changes nothing, yet it is about a third
of an interpreted fused call's time: the fused kernels call dozens of device functions per program.
:func:`install_launch_scoped_patching` patches ``tl`` and ``tl.core`` once when a launch starts,
undoes both when it ends, and has the device-function calls in between patch nothing.

**fp32 -> bf16 by truncation**, where a GPU rounds to nearest even. The interpreter keeps bf16 as the
upper 16 bits of fp32 (NumPy has no bf16) and its ``InterpreterBuilder.cast_impl`` converts fp32 to bf16
with ``_convert_float(..., rounding_mode=None)``, which drops the low 16 bits. Every default-rounding
cast reaches it: ``x.to(tl.bfloat16)`` (``create_fp_trunc``), the implicit cast of a store into a bf16
pointer, bf16 constants (3.9's ``get_bf16``) and fp16 -> bf16 (through fp32). A compiled kernel's
cast is ``cvt.rn.bf16.f32`` (round to nearest, ties to even), as is torch's ``.to(torch.bfloat16)``,
so an interpreted bf16 output was off by up to a whole ulp where the GPU's is off by half of one.
:func:`install_bf16_rounding` makes ``cast_impl`` round fp32 -> bf16 to nearest even
(:func:`_fp32_to_bf16_bits`: Inf stays Inf, NaN stays NaN) and leaves every other conversion, fp16
and FP8 included, to Triton. It is applied only where a probe shows the installed interpreter
truncates, so a Triton that rounds is untouched.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np

from .runtime import triton_interpreted


class _Recorder:
    """Stands in for the interpreter's patch scope: keeps what would be set instead of setting it."""

    def __init__(self) -> None:
        self.attrs: dict[str, Any] = {}

    def set_attr(self, obj: object, name: str, value: Any) -> None:
        self.attrs[name] = value


class _Probe:
    """A scalar interpreter tensor reduced to what ``__index__`` reads: ``.handle.data``."""

    def __init__(self, data: np.ndarray) -> None:
        self.handle = self
        self.data = data


def _index_fails_on_scalars(patch_tensor: Callable[[Any, Any], None]) -> bool:
    recorder = _Recorder()
    try:
        patch_tensor(_Probe, recorder)
    except Exception:
        # An interpreter shaped differently from the one this repair knows: leave it alone.
        return False
    index = recorder.attrs.get("__index__")
    if index is None:
        return False
    try:
        return index(_Probe(np.array([3], dtype=np.int32))) != 3
    except TypeError:
        return True


def install() -> bool:
    """Make the interpreter's ``tensor.__index__`` accept one-element arrays; True if a repair was needed."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_coc_repaired", False) or not _index_fails_on_scalars(original):
        return False

    def patch_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        # Set through the same scope after the original: the launch's restore undoes both in order.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_tensor._coc_repaired = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_tensor
    return True


class _NoPatches:
    """The scope of a device-function call inside a launch: the launch's patches already hold."""

    def restore(self) -> None:
        pass


# One entry while a launch's language patches are in place (launches do not nest).
_launches_patched: list[None] = []


def _sees_both_languages() -> None:
    """Code for a function whose globals hold ``tl`` and ``tl.core``: what ``_patch_lang`` patches for it."""


def install_launch_scoped_patching() -> bool:
    """Patch ``triton.language`` once per interpreted launch (module docstring); True if installed now."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "_coc_launch_scoped", False):
        return False
    both = types.FunctionType(_sees_both_languages.__code__, {"tl": tl, "core": tl.core})

    def patch_lang(fn: Callable[..., Any]) -> Any:
        if _launches_patched:
            return _NoPatches()
        scope = original(both)
        restore = scope.restore

        def restore_launch() -> None:
            _launches_patched.pop()
            restore()

        scope.restore = restore_launch
        _launches_patched.append(None)
        return scope

    patch_lang._coc_launch_scoped = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    return True


def _fp32_to_bf16_bits(data: np.ndarray) -> np.ndarray:
    """The bf16 bits (uint16) of fp32 ``data`` rounded to nearest, ties to even.

    Adding ``0x7FFF`` plus the last kept bit before dropping the low 16 bits rounds every finite value and
    leaves Inf as it is (a carry out of the largest finite values makes Inf, as it should); a NaN whose
    payload lies in the low bits would become Inf, or wrap, so NaNs keep their sign and upper payload and
    get the quiet bit instead."""
    bits = np.asarray(data, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, quiet_nan, rounded).astype(np.uint16)


# fp32 values whose bf16 truncation and rounding differ: above a halfway point, and a tie to an odd last bit.
_PROBE_FP32 = np.array([0x3F80C000, 0x3F818000], dtype=np.uint32).view(np.float32)


def _bf16_cast_truncates(cast_impl: Callable[[Any, Any, Any], Any]) -> bool:
    """Whether ``cast_impl`` (an ``InterpreterBuilder.cast_impl``) converts fp32 to bf16 by truncation."""
    import triton.language as tl
    from triton.runtime import interpreter

    try:
        probe = interpreter.TensorHandle(_PROBE_FP32, tl.float32)
        out = cast_impl(interpreter.InterpreterBuilder(), probe, tl.bfloat16)
        got = np.asarray(out.data).view(np.uint16).tolist()
    except Exception:
        # An interpreter shaped differently from the one this repair knows: leave it alone.
        return False
    return got == (_PROBE_FP32.view(np.uint32) >> 16).tolist()


def install_bf16_rounding() -> bool:
    """Make the interpreter round fp32 -> bf16 to nearest even (module docstring); True if a repair was needed."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "cast_impl", None)
    if original is None or getattr(original, "_coc_repaired", False) or not _bf16_cast_truncates(original):
        return False

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_bits(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._coc_repaired = True  # type: ignore[attr-defined]
    builder.cast_impl = cast_impl
    return True


if triton_interpreted():
    install()
    install_launch_scoped_patching()
    install_bf16_rounding()
