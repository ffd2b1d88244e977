"""The decode path's layer end: modelled latencies of all-reduce + residual + RMSNorm, and measured host cost.

``python -m bench.cost.decode [--gpu H100] [--tokens 1,8,32,128,512] [--hidden 4096,8192] [--worlds 2,4,8]
[--host] [--iters N] [--repeats R] [--json PATH]``

Prints the model's latencies of each algorithm of ``kernels.all_reduce_rmsnorm`` and the choice ``auto`` makes
(:func:`bench.model.decode.model_rows`: predictions, not measurements), and the published anchors (the issue's,
not measured here). ``--host`` measures on this machine's CPU (thread clock, W = 1, the sequential
backend: no device work) the host time per call of ``all_reduce_rmsnorm`` and of ``matmul_all_reduce`` with and
without the RMSNorm epilogue, above the same torch ops written by hand: the op layer's cost (validation, call
check, backend choice, the registered operator; the baselines do the same arithmetic), which the fused backend
adds its launches to.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.cost.output import write_json
from bench.model.decode import ANCHORS, model_rows


def _time(fns: list[Callable[[], object]], *, iters: int, repeats: int) -> list[float]:
    """Thread-clock microseconds per call of each fn: the minimum over interleaved rounds of the mean."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.thread_time()
            for _ in range(iters):
                fn()
            best[i] = min(best[i], (time.thread_time() - start) / iters * 1e6)
    return best


def host_rows(*, iters: int, repeats: int) -> list[dict]:
    """Host microseconds per call at W = 1 on the sequential backend, and above the hand-written torch ops."""
    import kernels

    # One intra-op thread: a matmul of this size gains nothing from more, and OpenMP's spinning workers
    # would charge the calling thread for a loaded machine's scheduling.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m, k, n = 8, 64, 64
    x, w, r, g = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n), torch.randn(n)
    xn = torch.randn(m, n)

    def torch_norm(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The op's own arithmetic (kernels/ops/norm.py), written out: what remains above it is the op layer.
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return ((h * rstd).to(torch.float32) * g).to(torch.float32), h

    cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        (
            "all_reduce_rmsnorm",
            lambda: kernels.all_reduce_rmsnorm(xn, r, g, backend="sequential"),
            lambda: torch_norm(xn.to(torch.float32) + r.to(torch.float32)),
        ),
        (
            "matmul_all_reduce",
            lambda: kernels.matmul_all_reduce(x, w, backend="sequential"),
            lambda: F.linear(x, w),
        ),
        (
            "matmul_all_reduce + rmsnorm epilogue",
            lambda: kernels.matmul_all_reduce(x, w, residual=r, norm_weight=g, backend="sequential"),
            lambda: torch_norm(F.linear(x, w) + r),
        ),
    ]
    rows = []
    for name, op, bare in cases:
        op(), bare()  # first calls: the call check and caches
        t_op, t_bare = _time([op, bare], iters=iters, repeats=repeats)
        rows.append(dict(op=name, op_us=t_op, torch_us=t_bare, overhead_us=t_op - t_bare))
    return rows


def _table(rows: list[dict], keys: list[str]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cost.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="H100", help="GPU generation of configs/links.yaml for the model")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 32, 128, 512])
    p.add_argument("--hidden", type=lambda s: [int(v) for v in s.split(",")], default=[4096, 8192])
    p.add_argument("--worlds", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4, 8])
    p.add_argument("--host", action="store_true", help="also measure the host time per call on this CPU")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write the tables as JSON here")
    args = p.parse_args(argv)
    out: dict[str, Any] = {
        "model": model_rows(args.gpu, tokens=args.tokens, hidden=args.hidden, worlds=args.worlds),
        "gpu_model": args.gpu,
        "kind": "model predictions (configs/links.yaml), not measurements",
        "anchors": {k: {"tokens": t, "hidden": h, "world": w, "us": us} for k, (t, h, w, us) in ANCHORS.items()},
    }
    print(f"Modelled all_reduce_rmsnorm, bf16, {args.gpu} (predictions, microseconds):")
    keys = ["world", "hidden", "tokens", "bytes", "unfused", "one_shot", "two_shot", "auto"]
    print(_table(out["model"], keys))
    print("\nPublished anchors (not measured here):")
    for label, (t, h, w, us) in ANCHORS.items():
        print(f"  {label}: {us} us (W={w}{'' if t is None else f', tokens {t}'}{'' if h is None else f', hidden {h}'})")
    if args.host:
        out["host"] = host_rows(iters=args.iters, repeats=args.repeats)
        print("\nHost time per call on this CPU (thread clock, W = 1, sequential backend, microseconds):")
        print(_table(out["host"], ["op", "op_us", "torch_us", "overhead_us"]))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
