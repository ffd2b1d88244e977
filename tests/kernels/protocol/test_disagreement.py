"""Ranks whose calls disagree are refused by name on every rank, before communicating, at every call
(kernels.protocol.admission).

Without the admission, such calls abort inside gloo ("Received data size doesn't match expected
size") or return wrong values. Each case below makes the last rank differ from the others in one
field; every rank must raise RuntimeError naming the op, rank 0, the odd rank and both values, no
rank may return a tensor, and the same group must run a correct call afterwards.
"""

import os

import pytest
import torch

import kernels
from kernels.testing import run_ranks

M, K, N = 6, 4, 5  # m divisible by 2 and 3: matmul_reduce_scatter scatters it

# case -> (op on rank 0, the field named, rank 0's value, the odd rank's value)
CASES = {
    "m": ("matmul_all_reduce", "x.shape[:-1]", "(6,)", "(12,)"),
    "m_local": ("all_gather_matmul", "x.shape", "(6, 4)", "(3, 4)"),
    "k": ("all_gather_matmul", "x.shape", "(6, 4)", "(6, 3)"),
    "n": ("matmul_reduce_scatter", "weight.shape[0] (n)", "5", "7"),
    "n_all_reduce": ("matmul_all_reduce", "weight.shape[0] (n)", "5", "7"),
    "dtype": ("matmul_all_reduce", "x.dtype", "torch.float32", "torch.float64"),
    "return_gathered": ("all_gather_matmul", "return_gathered", "False", "True"),
    "deterministic": ("matmul_reduce_scatter", "deterministic", "False", "True"),
    "parallel_num": ("matmul_all_reduce", "parallel_num", "2", "4"),
    "env_parallel_num": ("matmul_reduce_scatter", "parallel_num", "1", "2"),
    "bias": ("matmul_all_reduce", "bias given", "(True,)", "(False,)"),
    "backend": ("matmul_all_reduce", "backend", "sequential", "chunked"),
    "op": ("matmul_all_reduce", "op", "matmul_all_reduce", "all_gather_matmul"),
    "quant_mode": ("quantized_matmul_all_reduce", "format", "int8:per_channel", "int8:per_tensor"),
    "group_size": ("quantized_matmul_all_reduce", "format", "int8:per_group:2", "int8:per_group:4"),
}


def _tensors(m, k, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, k, generator=g, dtype=dtype),
        torch.randn(n, k, generator=g, dtype=dtype),
        torch.randn(n, generator=g, dtype=dtype),
    )


def _call(case, odd, backend):
    """The case's call as this rank makes it (``odd``: the rank that differs)."""
    op = CASES[case][0]
    m, k, n, dtype = M, K, N, torch.float32
    kwargs = {"backend": backend}
    flag = False
    with_bias = True
    if odd:
        if case == "m":
            m = 12
        elif case == "m_local":
            m = 3
        elif case == "k":
            k = 3
        elif case in ("n", "n_all_reduce"):
            n = 7
        elif case == "dtype":
            dtype = torch.float64
        elif case in ("return_gathered", "deterministic"):
            flag = True
        elif case == "bias":
            with_bias = False
        elif case == "op":
            op = "all_gather_matmul"
    if case == "parallel_num":
        kwargs = {"backend": None, "parallel_num": 4 if odd else 2}
    elif case == "backend":
        kwargs = {"backend": "chunked" if odd else "sequential", "parallel_num": 2}
    elif case == "env_parallel_num":
        kwargs = {"backend": None}
    x, w, b = _tensors(m, k, n, dtype)
    b = b if with_bias else None
    if op == "quantized_matmul_all_reduce":
        k = 8
        x, w, b = _tensors(m, k, n)
        if case == "quant_mode":
            qw, scale = kernels.quantize_weight(w, "per_tensor" if odd else "per_channel")
        else:
            qw, scale = kernels.quantize_weight(w, "per_group", group_size=4 if odd else 2)
        return lambda: kernels.quantized_matmul_all_reduce(x, qw, scale, b, **kwargs)
    fn = getattr(kernels, op)
    flag_name = "return_gathered" if op == "all_gather_matmul" else "deterministic"
    return lambda: fn(x, w, b, **kwargs, **{flag_name: flag})


def _disagreeing_call(rank, world, case, backend):
    odd = rank == world - 1
    saved = os.environ.get("COC_PARALLEL_NUM")
    if case == "env_parallel_num" and odd:
        os.environ["COC_PARALLEL_NUM"] = "2"  # the user bug: one rank launched with another split
    try:
        with torch.no_grad():
            try:
                out = _call(case, odd, backend)()
                outcome = ("returned", type(out).__name__)
            except RuntimeError as e:
                outcome = ("raised", str(e))
    finally:
        if saved is None:
            os.environ.pop("COC_PARALLEL_NUM", None)
        else:
            os.environ["COC_PARALLEL_NUM"] = saved
    # The check's own collective completed on every rank, so the group is in step: a correct
    # call right after must work and be exact.
    x, w, b = _tensors(M, K, N, seed=1)
    with torch.no_grad():
        y = kernels.matmul_all_reduce(x, w, b, backend=backend)
    torch.testing.assert_close(y, world * (x @ w.T) + b)
    return outcome


@pytest.mark.parametrize("backend", ["sequential", "chunked"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_disagreeing_ranks_raise_by_name(case, world, backend):
    check = "1" if world == 3 else None  # every call is admitted either way; COC_CHECK=1 exchanges full values
    op, field, value_0, value_odd = CASES[case]
    outcomes = run_ranks(_disagreeing_call, world, case, backend, env={"COC_CHECK": check, "COC_PARALLEL_NUM": None})
    odd = world - 1
    for rank, (kind, message) in enumerate(outcomes):
        assert kind == "raised", f"rank {rank} returned a {message} from a disagreeing call"
        local_op = "all_gather_matmul" if case == "op" and rank == odd else op
        assert message.startswith(f"{local_op}: ranks disagree: "), message
        assert f"rank 0 has {field}={value_0}" in message, message
        assert f"rank {odd} has {field}={value_odd}" in message, message
    # Every rank holds the same table, so all but the op prefix of the message is the same.
    assert len({m.split(": ", 1)[1] for _, m in outcomes}) == 1


def _uneven_shards(rank, world, backend):
    """Valid differences: column-parallel n and row-parallel k may be sharded unevenly."""
    with torch.no_grad():
        x, w, b = _tensors(M, K, N + rank)
        y = kernels.all_gather_matmul(x, w, b, backend=backend, parallel_num=2)
        torch.testing.assert_close(y, torch.cat([x] * world) @ w.T + b)
        ks = [K - r for r in range(world)]
        parts = [_tensors(M, kr, N, seed=10 + r) for r, kr in enumerate(ks)]
        x, w, _ = parts[rank]
        y = kernels.matmul_all_reduce(x, w, backend=backend, parallel_num=2)
        torch.testing.assert_close(y, sum(xr @ wr.T for xr, wr, _ in parts))
    return True


@pytest.mark.parametrize("backend", ["sequential", "chunked"])
def test_uneven_shards_pass_the_check(backend):
    assert run_ranks(_uneven_shards, 3, backend, env={"COC_CHECK": "1"}) == [True] * 3


def _subgroup_disagrees(rank, world):
    import torch.distributed as dist

    group = dist.new_group([1, 2])  # every rank creates it; only ranks 1 and 2 call the op on it
    if rank == 0:
        return None
    x, w, _ = _tensors(M if rank == 1 else 2 * M, K, N)
    with torch.no_grad(), pytest.raises(RuntimeError) as e:
        kernels.matmul_all_reduce(x, w, group=group)
    return str(e.value)


def test_subgroup_ranks_are_named_by_group_and_global_rank():
    _, *messages = run_ranks(_subgroup_disagrees, 3, env={"COC_CHECK": "1"})
    for message in messages:
        assert "rank 0 (global 1) has x.shape[:-1]=(6,), rank 1 (global 2) has x.shape[:-1]=(12,)" in message, message


def test_disagreement_is_caught_before_auto_tuning():
    """COC_PARALLEL_NUM=auto tunes with collectives sized from the shapes: the admission comes first."""
    outcomes = run_ranks(_disagreeing_call, 2, "m", None, env={"COC_PARALLEL_NUM": "auto"})
    for kind, message in outcomes:
        assert kind == "raised" and "rank 0 has x.shape[:-1]=(6,), rank 1 has x.shape[:-1]=(12,)" in message, message


def _dim_disagreement(rank: int, world: int, backend: str) -> str:
    """The last rank passes another gather_dim / scatter_dim, same shapes (COC_CHECK=1)."""
    x = torch.randn(2, 2 * world, K)
    w = torch.randn(N, K)
    messages = []
    for op, name in ((kernels.all_gather_matmul, "gather_dim"), (kernels.matmul_reduce_scatter, "scatter_dim")):
        with pytest.raises(RuntimeError) as e:
            op(x, w, backend=backend, parallel_num=2 if backend == "chunked" else None, **{name: rank // (world - 1)})
        messages.append(str(e.value))
    # -2 and 1 are the same dim of a 3-D x: the same call, not a disagreement.
    y = kernels.all_gather_matmul(x, w, backend=backend, gather_dim=-2 if rank else 1)
    assert y.shape == (2, 2 * world * world, N)
    return "\n".join(messages)


@pytest.mark.parametrize("backend", ["sequential", "chunked"])
def test_ranks_disagreeing_on_the_dim_are_refused_by_name_under_coc_check(backend: str) -> None:
    for text in run_ranks(_dim_disagreement, 2, backend, env={"COC_CHECK": "1"}):
        gather, scatter = text.split("\n")
        assert "all_gather_matmul: ranks disagree: rank 0 has gather_dim=0, rank 1 has gather_dim=1" in gather
        assert "matmul_reduce_scatter: ranks disagree: rank 0 has scatter_dim=0, rank 1 has scatter_dim=1" in scatter


FP8_K, FP8_N = 136, 24  # k not a multiple of 128


def _fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., k]`` quantized in row mode, payload and scales in x's leading shape."""
    q, s = kernels.quantize_fp8(x.reshape(-1, x.shape[-1]), "row")
    return q.view(x.shape), s.view(tuple(x.shape[:-1]) + (1,))


def _fp8_layout_mismatch(rank: int, world: int) -> list[str]:
    """The last rank passes another dim with the same shape ([4W, 4W, k], dim 0 against dim 1) or the
    same dim with another shape ([2, 8W, k] against [8W, 2, k], dim 1): the FP8 ops move the dim to
    dim 0 before the call, so only the caller's dim and the dims before it tell the calls apart.
    Refused by name on every backend, at a group's first call and later. Returns the messages."""
    import torch.distributed as dist

    messages = []
    wq, ws = kernels.quantize_fp8(torch.randn(FP8_N, FP8_K), "row")
    last = rank == world - 1
    square = torch.randn(4 * world, 4 * world, FP8_K)
    flat = torch.randn(2, 8 * world, FP8_K)
    fq, fs = _fp8_rows(flat)
    cases = [
        ("gather_dim", square, 1 if last else 0, "gather_dim=0"),
        ("gather_dim", flat.reshape(8 * world, 2, FP8_K) if last else flat, 1, f"x.shape=(2, {8 * world}, {FP8_K})"),
        ("scatter_dim", square, 1 if last else 0, "scatter_dim=0"),
        ("scatter_dim", flat.reshape(8 * world, 2, FP8_K) if last else flat, 1, f"x.shape[:-1]=(2, {8 * world})"),
    ]
    for name, x, dim, expected in cases:
        xq, xs = _fp8_rows(x)
        op = kernels.all_gather_scaled_matmul if name == "gather_dim" else kernels.scaled_matmul_reduce_scatter
        for backend, warm in (("fused", False), ("fused", True), ("sequential", False)):
            group = dist.new_group(list(range(world)))
            opts = {"group": group, "backend": backend, "out_dtype": torch.float32}
            if warm:
                op(fq, fs, wq, ws, **opts, **{name: 1})  # the same call everywhere: the heap exists
            try:
                op(xq, xs, wq, ws, **opts, **{name: dim})
            except RuntimeError as e:
                message = str(e)
                if "ranks disagree" not in message or expected not in message:
                    messages.append(f"{name} {backend} warm={warm}: {message}")
            else:
                messages.append(f"{name} {backend} warm={warm}: ranks with other layouts got a result")
    return messages


def test_fp8_ranks_with_other_dims_or_layouts_are_refused_by_name() -> None:
    failures = run_ranks(_fp8_layout_mismatch, 2, timeout=300)
    assert failures == [[], []], failures


def _check_in_capture(rank, world):
    x, w, _ = (t.cuda() for t in _tensors(M, K, N))
    kernels.matmul_all_reduce(x, w, backend="fused")  # warm-up outside capture: the heap
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # Admitted at capture (host data on a CPU group: nothing captured, nothing synchronized).
        y = kernels.matmul_all_reduce(x, w, backend="fused")
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.allclose(y, world * (x @ w.T), atol=1e-4))


@pytest.mark.gpu
def test_admission_inside_real_capture():
    from tests.kernels.fused.cases import run_gpu_ranks

    assert run_gpu_ranks(_check_in_capture, 2, env={"COC_CHECK": "1"}) == [True, True]
