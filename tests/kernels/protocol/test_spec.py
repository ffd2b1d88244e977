"""A resolved signature's runner (kernels/protocol/spec.py) against the op's implementation table: an entry replaced
after the signature resolved runs from the next call on, for a plain GEMM op and for the norm, whose sequential
backend binds its own runner (OpSpec.bind) only while its table holds the implementation it was made with."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kernels
from kernels.ops import all_gather, all_reduce_rmsnorm


def _gemm() -> Any:
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    return lambda: kernels.all_gather_matmul(x, w, backend="sequential")


def _norm() -> Any:
    x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.rand(8) + 0.5
    return lambda: kernels.all_reduce_rmsnorm(x, r, w, backend="sequential").out


@pytest.mark.parametrize(
    ("spec", "call"), [(all_gather.SPEC, _gemm), (all_reduce_rmsnorm.SPEC, _norm)], ids=["gemm", "norm"]
)
def test_an_implementation_replaced_after_a_signature_resolved_runs_at_the_next_call(spec: Any, call: Any) -> None:
    run = call()
    want = run()
    assert torch.equal(run(), want)  # the signature is resolved: this call took its runner
    real = spec.impl["sequential"]
    seen: list[int] = []

    def spy(c: Any, ops: Any) -> Any:
        seen.append(1)
        return real(c, ops)

    spec.impl["sequential"] = spy
    try:
        assert torch.equal(run(), want)
        assert torch.equal(run(), want)  # resolved again, with the spy: its runner is the spy's
    finally:
        spec.impl["sequential"] = real
    assert seen == [1, 1]
    assert torch.equal(run(), want)
    assert seen == [1, 1]  # restored: the spy no longer runs
