"""torch.compile(fullgraph=True) traces the FP8 ops into one ``torch.ops.coc`` call each, with the eager result."""

from __future__ import annotations

import pytest
import torch

import kernels

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
            "coc::all_gather_scaled_matmul_gathered",
            "coc::scaled_matmul_reduce_scatter",
            "coc::scaled_matmul_all_reduce",
            "coc::scaled_matmul",
        ]
    )
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(
            a.view(torch.uint8) if a.dtype.itemsize == 1 else a, e.view(torch.uint8) if e.dtype.itemsize == 1 else e
        )


@pytest.mark.parametrize("op", ["all_gather_scaled_matmul_gathered", "scaled_matmul_all_reduce", "scaled_matmul"])
def test_fake_impls_match_real_outputs(op: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, xs, w, ws, b = _inputs("block")
    extra = {
        "all_gather_scaled_matmul_gathered": ("", 1, "sequential", 1, 0, 1),
        "scaled_matmul_all_reduce": ("", 1, "sequential", 1, 0, 1, False),
        "scaled_matmul": ("sequential",),
    }[op]
    fn = getattr(torch.ops.coc, op).default
    real = fn(x, xs, w, ws, b, "block", torch.bfloat16, *extra)
    with FakeTensorMode() as mode:
        fake = fn(*(mode.from_tensor(t) for t in (x, xs, w, ws, b)), "block", torch.bfloat16, *extra)
    real = real if isinstance(real, tuple) else (real,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    for r, f in zip(real, fake, strict=True):
        assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device)
