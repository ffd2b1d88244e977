"""What the admission (:mod:`kernels.protocol.admission`) costs per call, and a whole small op call beside torch.

``python -m bench.cost.admission [--world 2] [--iters N] [--repeats R] [--json PATH]``

Tiny CPU shapes (``x [16, 32]``, ``weight [32, 32]``, fp32, ``kernels.matmul_all_reduce`` on the sequential
backend), on ``world`` gloo ranks of this machine:

* ``admission_us``: one :func:`kernels.protocol.admission.admit` of the Outcome a real call handed it (recorded
  from a ``matmul_all_reduce`` call: the call value, its operands and the digest of a signature resolved
  before, what every call after a signature's first admits): one all-gather of 4 int64 per rank and its reading;
* ``bare_all_gather_us``: a bare ``kernels.comm.all_gather`` of the same 4 int64 on the same group (the floor of
  any exchange there);
* ``call_us``: the whole public call (the signature fast path of :func:`kernels.protocol.spec.submit`, the
  admission, the sequential backend's GEMM and fixed-order all-reduce); ``call_unadmitted_us``: the same call
  under ``COC_CHECK=0`` (the documented opt-out: no admission); ``torch_us``: the same math by hand,
  ``y = x @ w.T; dist.all_reduce(y)``;
* ``admissions_per_call``: admissions counted during the timed calls over the calls made (1.0: every call admits).

and on one rank (a gloo group of one: no admission, nothing exchanged): ``w1_call_us`` and ``w1_torch_us``.

Each figure is the median over ``repeats`` rounds of the mean over ``iters`` calls, wall clock, the ranks aligned
by a barrier before each round; rank 0's figures. On a loaded machine they move with the load (the load average is
recorded beside them).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.harness import launch

M, K, N = 16, 32, 32
OP = "matmul_all_reduce"
# Every figure run() returns, in the order main() prints them.
FIGURES = (
    "admission_us",
    "bare_all_gather_us",
    "call_us",
    "call_unadmitted_us",
    "torch_us",
    "admissions_per_call",
    "w1_call_us",
    "w1_torch_us",
)


def _median_us(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """Microseconds per call: the median over ``repeats`` rounds of the mean over ``iters`` calls (wall clock,
    barrier-aligned rounds, a tenth of ``iters`` of warm-up first)."""
    for _ in range(max(2, iters // 10)):
        fn()
    rounds = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - t0) / iters)
    return statistics.median(rounds) * 1e6


def _operands(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)


def _calls(x: torch.Tensor, w: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The public call and the same math by hand (checked equal once)."""
    import kernels

    def coc() -> torch.Tensor:
        return kernels.matmul_all_reduce(x, w, backend="sequential")

    def by_hand() -> torch.Tensor:
        y = x @ w.T
        dist.all_reduce(y)
        return y

    torch.testing.assert_close(coc(), by_hand(), rtol=1e-5, atol=1e-5)
    return coc, by_hand


def _recorded_outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """The op name and Outcome that ``call`` hands the admission (:func:`kernels.protocol.spec.submit` resolves
    the signature on the first call, so the second takes the fast path with the digest known); the call runs for
    real on every rank, so every rank admits it."""
    from kernels.protocol import spec

    call()  # resolves the signature
    seen: list[tuple[str, Any]] = []
    admit = spec.admit

    def record(op: str, world: int, group: Any, outcome: Any) -> None:
        seen.append((op, outcome))
        admit(op, world, group, outcome)

    spec.admit = record
    try:
        call()
    finally:
        spec.admit = admit
    if len(seen) != 1 or seen[0][1].digest is None:
        raise RuntimeError(f"expected one admission with a known digest from a repeated call, saw {seen}")
    return seen[0]


def _measure(rank: int, world: int, device: torch.device, iters: int, repeats: int) -> dict[str, float]:
    from kernels import comm
    from kernels.protocol import admission

    x, w = _operands(rank)
    out: dict[str, float] = {}
    with torch.no_grad():
        coc, by_hand = _calls(x, w)
        if world == 1:
            return {"w1_call_us": _median_us(coc, iters, repeats), "w1_torch_us": _median_us(by_hand, iters, repeats)}
        op, outcome = _recorded_outcome(coc)
        out["admission_us"] = _median_us(lambda: admission.admit(op, world, None, outcome), iters, repeats)
        row = torch.zeros(4, dtype=torch.int64)
        table = row.new_empty(4 * world)
        out["bare_all_gather_us"] = _median_us(lambda: comm.all_gather(table, row, None), iters, repeats)
        before = admission.counts.get(op, 0)
        out["call_us"] = _median_us(coc, iters, repeats)
        made = (max(2, iters // 10) + iters * repeats) * 1.0
        out["admissions_per_call"] = (admission.counts.get(op, 0) - before) / made
        out["torch_us"] = _median_us(by_hand, iters, repeats)
        old = os.environ.get("COC_CHECK")
        os.environ["COC_CHECK"] = "0"
        try:
            out["call_unadmitted_us"] = _median_us(coc, iters, repeats)
        finally:
            if old is None:
                os.environ.pop("COC_CHECK", None)
            else:
                os.environ["COC_CHECK"] = old
    return out


def run(world: int = 2, iters: int = 500, repeats: int = 7) -> dict[str, Any]:
    """Every figure of the module docstring (:data:`FIGURES`), with the run's conditions."""
    if world < 2:
        raise ValueError(f"world={world}: the admission runs on groups of 2 ranks or more")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    figures = launch.spawn(_measure, world, "cpu", 600.0, iters, repeats)
    figures.update(launch.spawn(_measure, 1, "cpu", 600.0, iters, repeats))
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
        "world": world,
        "shape": [M, K, N],
        "iters": iters,
        "repeats": repeats,
        **{k: figures[k] for k in FIGURES},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    res = run(args.world, args.iters, args.repeats)
    print(
        f"admission cost, CPU gloo, W={res['world']}, torch {res['torch']}, {res['date']}, load average "
        f"{res['load_average'][0]:.1f}; sequential {OP} x [{M}, {K}], weight [{N}, {K}] fp32; "
        f"median of {res['repeats']} rounds of {res['iters']} calls"
    )
    print(
        f"  one admission (digest known):  {res['admission_us']:8.1f} us (a bare all-gather of the same 4 int64: "
        f"{res['bare_all_gather_us']:.1f} us)"
    )
    print(
        f"  W={res['world']} whole call:               {res['call_us']:8.1f} us (COC_CHECK=0: "
        f"{res['call_unadmitted_us']:.1f} us; by hand, x @ w.T + dist.all_reduce: {res['torch_us']:.1f} us; "
        f"{res['admissions_per_call']:.2f} admissions per call)"
    )
    print(f"  W=1 whole call:               {res['w1_call_us']:8.1f} us (by hand: {res['w1_torch_us']:.1f} us)")
    if args.json:
        from bench.harness.report import write_json

        write_json(args.json, res)


if __name__ == "__main__":
    main()
