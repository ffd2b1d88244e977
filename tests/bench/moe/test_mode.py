"""``python -m bench --mode moe``: the MoE suites' config, the model's predictions, the CPU run end to end (every
backend checked against plain torch math, then timed) and the model-only mode."""

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.harness import suites
from bench.model import moe as moe_model
from bench.model.dense import load_gpu
from bench.model.moe import AG, COMBINE, DISPATCH, GROUPED, GROUPED_BACKENDS, RS, MoeShape
from bench.moe import mode as moe
from kernels.testing import REPO_ROOT

# Bounds on hangs only (the tiny run takes seconds; a loaded 2-core machine is slower): nothing here is timed.
HANG_S = 600


def _bench(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)  # the command sets it for its CPU ranks
    cmd = [sys.executable, "-m", "bench", "--mode", "moe", *args, "--out-dir", str(tmp_path), "--name", "out"]
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    return r, (json.loads((tmp_path / "out.json").read_text()) if (tmp_path / "out.json").exists() else None)


def test_config_holds_the_anchor_shapes_and_stays_out_of_the_dense_suites():
    assert set(moe.suite_names()) >= {"tiny", "flux", "ep-dispatch", "qwen3-30b-a3b"}
    flux, qwen, ep = moe.load("flux"), moe.load("qwen3-30b-a3b"), moe.load("ep-dispatch")
    assert (flux["experts"], flux["topk"], flux["tokens"], flux["hidden"], flux["intermediate"]) == (
        32,
        4,
        8192,
        8192,
        8192,
    )
    assert 8 in flux["tp_world_sizes"]
    assert (qwen["experts"], qwen["topk"], qwen["hidden"], qwen["intermediate"]) == (128, 8, 2048, 768)
    assert (ep["experts"], ep["tokens"], ep["hidden"], ep["ep_world_sizes"]) == (8, 4096, 4096, [2])
    # configs/bench/ holds the dense suites only: each still loads, and the MoE file is not one of them.
    assert "moe-bench" not in suites.list_suites() and all(suites.load_suite(n) for n in suites.list_suites())
    with pytest.raises(ValueError, match="not in moe-bench.yaml"):
        moe.load("nope")


def test_expand_shards_the_experts_as_the_ops_do():
    cases = moe.expand(moe.load("qwen3-30b-a3b"), worlds=[1, 8])
    by = {(c.op, c.shape.world): c.shape for c in cases}
    grouped = {(c.layer, c.shape.k, c.shape.n) for c in cases if c.op == GROUPED}
    assert grouped == {("up", 2048, 1536), ("down", 768, 2048)}  # gate+up: 2 x intermediate
    assert (by[(AG, 8)].k, by[(AG, 8)].n) == (2048, 1536 // 8)  # column shard of gate+up
    assert (by[(RS, 8)].k, by[(RS, 8)].n) == (768 // 8, 2048)  # row shard of down
    assert by[(DISPATCH, 8)].rows == 4096 * 8 and (COMBINE, 8) in by
    assert all(c.shape.world in (1, 8) for c in cases)


@pytest.mark.parametrize("gen", ["H100", "H800"])
def test_predictions_are_positive_and_grow_with_the_tokens(gen):
    link, spec = load_gpu(gen)
    for name in ("flux", "ep-dispatch", "qwen3-30b-a3b"):
        for case in moe.expand(moe.load(name)):
            for backend in moe.backends_of(case, ["sequential", "chunked2", "chunked4", "fused"]):
                times = []
                for tokens in (1024, 4096, 16384):
                    bigger = moe_model.MoeCase(case.suite, case.layer, case.op, _with_tokens(case.shape, tokens))
                    t = moe_model.predict_case(bigger, backend, link=link, spec=spec, measured={})
                    assert t is not None and t > 0, (case.label, backend)
                    times.append(t)
                assert times == sorted(times) and times[0] < times[-1], (case.label, backend, times)


def _with_tokens(s: MoeShape, tokens: int) -> MoeShape:
    return MoeShape(tokens=tokens, k=s.k, n=s.n, experts=s.experts, topk=s.topk, world=s.world, dtype=s.dtype)


def test_model_orders_the_schedules_at_the_flux_anchor():
    """Flux's TP8 layer on H800: the fused design beats sequential for both ops, and a per-expert loop of
    torch.mm is slower than one grouped GEMM (E launches, E partial waves)."""
    link, spec = load_gpu("H800")
    cases = {(c.op, c.shape.world): c for c in moe.expand(moe.load("flux"))}
    for op in (AG, RS):
        seq, fused = (
            moe_model.predict_case(cases[(op, 8)], b, link=link, spec=spec, measured={})
            for b in ("sequential", "fused")
        )
        assert fused < seq, op
    s = cases[(GROUPED, 1)].shape
    grouped = moe_model.grouped_roofline(spec, s)
    assert moe_model.loop_roofline(spec, s) > grouped
    # Compute-bound: the roofline is within 10 % of 2 m k n at the efficiency-scaled peak.
    ideal = s.flops / (spec.peak_tflops["bf16"] * 1e12 * spec.gemm_efficiency)
    assert ideal <= grouped <= 1.1 * ideal + spec.launch_s


def test_cpu_run_checks_and_times_every_backend_with_the_model_beside(tmp_path):
    # One timed call, no warm-up: the run is checked here, its times mean nothing on CPU.
    r, doc = _bench(["--suite", "tiny", "--warmup", "0", "--repeats", "1"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = doc["records"]
    assert {(rec["op"], rec["world"]) for rec in records} == {
        (GROUPED, 1),
        (AG, 1),
        (RS, 1),
        (AG, 2),
        (RS, 2),
        (DISPATCH, 2),
        (COMBINE, 2),
    }
    for rec in records:
        by = {b["backend"]: b for b in rec["backends"]}
        want = list(GROUPED_BACKENDS) if rec["op"] == GROUPED else ["sequential", "chunked2", "fused"]
        assert list(by) == want, rec["label"]
        for name, b in by.items():
            assert b["status"] == "ok" and b["error_over_bound"] <= 1.0, (rec["label"], name, b)
            if name == "kernel":  # the Triton kernel: checked in the interpreter, never timed on CPU
                assert b["interpreted"] and "ms" not in b
                continue
            assert b["ms"]["median"] > 0 and b["speedup"] > 0, (rec["label"], name)
            if name != "fused":  # the model covers fused only where a link model has peer memory (GPUs)
                assert b["model_ms"] > 0, (rec["label"], name)
        if rec["op"] == GROUPED and hasattr(torch, "_grouped_mm"):
            assert "ms" in by["torch._grouped_mm"]
        if rec["op"] != GROUPED:
            assert "fallback" not in by["fused"], rec["label"]  # every MoE op runs its fused kernels
    links = doc["model"]["link_models"]
    assert links["2"]["name"] == "cpu-gloo-calibrated" and {f["collective"] for f in links["2"]["fits"]} == {
        "all_gather",
        "reduce_scatter",
    }
    assert "PREDICTION" in r.stdout and "ok(i)" in r.stdout


def test_model_only_mode_measures_nothing(tmp_path):
    r, doc = _bench(["--suite", "flux", "--suite", "qwen3-30b-a3b", "--gpu", "H800", "--device", "cpu"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MODEL ONLY for H800: nothing was measured" in r.stdout
    assert doc["meta"]["device"]["type"] == "model"
    for rec in doc["records"]:
        for b in rec["backends"]:
            assert b["status"] == "model" and "ms" not in b and b["model_ms"] > 0, (rec["label"], b)


def _wrong_results(rank, world, device):
    """In a one-rank group: each kind of case's check passes its own result and flags a perturbed one."""
    from bench.moe.ranks import _prepare, interpreter

    found = {}
    tiny = {**moe.load("tiny"), "ep_world_sizes": [1]}
    for case in moe.expand(tiny, worlds=[1]):
        prep = _prepare(case, rank, device, seed=3)
        with interpreter(False):
            out = prep.call("loop" if case.op == GROUPED else "sequential")()
        if case.op == DISPATCH:
            bad = (out[0] + 1e-3, *out[1:])
            found[case.op] = (prep.check(out), prep.check(bad))
        else:
            found[case.op] = (prep.check(out), prep.check(out * (1 + 1e-3)))
    return found


def test_plain_math_checks_flag_wrong_results(monkeypatch):
    from bench.harness import launch

    # run_in_process sets a rank's thread count and environment in this process: restored after.
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    threads = torch.get_num_threads()
    try:
        found = launch.run_in_process(_wrong_results, "cpu", HANG_S)
    finally:
        torch.set_num_threads(threads)
    assert set(found) == {GROUPED, AG, RS, DISPATCH, COMBINE}
    for op, (good, bad) in found.items():
        assert good <= 1.0 < bad, (op, good, bad)
