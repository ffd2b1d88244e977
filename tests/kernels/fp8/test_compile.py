"""torch.compile(fullgraph=True) traces the FP8 ops into one ``torch.ops.coc`` call each, with the eager result."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.testing import operator_calls

M, K, N = 3, 200, 130


def _inputs(mode: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x, xs = kernels.quantize_fp8(torch.randn(M * 2, K, generator=g), mode)
    w, ws = kernels.quantize_fp8(torch.randn(N, K, generator=g), "block2d" if mode == "block" else mode)
    return x, xs, w, ws, torch.randn(N, generator=g)


def _counting_backend(seen: list[str]):
    def backend(gm: torch.fx.GraphModule, example_inputs: list):
        for node in gm.graph.nodes:
            target = node.target
            if isinstance(target, torch._ops.OpOverload) and target.namespace == "coc":
                seen.append(target.name())
        return gm.forward

    return backend


@pytest.mark.parametrize("backend", ["sequential", "chunked"])
@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
def test_fp8_ops_compile_fullgraph(mode: str, backend: str) -> None:
    x, xs, w, ws, b = _inputs(mode)

    def fn(x, xs, w, ws, b):
        y1, xg, xsg = kernels.all_gather_scaled_matmul(
            x, xs, w, ws, b, out_dtype=torch.float32, backend=backend, parallel_num=2, return_gathered=True
        )
        y2 = kernels.scaled_matmul_reduce_scatter(x, xs, w, ws, out_dtype=torch.bfloat16, backend=backend)
        y3 = kernels.scaled_matmul_all_reduce(x, xs, w, ws, b, out_dtype=torch.float32, backend=backend)
        y4 = kernels.scaled_matmul(x, xs, w, ws, out_dtype=torch.float32, backend="sequential")
        return y1, xg, xsg, y2, y3, y4

    seen: list[str] = []
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=_counting_backend(seen))
    with torch.no_grad():
        got = compiled(x, xs, w, ws, b)
        want = fn(x, xs, w, ws, b)
    assert sorted(seen) == sorted(
        [
            "coc::all_gather_matmul",
            "coc::matmul_reduce_scatter",
            "coc::matmul_all_reduce",
            "coc::matmul",
        ]
    )
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(
            a.view(torch.uint8) if a.dtype.itemsize == 1 else a, e.view(torch.uint8) if e.dtype.itemsize == 1 else e
        )


@pytest.mark.parametrize("op", ["all_gather_scaled_matmul", "scaled_matmul_all_reduce", "scaled_matmul"])
def test_fake_impls_match_real_outputs(op: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, xs, w, ws, b = _inputs("block")
    kwargs = {"out_dtype": torch.bfloat16, "backend": "sequential"}
    if op == "all_gather_scaled_matmul":
        kwargs["return_gathered"] = True
    with torch.no_grad(), operator_calls() as calls:
        getattr(kernels, op)(x, xs, w, ws, b, **kwargs)
    ((fn, args),) = calls
    real = fn(*args)
    with FakeTensorMode() as mode:
        fake = fn(*(_fake(mode, a) for a in args))
    real = real if isinstance(real, tuple) else (real,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    for r, f in zip(_flat(real), _flat(fake), strict=True):
        assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device)


def _flat(out: object) -> list[torch.Tensor]:
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [] if out is None else [out]


def _fake(mode: object, a: object) -> object:
    if isinstance(a, torch.Tensor):
        return mode.from_tensor(a)
    if isinstance(a, list):
        return [_fake(mode, t) for t in a]
    return a
