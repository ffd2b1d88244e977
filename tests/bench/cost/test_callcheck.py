"""The call-check cost benchmark runs and reports positive figures (their values belong in docs/bench.md, not here)."""

from bench.cost import callcheck


def test_check_cost_reports_every_figure() -> None:
    res = callcheck.run(world=2, iters=5, repeats=1)
    for key in ("exchange_us", "bare_all_gather_us", "admit_steady_us", "validate_us"):
        assert res[key] > 0, (key, res)
    assert res["world"] == 2 and res["shape"] == [callcheck.M, callcheck.K, callcheck.N]
