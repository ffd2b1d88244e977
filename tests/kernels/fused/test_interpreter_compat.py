"""The repair of Triton 3.6's interpreter (scalar ``__index__`` under NumPy >= 2.4).

The repair lives in kernels/fused/interpreter_compat.py.
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
