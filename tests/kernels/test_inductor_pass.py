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

    from kernels import inductor_pass
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
    with inductor_pass.use_inductor_pass():
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
    return {"y": (y - ref_y).abs().max().item(), "grads": grads, "matched": matched}


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
