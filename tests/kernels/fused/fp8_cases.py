"""Rank bodies of the fused FP8 tests (module level so rank pools can unpickle them).

Inputs, the fp64 reference of the dequantized inputs and the bound come from :mod:`kernels.testing.fp8`,
with the "promoted" accumulation model, which holds for the fused kernels in every mode: they promote
the tensor-core sum into a separate fp32 accumulator every 128-deep k block in row and tensor mode too
(the scales are then applied once at the end, 2 roundings, within that model's ``ceil(k / 128) + W + 3``
term). Under the interpreter the tensor-core sums are fp32 (``u_acc = 2**-24``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.testing import presize, scramble
from kernels.testing.fp8 import assert_close, make_inputs, quantize, reference
from tests.kernels.fused.cases import run_op as run_op_of


def run_op(op: str, mode: str, x, xs, w, ws, b, out_dtype, group):
    """:func:`cases.run_op` with the FP8 format of ``mode`` (``ag_v2``: with the gathered payload and scales)."""
    from kernels.format import fp8

    return run_op_of(op, x, w, b, group, fp8(mode), x_scale=xs, w_scale=ws, out_dtype=out_dtype)


def gathered_scales(mode: str, xs) -> torch.Tensor:
    """What the gathered scale output must hold: every rank's scale rows (tensor: each rank's scalar on
    each of its rows)."""
    if mode == "tensor":
        return torch.cat([s.reshape(1, 1).expand(p.shape[0], 1) for p, s in xs])
    return torch.cat([s for _, s in xs])


def check_case(rank, world, group, op, mode, m, k, n, bias, out_dtype, seed) -> None:
    xs, ws, b = make_inputs(op, world, m, k, n, mode=mode, bias=bias, out_dtype=out_dtype, seed=seed)
    what = f"{op} {mode} W={world} m={m} k={k} n={n} bias={bias} out={out_dtype} rank={rank}"
    scramble(group, torch.device("cpu"))
    got = run_op(op, mode, *xs[rank], *ws[rank], b, out_dtype, group)
    if op == "ag_v2":
        got, x_gathered, s_gathered = got
        payload = torch.cat([p for p, _ in xs])
        assert x_gathered.dtype == payload.dtype, f"{what}: gathered dtype {x_gathered.dtype}"
        assert torch.equal(x_gathered.view(torch.uint8), payload.view(torch.uint8)), f"{what}: gathered bytes differ"
        want_s = gathered_scales(mode, xs)
        assert s_gathered.dtype == torch.float32 and torch.equal(s_gathered, want_s), f"{what}: gathered scales differ"
    assert_close(what, got, *reference(op, mode=mode, xs=xs, ws=ws, b=b, rank=rank, out_dtype=out_dtype), out_dtype)


def ops_body(rank: int, world: int, modes: tuple[str, ...], ops: tuple[str, ...], shapes) -> int:
    """Every op x mode on this group for every ``(m, k, n, bias, out_dtype)`` in ``shapes``."""
    group = dist.group.WORLD
    presize(group, torch.device("cpu"))
    done = 0
    for i, (m, k, n, bias, out_dtype) in enumerate(shapes):
        for mode in modes:
            for op in ops:
                check_case(rank, world, group, op, mode, m, k, n, bias, out_dtype, seed=100 * i + len(op) + len(mode))
                done += 1
    return done


def determinism_body(rank: int, world: int, mode: str) -> dict[str, list[torch.Tensor]]:
    """Three calls of each reducing op on the same inputs, the heap scrambled before each."""
    group = dist.group.WORLD
    presize(group, torch.device("cpu"))
    outs: dict[str, list[torch.Tensor]] = {}
    for op in ("rs", "ar_one", "ar_two"):
        xs, ws, b = make_inputs(op, world, 7, 200, 24, mode=mode, bias=True, out_dtype=torch.bfloat16, seed=5)
        outs[op] = []
        for _ in range(3):
            scramble(group, torch.device("cpu"))
            outs[op].append(run_op(op, mode, *xs[rank], *ws[rank], b, torch.bfloat16, group))
    return outs


def mismatch_body(rank: int, world: int, field: str) -> str:
    """Rank 1 differs from rank 0 in one field of a fused call; every rank must raise naming it (the admission of
    the public op: the heap's own check sees a digest only)."""
    import kernels

    group = dist.new_group(list(range(world)))
    mode, out_dtype, w_dtype = "block", torch.bfloat16, torch.float8_e4m3fn
    if rank == 1:
        if field == "quant_mode":
            mode = "row"
        elif field == "out_dtype":
            out_dtype = torch.float32
        else:
            w_dtype = torch.float8_e5m2
    g = torch.Generator().manual_seed(3)
    x, xs = quantize(torch.randn(6, 40, generator=g), mode, False)
    w, ws = quantize(torch.randn(8, 40, generator=g), mode, True, w_dtype)
    try:
        kernels.scaled_matmul_all_reduce(x, xs, w, ws, out_dtype=out_dtype, group=group, backend="fused")
    except RuntimeError as e:
        return str(e)
    raise AssertionError("a call whose ranks disagree returned")


def public_ops_body(rank: int, world: int, mode: str) -> int:
    """``kernels.fp8``'s public ops with ``backend="fused"`` reach these kernels and agree with
    ``backend="sequential"`` within the fused bound (payload and scales of the all-gather exactly)."""
    import kernels as fp8
    from kernels.fused import all_gather, all_reduce, scatter

    calls: list[str] = []

    def counted(module, name):
        inner = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.append(f"{module.__name__}.{name}")
            return inner(*args, **kwargs)

        return wrapper

    group = dist.group.WORLD
    presize(group, torch.device("cpu"))
    done = 0
    patched = [
        (all_gather, "run"),
        (scatter, "run"),
        (all_reduce, "run"),
    ]
    originals = [getattr(m, n) for m, n in patched]
    for m, n in patched:
        setattr(m, n, counted(m, n))
    try:
        for op in ("ag_v2", "rs", "ar"):
            xs, ws, b = make_inputs(op, world, 5, 136, 24, mode=mode, bias=True, out_dtype=torch.bfloat16, seed=11)
            (x, x_scale), (w, w_scale) = xs[rank], ws[rank]
            want, bound = reference(op, mode=mode, xs=xs, ws=ws, b=b, rank=rank, out_dtype=torch.bfloat16)
            results = {}
            for backend in ("sequential", "fused"):
                kwargs = dict(out_dtype=torch.bfloat16, group=group, backend=backend)
                if op == "ag_v2":
                    results[backend] = fp8.all_gather_scaled_matmul(
                        x, x_scale, w, w_scale, b, return_gathered=True, **kwargs
                    )
                elif op == "rs":
                    results[backend] = fp8.scaled_matmul_reduce_scatter(x, x_scale, w, w_scale, b, **kwargs)
                else:
                    results[backend] = fp8.scaled_matmul_all_reduce(x, x_scale, w, w_scale, b, **kwargs)
            fused, seq = results["fused"], results["sequential"]
            if op == "ag_v2":
                assert torch.equal(fused[1].view(torch.uint8), seq[1].view(torch.uint8)), f"{op} {mode}: gathered bytes"
                assert torch.equal(fused[2], seq[2]), f"{op} {mode}: gathered scales"
                fused, seq = fused[0], seq[0]
            assert_close(f"public {op} {mode} fused rank={rank}", fused, want, bound, torch.bfloat16)
            done += 1
    finally:
        for (m, n), original in zip(patched, originals, strict=True):
            setattr(m, n, original)
    assert calls == [f"{m.__name__}.{n}" for m, n in patched], f"the fused kernels ran for {calls}"
    return done
