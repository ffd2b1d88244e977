"""The Inductor post-grad pass: torch's plain TP styles, compiled, run the coc ops and give eager's results."""

import copy

import pytest
import torch

from kernels.testing import run_ranks


def _compiled_mlp(rank: int, world: int, sequence_parallel: bool, backend_env: str) -> dict:
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from kernels.inductor import rewrite as inductor_pass
    from kernels.testing import backend_calls
    from kernels.testing.compile import graph_passes_backend

    if backend_env:
        os.environ["COC_PARALLEL_NUM"] = backend_env
    torch._dynamo.reset()
    torch.manual_seed(0)
    h = 16
    model = torch.nn.Sequential(
        torch.nn.LayerNorm(h), torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)
    )
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    if sequence_parallel:
        plan = {
            "0": SequenceParallel(),
            "1": ColwiseParallel(input_layouts=Shard(0)),
            "3": RowwiseParallel(output_layouts=Shard(0)),
        }
    else:
        plan = {"1": ColwiseParallel(input_layouts=Replicate()), "3": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    x = torch.randn(4 * world, 3, h)  # [s, b, h]
    inductor_pass.clear_report()
    with inductor_pass.use_inductor_pass(), backend_calls() as calls:
        # Inductor compiles the sequential backend's graphs; the chunked backend's differ in the coc ops'
        # backend argument only, and run Inductor's graph passes without its code generation.
        compiled = torch.compile(model, backend=graph_passes_backend if backend_env else "inductor")
        if sequence_parallel:
            from torch.distributed.tensor import DTensor

            inp = DTensor.from_local(x.chunk(world, 0)[rank], mesh, [Shard(0)])
        else:
            inp = x
        y = compiled(inp)
        # The SP row layer returns this rank's rows (use_local_output): the losses of the ranks sum to
        # the global loss, and each rank's rows are compared with the reference's.
        y.square().sum().backward()
    ref_y = reference(x)
    ref_y.square().sum().backward()
    if sequence_parallel:
        ref_y = ref_y.chunk(world, 0)[rank]
    grads = {}
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = (g - q.grad).abs().max().item()
    matched = [(r.pattern, r.matched) for r in inductor_pass.report()]
    return {"y": (y - ref_y).abs().max().item(), "grads": grads, "matched": matched, "calls": dict(calls)}


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("backend_env", ["", "2"])
def test_plain_styles_compiled_with_the_pass_run_coc_ops(sequence_parallel, backend_env):
    for out in run_ranks(_compiled_mlp, 2, sequence_parallel, backend_env, timeout=600):
        assert out["y"] < 1e-5, out
        assert max(out["grads"].values()) < 1e-5, out
        matched = {pattern for pattern, ok in out["matched"] if ok}
        # Forward and backward graphs: the row all-reduce (no SP), or the column all-gather and the row
        # reduce-scatter (SP) become coc ops; what was left alone is reported with a reason.
        want = {"all_gather_matmul", "matmul_reduce_scatter"} if sequence_parallel else {"matmul_all_reduce"}
        assert want <= matched, out["matched"]


def test_plain_all_reduce_rewrite_runs_on_the_fused_backend():
    """Without sequence parallelism (the row layer's all-reduce) with ``USE_COC_FUSED_KERNEL=1``: the rewritten
    ops run the fused kernels (interpreted), within the same bounds."""
    for out in run_ranks(_compiled_mlp, 2, False, "", timeout=600, env={"USE_COC_FUSED_KERNEL": "1"}):
        assert out["y"] < 1e-5 and max(out["grads"].values()) < 1e-5, out
        assert "matmul_all_reduce" in {pattern for pattern, ok in out["matched"] if ok}, out["matched"]
        assert out["calls"] and {b for _, b in out["calls"]} == {"fused"}, out["calls"]


def _dynamic_sp_mlp(rank: int, world: int, dynamic: bool | None) -> list[dict]:
    """The sequence-parallel block on ``[b, s, h]`` (gather and scatter on dim 1, the split / cat form) compiled
    with the pass and called with three sequence lengths: per call, the errors against one process and what the
    pass reported for the graphs compiled during it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    import kernels
    from kernels.inductor import rewrite as inductor_pass
    from kernels.testing.compile import graph_passes_backend

    torch._dynamo.reset()
    torch.manual_seed(0)
    h = 16
    model = torch.nn.Sequential(
        torch.nn.LayerNorm(h), torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)
    )
    reference = copy.deepcopy(model)
    seq = Shard(1)
    plan = {
        "0": SequenceParallel(sequence_dim=1),
        "1": ColwiseParallel(input_layouts=seq),
        "3": RowwiseParallel(output_layouts=seq),
    }
    parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    was = inductor_pass.inductor_pass_enabled()
    kernels.enable_inductor_pass()
    rows = []
    try:
        compiled = torch.compile(model, dynamic=dynamic, backend=graph_passes_backend)
        for s in (4, 6, 8):
            x = torch.randn(3, s * world, h, generator=torch.Generator().manual_seed(s))
            inductor_pass.clear_report()
            y = compiled(x.chunk(world, 1)[rank])
            y.square().sum().backward()
            ref = reference(x)
            ref.square().sum().backward()
            grads = [
                (p.grad.full_tensor() - q.grad).abs().max().item()
                for p, q in zip(model.parameters(), reference.parameters(), strict=True)
            ]
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            rows.append(
                {
                    "y": (y - ref.chunk(world, 1)[rank]).abs().max().item(),
                    "grads": max(grads),
                    "report": [(r.graph, r.pattern, r.matched, r.detail) for r in inductor_pass.report()],
                }
            )
    finally:
        if not was:
            kernels.disable_inductor_pass()
        torch._dynamo.reset()
    return rows


@pytest.mark.parametrize("dynamic", [None, True], ids=["second_length", "dynamic"])
def test_dynamic_shapes_are_left_alone_and_reported(dynamic):
    """A graph with symbolic shapes (dynamic=True, or the recompile the default makes for a second length) compiles
    without the rewrites and runs as eager; the report says why for every collective of it."""
    both = {(g, p) for g in ("forward", "backward") for p in ("all_gather_matmul", "matmul_reduce_scatter")}
    for rows in run_ranks(_dynamic_sp_mlp, 2, dynamic, timeout=600):
        for row in rows:
            assert row["y"] < 1e-5 and row["grads"] < 1e-5, row
        static, symbolic, reused = [row["report"] for row in rows]
        if dynamic is None:
            # The first length compiles static graphs, rewritten; the second recompiles with symbolic shapes.
            assert {(g, p) for g, p, ok, _ in static if ok} == both, static
        else:
            static, symbolic, reused = [], static, symbolic + reused
        assert {(g, p) for g, p, ok, _ in symbolic} == both, symbolic
        assert all(not ok and "symbolic shape" in detail for _, _, ok, detail in symbolic), symbolic
        assert reused == [], reused  # the symbolic graphs serve the next length without a compile


def test_split_helpers_leave_symbolic_split_sizes_alone():
    """In a dynamic-shape graph a split's sizes are nodes (sym_size and arithmetic on it), not ints."""
    import operator

    import torch.fx as fx

    from kernels.inductor.patterns import LeftAlone, split_pieces, split_source

    aten = torch.ops.aten
    for sized in (lambda s: s, lambda s: [s, s]):
        graph = fx.Graph()
        x = graph.placeholder("x")
        s = graph.call_function(aten.sym_size.int, (x, 1))
        target = aten.split.Tensor if isinstance(sized(s), fx.Node) else aten.split_with_sizes.default
        split = graph.call_function(target, (x, sized(s), 1))
        pieces = [graph.call_function(operator.getitem, (split, i)) for i in range(2)]
        with pytest.raises(LeftAlone, match="not constants"):
            split_source(pieces)
        with pytest.raises(LeftAlone, match="not constants"):
            split_pieces(pieces, x, 1, 4, 2)
