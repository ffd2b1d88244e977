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
