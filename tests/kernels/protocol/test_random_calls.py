"""Hundreds of calls of mixed ops where a random rank sometimes fails its validation or changes its call: every call
is right on every rank or raises the same named error on every rank, and the calls after it are right again
(kernels.protocol.admission: no rank ever pairs its call with a peer's other call, waits alone or returns a wrong
value). Every rank draws the same plan from one seed, so each knows what every rank passes and what must happen.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

import kernels
from kernels.testing import run_ranks

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce_rmsnorm", "moe_dispatch")
FAULTS = ("none", "none", "none", "bad", "changed")


def _inputs(step: int, rank: int, m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(m, k, generator=g, dtype=torch.float64), torch.randn(n, k, generator=g, dtype=torch.float64)


def _call(op: str, step: int, rank: int, world: int, shape: tuple, fault: str, kw: dict) -> Callable[[], object]:
    """This rank's call of one step: the planned one, or with ``fault`` its bad or changed form."""
    m, k, n = shape
    x, w = _inputs(step, rank, m, k, n)
    if fault == "bad":
        w = w.float()  # a dtype mismatch: refused by this rank's validation
    if op == "all_gather_matmul":
        x = x[:-1] if fault == "changed" else x  # valid here, but not the peers' call
        return lambda: kernels.all_gather_matmul(x, w, **kw)
    if op == "matmul_reduce_scatter":
        w = w[: n - 1] if fault == "changed" else w
        return lambda: kernels.matmul_reduce_scatter(x, w, **kw)
    if op == "matmul_all_reduce":
        x = x[:-1] if fault == "changed" else x
        return lambda: kernels.matmul_all_reduce(x, w, **kw)
    if op == "all_reduce_rmsnorm":
        residual, weight = _inputs(step, world, m, k, k)  # replicated
        weight = weight[0] if fault != "bad" else weight  # bad: a 2-D weight
        eps = 1e-5 if fault == "changed" else 1e-6
        return lambda: kernels.all_reduce_rmsnorm(x, residual, weight, eps, backend=kw["backend"])
    ids = torch.randint(0, 2 * world, (m, 2), generator=torch.Generator().manual_seed(step * 7 + rank))
    tw = torch.rand(m, 2, generator=torch.Generator().manual_seed(step))
    if fault == "bad":
        ids[0, 0] = 2 * world  # an expert id out of range
    experts = 2 * world + (2 if fault == "changed" else 0)
    return lambda: kernels.moe_dispatch(x.float(), ids, tw, experts, **kw)


def _expected(op: str, step: int, rank: int, world: int, shape: tuple) -> torch.Tensor | None:
    """The fp64 reference of a good step on this rank (None: checked by its own invariant below)."""
    m, k, n = shape
    parts = [_inputs(step, r, m, k, n) for r in range(world)]
    if op == "all_gather_matmul":
        return torch.cat([x for x, _ in parts]) @ parts[rank][1].T
    total = sum(x @ w.T for x, w in parts)
    if op == "matmul_reduce_scatter":
        return total.chunk(world)[rank]
    if op == "matmul_all_reduce":
        return total
    if op == "all_reduce_rmsnorm":
        residual, _ = _inputs(step, world, m, k, k)
        return sum(x for x, _ in parts) + residual
    return None


def _plan(seed: int, calls: int, world: int) -> list[tuple[str, tuple, str, int]]:
    rng = random.Random(seed)
    plan = []
    for _ in range(calls):
        op = rng.choice(OPS)
        m = world * rng.randint(1, 4)
        shape = (m, rng.choice((8, 12)), rng.choice((4, 6)))
        plan.append((op, shape, rng.choice(FAULTS), rng.randrange(world)))
    return plan


def _random_body(rank: int, world: int, backend: str, calls: int, seed: int) -> list[str]:
    kw = {"backend": backend}
    if backend == "chunked":
        kw["parallel_num"] = 2
    seen = []
    with torch.no_grad():
        for step, (op, shape, fault, odd) in enumerate(_plan(seed, calls, world)):
            mine = fault if rank == odd else "none"
            try:
                out = _call(op, step, rank, world, shape, mine, kw)()
            except (ValueError, TypeError, RuntimeError) as e:
                seen.append(f"{step} {op} {type(e).__name__}: {e}")
                continue
            want = _expected(op, step, rank, world, shape)
            assert want is not None or op == "moe_dispatch"
            if op == "all_reduce_rmsnorm":
                got = out.residual
            elif op == "moe_dispatch":
                rows, handle = out
                got = kernels.moe_combine(rows, handle, backend=backend).double()
                x = _inputs(step, rank, *shape)[0]
                tw = torch.rand(shape[0], 2, generator=torch.Generator().manual_seed(step)).double()
                want = x * tw.sum(1, keepdim=True)  # the identity experts: each token its weights' sum
            else:
                got = out
            ok = got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
            seen.append(f"{step} {op} ok" if ok else f"{step} {op} WRONG on rank {rank}")
    return seen


@pytest.mark.parametrize(("backend", "calls"), [("sequential", 240), ("chunked", 240), ("fused", 40)])
def test_random_faults_give_the_same_outcome_on_every_rank(backend: str, calls: int) -> None:
    world = 2
    plan = _plan(11, calls, world)
    results = run_ranks(_random_body, world, backend, calls, 11, timeout=600)
    assert all(r == results[0] for r in results), [
        (a, b) for a, b in zip(results[0], results[1], strict=False) if a != b
    ][:5]
    for (_, _, fault, odd), outcome in zip(plan, results[0], strict=True):
        if fault == "none":
            assert outcome.endswith(" ok"), outcome
        elif fault == "bad":
            assert f"rank {odd} refused its arguments" in outcome, outcome
        else:
            assert "ranks disagree" in outcome, outcome
    assert sum(fault != "none" for _, _, fault, _ in plan) >= calls // 4
