"""torch.compile(fullgraph=True) and torch.library.opcheck on the registered ops (issue 10).

Every op and backend at world 2 (fused under the Triton interpreter, in the harness's rank
processes) must trace into a graph that holds exactly one ``torch.ops.coc`` call and no other
collective, with zero graph breaks, and give the eager result; the fake implementations must give
the real outputs' shapes, dtypes, devices and strides. The linears (column then row, sequence
parallel on and off, every column-backward option, chunked and fused) must compile whole, forward
and backward, at worlds 2 and 3, and give eager's outputs and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

import kernels
from kernels.testing import BACKEND_ENVS, operator_calls, run_ranks

BACKENDS = [("sequential", None), ("chunked", 2), ("chunked", 4), ("fused", None)]
# Odd sizes: m_local = 3 rows per rank (5 for the all-reduce), k = 5, n = 7; the reduce-scatter
# needs m divisible by W, so it gets 3 * W rows.
SHAPES = {
    "all_gather_matmul": 3,
    "all_gather_matmul_gathered": 3,
    "matmul_reduce_scatter": None,
    "matmul_all_reduce": 5,
    "quantized_matmul_all_reduce": 5,
}
K, N = 5, 7
# The registered operator each public op calls: one per communication pattern, whatever the format.
OPERATORS = {
    "all_gather_matmul": "all_gather_matmul",
    "all_gather_matmul_gathered": "all_gather_matmul",
    "matmul_reduce_scatter": "matmul_reduce_scatter",
    "matmul_all_reduce": "matmul_all_reduce",
    "quantized_matmul_all_reduce": "matmul_all_reduce",
}


def _graph_counter() -> tuple[Callable, list]:
    """A compile backend that records each graph's ``coc`` operator calls and other call targets."""
    graphs: list[dict[str, Any]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        coc, other, calls = [], [], []
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, torch._ops.OpOverload) and target.namespace == "coc":
                coc.append(target.name())
                calls.append(node.args)
            else:
                other.append(str(target))
        graphs.append({"coc": coc, "other": other, "args": calls})
        return gm.forward

    return backend, graphs


def _case(op: str, rank: int, world: int, dtype: torch.dtype = torch.float32) -> tuple[Callable[..., Any], tuple]:
    gen = torch.Generator().manual_seed(100 + rank)
    rows = SHAPES[op] or 3 * world
    x = torch.randn(rows, K, generator=gen, dtype=dtype)
    w = torch.randn(N, K, generator=gen, dtype=dtype)
    b = torch.randn(N, generator=gen, dtype=dtype)
    if op == "quantized_matmul_all_reduce":
        q, s = kernels.quantize_weight(w)
        return (lambda x, q, s, b, **kw: kernels.quantized_matmul_all_reduce(x, q, s, b, **kw)), (x, q, s, b)
    if op == "all_gather_matmul_gathered":
        return (lambda x, w, b, **kw: kernels.all_gather_matmul(x, w, b, return_gathered=True, **kw)), (x, w, b)
    return (lambda x, w, b, **kw: getattr(kernels, op)(x, w, b, **kw)), (x, w, b)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return all(_same(p, q) for p, q in zip(a, b, strict=False))
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _compile_rank(rank: int, world: int, backend: str, parallel_num: int | None) -> list[str]:
    """Failures, as text (empty when every op compiles whole and matches eager)."""
    from torch._dynamo.utils import counters

    failures = []
    for op in SHAPES:
        fn, args = _case(op, rank, world)
        kwargs = {"backend": backend, "parallel_num": parallel_num}
        with torch.no_grad():
            eager = fn(*args, **kwargs)
            torch._dynamo.reset()
            counters.clear()
            counter, graphs = _graph_counter()
            compiled = torch.compile(partial(fn, **kwargs), backend=counter, fullgraph=True)(*args)
        breaks = sum(counters["graph_break"].values())
        expected = OPERATORS[op]
        calls = [c for g in graphs for c in g["coc"]]
        collectives = [t for g in graphs for t in g["other"] if "c10d" in t or "distributed" in t]
        if breaks:
            failures.append(f"{op} {backend}: {breaks} graph breaks {dict(counters['graph_break'])}")
        if calls != [f"coc::{expected}"]:
            failures.append(f"{op} {backend}: graph calls {calls}, expected one coc::{expected}")
        if collectives:
            failures.append(f"{op} {backend}: collectives outside the op in the graph: {collectives}")
        if not _same(compiled, eager):
            failures.append(f"{op} {backend}: compiled result differs from eager")
    return failures


@pytest.mark.parametrize("backend,parallel_num", BACKENDS)
def test_ops_compile_whole_and_match_eager_world2(backend: str, parallel_num: int | None) -> None:
    results = run_ranks(_compile_rank, 2, backend, parallel_num, timeout=600)
    assert results == [[], []], results


def _recorded(fn: Callable[..., Any], args: tuple, **kwargs: Any) -> tuple[Any, tuple]:
    """The registered operator a public op call makes and its arguments."""
    with torch.no_grad(), operator_calls() as calls:
        fn(*args, **kwargs)
    assert len(calls) == 1, calls
    return calls[0]


def _fake_matches(operator: Any, args: tuple) -> str | None:
    """Run ``operator`` for real and under FakeTensorMode: None when the outputs agree in everything but values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = operator(*args)
    with FakeTensorMode() as mode:
        fake = operator(*[_fake(mode, a) for a in args])
    for r, f in zip(_flat(real), _flat(fake), strict=True):
        got = (tuple(f.shape), f.dtype, f.device, f.stride())
        want = (tuple(r.shape), r.dtype, r.device, r.stride())
        if got != want:
            return f"fake {got} != real {want}"
    return None


def _fake_rank(rank: int, world: int) -> list[str]:
    """Run each op's operator for real and under FakeTensorMode; the outputs must agree in everything but values."""
    failures = []
    for backend, num in BACKENDS:
        for op in SHAPES:
            fn, args = _case(op, rank, world)
            operator, op_args = _recorded(fn, args, backend=backend, parallel_num=num)
            problem = _fake_matches(operator, op_args)
            if problem:
                failures.append(f"{op} {backend}: {problem}")
    return failures


def test_fake_outputs_equal_real_outputs_world2() -> None:
    results = run_ranks(_fake_rank, 2, timeout=600)
    assert results == [[], []], results


def _opcheck_rank(rank: int, world: int) -> dict[str, dict]:
    results = {}
    for backend, num in (("sequential", 1), ("chunked", 2)):
        for op in SHAPES:
            fn, args = _case(op, rank, world)
            operator, op_args = _recorded(fn, args, backend=backend, parallel_num=num)
            results[f"{op} {backend}"] = torch.library.opcheck(operator, op_args)
    return results


def test_opcheck_every_op_world2() -> None:
    for per_rank in run_ranks(_opcheck_rank, 2, timeout=600):
        for call, result in per_rank.items():
            assert set(result.values()) == {"SUCCESS"}, (call, result)


@pytest.mark.parametrize("backend,parallel_num", [("sequential", 1), ("chunked", 2), ("fused", 1)])
def test_opcheck_world1_without_process_group(backend: str, parallel_num: int) -> None:
    x, w, b = torch.randn(3, K), torch.randn(N, K), torch.randn(N)
    q, s = kernels.quantize_weight(w, "per_group", 2)
    calls = {
        "all_gather_matmul": partial(kernels.all_gather_matmul, x, w, b),
        "all_gather_matmul_gathered": partial(kernels.all_gather_matmul, x, w, b, return_gathered=True),
        "matmul_reduce_scatter": partial(kernels.matmul_reduce_scatter, x, w, b),
        "matmul_all_reduce": partial(kernels.matmul_all_reduce, x, w, deterministic=True),
        "quantized_matmul_all_reduce": partial(kernels.quantized_matmul_all_reduce, x, q, s, b, group_size=2),
    }
    for op, fn in calls.items():
        operator, args = _recorded(fn, (), backend=backend, parallel_num=parallel_num)
        result = torch.library.opcheck(operator, args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


def test_gathered_output_never_aliases_the_input_world1() -> None:
    x, w = torch.randn(4, K), torch.randn(N, K)
    with torch.no_grad():
        y, x_gathered = kernels.all_gather_matmul(x, w, backend="sequential", return_gathered=True)
    assert torch.equal(x_gathered, x)
    assert x_gathered.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_compiled_world1_dynamic_shapes_decide_without_the_shape() -> None:
    """With no shape-dependent setting, a dynamic-shape graph compiles whole and serves every m."""
    from torch._dynamo.utils import counters

    w = torch.randn(N, K)
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda x: kernels.matmul_all_reduce(x, w, parallel_num=2), fullgraph=True, dynamic=True)
    with torch.no_grad():
        for m in (3, 4, 9):
            x = torch.randn(m, 2, K)
            torch.testing.assert_close(fn(x), torch.nn.functional.linear(x, w))
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1


# The column backward's two switches (configs/coc.yaml keys): default, no recompute, and the
# overlapped op in the backward.
COLUMN_CONFIGS = {
    "default": "",
    "keep_gathered": "recompute_all_gather: false\n",
    "coc_in_backward": "enable_coc_in_column_backward: true\n",
}


def _mlp(sp: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    import autopar

    torch.manual_seed(3)
    cfg = autopar.ParallelConfig(sequence_parallel=sp, use_cpu_initialization=True)
    col = autopar.ColumnParallelLinear(6, 12, config=cfg, init_method=torch.nn.init.normal_)
    row = autopar.RowParallelLinear(
        12, 5, config=cfg, init_method=torch.nn.init.normal_, bias=True, input_is_parallel=True, skip_bias_add=False
    )
    with torch.no_grad():
        col.bias.uniform_()
        row.bias.uniform_()
    return col, row


def _step(col: torch.nn.Module, row: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return row(torch.nn.functional.gelu(col(x)[0]))[0]


def _grads(
    col: torch.nn.Module, row: torch.nn.Module, x: torch.Tensor, fn: Callable, g: torch.Tensor
) -> list[torch.Tensor]:
    for p in (*col.parameters(), *row.parameters()):
        p.grad = None
    x = x.clone().requires_grad_()
    y = fn(col, row, x)
    (y * g).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in (*col.parameters(), *row.parameters())]


def _compile_linears_rank(
    rank: int, world: int, config_dir: str, configs: tuple[str, ...], inductor_configs: tuple[str, ...]
) -> list[str]:
    """Column then row linear, compiled whole, under each of ``configs``; failures as text. Inductor compiles
    those in ``inductor_configs``, the others go through its graph passes only
    (:func:`kernels.testing.compile.graph_passes_backend`: the same graphs, no C++ code generation)."""
    import os

    from torch._dynamo.utils import counters

    from kernels.testing.compile import graph_passes_backend

    failures = []
    for name in configs:
        text = COLUMN_CONFIGS[name]
        path = os.path.join(config_dir, f"{name}.yaml")
        if rank == 0:
            with open(path + ".tmp", "w") as f:
                f.write(text or "{}\n")
            os.replace(path + ".tmp", path)
        torch.distributed.barrier()
        os.environ["COC_CONFIG"] = path
        try:
            for sp in (False, True):
                col, row = _mlp(sp)
                gen = torch.Generator().manual_seed(rank)
                s_local = 3 if sp else 3 * world  # odd sequence length per rank
                x = torch.randn(s_local, 2, 6, generator=gen)
                g = torch.randn(s_local, 2, 5, generator=gen)
                eager = _grads(col, row, x, _step, g)
                torch._dynamo.reset()
                counters.clear()
                compiler = "inductor" if name in inductor_configs else graph_passes_backend
                compiled_step = torch.compile(_step, fullgraph=True, backend=compiler)
                compiled = _grads(col, row, x, compiled_step, g)
                tag = f"config={name} sp={sp}"
                breaks = sum(counters["graph_break"].values())
                if breaks:
                    failures.append(f"{tag}: {breaks} graph breaks {dict(counters['graph_break'])}")
                if counters["stats"]["unique_graphs"] != 1:
                    failures.append(f"{tag}: {counters['stats']['unique_graphs']} graphs, expected 1")
                for i, (a, b) in enumerate(zip(compiled, eager, strict=False)):
                    if a is None or b is None or a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                        failures.append(f"{tag}: output/gradient {i} differs from eager")
        finally:
            os.environ.pop("COC_CONFIG", None)
    return failures


@pytest.mark.one_triton  # whole linears; the ops' compile tests above rerun under Triton 3.6
@pytest.mark.parametrize(("backend", "world"), [("chunked", 2), ("fused", 2)])
def test_linears_compile_forward_and_backward(world: int, backend: str, tmp_path: Any) -> None:
    # The column backward's switches change the traced graph: every switch on the chunked backend. The fused
    # backend changes the coc ops' backend argument in the same graphs: the default switches. The world size
    # enters the graphs as shapes only (the odd world 3 runs the linears eagerly in tests/autopar/tp). Inductor
    # compiles the default switches; the others run Inductor's graph passes without code generation.
    configs = tuple(COLUMN_CONFIGS) if backend == "chunked" else ("default",)
    inductor_configs = ("default",)
    results = run_ranks(
        _compile_linears_rank,
        world,
        str(tmp_path),
        configs,
        inductor_configs,
        env=BACKEND_ENVS[backend],
        timeout=900,
    )
    assert results == [[]] * world, results


def _graph_replay_rank(rank: int, world: int) -> list[str]:
    """Capture forward + backward of the linears in one CUDA graph, replay it 20 times on new
    inputs, each against an eager run of identical copies; failures as text."""
    import copy

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    failures = []
    for sp in (False, True) if world > 1 else (False,):
        col, row = (m.to(device) for m in _mlp(sp))
        eager_col, eager_row = copy.deepcopy(col), copy.deepcopy(row)
        params = [*col.parameters(), *row.parameters()]
        s_local = 4 if sp else 4 * world
        static_x = torch.zeros(s_local, 2, 6, device=device, requires_grad=True)
        static_g = torch.zeros(s_local, 2, 5, device=device)

        def step(col=col, row=row, static_x=static_x, static_g=static_g) -> torch.Tensor:
            y = _step(col, row, static_x)
            (y * static_g).sum().backward()
            return y

        # Warm-up on a side stream (as torch's capture recipe): first calls make the split choice
        # and any heap before capture, where neither may happen.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        for t in params + [static_x]:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = step()
        gen = torch.Generator(device=device).manual_seed(rank)
        for i in range(20):
            x = torch.randn(static_x.shape, device=device, generator=gen)
            g = torch.randn(static_g.shape, device=device, generator=gen)
            with torch.no_grad():
                static_x.copy_(x)
                static_g.copy_(g)
            graph.replay()
            want = _grads(eager_col, eager_row, x, _step, g)
            got = [static_y, static_x.grad] + [p.grad for p in params]
            for j, (a, b) in enumerate(zip(got, want, strict=False)):
                if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                    failures.append(f"sp={sp} replay {i}: output/gradient {j} differs from eager")
        torch.cuda.synchronize()
    return failures


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("parallel_num", [None, "2", "4", "fused"])
def test_linears_cuda_graph_replays_match_eager(world: int, parallel_num: str | None) -> None:
    """Sequential (no COC_PARALLEL_NUM), chunked 2 / 4 and fused (USE_COC_FUSED_KERNEL=1, world 2:
    one process per GPU; the fused ops on one shared GPU are tests/kernels/fused/test_graphs.py). World 1
    still runs the chunked path's per-piece GEMMs and copies."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs one GPU per rank; fewer than {world} GPUs")
    env: dict[str, str | None] = {"COC_PARALLEL_NUM": parallel_num}
    if parallel_num == "fused":
        if world == 1:
            pytest.skip("a fused call at world 1 is a plain GEMM: nothing fused to capture")
        pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
        env = {"COC_PARALLEL_NUM": None, "USE_COC_FUSED_KERNEL": "1"}
    results = run_ranks(_graph_replay_rank, world, backend="nccl", env=env, timeout=600)
    assert results == [[]] * world, results


@pytest.mark.gpu
def test_linears_cuda_graph_replays_on_one_gpu() -> None:
    """The fused linears captured in one CUDA graph by two processes sharing one GPU (a gloo group; the
    fused path's heap is CUDA IPC): the variant of the test above that a one-GPU machine runs."""
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    env = {"COC_PARALLEL_NUM": None, "USE_COC_FUSED_KERNEL": "1"}
    results = run_ranks(_graph_replay_rank, 2, device="cuda", env=env, timeout=600)
    assert results == [[]] * 2, results


@pytest.mark.gpu
def test_auto_split_choice_inside_capture_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuning cannot be captured: a first ``auto`` call inside capture names the warm-up it needs."""
    from kernels import tune

    monkeypatch.setenv("COC_PARALLEL_NUM", "auto")
    tune.clear_memory_cache()
    x, w = torch.randn(8, 16, device="cuda"), torch.randn(4, 16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(graph):
            kernels.matmul_all_reduce(x, w)


def test_host_cost_bench_reports_every_backend(tmp_path: Any) -> None:
    """``python -m bench.cost.host`` at world 1 (eager, thread clock) gives a figure per op and backend."""
    import json
    import subprocess
    import sys

    from kernels.testing import REPO_ROOT

    out = tmp_path / "host_cost.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.cost.host",
            "--worlds",
            "1",
            "--no-compile",
            "--iters",
            "3",
            "--repeats",
            "1",
            "--clock",
            "thread",
            "--json",
            str(out),
        ],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    rows = json.loads(out.read_text())["rows"]
    got = {(r["op"], r["backend"]) for r in rows if r["mode"] == "eager" and r["us"] > 0}
    assert len(got) == 15 and not [r for r in rows if "error" in r], rows


def test_compiled_choice_follows_customized_coc_per_shape(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape-dependent choice (customized_coc) is made per traced shape, even with dynamic=True."""
    path = tmp_path / "coc.yaml"
    path.write_text('customized_coc: {"[4, 5, 7]": 4}\n')
    monkeypatch.setenv("COC_CONFIG", str(path))
    w = torch.randn(N, K)
    torch._dynamo.reset()
    counter, graphs = _graph_counter()
    fn = torch.compile(lambda x: kernels.matmul_all_reduce(x, w), backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for m in (4, 6):
            x = torch.randn(m, K)
            torch.testing.assert_close(fn(x), torch.nn.functional.linear(x, w))
    from kernels.ops.gemm import GemmCall

    calls = (GemmCall.decode(args[-1]) for g in graphs for args in g["args"])
    chosen = [(call.backend, call.parallel_num) for call in calls]
    assert chosen == [("chunked", 4), ("sequential", 1)], chosen


def _dims_cases(rank: int, world: int) -> dict[str, tuple[Callable[..., Any], tuple, str]]:
    """gather_dim / scatter_dim on ``[b, s, k]`` inputs and the list-of-weights all-gather:
    ``name -> (fn(*args, **backend kwargs), args, the one coc operator its graph must hold)``."""
    gen = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(2, 3, K, generator=gen)
    xs = torch.randn(2, 3 * world, K, generator=gen)
    w, w2 = torch.randn(N, K, generator=gen), torch.randn(4, K, generator=gen)
    b = torch.randn(N, generator=gen)
    return {
        "gather_dim": (
            lambda x, w, b, **kw: kernels.all_gather_matmul(x, w, b, gather_dim=1, **kw),
            (x, w, b),
            "coc::all_gather_matmul",
        ),
        "gather_dim gathered": (
            lambda x, w, b, **kw: kernels.all_gather_matmul(x, w, b, gather_dim=-2, return_gathered=True, **kw),
            (x, w, b),
            "coc::all_gather_matmul",
        ),
        "weights": (
            lambda x, w, w2, b, **kw: kernels.all_gather_matmul(x, [w, w2], [b, None], gather_dim=1, **kw),
            (x, w, w2, b),
            "coc::all_gather_matmul",
        ),
        "weights gathered": (
            lambda x, w, w2, b, **kw: kernels.all_gather_matmul(x, (w, w2), None, return_gathered=True, **kw),
            (x, w, w2, b),
            "coc::all_gather_matmul",
        ),
        "scatter_dim": (
            lambda x, w, b, **kw: kernels.matmul_reduce_scatter(x, w, b, scatter_dim=1, **kw),
            (xs, w, b),
            "coc::matmul_reduce_scatter",
        ),
    }


def _dims_compile_rank(rank: int, world: int, backend: str, parallel_num: int | None) -> list[str]:
    from torch._dynamo.utils import counters

    failures = []
    kwargs = {"backend": backend, "parallel_num": parallel_num}
    for name, (fn, args, expected) in _dims_cases(rank, world).items():
        with torch.no_grad():
            eager = fn(*args, **kwargs)
            torch._dynamo.reset()
            counters.clear()
            counter, graphs = _graph_counter()
            compiled = torch.compile(partial(fn, **kwargs), backend=counter, fullgraph=True)(*args)
        breaks = sum(counters["graph_break"].values())
        calls = [c for g in graphs for c in g["coc"]]
        if breaks:
            failures.append(f"{name} {backend}: {breaks} graph breaks {dict(counters['graph_break'])}")
        if calls != [expected]:
            failures.append(f"{name} {backend}: graph calls {calls}, expected one {expected}")
        flat_e = list(eager[0]) + [eager[1]] if isinstance(eager, tuple) and isinstance(eager[0], list) else eager
        flat_c = (
            list(compiled[0]) + [compiled[1]]
            if isinstance(compiled, tuple) and isinstance(compiled[0], list)
            else compiled
        )
        if isinstance(flat_e, list):
            flat_e, flat_c = tuple(flat_e), tuple(flat_c)
        if not _same(flat_c, flat_e):
            failures.append(f"{name} {backend}: compiled result differs from eager")
    return failures


@pytest.mark.parametrize("backend,parallel_num", [("sequential", None), ("chunked", 2), ("fused", None)])
def test_dims_and_weight_lists_compile_whole_world2(backend: str, parallel_num: int | None) -> None:
    results = run_ranks(_dims_compile_rank, 2, backend, parallel_num, timeout=600)
    assert results == [[], []], results


def _dims_fake_and_opcheck_rank(rank: int, world: int) -> list[str]:
    """The operators' fake outputs equal the real ones (shape, dtype, stride) with dims and weight lists,
    and opcheck passes."""
    failures = []
    gen = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(3, 2, 1, K, generator=gen)
    xs = torch.randn(3, 2 * world, 1, K, generator=gen)
    w, w2, b = torch.randn(N, K, generator=gen), torch.randn(2, K, generator=gen), torch.randn(N, generator=gen)
    for backend, num in (("sequential", 1), ("chunked", 2)):
        calls = {
            "all_gather_matmul": partial(kernels.all_gather_matmul, x, w, b, gather_dim=1),
            "all_gather_matmul_gathered": partial(kernels.all_gather_matmul, x, w, gather_dim=-3, return_gathered=True),
            "all_gather_matmul_multi": partial(
                kernels.all_gather_matmul, x, [w, w2], [b, None], gather_dim=2, return_gathered=True
            ),
            "matmul_reduce_scatter": partial(kernels.matmul_reduce_scatter, xs, w, b, scatter_dim=1),
        }
        for op, fn in calls.items():
            operator, args = _recorded(fn, (), backend=backend, parallel_num=num)
            problem = _fake_matches(operator, args)
            if problem:
                failures.append(f"{op} {backend}: {problem}")
            result = torch.library.opcheck(operator, args)
            if set(result.values()) != {"SUCCESS"}:
                failures.append(f"{op} {backend}: opcheck {result}")
    return failures


def _fake(mode: Any, a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return mode.from_tensor(a)
    if isinstance(a, list):
        return [_fake(mode, t) for t in a]
    return a


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [] if out is None else [out]


def test_dims_and_weight_lists_fake_outputs_and_opcheck_world2() -> None:
    results = run_ranks(_dims_fake_and_opcheck_rank, 2, timeout=600)
    assert results == [[], []], results


def test_constant_result_mark_is_torchs_and_import_skips_dynamo() -> None:
    """``kernels.protocol.assume_constant_result`` marks a function as torch's decorator does (if
    torch changes how, this fails rather than compiled dispatch silently re-deciding per call), and
    importing the package does not import ``torch._dynamo``."""
    import subprocess
    import sys

    from kernels.protocol import assume_constant_result

    def ours() -> int:
        return 1

    def torchs() -> int:
        return 1

    assert vars(assume_constant_result(ours)) == vars(torch.compiler.assume_constant_result(torchs)) != {}
    code = "import sys, kernels, autopar; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout
