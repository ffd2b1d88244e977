"""all-gather + GEMM (kernels/ops/all_gather.py) in every operand format on every backend, worlds 1-3, against the fp64
reference (tests/kernels/op_cases.py has the cases and their bounds)."""

from __future__ import annotations

import pytest

from kernels.testing import run_ranks
from tests.kernels import op_cases

# (backend, world): the fused kernels run under the Triton interpreter, where every launch costs seconds.
GRID = [
    ("sequential", 1),
    ("sequential", 2),
    ("sequential", 3),
    ("chunked", 2),
    ("chunked", 3),
    ("fused", 1),
    ("fused", 2),
]


@pytest.mark.parametrize(("backend", "world"), GRID, ids=[f"{b}-W{w}" for b, w in GRID])
def test_every_format_matches_the_reference(backend: str, world: int) -> None:
    per_rank = run_ranks(op_cases.pattern_body, world, "all_gather", backend, timeout=900)
    failures = {
        f"rank {r} {case}": problem for r, res in enumerate(per_rank) for case, problem in res.items() if problem
    }
    assert len(per_rank[0]) == len(op_cases.FORMATS) * len(op_cases.CASES["all_gather"][1])
    assert not failures, failures
