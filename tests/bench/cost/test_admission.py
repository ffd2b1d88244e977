"""The admission cost benchmark (bench/cost/admission.py) runs on W = 2 gloo ranks and W = 1 and reports every
figure, finite and positive (their values belong in docs/bench.md, not here)."""

import math

from bench.cost import admission


def test_admission_cost_reports_every_figure() -> None:
    res = admission.run(world=2, iters=5, repeats=3)
    for key in admission.FIGURES:
        assert key in res, (key, res)
        assert math.isfinite(res[key]) and res[key] > 0, (key, res)
    # Every timed call of the public op was admitted once (the fast path skips the validation, not the admission).
    assert res["admissions_per_call"] == 1.0, res
    assert res["world"] == 2 and res["shape"] == [admission.M, admission.K, admission.N]
