"""One rank's bad arguments, at any call, raise the same named error on every rank (kernels.protocol.admission):
the local validation outcome travels with the admission, which every call makes, so no peer is left waiting.

* a rank whose arguments are invalid (wrong dtype, k mismatch, not a tensor, a bad FP8 scale) makes every rank raise
  the same exception naming that rank, on every backend (fused too: before any kernel), at a group's first call
  and in the steady state alike; the group runs a correct call right after;
* the README's two-rank example at three ranks (uneven sequence shards) is refused by name;
* FP8 calls that differ in their format, weight dtype or output dtype name the field and both values;
* a long, non-ASCII message travels whole; the admission runs inside CUDA-graph capture (host data only).
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.testing import run_ranks

M, K, N = 6, 8, 5


def _tensors(m: int, k: int, n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).to(dtype) for shape in ((m, k), (n, k), (n,)))


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
    ("check", "warm"), [(None, False), (None, True), ("1", True)], ids=["first", "steady", "check1"]
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
        want = "all_gather_matmul: ranks disagree: rank 0 has x.shape=(3, 2, 16), rank 1 has x.shape=(3, 2, 16), "
        assert message.startswith(want + "rank 2 has x.shape=(2, 2, 16)"), message


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
        ("mode", "rank 0 has format=fp8:block, rank 1 has format=fp8:row"),
        ("weight_dtype", "rank 0 has weight.dtype=torch.float8_e4m3fn, rank 1 has weight.dtype=torch.float8_e5m2"),
        ("out_dtype", "rank 0 has out_dtype=torch.bfloat16, rank 1 has out_dtype=torch.float32"),
    ],
)
def test_fp8_disagreements_name_the_op_the_field_and_both_values(field: str, named: str) -> None:
    for message in run_ranks(_fp8_disagree, 2, field, env={"COC_CHECK": "1"}):
        assert message.startswith(f"all_gather_scaled_matmul: ranks disagree: {named}; "), message
        assert "tensor-mode" not in message and "[[" not in message, message


def _long_message(rank: int, world: int) -> str:
    x, w, b = _tensors(M, K, N)
    try:
        # 400 two-byte characters in the error of rank 1 alone.
        kernels.matmul_all_reduce(x, w, b, backend="é" * 400 if rank else None)
    except ValueError as e:
        return str(e)
    return "returned"


def test_long_and_non_ascii_messages_travel_whole() -> None:
    for message in run_ranks(_long_message, 2):
        assert message.startswith("matmul_all_reduce: rank 1 refused its arguments: backend=") and "é" * 400 in message


def _in_capture(rank: int, world: int, check: str | None) -> list[str]:
    """A stand-in for capture: the admission moves host data on a CPU group, so it runs inside capture too (a
    captured call is admitted once, at capture), without a warning; one rank's error is still every rank's."""
    import warnings

    from kernels import capture

    real = capture.capturing
    capture.capturing = lambda device: True
    out = []
    try:
        x, w, b = _tensors(M, K, N)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernels.matmul_all_reduce(x, w, b, backend="sequential")
            out.append("ran")
            try:
                kernels.matmul_all_reduce(x, w[:, :-1] if rank else w, b, backend="sequential")
            except ValueError as e:
                out.append(str(e).split(": x has", 1)[0])
        out += [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    finally:
        capture.capturing = real
    return out


@pytest.mark.parametrize("check", ["1", None], ids=["check1", "default"])
def test_admission_inside_capture(check: str | None) -> None:
    outs = run_ranks(_in_capture, 2, check, env={"COC_CHECK": check})
    assert outs[0] == outs[1] == ["ran", "matmul_all_reduce: rank 1 refused its arguments: k mismatch"], outs
