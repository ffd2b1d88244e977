"""bench.harness.suites (YAML suites -> cases with per-rank shapes) and bench.harness.timing statistics."""

import pytest
import torch

from bench.harness import suites
from bench.harness.suites import Case, load_suite
from bench.harness.timing import Stats, Timer


@pytest.mark.parametrize("name", suites.list_suites())
def test_every_shipped_suite_loads_and_expands(name):
    s = load_suite(name)
    cases = s.cases()
    assert cases, name
    for c in cases:
        assert c.invalid_reason() is None, c.label


def test_shipped_suites_cover_the_issue():
    names = set(suites.list_suites())
    assert {"tiny", "llama2-7b", "llama2-70b", "llama3-70b", "bloom-176b"} <= names
    for name in ("llama2-7b", "llama2-70b", "llama3-70b", "bloom-176b"):
        assert load_suite(name).world_sizes == [2, 4, 8]


def test_case_shapes_follow_the_op_contract():
    ag = Case("s", "fc1", "all_gather_matmul", 4096, 8192, 57344, 8, "bf16")
    assert ag.x_shape == (512, 8192) and ag.w_shape == (7168, 8192)
    assert ag.gemm_shape == (4096, 8192, 7168) and ag.comm_elems == 4096 * 8192
    rs = Case("s", "fc2", "matmul_reduce_scatter", 4096, 28672, 8192, 8, "bf16")
    assert rs.x_shape == (4096, 3584) and rs.w_shape == (8192, 3584)
    assert rs.gemm_shape == (4096, 3584, 8192) and rs.comm_elems == 4096 * 8192
    assert rs.flops == 2 * 4096 * 3584 * 8192


def test_invalid_cases_name_the_dim():
    assert "M=100" in Case("s", "l", "matmul_reduce_scatter", 100, 64, 64, 8, "fp32").invalid_reason()
    assert "k=60" in Case("s", "l", "matmul_all_reduce", 64, 60, 64, 8, "fp32").invalid_reason()
    assert "n=60" in Case("s", "l", "all_gather_matmul", 64, 64, 60, 8, "fp32").invalid_reason()


def test_bad_suite_files_raise_naming_the_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\ntokens: [8]\nworld_sizes: [2]\ndtypes: [fp32]\nlayers: []\nrepeat: 3\n")
    with pytest.raises(ValueError, match="repeat"):
        load_suite(str(p))
    p.write_text("name: x\ntokens: [8]\nworld_sizes: [2]\ndtypes: [fp64]\nlayers: [{name: a, op: ag, k: 8, n: 8}]\n")
    with pytest.raises(ValueError, match="fp64"):
        load_suite(str(p))
    p.write_text("name: x\ntokens: [8]\nworld_sizes: [2]\ndtypes: [fp32]\nlayers: [{name: a, op: gemm, k: 8, n: 8}]\n")
    with pytest.raises(ValueError, match="gemm"):
        load_suite(str(p))
    with pytest.raises(ValueError, match="not found"):
        load_suite("no-such-suite")


def test_op_and_backend_names():
    assert suites.parse_op("qar") == "quantized_matmul_all_reduce"
    assert suites.backend_args("chunked4") == ("chunked", 4)
    assert suites.backend_args("fused") == ("fused", None)
    with pytest.raises(ValueError, match="chunked3"):
        suites.parse_backend("chunked3")


def test_operand_formats_parse_expand_and_refuse_by_name(tmp_path):
    assert suites.parse_format(" fp8:row ") == "fp8:row"
    assert suites.parse_format("int8:per_group") == f"int8:per_group:{suites.DEFAULT_GROUP_SIZE}"
    c = Case("s", "l", "matmul_all_reduce", 8, 64, 8, 2, "bf16", suites.parse_format("int8:per_group:32"))
    assert (c.kind, c.mode, c.group_size) == ("int8", "per_group", 32) and c.label.endswith("bf16 int8:per_group:32")
    assert c.to_dict()["format"] == "int8:per_group:32"
    for bad in ("fp8", "fp8:rows", "int8:per_group:0", "plain:x", "bf16"):
        with pytest.raises(ValueError, match="accepted: plain, fp8:tensor"):
            suites.parse_format(bad)
    p = tmp_path / "f.yaml"
    layers = "layers: [{name: a, op: [ag, qar], k: 8, n: 8}]\n"
    p.write_text("name: f\ntokens: [8]\nworld_sizes: [2]\ndtypes: [fp32]\nformat: [plain, fp8:row]\n" + layers)
    got = [(c.op, c.fmt) for c in load_suite(str(p)).cases()]
    # qar is matmul_all_reduce in int8:per_channel whatever the suite's formats: once, not once per format.
    assert got == [
        ("all_gather_matmul", "plain"),
        ("matmul_all_reduce", "int8:per_channel"),
        ("all_gather_matmul", "fp8:row"),
    ]
    assert [c.fmt for c in load_suite(str(p)).cases(formats=["fp8:tensor"])] == ["fp8:tensor", "int8:per_channel"]
    p.write_text("name: f\ntokens: [8]\nworld_sizes: [2]\ndtypes: [fp32]\nformat: fp4\n" + layers)
    with pytest.raises(ValueError, match="format: unknown format 'fp4'"):
        load_suite(str(p))


def test_stats_quantiles_match_numpy_linear():
    s = Stats.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.min, s.max, s.n) == (3.0, 1.0, 5.0, 5)
    assert s.p20 == pytest.approx(1.8) and s.p80 == pytest.approx(4.2)
    assert s.spread == pytest.approx((4.2 - 1.8) / 3.0)
    with pytest.raises(ValueError):
        Stats.of([])


def test_timer_runs_warmup_and_repeats_without_a_process_group():
    calls = []
    stats = Timer(torch.device("cpu")).run(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7 and stats.n == 5 and stats.min >= 0.0
    with pytest.raises(ValueError, match="repeats"):
        Timer(torch.device("cpu")).run(lambda: None, warmup=0, repeats=0)
