"""Two repairs of Triton's interpreter (3.6 through 3.9); compiled kernels never go through this code.

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


if triton_interpreted():
    install()
    install_launch_scoped_patching()
