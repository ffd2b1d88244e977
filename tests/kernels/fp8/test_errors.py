"""Bad FP8 calls get a named ValueError / TypeError before any communication, on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import kernels
from kernels.testing import run_ranks

M, K, N = 3, 200, 130
OPS = (kernels.all_gather_scaled_matmul, kernels.scaled_matmul_reduce_scatter, kernels.scaled_matmul_all_reduce)


def _good(mode: str = "block") -> dict:
    x, xs = kernels.quantize_fp8(torch.randn(M * 2, K), mode)
    w, ws = kernels.quantize_fp8(torch.randn(N, K), "block2d" if mode == "block" else mode)
    return {"x": x, "x_scale": xs, "weight": w, "w_scale": ws}


def _bad_cases() -> list[tuple[str, dict, type, str]]:
    g = _good()
    nan = g["x_scale"].clone()
    nan[1, 1] = float("nan")
    neg = g["w_scale"].clone()
    neg[0, 1] = -1.0
    zero = g["x_scale"].clone()
    zero[0, 0] = 0.0
    return [
        ("x not fp8", {**g, "x": g["x"].float()}, TypeError, "x dtype torch.float32 is not FP8"),
        ("weight not fp8", {**g, "weight": g["weight"].bfloat16()}, TypeError, "weight dtype torch.bfloat16"),
        ("scale dtype", {**g, "x_scale": g["x_scale"].double()}, TypeError, "x_scale dtype torch.float64"),
        ("scale shape", {**g, "x_scale": g["x_scale"][:, :1]}, ValueError, r"x_scale shape \[6, 1\] with w_scale"),
        ("w scale shape", {**g, "w_scale": g["w_scale"][:1]}, ValueError, "fit no scaling mode"),
        ("mixed modes", {**g, "w_scale": torch.ones(N, 1)}, ValueError, "fit no scaling mode"),
        ("nan scale", {**g, "x_scale": nan}, ValueError, r"x_scale\[1, 1\]=nan"),
        ("negative scale", {**g, "w_scale": neg}, ValueError, r"w_scale\[0, 1\]=-1.0"),
        ("zero scale", {**g, "x_scale": zero}, ValueError, r"x_scale\[0, 0\]=0.0"),
        ("k mismatch", {**g, "weight": g["weight"][:, :100]}, ValueError, "k mismatch"),
        ("bias shape", {**g, "bias": torch.zeros(N + 1)}, ValueError, r"bias must have shape \(130,\)"),
        ("bias dtype", {**g, "bias": torch.zeros(N, dtype=torch.float16)}, TypeError, "bias dtype torch.float16"),
        ("out_dtype", {**g, "out_dtype": torch.float8_e4m3fn}, ValueError, "out_dtype=torch.float8_e4m3fn"),
        ("out_dtype type", {**g, "out_dtype": "bf16"}, TypeError, "out_dtype must be a torch.dtype"),
        ("backend", {**g, "backend": "nccl"}, ValueError, "backend='nccl'"),
        ("parallel_num", {**g, "parallel_num": 3}, ValueError, "parallel_num=3"),
    ]


@pytest.mark.parametrize(("name", "kwargs", "error", "match"), _bad_cases(), ids=[c[0] for c in _bad_cases()])
@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_bad_call_is_named(op, name: str, kwargs: dict, error: type, match: str) -> None:
    kwargs = dict(kwargs)
    with pytest.raises(error, match=match):
        op(kwargs.pop("x"), kwargs.pop("x_scale"), kwargs.pop("weight"), kwargs.pop("w_scale"), **kwargs)


def test_bad_dims_and_scale_shapes_are_named() -> None:
    x = torch.randn(2, 4, 64)
    xq, xs = kernels.quantize_fp8(x.reshape(-1, 64), "row")
    wq, ws = kernels.quantize_fp8(torch.randn(8, 64), "row")
    xq = xq.view(2, 4, 64)
    with pytest.raises(ValueError, match="gather_dim=2 is the last dim of x"):
        kernels.all_gather_scaled_matmul(xq, xs, wq, ws, gather_dim=2)
    with pytest.raises(ValueError, match="scatter_dim=3 is out of range"):
        kernels.scaled_matmul_reduce_scatter(xq, xs, wq, ws, scatter_dim=3)
    with pytest.raises(ValueError, match=r"x_scale shape \[7, 1\] with w_scale shape \[8, 1\] fit no scaling mode"):
        kernels.all_gather_scaled_matmul(xq, xs[:7], wq, ws, gather_dim=1)
    with pytest.raises(TypeError, match="gather_dim must be an int"):
        kernels.all_gather_scaled_matmul(xq, xs, wq, ws, gather_dim=1.0)


def _ranks_bad_then_good(rank: int, world: int) -> list[str]:
    messages = []
    for case in _bad_cases():
        kwargs = dict(case[1])
        try:
            kernels.scaled_matmul_all_reduce(
                kwargs.pop("x"), kwargs.pop("x_scale"), kwargs.pop("weight"), kwargs.pop("w_scale"), **kwargs
            )
        except (ValueError, TypeError) as e:
            messages.append(type(e).__name__)
    g = _good()
    try:
        kernels.scaled_matmul_reduce_scatter(g["x"][:5], g["x_scale"][:5], g["weight"], g["w_scale"])
    except ValueError as e:
        messages.append(str(e))
    # Nothing was left half-communicated: a real call on the same group still agrees.
    y = kernels.scaled_matmul_all_reduce(**g, out_dtype=torch.float32)
    table = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(table, y)
    assert all(torch.equal(t, table[0]) for t in table)
    return messages


def test_errors_before_communication_on_every_rank() -> None:
    results = run_ranks(_ranks_bad_then_good, 2, timeout=180)
    for messages in results:
        assert len(messages) == len(_bad_cases()) + 1
        assert "x.shape[0]=5" in messages[-1] and "W=2" in messages[-1]


def _ranks_bad_value_after_resolved(rank: int, world: int) -> list[str]:
    """Each op resolves its signature with a good call; then rank 1 alone passes a NaN scale of the same shape
    (a resolved signature's call, whose scale values are still read): every rank raises; a good call follows."""
    messages = []
    g = _good()
    for op in (kernels.all_gather_scaled_matmul, kernels.scaled_matmul_reduce_scatter):
        good = op(**g, out_dtype=torch.float32)
        bad = dict(g)
        if rank == 1:
            bad["x_scale"] = g["x_scale"].clone()
            bad["x_scale"][1, 1] = float("nan")
        try:
            op(**bad, out_dtype=torch.float32)
        except ValueError as e:
            messages.append(str(e))
        assert torch.equal(op(**g, out_dtype=torch.float32), good)
    return messages


def test_a_bad_scale_value_on_one_rank_of_a_resolved_signature_raises_on_every_rank() -> None:
    results = run_ranks(_ranks_bad_value_after_resolved, 2, timeout=180)
    for messages in results:
        assert len(messages) == 2, messages
        assert all("x_scale[1, 1]=nan" in m for m in messages), messages
