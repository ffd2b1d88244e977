"""The Inductor pass on a decoder layer's end: all-reduce -> residual add -> RMSNorm becomes one coc op.

A function ``y = funcol.all_reduce(x @ w, "sum", group); h = y.view(...) + residual; out = rmsnorm(h) * weight``
(HF's ``LlamaRMSNorm`` written out, or ``F.rms_norm``), returning ``out`` and a later use of ``h``, is compiled at
world 2 (gloo) with the pass on ``graph_passes_backend``: the result equals the eager function's within the bound
:func:`_bound` derives, the report lists the rewrite, and a spy on the ops' backends shows that the GEMM epilogue
(``coc.matmul_all_reduce_rmsnorm``) or, for an all-reduce of something other than a matmul,
``coc.all_reduce_rmsnorm`` ran, and no other coc op. Near misses (a mean over another dim, a max
reduction, F.rms_norm's order in bf16, the reduced tensor used elsewhere) are left alone with the reason and
still give eager's result.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

from kernels.testing import run_ranks

EPS = 1e-6
M, K, N = 6, 8, 16  # rows (as [2, 3]), each rank's k, hidden
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}  # unit roundoff


def _hf_rmsnorm(h: torch.Tensor, weight: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward (``dim`` other than -1: a near miss)."""
    dtype = h.dtype
    hf = h.to(torch.float32)
    variance = hf.pow(2).mean(dim, keepdim=True)
    hf = hf * torch.rsqrt(variance + EPS)
    return weight * hf.to(dtype)


def _layer_end(case: str, group: object) -> object:
    """The function compiled for ``case``: the all-reduce of a row-parallel product, the residual add (its sum used
    again after the norm, as the next layer's residual) and the norm."""
    import torch.distributed._functional_collectives as funcol

    def f(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = torch.tanh(x @ w) if case == "not_mm" else x @ w
        y = funcol.all_reduce(p, "max" if case == "max" else "sum", group)
        h = y.view(residual.shape) + residual
        if case.startswith("rms_norm"):
            out = torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, EPS)
        else:
            out = _hf_rmsnorm(h, weight, dim=0 if case == "mean_dim0" else -1)
        return (out, h * 2) + ((y,) if case == "y_used" else ())

    return f


@contextlib.contextmanager
def _norm_runs() -> Iterator[collections.Counter]:
    """Counts the runs of ``coc.all_reduce_rmsnorm``'s backends (the table its operator looks up at each call;
    ``backend_calls`` counts the GEMM ops, the epilogue's included), restored after."""
    from kernels.ops import all_reduce_rmsnorm

    runs: collections.Counter = collections.Counter()
    saved = dict(all_reduce_rmsnorm.SPEC.impl)

    def spy(backend: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: object) -> torch.Tensor:
            runs[("all_reduce_rmsnorm", backend)] += 1
            return fn(*args)

        return run

    for backend, fn in saved.items():
        all_reduce_rmsnorm.SPEC.impl[backend] = spy(backend, fn)
    try:
        yield runs
    finally:
        all_reduce_rmsnorm.SPEC.impl.update(saved)


def _bound(case: str, xs: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple:
    """Elementwise bounds on ``|compiled - eager|`` for the outputs of :func:`_layer_end` (``out``, ``2 h`` and, for
    "y_used", ``y``), in fp64, from the math.

    Both compute ``h = reduce_r p_r + residual`` (``p_r = x_r @ w``, or its tanh) and its RMSNorm in the data's dtype
    (unit roundoff ``u``); they may differ in (1) the order of each rank's k-term product (fp32 accumulation,
    ``k * u32`` relative to ``S = sum_r |x_r| @ |w|``, which bounds ``|p_r|`` too; a bf16 partial may then round the
    other way, ``u * S``), (2) the graph's rounding of the reduced sum and of ``h`` before its norm, which the op
    skips (it normalizes the fp32 ``h``): ``2u`` of ``S + |h|``, and (3) the order of the mean's squares (``n * u32``
    relative for n terms) and the rounding of the output (``2u``). First order, ``dh = (2k u32 + 2u) S + 2u |h|``;
    the mean of squares moves by ``mean(2 |h| dh + dh^2) + (n + 2) u32 ms``, ``rstd`` by half that relative to
    ``ms + eps``, so ``dout = |weight| rstd (dh + |h| drstd) + 2u |out|``. The bounds are twice these."""
    u, u32 = UNIT[w.dtype], UNIT[torch.float32]
    xs, w, residual, weight = (t.double() for t in (xs, w, residual, weight))
    s = sum(x.abs() @ w.abs() for x in xs).view(residual.shape)
    p = torch.stack([torch.tanh(x @ w) if case == "not_mm" else x @ w for x in xs])
    h = (p.amax(0) if case == "max" else p.sum(0)).view(residual.shape) + residual
    k = w.shape[0]
    dim = 0 if case == "mean_dim0" else -1
    dh = (2 * k * u32 + 2 * u) * s + 2 * u * h.abs()
    ms = h.pow(2).mean(dim, keepdim=True)
    dms = (2 * h.abs() * dh + dh**2).mean(dim, keepdim=True) + (h.shape[dim] + 2) * u32 * ms
    rstd = torch.rsqrt(ms + EPS)
    out = weight.abs() * h.abs() * rstd
    dout = weight.abs() * rstd * (dh + h.abs() * 0.5 * dms / (ms + EPS)) + 2 * u * out
    return 2 * dout, 2 * (2 * dh + u * h.abs()), 2 * dh.view(-1, w.shape[1])


def _compiled_cases(rank: int, world: int, cases: list[tuple[str, torch.dtype]]) -> list[dict]:
    """Compile :func:`_layer_end` for each case with the pass; what each rewrote, ran and how far from eager."""
    import torch.distributed as dist

    from kernels.inductor import rewrite as inductor_pass
    from kernels.testing import backend_calls
    from kernels.testing.compile import graph_passes_backend

    out = []
    for case, dtype in cases:
        torch._dynamo.reset()
        torch.manual_seed(0)  # the same full tensors on every rank; each rank multiplies its own rows of xs
        xs = torch.randn(world, M, K).to(dtype)
        w, residual, weight = torch.randn(K, N).to(dtype), torch.randn(2, 3, N).to(dtype), torch.randn(N).to(dtype)
        f = _layer_end(case, dist.group.WORLD)
        args = (xs[rank], w, residual, weight)
        inductor_pass.clear_report()
        with inductor_pass.use_inductor_pass(), _norm_runs() as runs, backend_calls() as calls, torch.no_grad():
            got = torch.compile(f, backend=graph_passes_backend)(*args)
        want = f(*args)
        bounds = _bound(case, xs, w, residual, weight)[: len(got)]
        ratio = max(
            ((g.double() - e.double()).abs() / b).max().item() for g, e, b in zip(got, want, bounds, strict=True)
        )
        records = [(r.pattern, r.matched, r.detail) for r in inductor_pass.report()]
        out.append({"ratio": ratio, "records": records, "runs": dict(runs) | dict(calls)})
    return out


# case, dtype, the report's one rewrite, the one coc backend run it gives (by kernels.testing.backend_calls' name)
_EPILOGUE = ("matmul_all_reduce_rmsnorm", "matmul_all_reduce+rmsnorm")
_MATCHED = [
    ("mm", torch.float32, *_EPILOGUE),
    ("mm", torch.bfloat16, *_EPILOGUE),
    ("rms_norm", torch.float32, *_EPILOGUE),
    ("not_mm", torch.float32, "all_reduce_rmsnorm", "all_reduce_rmsnorm"),
]
# case, dtype, the report's one record (pattern, rewritten) and the reason the norm stays in it: a norm after a
# matmul all-reduce that differs leaves the all-reduce's own rewrite in place
_LEFT_ALONE = [
    ("mean_dim0", torch.float32, ("matmul_all_reduce", True), "is not a mean over the last dim"),
    ("max", torch.float32, ("all_reduce_rmsnorm", False), "the reduction is 'max', not 'sum'"),
    ("rms_norm", torch.bfloat16, ("matmul_all_reduce", True), "F.rms_norm's order"),
    ("y_used", torch.float32, ("matmul_all_reduce", True), "the reduced tensor"),
]


@pytest.fixture(scope="module")
def results() -> dict:
    """Every case compiled in one run of the two ranks (one start of the ranks' processes)."""
    cases = [(case, dtype) for case, dtype, *_ in _MATCHED + _LEFT_ALONE]
    ranks = run_ranks(_compiled_cases, 2, cases, timeout=600)
    return {(case, dtype): [r[i] for r in ranks] for i, (case, dtype) in enumerate(cases)}


@pytest.mark.parametrize("case, dtype, op, run", _MATCHED)
def test_norm_after_all_reduce_becomes_one_coc_op(
    results: dict, case: str, dtype: torch.dtype, op: str, run: str
) -> None:
    for rank in results[(case, dtype)]:
        assert rank["ratio"] <= 1, rank
        assert [(p, m) for p, m, _ in rank["records"]] == [(op, True)], rank["records"]
        assert rank["runs"] == {(run, "sequential"): 1}, rank  # that op ran, and no other coc op


@pytest.mark.parametrize("case, dtype, record, reason", _LEFT_ALONE)
def test_near_misses_are_left_alone_with_the_reason(
    results: dict, case: str, dtype: torch.dtype, record: tuple[str, bool], reason: str
) -> None:
    for rank in results[(case, dtype)]:
        assert rank["ratio"] <= 1, rank
        assert [(p, m) for p, m, _ in rank["records"]] == [record], rank["records"]
        assert reason in rank["records"][0][2], rank["records"]
        # the plain GEMM + all-reduce where the pass made it, no norm op
        want = {("matmul_all_reduce", "sequential"): 1} if record[1] else {}
        assert rank["runs"] == want, rank


def _norm(eps: object = EPS, keepdim: bool = True) -> object:
    """``rmsnorm(y + r) * wt`` as a function of ``(y, r, wt)``, its eps a number or a function of ``wt``."""

    def fn(y: torch.Tensor, r: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        h = y + r
        ms = h.pow(2).mean(-1, keepdim=keepdim)
        ms = ms if keepdim else ms[:, None]
        return h * torch.rsqrt(ms + (eps(wt) if callable(eps) else eps)) * wt

    return fn


@pytest.mark.parametrize(
    "fn, shapes, reason",
    [
        (_norm(), [(6, N), (6, N), (N,)], None),
        (_hf_rmsnorm_of_sum := lambda y, r, wt: _hf_rmsnorm(y + r, wt), [(6, N), (6, N), (N,)], None),
        (_norm(eps=lambda wt: wt[:1]), [(6, N), (6, N), (N,)], "is not a constant number"),
        (_norm(keepdim=False), [(6, N), (6, N), (N,)], "with keepdim"),
        (_norm(), [(6, N), (1, N), (N,)], "broadcasts"),
        (_norm(), [(6, N), (6, N), (1,)], "the norm weight is \\[1\\]"),
    ],
)
def test_find_norm_checks_each_step(fn: object, shapes: list, reason: str | None) -> None:
    """fp32 norms after a stand-in for the reduced tensor (the first input), traced without Inductor."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kernels.inductor.norm import find_norm
    from kernels.inductor.patterns import LeftAlone

    graph = make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes)).graph  # type: ignore[arg-type]
    y, r, wt = (n for n in graph.nodes if n.op == "placeholder")
    if reason is None:
        tail = find_norm(y)
        assert (tail.eps, tail.residual, tail.weight) == (EPS, r, wt)
        return
    with pytest.raises(LeftAlone, match=reason):
        find_norm(y)


def test_rewrites_run_on_the_fused_backend() -> None:
    """``USE_COC_FUSED_KERNEL=1``: the pass gives both ops the fused backend (the interpreted Triton kernels on the
    shared-memory heap), within the same bounds."""
    cases = [("mm", torch.float32), ("mm", torch.bfloat16), ("not_mm", torch.float32)]
    runs = [{("matmul_all_reduce+rmsnorm", "fused"): 1}] * 2 + [{("all_reduce_rmsnorm", "fused"): 1}]
    ranks = run_ranks(_compiled_cases, 2, cases, timeout=600, env={"USE_COC_FUSED_KERNEL": "1"})
    for rank in ranks:
        for row, want in zip(rank, runs, strict=True):
            assert row["ratio"] <= 1 and row["runs"] == want, row
            assert [m for _, m, _ in row["records"]] == [True], row["records"]
