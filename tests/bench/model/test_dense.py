"""bench.model.dense: the alpha-beta link model, calibration, pipeline schedules and the GPU roofline."""

import math

import pytest

from bench.model import dense
from bench.model.dense import CollectiveFit, LinkModel, chunk_rows, pipeline_comm_first, pipeline_compute_first


def test_bus_factor_follows_nccl_tests_convention():
    assert dense.bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert dense.bus_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert dense.bus_factor("all_reduce", 2) == pytest.approx(1.0)
    assert dense.bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="broadcast"):
        dense.bus_factor("broadcast", 2)


def test_calibrate_recovers_alpha_and_bandwidth_exactly():
    alpha, bw = 40e-6, 2.5e9
    samples = []
    for coll in ("all_gather", "all_reduce"):
        for nbytes in (1e4, 1e5, 1e6, 4e6):
            samples.append((coll, 2, nbytes, alpha + dense.bus_factor(coll, 2) * nbytes / bw))
    link = dense.calibrate(samples)
    for coll in ("all_gather", "all_reduce"):
        fit = link.fits[(coll, 2)]
        assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
        assert fit.bus_bytes_per_s == pytest.approx(bw, rel=1e-6)
        assert fit.rel_rms == pytest.approx(0.0, abs=1e-9)
        assert link.collective_time(coll, 3e6, 2) == pytest.approx(alpha + dense.bus_factor(coll, 2) * 3e6 / bw)


def test_calibrate_needs_two_sizes():
    with pytest.raises(ValueError, match="two or more sizes"):
        dense.calibrate([("all_gather", 2, 1e4, 1e-4), ("all_gather", 2, 1e4, 2e-4)])


def test_links_yaml_collective_time_is_the_documented_formula():
    link, _ = dense.load_gpu("H100")
    nbytes = 64e6
    expected = 10e-6 + 6 * 0.5e-6 + 7 / 8 * nbytes / (450e9 * 0.82)
    assert link.collective_time("all_gather", nbytes, 8) == pytest.approx(expected)
    expected_ar = 10e-6 + 13 * 0.5e-6 + 2 * 7 / 8 * nbytes / (450e9 * 0.82)
    assert link.collective_time("all_reduce", nbytes, 8) == pytest.approx(expected_ar)
    assert link.collective_time("all_reduce", nbytes, 1) == 0.0


def test_chunk_rows_uneven_split_sums_to_m():
    assert chunk_rows(10, 4) == [3, 3, 2, 2]
    assert chunk_rows(3, 8) == [1, 1, 1]
    assert sum(chunk_rows(4093, 8)) == 4093


def test_pipelines_by_hand():
    # Two pieces of 1 s GEMM and 1 s collective: the second GEMM hides the first collective.
    assert pipeline_compute_first([1, 1], [1, 1], 0.0) == pytest.approx(3.0)
    assert pipeline_comm_first([1, 1], [1, 1], 0.0) == pytest.approx(3.0)
    # Interference only applies while the neighbour's transfer is running.
    assert pipeline_compute_first([1, 1], [1, 1], 0.5) == pytest.approx(3.5)
    assert pipeline_compute_first([1, 1], [0.0, 0.0], 0.5) == pytest.approx(2.0)


@pytest.mark.parametrize("g,c", [([1, 2, 3], [3, 2, 1]), ([0.5] * 8, [0.1] * 8), ([0.1] * 4, [2.0] * 4)])
def test_pipelines_between_physical_bounds(g, c):
    for fn in (pipeline_compute_first, pipeline_comm_first):
        t = fn(g, c, 0.0)
        assert max(sum(g), sum(c)) <= t + 1e-12
        assert t <= sum(g) + sum(c) + 1e-12


def _flat_gemm(rate_flops):
    return lambda m, k, n: 2.0 * m * k * n / rate_flops


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_predictions_respect_the_overlap_limit(op):
    link, _ = dense.load_gpu("H100")
    gemm = _flat_gemm(700e12)
    world, shape = 8, (8192, 8192, 1280) if op == "all_gather_matmul" else (8192, 1024, 8192)
    elems = 8192 * (8192 if op == "all_gather_matmul" else 8192)
    coll = dense.OP_COLLECTIVE[op]
    t_g, t_c = gemm(*shape), link.collective_time(coll, elems * 2, world)
    seq = dense.predict(op, "sequential", world, shape, elems, dtype="bf16", gemm_time=gemm, link=link)
    assert seq == pytest.approx(t_g + t_c)
    for backend in ("chunked2", "chunked4", "chunked8", "fused"):
        t = dense.predict(op, backend, world, shape, elems, dtype="bf16", gemm_time=gemm, link=link)
        assert t >= t_g - 1e-12, backend  # an op never beats its own GEMM
        assert t >= dense.bus_factor("all_gather", world) * elems * 2 / link.link_bytes_per_s - 1e-12, backend


def test_fused_not_modelled_without_peer_memory_parameters():
    link = LinkModel(name="x", source="test", fits={("all_reduce", 2): CollectiveFit(1e-5, 1e9)})
    flat = {"dtype": "fp32", "gemm_time": _flat_gemm(1e9), "link": link}
    assert dense.predict("matmul_all_reduce", "fused", 2, (64, 32, 16), 64 * 16, **flat) is None
    assert dense.predict("matmul_all_reduce", "chunked2", 2, (64, 32, 16), 64 * 16, **flat) is not None


def test_roofline_large_gemm_runs_at_peak_times_efficiency():
    _, spec = dense.load_gpu("H100")
    m = k = n = 16384  # 128 x 64 tiles of 128 x 256: a whole number of waves is not needed at this size
    t = spec.gemm_time(m, k, n, "bf16")
    ideal = 2 * m * k * n / (989e12 * 0.80)
    assert ideal <= t <= ideal * 1.05
    # Small GEMMs are bounded by waves / memory, never faster than the ideal.
    assert spec.gemm_time(64, 8192, 1024, "bf16") >= 2 * 64 * 8192 * 1024 / (989e12 * 0.80)


def test_detect_generation_from_cuda_device_names():
    assert dense.detect_generation("NVIDIA H100 80GB HBM3") == "H100"
    assert dense.detect_generation("NVIDIA H200") == "H200"
    assert dense.detect_generation("NVIDIA A100-SXM4-80GB") == "A100"
    assert dense.detect_generation("NVIDIA H800") == "H800"
    assert dense.detect_generation("Tesla T4") is None
    with pytest.raises(ValueError, match="unknown GPU generation"):
        dense.load_gpu("T4")


def test_gemm_times_prefers_measurements_then_scales_by_rows():
    g = dense.GemmTimes({(100, 8, 8): 2.0})
    assert g(100, 8, 8) == 2.0
    assert g(50, 8, 8) == pytest.approx(1.0)
    with pytest.raises(KeyError):
        g(50, 9, 8)
    assert math.isclose(dense.GemmTimes({}, lambda m, k, n: 7.0)(1, 2, 3), 7.0)


def test_full_interference_serializes_the_pipeline():
    assert pipeline_compute_first([1, 1], [1, 1], 1.0) == pytest.approx(4.0)
    assert pipeline_comm_first([1, 1], [1, 1], 1.0) == pytest.approx(4.0)


def test_interference_from_bare_timings_is_clamped_to_0_1():
    from bench.dense.runner import interference

    assert interference(10.0, 5.0, 10.0) == 0.0  # the collective hid entirely
    assert interference(10.0, 5.0, 12.5) == pytest.approx(0.5)
    assert interference(10.0, 5.0, 15.0) == pytest.approx(1.0)  # serialized
    assert interference(10.0, 5.0, 40.0) == 1.0  # noise cannot claim more than serializing
    assert interference(10.0, 5.0, 8.0) == 0.0
    assert interference(10.0, 0.0, 12.0) == 0.0


# ------------------------------------------------------------------------------ FP8 terms


def test_fp8_peak_is_twice_bf16_on_hopper_and_refused_without_fp8_tensor_cores():
    for gen in ("H100", "H200", "H800"):
        _, spec = dense.load_gpu(gen)
        assert spec.peak_tflops["fp8"] == 2 * spec.peak_tflops["bf16"] == 1978, gen
    _, a100 = dense.load_gpu("A100")
    with pytest.raises(ValueError, match="no peak TFLOP/s for dtype 'fp8' on A100"):
        a100.gemm_time(4096, 4096, 4096, "fp8")


def test_fp8_gemm_compute_time_is_half_of_bf16():
    _, spec = dense.load_gpu("H100")
    m = k = n = 16384  # compute bound in both dtypes
    bf16 = spec.gemm_time(m, k, n, "bf16") - spec.launch_s
    fp8 = spec.gemm_time(m, k, n, "fp8") - spec.launch_s
    assert fp8 == pytest.approx(bf16 / 2, rel=1e-12)


def test_fp8_gemm_memory_bound_reads_one_byte_operands_and_their_scales():
    _, spec = dense.load_gpu("H100")
    m, k, n = 16, 8192, 8192  # decode-sized: HBM bound
    for mode, scales in (("block", m * 64 * 4 + 64 * 64 * 4), ("row", m * 4 + n * 4), ("tensor", 4)):
        traffic = m * k + k * n + m * n * 2 + scales  # bf16 output
        want = traffic / spec.hbm_bytes_per_s + spec.launch_s
        assert spec.gemm_time(m, k, n, "fp8", out_dtype="bf16", fp8_mode=mode) == pytest.approx(want, rel=1e-12), mode
    assert spec.gemm_time(m, k, n, "fp8", out_dtype="fp32") > spec.gemm_time(m, k, n, "fp8", out_dtype="bf16")


@pytest.mark.parametrize("k", [8192, 200])
def test_fp8_all_gather_moves_half_the_bf16_bytes_plus_the_scales(k):
    m, n, world = 4096, 1280, 8
    shape, elems = (m, k, n), m * k
    bf16 = dense.comm_bytes("all_gather_matmul", "fused", shape, elems, "bf16")
    assert bf16 == 2 * m * k
    blocks = -(-k // 128)
    for backend in ("baseline", "sequential", "chunked4", "fused"):
        got = dense.comm_bytes("all_gather_matmul", backend, shape, elems, "fp8", fp8_mode="block")
        assert got == bf16 / 2 + m * blocks * 4, backend
        assert dense.comm_bytes("all_gather_matmul", backend, shape, elems, "fp8", fp8_mode="row") == bf16 / 2 + m * 4
    # A tensorwise scale is one global scalar; the fused heap still gives each row a scale slot.
    assert dense.comm_bytes("all_gather_matmul", "baseline", shape, elems, "fp8", fp8_mode="tensor") == bf16 / 2
    assert dense.comm_bytes("all_gather_matmul", "fused", shape, elems, "fp8", fp8_mode="tensor") == bf16 / 2 + m * 4
    # ...and the prediction uses exactly these bytes: baseline = FP8 GEMM + NCCL all-gather of them.
    link, _ = dense.load_gpu("H100")
    gemm = _flat_gemm(1500e12)
    t = dense.predict("all_gather_matmul", "baseline", world, shape, elems, dtype="fp8", gemm_time=gemm, link=link)
    assert t == pytest.approx(gemm(*shape) + link.collective_time("all_gather", bf16 / 2 + m * blocks * 4, world))


def test_fp8_reductions_move_the_output_dtype_in_the_baseline_and_fp32_partials_here():
    shape, elems = (8192, 3584, 8192), 8192 * 8192
    for op in ("matmul_reduce_scatter", "matmul_all_reduce"):
        assert dense.comm_bytes(op, "baseline", shape, elems, "fp8") == 2 * elems  # bf16 out
        assert dense.comm_bytes(op, "baseline", shape, elems, "fp8", out_dtype="fp32") == 4 * elems
        for backend in ("sequential", "chunked4", "fused"):
            assert dense.comm_bytes(op, backend, shape, elems, "fp8") == 4 * elems, (op, backend)
    with pytest.raises(ValueError, match="fp8_mode"):
        dense.comm_bytes("all_gather_matmul", "fused", shape, elems, "fp8", fp8_mode="blockwise")


def test_fp8_predictions_table_covers_the_llama70b_tp8_layers():
    rows = dense.fp8_rows("H100")
    assert {r["label"] for r in rows} == {
        "qkv all_gather_matmul",
        "attn_out matmul_reduce_scatter",
        "attn_out matmul_all_reduce",
        "fc1 all_gather_matmul",
        "fc2 matmul_reduce_scatter",
        "fc2 matmul_all_reduce",
    }
    for r in rows:
        assert all(r[key] > 0 for key in ("bf16_sequential", "bf16_fused", "fp8_baseline", "fp8_fused")), r
        if r["op"] == "all_gather_matmul":
            m, k, _ = r["gemm_shape"]
            assert r["fp8_fused_mb"] * 1e6 == r["bf16_sequential_mb"] * 1e6 / 2 + m * (k // 128) * 4
            assert r["fp8_fused"] < r["bf16_fused"]
    assert len(dense.fp8_table("H100")) == len(rows) + 2
