"""The three ops, sequential and chunked backends, against plain torch math.

Every rank builds every rank's inputs from one seed, so each rank can compute the exact global
reference locally: the toolkit's fp64 reference and its one tolerance rule (dtype, k, W). The
gathered x is pure data movement and a second call with the same inputs runs the same arithmetic:
both are compared exactly.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

import kernels
from kernels.testing import assert_close, reference, run_ranks

WORLDS = [1, 2, 3, 4]
BACKENDS = ["sequential", "chunked"]
PARALLEL_NUMS = [1, 2, 4, 8]
ROWS_PER_RANK = [1, 7, 13]
K_LOCAL, N = 12, 10


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None


def _inputs(world, rows, k, n, three_d, seed=0):
    """Every rank's input (a list over ranks), weight shards and bias, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    shape = (rows, 2, k) if three_d else (rows, k)
    xs = [torch.randn(shape, generator=g) for _ in range(world)]
    ws = [torch.randn(n, k, generator=g) for _ in range(world)]
    bias = torch.randn(n, generator=g)
    dev = _device()
    if dev is not None:
        # TF32 would make the GPU result differ from fp32 math by more than the tolerance.
        torch.backends.cuda.matmul.allow_tf32 = False
        xs, ws, bias = [x.to(dev) for x in xs], [w.to(dev) for w in ws], bias.to(dev)
    return xs, ws, bias


def _check_all_gather_matmul(rank, world, backend, parallel_num):
    for rows, three_d, with_bias in itertools.product(ROWS_PER_RANK, [False, True], [False, True]):
        xs, ws, bias = _inputs(world, rows, K_LOCAL, N, three_d)
        b = bias if with_bias else None
        w = ws[0]
        y, xg = kernels.all_gather_matmul(
            xs[rank], w, b, backend=backend, parallel_num=parallel_num, return_gathered=True
        )
        assert_close(f"ag rows={rows} rank={rank}", (y, xg), reference("ag_v2", xs, ws, b, rank), torch.float32)
        y_only = kernels.all_gather_matmul(xs[rank], w, b, backend=backend, parallel_num=parallel_num)
        torch.testing.assert_close(y_only, y, rtol=0, atol=0)
        assert y.shape == (rows * world,) + ((2,) if three_d else ()) + (N,)


def _check_matmul_reduce_scatter(rank, world, backend, parallel_num):
    for rows, three_d, with_bias, det in itertools.product(ROWS_PER_RANK, [False, True], [False, True], [False, True]):
        xs, ws, bias = _inputs(world, rows * world, K_LOCAL, N, three_d)
        b = bias if with_bias else None
        y = kernels.matmul_reduce_scatter(
            xs[rank], ws[rank], b, backend=backend, parallel_num=parallel_num, deterministic=det
        )
        assert_close(f"rs rows={rows} det={det} rank={rank}", y, reference("rs", xs, ws, b, rank), torch.float32)


def _check_matmul_all_reduce(rank, world, backend, parallel_num):
    for rows, three_d, with_bias, det in itertools.product(ROWS_PER_RANK, [False, True], [False, True], [False, True]):
        xs, ws, bias = _inputs(world, rows, K_LOCAL, N, three_d)
        b = bias if with_bias else None
        y = kernels.matmul_all_reduce(
            xs[rank], ws[rank], b, backend=backend, parallel_num=parallel_num, deterministic=det
        )
        assert_close(f"ar rows={rows} det={det} rank={rank}", y, reference("ar", xs, ws, b, rank), torch.float32)


CHECKS = {
    "all_gather_matmul": _check_all_gather_matmul,
    "matmul_reduce_scatter": _check_matmul_reduce_scatter,
    "matmul_all_reduce": _check_matmul_all_reduce,
}


@pytest.mark.parametrize("parallel_num", PARALLEL_NUMS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op", sorted(CHECKS))
def test_op_matches_torch(op, world, backend, parallel_num):
    run_ranks(CHECKS[op], world, backend, parallel_num)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", sorted(CHECKS))
def test_op_matches_torch_nccl(op, backend):
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("NCCL needs one GPU per rank; fewer than 2 GPUs")
    for parallel_num in PARALLEL_NUMS:
        run_ranks(CHECKS[op], world, backend, parallel_num, backend="nccl")


@pytest.mark.gpu
def test_chunked_single_rank_cuda_waits_for_local_copies():
    """World 1 on CUDA (no process group): the chunked path's stand-in copies run on its comm
    stream, and every piece must be read only after its copy (large pieces make a race visible)."""
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(8192, 1024, device=dev, generator=g)
    w = torch.randn(256, 1024, device=dev, generator=g)
    ref = reference("ar", [x], [w], None, 0)  # at W = 1 every op is the one GEMM
    for deterministic in (False, True):
        # Freed NaN blocks of these sizes are what an early read of a fresh buffer would see.
        torch.full_like(x, float("nan"))
        torch.full_like(x[:, :256], float("nan"))
        got = kernels.all_gather_matmul(x, w, backend="chunked", parallel_num=8)
        assert_close("ag", got, ref, torch.float32)
        got = kernels.matmul_reduce_scatter(x, w, backend="chunked", parallel_num=8, deterministic=deterministic)
        assert_close("rs", got, ref, torch.float32)
        got = kernels.matmul_all_reduce(x, w, backend="chunked", parallel_num=8, deterministic=deterministic)
        assert_close("ar", got, ref, torch.float32)


def _ops_with_soc_padding(rank, world, yaml_path):
    """matmul_soc_friendly active (as on CUDA) through every op and backend: results unchanged."""
    import os

    from kernels import padding

    os.environ["COC_CONFIG"] = yaml_path
    saved = padding._enabled
    padding._enabled = lambda x, force: True
    try:
        for backend, pn in [("sequential", 1), ("chunked", 2), ("chunked", 4)]:
            for check in CHECKS.values():
                check(rank, world, backend, pn)
    finally:
        padding._enabled = saved
        os.environ.pop("COC_CONFIG")


def test_ops_with_soc_friendly_padding(tmp_path):
    path = tmp_path / "soc.yaml"
    path.write_text(f"k_min: 1\nk_max: {K_LOCAL}\n")  # k = 12 and n = 10 both get padded
    run_ranks(_ops_with_soc_padding, 2, str(path))
