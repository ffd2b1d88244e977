"""Four repairs of Triton's interpreter (3.6 through 3.9); compiled kernels never go through this code.

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

**A dot's rows depend on their neighbours** where NumPy's BLAS makes them so. The interpreter's ``tl.dot`` is
``InterpreterBuilder.create_dot``: ``np.matmul(a, b, dtype=d.dtype) + d`` (FP8 operands first converted to fp16;
``input_precision`` ignored, so "tf32" multiplies in full fp32), and a float32 or float64 ``d`` sends the product
to the BLAS's sgemm or dgemm. OpenBLAS (0.3.31, DYNAMIC_ARCH, on AMD EPYC among others) computes a row's
products with micro-kernels chosen by where the row falls in the matrix (full row blocks and the tail), whose sums
are ordered differently, so a row's bits change with its position and the tile's row count. A GPU computes each
element of an MMA the same way wherever its row lies, and the fused kernels promise what follows (a row's result
depends only on that row's inputs, for a fixed tile shape and k steps): the all-gather's rows at gather dim 1 equal
the same rows at dim 0, the chunked MoE backend's per-piece GEMMs equal one GEMM on all rows.
:func:`install_position_independent_dot` replaces the BLAS product with :func:`fixed_order_dot`, whose every
element is a function of its own row of ``a``, column of ``b`` and element of ``d`` alone (its docstring: the
arithmetic and its error). It is applied only where a probe (:func:`_position_dependent_dots`)
shows the installed interpreter's fp32 or fp64 dot giving a row other bits alone, among fewer rows or at another
position, and only for the dtypes that do; other accumulators (fp16, integers) are NumPy's own loops and stay.
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


def fixed_order_dot(a: np.ndarray, b: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``a @ b + d`` in ``d``'s dtype (float32 or float64), every element computed the same way from its own row of
    ``a``, column of ``b`` and element of ``d``, whatever the rest of the matrices (leading batch dims broadcast).

    The arithmetic: products in fp64, summed over k pairwise in a fixed order (element ``i`` plus element
    ``i + ceil(k / 2)``, halving until one is left: the order depends on k alone), ``d`` added in fp64, one rounding
    to ``d``'s dtype. Only elementwise NumPy ufuncs run (IEEE per element, SIMD or not), so an element's bits are a
    function of its inputs: the same for a row alone, among other rows or at another position. The fp64 sum is
    itself fixed-order, so no double rounding can differ between positions.

    Why fp64: for an fp32 ``d`` the operands the kernels feed a dot (fp32, fp16, bf16 and FP8 widened to fp32,
    int8 weights dequantized to x's dtype) have at most 24 significant bits, so every product is exact in fp64; the
    pairwise sum and the add of ``d`` err by at most ``(ceil(log2 k) + 1) 2^-53 (S + |d|)`` with
    ``S = sum_i |a_i b_i|``, and the rounding to fp32 by ``2^-24 |a @ b + d|``: the exact result rounded once, up to
    a few fp64 ulps of ``S``. A dot accumulated in fp32 (the BLAS, a GPU's MMA) errs by up to ``k 2^-24 S``, which
    is what the kernels' documented bounds allow (``k eps32`` of kernels/testing/reference.py, the MoE and grouped
    GEMM tests' ``2 (k + 1) 2^-24``; a kernel's k loop adds each step's dot to its fp32 accumulator with this one
    rounding), so every bound holds with more margin. For an fp64 ``d`` (fp64 inputs) the products round in fp64
    too: ``(ceil(log2 k) + 2) 2^-53 (S + |d|)`` in all. With fp32 operands nothing overflows on the way (their
    products lie far inside fp64's range): Inf comes from Inf operands or the final rounding, NaN as IEEE makes it.

    Cost: ``k x m x n`` fp64 products and ``ceil(log2 k)`` vectorized adds; for the interpreter's 16 x 16 x 16 CPU
    tiles tens of microseconds per dot, against milliseconds of interpreter work per k step.
    """
    wide = np.float64
    with np.errstate(all="ignore"):
        # [..., k, m, n]: k leading, so each halving adds two contiguous blocks.
        p = (
            np.swapaxes(np.asarray(a), -1, -2).astype(wide)[..., :, :, None]
            * np.asarray(b, dtype=wide)[..., :, None, :]
        )
        k = p.shape[-3]
        while k > 1:
            half = k // 2
            np.add(p[..., :half, :, :], p[..., k - half : k, :, :], out=p[..., :half, :, :])
            k -= half
        total = p[..., 0, :, :] if k else np.zeros(p.shape[:-3] + p.shape[-2:], wide)
        return (total + d).astype(d.dtype)


# The probe's GEMM: a 16 x 32 x 16 tile (the CPU tiles' height; k of two of their steps) of standard normal values.
_PROBE_DOT_SHAPE = (16, 32, 16)


def _position_dependent_dots(create_dot: Callable[..., Any]) -> frozenset[np.dtype]:
    """The accumulator dtypes (of float32, float64) for which ``create_dot`` (an ``InterpreterBuilder.create_dot``)
    gives some row of a tile other bits when the row is alone, among fewer rows or at another position."""
    import triton.language as tl
    from triton.runtime import interpreter

    m, k, n = _PROBE_DOT_SHAPE
    rng = np.random.default_rng(0)
    found = []
    for dtype, tl_dtype in ((np.dtype(np.float32), tl.float32), (np.dtype(np.float64), tl.float64)):
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)

        def dot(rows: np.ndarray, b: np.ndarray = b, dtype: np.dtype = dtype, tl_dtype: Any = tl_dtype) -> bytes:
            handles = [interpreter.TensorHandle(v, tl_dtype) for v in (rows, b, np.zeros((len(rows), n), dtype))]
            out = np.asarray(create_dot(interpreter.InterpreterBuilder(), *handles, "ieee", 0).data)
            if out.dtype != dtype or out.shape != (len(rows), n):
                raise TypeError(f"a dot of {dtype} gave {out.dtype} {out.shape}")
            return np.ascontiguousarray(out).tobytes()

        try:
            full = np.frombuffer(dot(a), dtype).reshape(m, n)
            depends = (
                any(dot(a[i : i + 1]) != full[i].tobytes() for i in range(m))
                or dot(a[1:]) != full[1:].tobytes()
                or dot(np.roll(a, 5, axis=0)) != np.roll(full, 5, axis=0).tobytes()
            )
        except Exception:
            # An interpreter shaped differently from the one this repair knows: leave it alone.
            return frozenset()
        if depends:
            found.append(dtype)
    return frozenset(found)


def install_position_independent_dot() -> bool:
    """Make the interpreter's fp32 / fp64 dots position-independent where they are not (module docstring); True if
    a repair was needed."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "_coc_repaired", False):
        return False
    repaired = _position_dependent_dots(original)
    if not repaired:
        return False
    builder.create_dot = fixed_order_create_dot(original, repaired)
    return True


def fixed_order_create_dot(original: Callable[..., Any], dtypes: frozenset[np.dtype]) -> Callable[..., Any]:
    """``original`` (an ``InterpreterBuilder.create_dot``) with the dots whose accumulator is of ``dtypes`` computed
    by :func:`fixed_order_dot`, and every other left to ``original`` (``__wrapped__``)."""
    import triton.language as tl
    from triton.runtime import interpreter

    def create_dot(self: Any, a: Any, b: Any, d: Any, *precision: Any) -> Any:
        # precision: Triton's (input_precision, max_num_imprecise_acc), passed on as they came.
        if d.data.dtype not in dtypes:
            return original(self, a, b, d, *precision)
        a_data, b_data = a.data, b.data
        # Triton's own operand handling (3.6 and 3.9 alike): FP8 operands are multiplied as fp16; precision
        # (input_precision, max_num_imprecise_acc) is ignored, as Triton ignores it.
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or (
            b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()
        ):
            a_data = interpreter._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        return interpreter.TensorHandle(fixed_order_dot(a_data, b_data, d.data), d.dtype.scalar)

    create_dot._coc_repaired = True  # type: ignore[attr-defined]
    create_dot._coc_dtypes = dtypes  # type: ignore[attr-defined]
    create_dot.__wrapped__ = original  # type: ignore[attr-defined]
    return create_dot


if triton_interpreted():
    install()
    install_launch_scoped_patching()
    install_bf16_rounding()
    install_position_independent_dot()
