"""matmul_soc_friendly: padding plan, unchanged results for odd shapes, no-op on CPU, the ops with it on.

Padding adds ``0 * 0`` terms to every dot product and sliced-off columns, so the math is the
same; the GEMM may block k differently, so results are checked against the toolkit's fp64
reference within its tolerance rule (a padded GEMM is the W = 1 matmul_all_reduce).
"""

import os

import pytest
import torch
import torch.nn.functional as F

from kernels import padding
from kernels.testing import assert_close, reference, run_ranks
from tests.kernels import op_cases


def test_alignment_is_128_bytes_and_multiple_of_16():
    assert padding.alignment(torch.float16) == 64
    assert padding.alignment(torch.bfloat16) == 64
    assert padding.alignment(torch.float32) == 32
    assert padding.alignment(torch.float64) == 16


@pytest.mark.parametrize(
    "k,n,k_min,k_max,expected",
    [
        (1000, 10, 512, 4096, (1024, 32)),  # k in range: both padded
        (1000, 10, 1024, 4096, (1000, 32)),  # k below k_min: only n
        (5000, 64, 1024, 4096, (5000, 64)),  # k above k_max, n aligned: nothing
        (1024, 96, 1024, 4096, (1024, 96)),  # already aligned at the range edge
        (4095, 33, 1024, 4095, (4096, 64)),  # k at k_max is still padded
    ],
)
def test_padded_shape(k, n, k_min, k_max, expected):
    assert padding.padded_shape(k, n, torch.float32, k_min, k_max) == expected


@pytest.fixture
def wide_k_range(tmp_path, monkeypatch):
    cfg = tmp_path / "coc.yaml"
    cfg.write_text("k_min: 1\nk_max: 4096\n")
    monkeypatch.setenv("COC_CONFIG", str(cfg))


@pytest.mark.parametrize("m,k,n", [(7, 13, 10), (1, 1, 1), (5, 100, 33), (3, 1023, 65)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_forced_padding_keeps_results(wide_k_range, m, k, n, with_bias):
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    ref = reference("ar", [x], [w], b, 0)
    y = padding.linear(x, w, b, force=True)
    assert y.is_contiguous()
    assert_close("padded", y, ref, torch.float32)
    out = torch.empty(m, n)
    assert padding.linear(x, w, b, out=out, force=True) is out
    assert_close("padded into out", out, ref, torch.float32)
    # Strided views into an output (the chunked path writes pieces of one buffer).
    big = torch.zeros(m + 2, n)
    padding.linear(x, w, b, out=big[1 : m + 1], force=True)
    assert_close("padded into a view", big[1 : m + 1], ref, torch.float32)
    assert torch.equal(big[0], torch.zeros(n)) and torch.equal(big[m + 1], torch.zeros(n))


def test_forced_padding_leading_dims(wide_k_range):
    """The chunked reduce-scatter multiplies a 3-D view ``[W, rows, k]``."""
    x = torch.randn(3, 4, 13)[:, 1:3]
    w = torch.randn(10, 13)
    y = padding.linear(x, w, force=True)
    assert_close("padded 3-D", y, reference("ar", [x], [w], None, 0), torch.float32)


@pytest.mark.parametrize("lead", [(3,), (2, 3)], ids=["2d", "leading_dims"])
def test_forced_padding_of_an_empty_k_shard(wide_k_range, lead):
    """k = 0 (a row-parallel rank with an empty k shard; n = 10 is not aligned, so the padded path runs): the
    product is the bias alone, exactly, as F.linear gives it."""
    x = torch.randn(*lead, 0)
    w = torch.randn(10, 0)
    b = torch.randn(10)
    y = padding.linear(x, w, b, force=True)
    assert torch.equal(y, F.linear(x, w, b))


def test_noop_on_cpu(wide_k_range, monkeypatch):
    def fail(*args):
        raise AssertionError("padding planned on CPU without force")

    monkeypatch.setattr(padding, "padded_shape", fail)
    x, w, b = torch.randn(7, 13), torch.randn(10, 13), torch.randn(10)
    assert torch.equal(padding.linear(x, w, b), F.linear(x, w, b))
    out = torch.empty(7, 10)
    padding.linear(x, w, out=out)
    assert torch.equal(out, x @ w.T)


@pytest.mark.gpu
def test_cuda_padding_keeps_results(wide_k_range):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(33, 1000, device="cuda", dtype=torch.float16, generator=g)
    w = torch.randn(77, 1000, device="cuda", dtype=torch.float16, generator=g)
    y = padding.linear(x, w)
    assert_close("padded fp16 on CUDA", y, reference("ar", [x], [w], None, 0), torch.float16)


def _ops_with_soc_padding(rank: int, world: int, yaml_path: str) -> tuple[dict[str, dict], int]:
    """matmul_soc_friendly active (as on CUDA) through every op's plain-format cases on the sequential and chunked
    backends (tests/kernels/op_cases.py): results within the unpadded ops' bounds. Returns the results and how
    many GEMMs were padded."""
    os.environ["COC_CONFIG"] = yaml_path
    saved_enabled, saved_shape = padding._enabled, padding.padded_shape
    padded = []

    def shape(k, n, dtype, k_min, k_max):
        out = saved_shape(k, n, dtype, k_min, k_max)
        padded.append(out != (k, n))
        return out

    padding._enabled = lambda x, force: True
    padding.padded_shape = shape
    try:
        results = {
            f"{pattern} {backend}": op_cases.pattern_body(rank, world, pattern, backend, ("plain",))
            for pattern in op_cases.PATTERNS
            for backend in op_cases.SCRIPTED
        }
    finally:
        padding._enabled, padding.padded_shape = saved_enabled, saved_shape
        os.environ.pop("COC_CONFIG")
    return results, sum(padded)


def test_ops_with_soc_friendly_padding(tmp_path):
    path = tmp_path / "soc.yaml"
    path.write_text(f"k_min: 1\nk_max: {op_cases.K_PLAIN}\n")  # the plain cases' k (20) and n (24) get padded
    per_rank = run_ranks(_ops_with_soc_padding, 2, str(path))
    assert all(padded > 0 for _, padded in per_rank), per_rank
    for pattern in op_cases.PATTERNS:
        for backend in op_cases.SCRIPTED:
            results = [res[f"{pattern} {backend}"] for res, _ in per_rank]
            op_cases.check_pattern(pattern, results, backend, ("plain",))
