"""What the call check (``kernels.callcheck``) costs: a checked call's exchange and the steady state's lookup.

``python -m bench.cost.callcheck [--world 2] [--iters N] [--repeats R] [--json PATH]``

At ``world`` gloo ranks of this machine, tiny CPU shapes (``x [16, 32]``, ``weight [32, 32]``, fp32,
sequential ``matmul_all_reduce``):

* ``exchange``: one check, the all-gather of every rank's row (``kernels.callcheck.ROW_WORDS`` int64) and
  its comparison, beside a bare ``all_gather_into_tensor`` of the same size (wall clock, barrier-aligned);
* ``steady``: the host time :func:`kernels.callcheck.admit` takes for a call whose signature passed a check
  already, over the argument validation and descriptor it runs anyway (the config read, the request's
  fields, the lookup), on the calling thread's CPU clock (gloo's threads and the other rank do not count).

Each figure is the minimum over ``repeats`` rounds of the mean over ``iters`` calls.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.harness import launch

M, K, N = 16, 32, 32


def _best(fn: Callable[[], Any], iters: int, repeats: int, clock: Callable[[], float]) -> float:
    """Microseconds per call: the minimum over rounds of the mean over ``iters`` calls."""
    for _ in range(max(2, iters // 10)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = clock()
        for _ in range(iters):
            fn()
        best = min(best, (clock() - t0) / iters)
    return best * 1e6


def _measure(rank: int, world: int, device: torch.device, iters: int, repeats: int) -> dict[str, float]:
    import kernels
    from kernels import agree, callcheck, comm

    x, w = torch.randn(M, K), torch.randn(N, K)
    op = "matmul_all_reduce"

    def validate() -> agree.Descriptor:
        kernels.checks.check_matmul_operands(x, w, None)
        return agree.describe_call(op, M, K, N, x.dtype, bias=False, flag=False, backend="sequential")

    descriptor = agree.resolve_request(validate(), kernels.get_config())
    row = torch.zeros((1, callcheck.ROW_WORDS), dtype=torch.int64)
    table = row.new_empty((world, callcheck.ROW_WORDS))
    thread = time.thread_time
    out: dict[str, float] = {}
    with torch.no_grad():
        out["exchange_us"] = _best(
            lambda: callcheck.exchange(op, None, world, x.device, descriptor=descriptor),
            iters,
            repeats,
            time.perf_counter,
        )
        out["bare_all_gather_us"] = _best(lambda: comm.all_gather(table, row, None), iters, repeats, time.perf_counter)
        callcheck.reset()
        callcheck.admit(op, None, world, x.device, validate)  # checked once: the signature is seen from now on
        out["admit_steady_us"] = _best(
            lambda: callcheck.admit(op, None, world, x.device, validate), iters, repeats, thread
        )
        out["validate_us"] = _best(validate, iters, repeats, thread)
    return out


def run(world: int = 2, iters: int = 500, repeats: int = 7) -> dict[str, Any]:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    figures = launch.spawn(_measure, world, "cpu", 600.0, iters, repeats)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
        "world": world,
        "shape": [M, K, N],
        "iters": iters,
        "repeats": repeats,
        **figures,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    args = ap.parse_args()
    res = run(args.world, args.iters, args.repeats)
    print(
        f"call check cost, CPU gloo, W={res['world']}, torch {res['torch']}, {res['date']}, load average "
        f"{res['load_average'][0]:.1f}; sequential matmul_all_reduce x [{M}, {K}], weight [{N}, {K}] fp32"
    )
    print(
        f"  a checked call's exchange:          {res['exchange_us']:8.1f} us (wall; a bare all-gather of the same "
        f"row: {res['bare_all_gather_us']:.1f} us)"
    )
    steady = res["admit_steady_us"] - res["validate_us"]
    print(
        f"  steady state, signature seen:       {steady:8.2f} us of host time over the validation "
        f"({res['validate_us']:.1f} us; thread clock)"
    )
    if args.json:
        from bench.harness.report import write_json

        write_json(args.json, res)


if __name__ == "__main__":
    main()
