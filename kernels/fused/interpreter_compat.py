"""Repair of a Triton interpreter defect that breaks every loop of the fused kernels with a runtime bound.

The interpreter passes a scalar kernel argument as a one-element 1-D NumPy array. Triton 3.6
implements ``tensor.__index__`` as ``int(array)``, which NumPy 2.4 turned into a TypeError for
arrays with ``ndim > 0`` ("only 0-dimensional arrays can be converted to Python scalars"), so
``for k0 in range(0, K, BLOCK_K)`` with a runtime ``K`` fails at its first launch
(triton-lang/triton issue 9171; later Triton releases convert the single element explicitly).
Compiled kernels never go through this code. The repair is applied only where a probe shows the
installed interpreter's ``__index__`` fails on a one-element array, so newer Triton is untouched.
"""

from __future__ import annotations

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


if triton_interpreted():
    install()
