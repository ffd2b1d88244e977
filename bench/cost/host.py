"""Host time per call of each backend of the kernels ops, above a bare ``F.linear`` + collective.

``python -m bench.cost.host [--worlds 1 2] [--iters N] [--repeats R] [--no-compile] [--clock wall|thread]
[--json PATH]``

Tiny CPU shapes (``x [16, 32]``, ``weight [32, 32]``, fp32), so the matmul and the collective
cost little and the figure is what the op adds on the host: validation, backend choice, the
operator call, the chunked path's pieces and their async collectives. The reference is the same
work written by hand (``F.linear`` then ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` /
``all_reduce``; just ``F.linear`` at world 1). Each backend is timed eagerly and under
``torch.compile(fullgraph=True)``; a variant that does not compile is reported with its error.
The fused backend runs under the Triton interpreter on CPU, so its figures are interpreter time,
not what a GPU launch costs. Each figure is the minimum over ``repeats`` interleaved rounds of
the mean over ``iters`` calls; world 2 runs on two gloo ranks of this machine (noisy: the
collective itself costs tens of microseconds). ``--clock thread`` measures the calling thread's CPU
time instead of wall time: on a loaded machine it leaves out the time other processes take the core,
which is what a before/after comparison of a code change needs (gloo's own threads are not counted,
so use it at world 1).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.harness import launch

M, K, N = 16, 32, 32
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
VARIANTS: list[tuple[str, str | None, int | None]] = [
    ("sequential", "sequential", None),
    ("chunked 2", "chunked", 2),
    ("chunked 4", "chunked", 4),
    ("chunked 8", "chunked", 8),
    ("fused", "fused", None),
]
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def _reference(op: str, x: torch.Tensor, w: torch.Tensor, world: int) -> Callable[[], Any]:
    if world == 1:
        return lambda: F.linear(x, w)
    if op == "all_gather_matmul":

        def ag() -> torch.Tensor:
            full = x.new_empty((world * x.shape[0], x.shape[1]))
            dist.all_gather_into_tensor(full, x)
            return F.linear(full, w)

        return ag
    if op == "matmul_reduce_scatter":

        def rs() -> torch.Tensor:
            partial = F.linear(x, w)
            out = partial.new_empty((partial.shape[0] // world, partial.shape[1]))
            dist.reduce_scatter_tensor(out, partial)
            return out

        return rs

    def ar() -> torch.Tensor:
        partial = F.linear(x, w)
        dist.all_reduce(partial)
        return partial

    return ar


def _time(
    fns: list[Callable[[], Any]], iters: int, repeats: int, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """Mean seconds per call of each fn, the minimum over interleaved rounds (as timeit advises)."""
    for fn in fns:
        for _ in range(max(2, iters // 10)):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if world_size() > 1:
                dist.barrier()
            t0 = clock()
            for _ in range(iters):
                fn()
            samples[i].append((clock() - t0) / iters)
    return [min(s) for s in samples]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@dataclass(frozen=True)
class Settings:
    """What every rank of one run times: calls per round, rounds, whether compiled variants run too, the clock."""

    iters: int
    repeats: int
    compile_too: bool
    clock_name: str


def _bench(rank: int, world: int, device: torch.device, settings: Settings) -> list[dict]:
    import kernels

    iters, repeats = settings.iters, settings.repeats

    functions = {
        "all_gather_matmul": kernels.all_gather_matmul,
        "matmul_reduce_scatter": kernels.matmul_reduce_scatter,
        "matmul_all_reduce": kernels.matmul_all_reduce,
    }
    torch.manual_seed(rank)
    x, w = torch.randn(M, K), torch.randn(N, K)
    rows = []
    with torch.no_grad():
        for op in OPS:
            fn_op = functions[op]
            ref = _reference(op, x, w, world)
            for label, backend, num in VARIANTS:
                fused = backend == "fused"
                n_iter, n_rep = (3, 2) if fused else (iters, repeats)
                eager = lambda f=fn_op, b=backend, p=num: f(x, w, backend=b, parallel_num=p)  # noqa: E731
                fns, modes = [ref, eager], ["eager"]
                errors = {}
                if settings.compile_too:
                    torch._dynamo.reset()
                    compiled = torch.compile(eager, fullgraph=True)
                    try:
                        compiled()
                        fns.append(compiled)
                        modes.append("compiled")
                    except Exception as e:  # reported, not hidden: a backend that cannot compile
                        errors["compiled"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                    if world > 1:
                        # A rank whose compile raised skipped its collectives: realign the ranks.
                        ok = torch.tensor([int("compiled" in modes)])
                        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                        if not ok.item() and "compiled" in modes:
                            fns.pop()
                            modes.pop()
                            errors["compiled"] = "a peer rank failed to compile"
                clock = CLOCKS[settings.clock_name]
                times = _time(fns, n_iter, n_rep, clock)
                t_ref = _time([ref], iters, repeats, clock)[0] if fused else times[0]
                for mode, t in zip(modes, times[1:], strict=False):
                    rows.append(
                        {
                            "world": world,
                            "op": op,
                            "backend": label,
                            "mode": mode,
                            "us": t * 1e6,
                            "ref_us": t_ref * 1e6,
                            "added_us": (t - t_ref) * 1e6,
                        }
                    )
                for mode, err in errors.items():
                    rows.append({"world": world, "op": op, "backend": label, "mode": mode, "error": err})
    return rows


def run(worlds: list[int], iters: int = 300, repeats: int = 7, compile_too: bool = True, clock: str = "wall") -> dict:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    rows: list[dict] = []
    for world in worlds:
        rows += launch.spawn(_bench, world, "cpu", 1800.0, Settings(iters, repeats, compile_too, clock))
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
        "shape": [M, K, N],
        "iters": iters,
        "repeats": repeats,
        "clock": clock,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or the calling thread's CPU time (world 1 before/after comparisons)",
    )
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    args = ap.parse_args()
    res = run(args.worlds, args.iters, args.repeats, not args.no_compile, args.clock)
    print(
        f"host time per call ({res['clock']} clock), CPU, torch {res['torch']}, {res['date']}, load average "
        f"{res['load_average'][0]:.1f}; x [{M}, {K}], weight [{N}, {K}] fp32 (fused: interpreter time)"
    )
    print(f"{'W':>2s} {'op':22s} {'backend':11s} {'mode':9s} {'us/call':>9s} {'reference':>10s} {'added':>9s}")
    for r in res["rows"]:
        head = f"{r['world']:2d} {r['op']:22s} {r['backend']:11s} {r['mode']:9s}"
        if "error" in r:
            print(f"{head} {r['error']}")
        else:
            print(f"{head} {r['us']:9.1f} {r['ref_us']:10.1f} {r['added_us']:9.1f}")
    if args.json:
        from bench.harness.report import write_json

        write_json(args.json, res)


if __name__ == "__main__":
    main()
