"""Fused Triton ops under the interpreter on spawned gloo ranks: correctness, determinism, W == 1, GEMM core."""

import pytest
import torch

from kernels.testing import run_ranks
from tests.kernels.fused import cases as fused_cases
from tests.kernels.fused import mismatch_cases as fused_mismatch_cases


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("op", fused_cases.OPS)
def test_fused_op_matches_torch(op, world):
    # Each rank body runs 4 cases (bias on/off, rows not a tile multiple, non-contiguous inputs) on a
    # heap scrambled with random data before every call, and asserts against fp64 torch math.
    assert run_ranks(fused_cases.correctness_body, world, op) == [4] * world


@pytest.mark.parametrize("op", fused_cases.OPS)
def test_fused_op_bf16_matches_torch(op):
    # The interpreter's own bf16 dot is off by ~1e10 (kernels.fused.tile._WIDEN_BF16_DOT): every op,
    # and the w8A16 kernel below, must still give bf16 results within the bf16 bound.
    # One case (odd rows, bias, non-contiguous inputs): the fp32 test covers the index arithmetic.
    case = fused_cases.CORRECTNESS_CASES[2]
    assert run_ranks(fused_cases.correctness_body, 2, op, torch.bfloat16, "cpu", (case,)) == [1, 1]


def test_fused_w8a16_bf16_matches_torch():
    assert run_ranks(fused_cases.w8a16_bf16_body, 2) == [2, 2]


def test_fused_ops_fp64():
    assert run_ranks(fused_cases.fp64_body, 2) == [len(fused_cases.OPS)] * 2


@pytest.mark.one_triton  # W = 3 (not run by the 3.6 rerun); the kernels it repeats rerun in test_fused_op_matches_torch
def test_fused_deterministic_and_ranks_agree():
    outs = run_ranks(fused_cases.determinism_body, 3)
    for op in ("rs", "ar_one", "ar_two"):
        for rank_outs in outs:
            assert all(torch.equal(rank_outs[op][0], o) for o in rank_outs[op][1:]), f"{op}: repeats differ"
    for op in ("ar_one", "ar_two"):
        assert all(torch.equal(outs[0][op][0], o[op][0]) for o in outs[1:]), f"{op}: ranks differ"


def test_fused_all_gather_with_tiles_that_differ_by_rank(tmp_path):
    # Column shards may differ in n, and the tuned file is looked up by n, so ranks may run the
    # all-gather GEMM with different tile heights; the pushed chunks must still match what peers wait on.
    from kernels.fused import tuned
    from kernels.fused.gemm_configs import GemmConfig

    tall, short = GemmConfig(32, 32, 16, 1, 1, 2), GemmConfig(16, 16, 16, 1, 1, 1)
    entries = [
        tuned.Entry("all_gather_matmul", "float32", 24, 16, 20, short),
        tuned.Entry("all_gather_matmul", "float32", 24, 64, 20, tall),
    ]
    tuned.write(tmp_path / "cpu.yaml", entries, {"gpu": "test"})
    env = {tuned.ENV_TUNED_DIR: str(tmp_path)}
    got = run_ranks(fused_cases.per_rank_tiles_body, 2, env=env)
    assert got == [[short.block_m], [tall.block_m]]
    # A tall tile waits for every chunk it overlaps: with rank 0's second chunk withheld, rank 1 times out.
    errors = run_ranks(fused_cases.withheld_chunk_body, 2, env={**env, "COC_TIMEOUT": "5"}, timeout=120)
    assert "rank 1 (group rank 1) waited more than COC_TIMEOUT=5 s for rank 0" in errors[1], errors[1]
    assert "to push its input shard" in errors[1], errors[1]


def test_a_call_from_another_stream_waits_for_the_previous_call(monkeypatch):
    # The ordering logic of runtime._follow_last_call with stand-in streams (the GPU test below runs it
    # on real ones): a call from a new stream waits for the previous call's stream, one from the same
    # stream adds no wait, and inside capture nothing is recorded or waited on.
    from types import SimpleNamespace

    from kernels.fused import runtime

    class Stream:
        def __init__(self, name: str) -> None:
            self.name, self.waited = name, []

        def wait_stream(self, other: "Stream") -> None:
            self.waited.append(other.name)

    a, b = Stream("a"), Stream("b")
    current, capture = [a], [False]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capture[0])
    heap = SimpleNamespace(device=torch.device("cuda", 0), last_stream=None)
    runtime._follow_last_call(heap)
    runtime._follow_last_call(heap)
    assert heap.last_stream is a and a.waited == []
    current[0] = b
    runtime._follow_last_call(heap)
    assert heap.last_stream is b and b.waited == ["a"]
    capture[0], current[0] = True, a
    runtime._follow_last_call(heap)
    assert heap.last_stream is b and a.waited == []
    cpu_heap = SimpleNamespace(device=torch.device("cpu"), last_stream=None)
    runtime._follow_last_call(cpu_heap)
    assert cpu_heap.last_stream is None


@pytest.mark.gpu
def test_fused_calls_from_two_streams_gpu():
    # The flow control is stream order; calls from two streams must still form one sequence.
    assert fused_cases.run_gpu_ranks(fused_cases.gpu_streams_body, 2) == [8, 8]


def test_ranks_with_other_tuned_tiles_raise_naming_the_tiles(tmp_path):
    from kernels.fused import tuned
    from kernels.fused.gemm_configs import GemmConfig

    tall = GemmConfig(32, 32, 16, 1, 1, 2)
    entries = [tuned.Entry(op, "float32", 4, 6, 8, tall) for op in ("matmul_reduce_scatter", "matmul_all_reduce")]
    tuned.write(tmp_path / "cpu.yaml", entries, {"gpu": "test"})
    for messages in run_ranks(fused_mismatch_cases.tuned_tiles_body, 2, str(tmp_path), timeout=300):
        assert len(messages) == 4, messages
        for message in messages:
            assert "ranks disagree" in message and "tiles=16x16" in message and "tiles=32x32" in message, message
            assert "same tuned file" in message, message


def test_fused_singleton_group_is_plain_gemm():
    assert run_ranks(fused_cases.singleton_body, 2) == [3, 3]


def test_gemm_core_matches_torch():
    from kernels.fused.matmul import linear

    g = torch.Generator().manual_seed(0)
    for m, k, n, bias, transposed in [(1, 1, 1, False, False), (37, 29, 19, True, False), (18, 33, 40, True, True)]:
        x = torch.randn(k, m, generator=g).t() if transposed else torch.randn(m, k, generator=g)
        w = torch.randn(k, n, generator=g).t() if transposed else torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        want, bound, _ = fused_cases.reference("ag", [x], [w], b, 0)
        got = linear(x, w, b)
        assert float(((got.double() - want).abs() - bound).max()) <= 0, (m, k, n, bias, transposed)
    assert linear(torch.empty(0, 4), torch.empty(3, 4)).shape == (0, 3)


def test_fp32_dot_precision_follows_torch_tf32_switch():
    """fp32 on CUDA is exact unless torch allows TF32 (as for the sequential path's cuBLAS GEMM)."""
    from kernels.fused.blocks import dot_precision

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert dot_precision(torch.float32, cuda) == "ieee"
        assert dot_precision(torch.bfloat16, cuda) == dot_precision(torch.float32, cpu) == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert dot_precision(torch.float32, cuda) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_unavailable_reason_names_why():
    results = run_ranks(fused_cases.reasons_body, 2)
    for ok, meta, hosts in results:
        assert ok is None
        assert "meta" in meta
        assert "spans 2 hosts" in hosts and "node0" in hosts and "node1" in hosts
    assert results[0] == results[1]  # every rank decides the same, so all pick the same backend


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3, 4])
def test_fused_ops_gpu(world):
    # W processes on the GPU(s) at hand (sharing one GPU through CUDA IPC when only one exists): every
    # op and w8A16 in fp16 and bf16, on a grid larger than one wave with several tiles and all-gather
    # chunks per shard, and on one odd tile; the heap the ops use is scrambled before every call.
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    cases = 2 * 2 * (len(fused_cases.OPS) + 1)
    assert (
        fused_cases.run_gpu_ranks(fused_cases.gpu_correctness_body, world, (torch.float16, torch.bfloat16), timeout=240)
        == [cases] * world
    )


def test_fused_edge_shapes():
    assert run_ranks(fused_cases.edge_shapes_body, 3) == [8, 8, 8]


def test_public_ops_select_fused_by_environment():
    assert run_ranks(fused_cases.public_api_body, 2, env={"USE_COC_FUSED_KERNEL": "1"}) == [3, 3]


_NO_PG_SCRIPT = """
import torch, torch.distributed as dist, kernels
assert not dist.is_initialized()
f64 = torch.float64
x, w, b = torch.randn(3, 2, 8, dtype=f64), torch.randn(5, 8, dtype=f64), torch.randn(5, dtype=f64)
want = x @ w.T + b
y, x_gathered = kernels.all_gather_matmul(x, w, b, backend="fused", return_gathered=True)
assert torch.allclose(y, want) and torch.equal(x_gathered, x)
assert torch.allclose(kernels.matmul_reduce_scatter(x, w, b, backend="fused"), want)
assert torch.allclose(kernels.matmul_all_reduce(x, w, b, backend="fused"), want)
qweight, scale = kernels.quantize_weight(w.float(), mode="per_channel")
got = kernels.quantized_matmul_all_reduce(x.float(), qweight, scale, b.float(), backend="fused")
assert torch.allclose(got, x.float() @ (qweight.float() * scale[:, None]).T + b.float(), atol=1e-4)
print("ok")
"""


def test_fused_without_process_group_is_plain_gemm():
    # docs/api.md: W == 1 is valid without torch.distributed initialized; the fused path once asked the
    # (missing) default group for its size. A fresh interpreter guarantees no group exists.
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    from kernels.testing import REPO_ROOT as root

    done = subprocess.run(
        [sys.executable, "-c", _NO_PG_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_locality_reason_is_the_same_verdict_on_every_rank():
    from kernels.fused import _locality_reason

    same_host = [(None, "h0", 0, ()), (None, "h0", 1, ())]
    assert _locality_reason(same_host) is None
    # One-directional peer access: GPU 1 cannot reach GPU 0 although 0 reaches 1. The verdict
    # comes from the exchanged data only, so rank 0 falls back too (no rank runs fused alone).
    one_way = [(None, "h0", 0, ()), (None, "h0", 1, (0,))]
    assert _locality_reason(one_way) == "GPU 1 has no peer access to GPU 0"
    assert "spans 2 hosts" in _locality_reason([(None, "h0", 0, ()), (None, "h1", 0, ())])
    assert _locality_reason([(None, "h0", -1, ()), ("no cupy", "h0", -1, ())]) == "no cupy"


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_raise_naming_the_field(world):
    results = run_ranks(fused_mismatch_cases.mismatch_body, world, timeout=300)
    cases = list(fused_mismatch_cases.MISMATCH_CASES) + [("rs", "weight.shape[0] (n)", None)]
    last = world - 1
    for rank, messages in enumerate(results):
        assert len(messages) == len(cases)
        for (op, field, _), message in zip(cases, messages, strict=False):
            name = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter", "ar": "matmul_all_reduce"}[op]
            assert message.startswith(f"{name}: ranks disagree: rank 0 has {field}="), message
            # Both ranks named, with the field: this rank and the odd one out (which names some peer).
            assert f"has {field}=" in message, (field, message)
            if rank != last:
                assert f"rank {rank} has" in message and f"rank {last} has" in message, message
            else:
                assert f"rank {last} has" in message, message
