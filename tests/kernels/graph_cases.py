"""CUDA-graph capture of the scripted backends' FP8 and int8 ops (GPU only): the body the per-op tests run.

Each FP8 scaling mode and int8 weight layout of a pattern, on the sequential or chunked backend: a warm-up on a
side stream (torch's capture recipe: the call check's first signature and the split choice happen there), one
call captured, then replays on new activations (FP8: new payloads and scales copied into the captured ones), each
bitwise the eager call on the same inputs (the same kernels in the same order).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.testing import run_ranks
from tests.kernels import op_cases

FORMATS = ("fp8:tensor", "fp8:row", "fp8:block", "int8:per_tensor", "int8:per_channel", "int8:per_group")
M_LOCAL, K, N = 8, 256, 256  # k: two FP8 128-blocks
REPLAYS = 5


def _activation(pattern: str, fmt: str, world: int, seed: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """x's arguments (FP8: payload and scale) for this rank: ``[m_local, k]`` for the all-gather, ``[W * m_local,
    k / W]`` for the reducing ops."""
    rows, k = (M_LOCAL, K) if pattern == "all_gather" else (world * M_LOCAL, K // world)
    args, _ = op_cases._x(fmt, op_cases._operand(fmt, seed, rows, k), torch.bfloat16)
    return tuple(a.to(device) for a in args)


def scripted_capture(rank: int, world: int, pattern: str, backend: str) -> list[str]:
    """Failures as text (empty: every format's replays equal eager)."""
    device = torch.device("cuda", torch.cuda.current_device())
    kw: dict[str, Any] = {"backend": backend}
    if backend == "chunked":
        kw["parallel_num"] = 2
    failures = []
    for fmt in FORMATS:
        k = K if pattern == "all_gather" else K // world
        w = op_cases._operand(fmt, 1000 + rank, N, k)
        w_args, _ = op_cases._w(fmt, w, torch.bfloat16, offset=False, seed=rank)
        w_args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in w_args)
        static = _activation(pattern, fmt, world, rank, device)

        def call(fmt: str = fmt, static: tuple = static, w_args: tuple = w_args) -> torch.Tensor:
            return op_cases._call(pattern, fmt, static, [w_args], None, torch.bfloat16, **kw)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        for i in range(REPLAYS):
            fresh = _activation(pattern, fmt, world, 100 * (i + 1) + rank, device)
            with torch.no_grad():
                for dst, src in zip(static, fresh, strict=True):
                    dst.copy_(src)
            graph.replay()
            eager = call()
            if not torch.equal(captured, eager):
                diff = (captured.float() - eager.float()).abs().max().item()
                failures.append(f"{pattern} {fmt} {backend} W={world} replay {i}: max |graph - eager| = {diff}")
        torch.cuda.synchronize()
    return failures


def check_scripted_capture(pattern: str, backend: str) -> None:
    """:func:`scripted_capture` at W = 2 over NCCL with two GPUs, else W = 1 (the GEMM alone): no failure."""
    world = min(torch.cuda.device_count(), 2)
    per_rank = run_ranks(scripted_capture, world, pattern, backend, backend="nccl", timeout=600)
    assert per_rank == [[]] * world, per_rank
