"""The host time an eager call adds over the same torch arithmetic (issue 37's lean eager path).

``python -m bench.cost.eager [--iters N] [--repeats R] [--json PATH]`` (beside ``bench.cost.host``, ``.decode``,
``.admission``).

One process, no process group (W = 1), the sequential backend, ``x [4, 64]``, ``weight [64, 64]`` fp32 (the norm:
``x``, ``residual [4, 64]``, ``weight [64]``), torch on one thread, under ``torch.no_grad()``. For each of
``matmul_all_reduce``, ``all_gather_matmul``, ``matmul_reduce_scatter`` and ``all_reduce_rmsnorm``: the op's call
beside the torch code that does the arithmetic its sequential backend does at W = 1 (``F.linear(x, w)``; the norm's
fp32 ``h = x + residual``, ``h * rsqrt(mean(h^2) + eps) * weight``), after a warm-up that resolves the call's
signature (the steady state: every call after a signature's first). Clock: the calling thread's CPU time
(``time.thread_time``), which leaves out the time other processes hold the core; each figure is the minimum over
``repeats`` interleaved rounds (op, torch, op, torch, ...) of the mean over ``iters`` calls. ``over_us`` = op -
torch: what the protocol (signature, admission skipped at W = 1, backend, the direct call of the implementation)
adds to the arithmetic.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.cost.output import write_json

M, K, N = 4, 64, 64
EPS = 1e-6
OPS = ("matmul_all_reduce", "all_gather_matmul", "matmul_reduce_scatter", "all_reduce_rmsnorm")


def cases() -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """op -> (its call, the torch code of the same arithmetic), on the module's fixed inputs."""
    import kernels

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    residual, norm_weight = torch.randn(M, K, generator=g), torch.rand(K, generator=g) + 0.5

    def torch_norm() -> tuple[torch.Tensor, torch.Tensor]:
        h = x + residual
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return h * rstd * norm_weight, h

    def linear() -> torch.Tensor:
        return F.linear(x, w)

    return {
        "matmul_all_reduce": (lambda: kernels.matmul_all_reduce(x, w, backend="sequential"), linear),
        "all_gather_matmul": (lambda: kernels.all_gather_matmul(x, w, backend="sequential"), linear),
        "matmul_reduce_scatter": (lambda: kernels.matmul_reduce_scatter(x, w, backend="sequential"), linear),
        "all_reduce_rmsnorm": (
            lambda: kernels.all_reduce_rmsnorm(x, residual, norm_weight, EPS, backend="sequential"),
            torch_norm,
        ),
    }


def _mean_us(fn: Callable[[], Any], iters: int) -> float:
    t0 = time.thread_time()
    for _ in range(iters):
        fn()
    return (time.thread_time() - t0) / iters * 1e6


def run(iters: int = 200, repeats: int = 15) -> dict[str, Any]:
    """``{"rows": [{op, op_us, torch_us, over_us}], ...}`` (module docstring)."""
    if iters < 1 or repeats < 1:
        raise ValueError(f"iters and repeats must be at least 1, got iters={iters}, repeats={repeats}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        with torch.no_grad():
            for op, (call, reference) in cases().items():
                for _ in range(max(2, iters // 10)):
                    call()
                    reference()
                op_us, torch_us = float("inf"), float("inf")
                for _ in range(repeats):
                    op_us = min(op_us, _mean_us(call, iters))
                    torch_us = min(torch_us, _mean_us(reference, iters))
                rows.append(dict(op=op, op_us=op_us, torch_us=torch_us, over_us=op_us - torch_us))
    finally:
        torch.set_num_threads(threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return dict(
        rows=rows,
        shape=[M, K, N],
        iters=iters,
        repeats=repeats,
        clock="thread",
        load_average=load,
        torch=torch.__version__,
        date=datetime.date.today().isoformat(),
    )


def report(result: dict[str, Any]) -> str:
    lines = [f"{'op':24s} {'op us':>8s} {'torch us':>9s} {'over us':>8s}"]
    for row in result["rows"]:
        lines.append(f"{row['op']:24s} {row['op_us']:8.1f} {row['torch_us']:9.1f} {row['over_us']:8.1f}")
    lines.append(
        f"W = 1, sequential, x {result['shape'][:2]}, thread CPU time, min of {result['repeats']} rounds of "
        f"{result['iters']} calls; load average {result['load_average']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    result = run(args.iters, args.repeats)
    print(report(result))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
