"""The eager host-time benchmark (bench/cost/eager.py): every op has a row with finite figures, and the torch code
it is timed against computes what the op's call returns, bit for bit (it times the same arithmetic, not less)."""

import math

import torch

from bench.cost import eager


def test_torch_side_is_the_same_arithmetic() -> None:
    with torch.no_grad():
        for op, (call, reference) in eager.cases().items():
            got, want = call(), reference()
            if op == "all_reduce_rmsnorm":
                got = (got.out, got.residual)
            else:
                got, want = (got,), (want,)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), op


def test_every_op_has_a_row() -> None:
    result = eager.run(iters=3, repeats=2)
    assert [row["op"] for row in result["rows"]] == list(eager.OPS)
    for row in result["rows"]:
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("op_us", "torch_us")), row
        assert row["over_us"] == row["op_us"] - row["torch_us"]
    assert "over us" in eager.report(result)
