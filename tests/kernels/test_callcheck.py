"""When calls are compared across ranks (kernels.callcheck), and one rank's bad arguments raised on every rank.

* COC_CHECK=1 compares every call, unset the first call of each new signature (cached: a repeated call
  communicates nothing more), 0 none on sequential / chunked;
* a rank whose arguments are invalid (wrong dtype, k mismatch, a bad FP8 scale) raises on its own only
  when nobody checks; when the call is checked its error travels in the exchange, and every rank raises
  the same exception naming that rank, on every backend (fused too: the host check runs before a
  group's heap exists), at a first call by default and at any call under COC_CHECK=1;
* the README's two-rank example at three ranks (uneven sequence shards) is refused by name by default.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import callcheck
from kernels.testing import run_ranks

M, K, N = 6, 8, 5


def _tensors(m: int, k: int, n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).to(dtype) for shape in ((m, k), (n, k), (n,)))


def _count_exchanges(rank: int, world: int, backend: str) -> list[str]:
    """The ops whose calls were exchanged over a script: A, A again, B (another m), A again, per op."""
    seen: list[str] = []
    real = callcheck.exchange

    def counting(op, *args, **kwargs):
        seen.append(op)
        return real(op, *args, **kwargs)

    callcheck.exchange = counting
    try:
        a = _tensors(M, K, N)
        b = _tensors(2 * M, K, N)
        qw, scale = kernels.quantize_weight(a[1])
        xq, xs = kernels.quantize_fp8(a[0], "row")
        wq, ws = kernels.quantize_fp8(a[1], "row")
        with torch.no_grad():
            for x, w, bias in (a, a, b, a):
                kernels.all_gather_matmul(x, w, bias, backend=backend)
                kernels.matmul_reduce_scatter(x, w, bias, backend=backend)
                kernels.matmul_all_reduce(x, w, bias, backend=backend)
                kernels.quantized_matmul_all_reduce(x, qw, scale, bias, backend=backend)
                kernels.scaled_matmul_all_reduce(xq, xs, wq, ws, backend=backend)
    finally:
        callcheck.exchange = real
    return seen


OPS = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "quantized_matmul_all_reduce",
    "scaled_matmul_all_reduce",
]


@pytest.mark.parametrize("backend", ["sequential", "chunked"])
@pytest.mark.parametrize("check", ["1", None, "0", ""], ids=["check1", "default", "check0", "empty"])
def test_calls_are_compared_as_coc_check_says(check: str | None, backend: str) -> None:
    """1: every call; unset or empty: the first call of each signature (A, B; not A again); 0: none. The
    FP8 call's signature is the same in all four rounds (its shapes do not change)."""
    seen = run_ranks(_count_exchanges, 2, backend, env={"COC_CHECK": check})
    if check == "1":
        expected = OPS * 4
    elif check == "0":
        expected = []
    else:
        expected = OPS + OPS[:4]
    assert seen == [expected, expected]


def _fp8_pair(rank: int, bad: bool) -> tuple[torch.Tensor, ...]:
    x, w, _ = _tensors(M, 2 * K, N, seed=rank)
    xq, xs = kernels.quantize_fp8(x, "row")
    wq, ws = kernels.quantize_fp8(w, "row")
    if bad:
        xs = xs.clone()
        xs[2, 0] = float("nan")
    return xq, xs, wq, ws


def _bad_call(case: str, rank: int, bad: bool, backend: str, group):
    """This rank's call of ``case``: the bad one where ``bad``, else a valid one of the same op."""
    x, w, b = _tensors(M, K, N, seed=rank)
    opts = {"backend": backend, "group": group}
    if case == "dtype":
        w = w.double() if bad else w
        return lambda: kernels.matmul_all_reduce(x, w, b, **opts)
    if case == "k":
        w = w[:, :-1] if bad else w
        return lambda: kernels.matmul_reduce_scatter(x, w, b, **opts)
    if case == "not_a_tensor":
        x = x.tolist() if bad else x
        return lambda: kernels.all_gather_matmul(x, w, b, **opts)
    xq, xs, wq, ws = _fp8_pair(rank, bad)
    return lambda: kernels.scaled_matmul_all_reduce(xq, xs, wq, ws, out_dtype=torch.float32, **opts)


CASES = {
    # case -> (exception class every rank raises, the bad rank's problem as its message names it)
    "dtype": (TypeError, "weight dtype torch.float64 does not match x dtype torch.float32"),
    "k": (ValueError, "k mismatch: x has k=8"),
    "not_a_tensor": (TypeError, "x must be a torch.Tensor, got list"),
    "fp8_scale": (ValueError, "x_scale[2, 0]=nan is not accepted"),
}


def _one_rank_bad(rank: int, world: int, case: str, backend: str, warm: bool) -> tuple[str, str]:
    import torch.distributed as dist

    bad_rank = world - 1
    # A new group: the first fused call on it creates its heap (no heap left by an earlier task).
    group = dist.new_group(list(range(world)))
    with torch.no_grad():
        if warm:
            _bad_call(case, rank, False, backend, group)()  # the steady state: the op's signature was seen
        try:
            _bad_call(case, rank, rank == bad_rank, backend, group)()
            outcome = ("returned", "")
        except (RuntimeError, ValueError, TypeError) as e:
            outcome = (type(e).__name__, str(e))
        # Nothing was left half-communicated: the group runs a correct call right after.
        x, w, b = _tensors(M, K, N, seed=10)
        y = kernels.matmul_all_reduce(x, w, b, backend=backend, group=group)
        torch.testing.assert_close(y, world * (x @ w.T) + b)
    return outcome


@pytest.mark.parametrize("backend", ["sequential", "chunked", "fused"])
@pytest.mark.parametrize(
    ("check", "warm"), [(None, False), ("1", True)], ids=["default-first-call", "check1-steady-state"]
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_rank_with_bad_arguments_raises_on_every_rank(case: str, check: str | None, warm: bool, backend: str):
    error, problem = CASES[case]
    outcomes = run_ranks(_one_rank_bad, 2, case, backend, warm, env={"COC_CHECK": check}, timeout=300)
    for rank, (kind, message) in enumerate(outcomes):
        assert kind == error.__name__, f"rank {rank}: {kind} {message}"
        assert "rank 1 refused its arguments" in message and problem in message, message
    assert outcomes[0] == outcomes[1]


def _readme_example(rank: int, world: int) -> str:
    torch.manual_seed(0)
    x, w1 = torch.randn(8, 2, 16), torch.randn(64, 16)
    x_shard = x.chunk(world)[rank]  # 3, 3 and 2 rows of s at W = 3
    try:
        kernels.all_gather_matmul(x_shard, w1.chunk(world)[rank])
    except RuntimeError as e:
        return str(e)
    return "returned"


def test_readme_example_with_uneven_shards_is_refused_by_name_by_default():
    for message in run_ranks(_readme_example, 3, env={"COC_CHECK": None}):
        assert message.startswith("all_gather_matmul: ranks disagree: rank 0 has m_local=6, rank 2 has m_local=4"), (
            message
        )


def _fp8_disagree(rank: int, world: int, field: str) -> str:
    x, w, _ = _tensors(M, 2 * K, N)
    odd = rank == world - 1
    x_mode = "row" if field == "mode" and odd else "block"
    xq, xs = kernels.quantize_fp8(x, x_mode)
    wq, ws = kernels.quantize_fp8(w, "row" if x_mode == "row" else "block2d")
    if field == "weight_dtype" and odd:
        wq, ws = kernels.quantize_fp8(w, "block2d", dtype=torch.float8_e5m2)
    out_dtype = torch.float32 if field == "out_dtype" and odd else torch.bfloat16
    try:
        kernels.all_gather_scaled_matmul(xq, xs, wq, ws, out_dtype=out_dtype)
    except RuntimeError as e:
        return str(e)
    return "returned"


@pytest.mark.parametrize(
    ("field", "named"),
    [
        (
            "mode",
            "rank 0 has scaling mode (from the scale shapes)=block, rank 1 has scaling mode (from the "
            "scale shapes)=row",
        ),
        ("weight_dtype", "rank 0 has weight.dtype=torch.float8_e4m3fn, rank 1 has weight.dtype=torch.float8_e5m2"),
        ("out_dtype", "rank 0 has out_dtype=torch.bfloat16, rank 1 has out_dtype=torch.float32"),
    ],
)
def test_fp8_disagreements_name_the_op_the_field_and_both_values(field: str, named: str) -> None:
    for message in run_ranks(_fp8_disagree, 2, field, env={"COC_CHECK": "1"}):
        assert message.startswith(f"all_gather_scaled_matmul: ranks disagree: {named} ("), message
        assert "tensor-mode" not in message and "[[" not in message, message


def test_long_and_non_ascii_messages_travel_cut_at_a_character() -> None:
    long = ValueError("é" * 400)
    row = callcheck._encode(None, long)
    assert len(row) == callcheck.ROW_WORDS
    cls, message = callcheck._decode(row)
    assert cls is ValueError and message.endswith(" ...") and message.startswith("é" * 200)
    cls, message = callcheck._decode(callcheck._encode(None, KeyError("x")))
    assert cls is RuntimeError and message == "'x'"


def _in_capture(rank: int, world: int, check: str | None) -> list[str]:
    """A stand-in for capture (the check needs a host read that capture cannot hold): COC_CHECK=1 refuses by
    name, the default leaves the unseen signature unchecked with one warning."""
    import warnings

    from kernels import capture

    real = capture.capturing
    capture.capturing = lambda device: True
    out = []
    try:
        x, w, b = _tensors(M, K, N)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                try:
                    kernels.matmul_all_reduce(x, w, b, backend="sequential")
                    out.append("ran")
                except RuntimeError as e:
                    out.append(str(e))
        out += [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    finally:
        capture.capturing = real
    return out


@pytest.mark.parametrize("check", ["1", None], ids=["check1", "default"])
def test_check_inside_capture(check: str | None) -> None:
    for out in run_ranks(_in_capture, 2, check, env={"COC_CHECK": check}):
        if check == "1":
            assert len(out) == 2 and all("COC_CHECK=1 inside CUDA-graph capture" in m for m in out), out
        else:
            assert out[:2] == ["ran", "ran"] and len(out) == 3, out
            assert "first seen inside CUDA-graph capture is not compared across ranks" in out[2], out
