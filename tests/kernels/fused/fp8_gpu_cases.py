"""Rank bodies of the gpu-marked fused FP8 tests (module level so the rank pools can unpickle them).

Every rank is a process of its own on the GPU(s) (several share one GPU through CUDA IPC when only
one exists: a correctness check, not a timing). Inputs, the fp64 reference and the bound are
:mod:`kernels.testing.fp8`'s; the bound takes the Hopper FP8 tensor-core accumulator
(``kernels.fp8.numerics.HOPPER_FP8_ACCUMULATOR``, about 14 bits, DeepSeek-V3 3.3.2) for the 128-deep
sums, which also covers any more precise accumulation (the fp16 path of unaligned ``k``).
"""

from __future__ import annotations

import importlib
import time
import warnings

import torch
import torch.distributed as dist

from kernels.format import fp8
from kernels.fp8.numerics import HOPPER_FP8_ACCUMULATOR
from kernels.testing import fp8 as fp8_reference
from kernels.testing import heap_device, presize, scramble
from tests.kernels.fused import fp8_cases

OPS = ("ag", "ag_v2", "rs", "ar_one", "ar_two", "ar")
# The fused pattern module each public op's fused backend runs (its ``run`` is counted).
FUSED_MODULES = {"ag": "kernels.fused.all_gather", "rs": "kernels.fused.scatter", "ar": "kernels.fused.all_reduce"}
STRAGGLER_S = 0.25


def wave_shape(world: int) -> tuple[int, int, int]:
    """(m, k, n): several 128-row tiles and all-gather chunks per shard (m odd), ``k`` 16-byte aligned
    (FP8 wgmma) with a partial last scale block, ``n`` with a partial last weight block, and for
    every op at W >= 2 more output tiles than the GPU has SMs (more than one wave)."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    m = 517
    row_tiles = -(-min(2 * m + 1, world * m) // 128)
    n_tiles = -(-(sms + 1) // row_tiles) + 1
    return m, 400, n_tiles * 128 - 24


def shapes(world: int) -> list[tuple[int, int, int, bool, torch.dtype]]:
    """(m, k, n, bias, out_dtype): the wave shape in bf16 with bias, and one odd tile whose ``k`` is
    not 16-byte aligned (the fp16 k-step path) in fp32 without."""
    return [wave_shape(world) + (True, torch.bfloat16), (13, 200, 20, False, torch.float32)]


def _to(dev: torch.device, *tensors):
    return tuple(None if t is None else t.to(dev) for t in tensors)


def check_case(rank: int, world: int, group, dev, op: str, mode: str, shape, seed: int) -> None:
    m, k, n, bias, out_dtype = shape
    xs, ws, b = fp8_reference.make_inputs(op, world, m, k, n, mode=mode, bias=bias, out_dtype=out_dtype, seed=seed)
    what = f"{op} {mode} W={world} m={m} k={k} n={n} bias={bias} out={out_dtype} rank={rank} (GPU)"
    x, x_scale, w, w_scale, bias_t = _to(dev, *xs[rank], *ws[rank], b)
    scramble(group, dev)
    if rank == seed % world:
        # A straggler: without its waits a peer would read this rank's stale (scrambled) heap.
        time.sleep(STRAGGLER_S)
    got = fp8_cases.run_op(op, mode, x, x_scale, w, w_scale, bias_t, out_dtype, group)
    if op == "ag_v2":
        got, x_gathered, s_gathered = got
        payload = torch.cat([p for p, _ in xs])
        assert torch.equal(x_gathered.cpu().view(torch.uint8), payload.view(torch.uint8)), f"{what}: gathered bytes"
        want_s = fp8_cases.gathered_scales(mode, xs)
        assert torch.equal(s_gathered.cpu(), want_s), f"{what}: gathered scales differ"
    want, bound = fp8_reference.reference(
        op, xs, ws, b, rank, mode=mode, out_dtype=out_dtype, u_acc=HOPPER_FP8_ACCUMULATOR
    )
    fp8_reference.assert_close(what, got.cpu(), want, bound, out_dtype)


def public_case(rank: int, world: int, group, dev, op: str, mode: str, seed: int) -> None:
    """The public FP8 op with ``backend="fused"``: it reaches the pattern module's ``run`` with the FP8 format
    (no fallback), within the bound."""
    import kernels

    m, k, n = 37, 272, 136
    xs, ws, b = fp8_reference.make_inputs(op, world, m, k, n, mode=mode, bias=True, out_dtype=torch.bfloat16, seed=seed)
    x, x_scale, w, w_scale, bias_t = _to(dev, *xs[rank], *ws[rank], b)
    fn = {
        "ag": kernels.all_gather_scaled_matmul,
        "rs": kernels.scaled_matmul_reduce_scatter,
        "ar": kernels.scaled_matmul_all_reduce,
    }[op]
    kernel = importlib.import_module(FUSED_MODULES[op])
    inner, calls = kernel.run, []

    def counted(call, ops, *args):
        calls.append(call.fmt)
        return inner(call, ops, *args)

    scramble(group, dev)
    kernel.run = counted
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = fn(x, x_scale, w, w_scale, bias_t, out_dtype=torch.bfloat16, group=group, backend="fused")
    finally:
        kernel.run = inner
    # The dispatcher sends a fused call elsewhere with a warning (once per process): on a GPU a failure.
    assert calls == [fp8(mode)], (
        f"public {op} {mode}: the fused kernels ran {calls}: {[str(c.message) for c in caught]}"
    )
    want, bound = fp8_reference.reference(
        op, xs, ws, b, rank, mode=mode, out_dtype=torch.bfloat16, u_acc=HOPPER_FP8_ACCUMULATOR
    )
    fp8_reference.assert_close(
        f"public {op} {mode} W={world} rank={rank} (GPU)", got.cpu(), want, bound, torch.bfloat16
    )


def gpu_ops_body(rank: int, world: int, mode: str, device: str = "cuda", case_shapes=None) -> int:
    """Every fused FP8 op in ``mode`` on the CUDA-IPC heap, scrambled before every call, with a
    straggler: the kernels directly at both :func:`shapes`, then each public op once. (``device``
    and ``case_shapes`` let the body itself be checked on CPU under the interpreter.)"""
    dev = heap_device(device)
    group = dist.group.WORLD
    presize(group, dev, 64 << 20)
    checked = 0
    for i, shape in enumerate(case_shapes or shapes(world)):
        for op in OPS:
            check_case(rank, world, group, dev, op, mode, shape, seed=10 * i + checked)
            checked += 1
    for op in ("ag", "rs", "ar"):
        public_case(rank, world, group, dev, op, mode, seed=100 + checked)
        checked += 1
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return checked
