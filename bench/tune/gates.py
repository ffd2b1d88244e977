"""The size switch of ``kernels.all_reduce_rmsnorm``, measured: the ``all_reduce_gates`` of the tuned file.

``algorithm="auto"`` runs one-shot up to ``one_shot_max_bytes`` of x, two-shot up to ``fused_max_bytes`` and the
unfused torch.distributed exchange above (``kernels/fused/tuned.py``; published defaults until measured). Here
every rank of a group of W times the three algorithms on the fused backend, for x ``[m, hidden]`` over
``tokens``; a call's time is its slowest rank's (the layer goes on when the last rank holds its rows). The gates
are the pair (``one_shot_max_bytes <= fused_max_bytes``, each 0 or a measured size) that loses least against the
fastest algorithm, summed over the sizes (:func:`choose_gates`): one noisy size cannot split the switch into
more than three ranges, which a pair of gates cannot express anyway. They are written into this device's tuned
file beside the GEMM entries (``kernels.fused.tuned.write_gates``).

Run by ``python -m bench --mode tune`` on a machine with two GPUs or more (W = 2, 4, 8 up to its GPU count; a
machine with one GPU keeps the defaults and says so). ``--allow-cpu`` runs W = 2 on CPU over gloo with the fused
kernels interpreted: it exercises the path and the file, its times say nothing about a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

ALGORITHMS = ("one_shot", "two_shot", "unfused")
# Decode sizes (1 to 512 tokens, issue 31's suite) at a Llama-70B-like hidden size; the CPU run's are tiny.
GPU_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
GPU_HIDDEN = 8192
CPU_TOKENS = (1, 4)
CPU_HIDDEN = 32


def choose_gates(timings: dict[int, dict[str, float]]) -> tuple[int, int]:
    """``(one_shot_max_bytes, fused_max_bytes)`` from ``{x bytes: {algorithm: seconds}}``: the gates among 0 and
    the measured sizes whose choices cost least, as a sum over the sizes of each choice's time over the fastest
    time there; ties go to the smaller gates (fewer bytes promised to the fused path)."""
    sizes = sorted(timings)
    if not sizes:
        raise ValueError("choose_gates: no timings")
    for size in sizes:
        missing = [a for a in ALGORITHMS if not timings[size].get(a, 0) > 0]
        if missing:
            raise ValueError(f"choose_gates: size {size} has no positive time for {missing}")
    best = {s: min(timings[s][a] for a in ALGORITHMS) for s in sizes}

    def cost(one_shot_max: int, fused_max: int) -> float:
        total = 0.0
        for s in sizes:
            algorithm = "one_shot" if s <= one_shot_max else "two_shot" if s <= fused_max else "unfused"
            total += timings[s][algorithm] / best[s]
        return total

    gates = [0, *sizes]
    return min(((a, b) for a in gates for b in gates if b >= a), key=lambda ab: (cost(*ab), ab))


def _slowest_rank_s(call: Callable[[], object], device: torch.device, reps: int) -> float:
    """The minimum over ``reps`` of the slowest rank's seconds for one ``call`` (started together)."""
    import torch.distributed as dist

    call()  # the heap, the call check and the compile, outside the timing
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        best = min(best, float(took))
    return best


def _time_rank(rank: int, world: int, tokens: tuple[int, ...], hidden: int, reps: int) -> dict[int, dict]:
    """Rank body: ``{x bytes: {algorithm: seconds}}`` for bf16 x ``[m, hidden]``, m over ``tokens``."""
    import functools

    import kernels

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(rank)
    out: dict[int, dict] = {}
    for m in tokens:
        x = torch.randn(m, hidden, generator=gen).to(device, torch.bfloat16)
        residual = torch.randn(m, hidden, generator=torch.Generator().manual_seed(7)).to(device, torch.bfloat16)
        weight = torch.ones(hidden, dtype=torch.bfloat16, device=device)
        run = functools.partial(kernels.all_reduce_rmsnorm, x, residual, weight, backend="fused")
        out[m * hidden * x.element_size()] = {
            a: _slowest_rank_s(functools.partial(run, algorithm=a), device, reps) for a in ALGORITHMS
        }
    kernels.check_errors()
    return out


def measure(worlds: list[int], *, cuda: bool, tokens: tuple[int, ...], hidden: int, reps: int) -> dict[int, dict]:
    """``{W: {x bytes: {algorithm: seconds}}}`` for each world size, one pool of ranks each."""
    from kernels.testing import run_ranks

    backend, device = ("nccl", "cuda") if cuda else ("gloo", "cpu")
    return {
        w: run_ranks(_time_rank, w, tokens, hidden, reps, backend=backend, device=device, timeout=900)[0]
        for w in worlds
    }


def worlds_here(cuda: bool) -> list[int]:
    """The world sizes this machine can measure: 2, 4, 8 up to its GPU count (none with one GPU); W = 2 on CPU."""
    if not cuda:
        return [2]
    return [w for w in (2, 4, 8) if w <= torch.cuda.device_count()]


def run(path: Path, *, cuda: bool, reps: int | None = None) -> list[dict]:
    """Measure the gates at :func:`worlds_here`, write them into the tuned file ``path`` and return one row
    per world (the gates and every timing); no row and no write where no world can be measured."""
    from kernels.fused import tuned

    worlds = worlds_here(cuda)
    if not worlds:
        print("all_reduce_rmsnorm gates: one GPU here, so the size switch keeps its defaults (needs 2 GPUs or more)")
        return []
    tokens, hidden = (GPU_TOKENS, GPU_HIDDEN) if cuda else (CPU_TOKENS, CPU_HIDDEN)
    timings = measure(worlds, cuda=cuda, tokens=tokens, hidden=hidden, reps=reps or (20 if cuda else 1))
    rows, gates = [], []
    for w, per_size in timings.items():
        one_shot_max, fused_max = choose_gates(per_size)
        gates.append(tuned.Gates(w, one_shot_max, fused_max))
        rows.append(dict(world=w, one_shot_max_bytes=one_shot_max, fused_max_bytes=fused_max, timings=per_size))
        print(f"all_reduce_rmsnorm gates at W = {w}: one-shot <= {one_shot_max} B, two-shot <= {fused_max} B")
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    tuned.write_gates(path, gates, {"gates_created": created})
    return rows
