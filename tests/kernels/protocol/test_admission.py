"""Ranks never out of step (kernels.protocol.admission): every call is admitted collectively, so a rank that fails
its own validation, or makes another call, at any call (not only a signature's first) gets the same named error on
every rank, and the next good call is right on every rank; no rank pairs its next call with a peer's previous one,
waits alone, or returns a wrong value. W = 2 and 3, sequential, chunked (2 pieces) and fused (interpreted).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import kernels
from kernels.testing import outcomes, run_ranks

BACKENDS = ["sequential", "chunked", "fused"]


def _tensors(rank: int, m: int = 8, n: int = 16, k: int = 12) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 + rank)
    shared = torch.Generator().manual_seed(7)
    x = torch.randn(m, n, generator=g)
    residual = torch.randn(m, n, generator=shared)
    weight = torch.randn(n, generator=shared)
    w = torch.randn(k, n, generator=g)
    return x, residual, weight, w


def _norm_expected(world: int, residual: torch.Tensor, m: int = 8, n: int = 16) -> torch.Tensor:
    """``residual + sum of every rank's x`` (fp32, rank order), what the residual output holds."""
    h = torch.zeros(m, n)
    for r in range(world):
        h = h + _tensors(r, m, n)[0]
    return h + residual


def _ids(world: int, step: int) -> torch.Tensor:
    """Every rank's expert ids of one MoE step, in rank order (rank r's are ``_ids(...)[8 r: 8 (r + 1)]``)."""
    return torch.cat(
        [torch.randint(0, 4, (8, 2), generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
    )


def _raise_alone_then_recover(rank: int, world: int, backend: str) -> list[str]:
    """Scenario 1: call A good; at call B the last rank alone passes a bad argument (and catches its error); call C
    on every rank with new data: C must be right on every rank (no rank pairs C with a peer's B). Once with the
    decode norm's residual shape, once with an out-of-range expert id in a MoE call (routing changes every step)."""
    x, residual, weight, _ = _tensors(rank)
    last = rank == world - 1
    seen = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # all_reduce_rmsnorm has no chunked backend: a chunked request warns
        a = kernels.all_reduce_rmsnorm(x, residual, weight, backend=backend).residual
        seen.append(str(torch.allclose(a, _norm_expected(world, residual), atol=1e-5)))
        bad = residual[:4] if last else residual
        seen += outcomes([lambda: kernels.all_reduce_rmsnorm(x, bad, weight, backend=backend)])
        c = kernels.all_reduce_rmsnorm(2 * x, residual, weight, backend=backend).residual
        h = _norm_expected(world, torch.zeros_like(residual)) * 2 + residual
        seen.append(str(torch.allclose(c, h, atol=1e-5)))
    experts = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(3))
    kw = {"backend": backend, "parallel_num": 2} if backend == "chunked" else {"backend": backend}
    xs = torch.cat([_tensors(r)[0] for r in range(world)])
    with torch.no_grad():
        for step in range(3):
            every = _ids(world, step)
            ids = every[8 * rank : 8 * (rank + 1)].clone()
            if step == 1 and last:
                ids[3, 1] = 4  # out of range, on this rank alone
            try:
                y, routing = kernels.all_gather_grouped_matmul(x, ids, experts, **kw)
            except ValueError as e:
                seen.append(f"ValueError: {e}")
                continue
            chosen = every[routing.token_index, routing.slot]
            ref = torch.stack([xs[t] @ experts[e].T for t, e in zip(routing.token_index, chosen, strict=True)])
            seen.append(str(torch.allclose(y, ref, atol=1e-4)))
    return seen


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_raises_alone_does_not_shift_later_calls(world: int, backend: str) -> None:
    results = run_ranks(_raise_alone_then_recover, world, backend)
    assert all(r == results[0] for r in results), results
    first, b, c, moe_a, moe_b, moe_c = results[0]
    assert first == "True" and c == "True" and moe_a == "True" and moe_c == "True", results[0]
    assert b.startswith("ValueError: all_reduce_rmsnorm: rank "), b
    assert f"rank {world - 1} refused its arguments" in b and "residual must be [8, 16]" in b, b
    assert "every rank raised this error" in b and "the group stays usable" in b, b
    assert moe_b.startswith(f"ValueError: all_gather_grouped_matmul: rank {world - 1} refused its arguments"), moe_b
    assert "topk_ids[3, 1]=4 is out of range" in moe_b, moe_b


def _change_later(rank: int, world: int, backend: str) -> list[str]:
    """Scenario 2: both calls of all_gather_matmul good, then the last rank passes fewer rows; then a good call."""
    kw = {"backend": backend, "parallel_num": 2} if backend == "chunked" else {"backend": backend}
    x, _, _, w = _tensors(rank)
    seen = []
    with torch.no_grad():
        kernels.all_gather_matmul(x, w, **kw)
        kernels.all_gather_matmul(x, w, **kw)
        rows = x[:6] if rank == world - 1 else x
        seen += outcomes([lambda: kernels.all_gather_matmul(rows, w, **kw)])
        y = kernels.all_gather_matmul(x, w, **kw)
        xs = torch.cat([_tensors(r)[0] for r in range(world)])
        seen.append(str(torch.allclose(y, xs @ w.T, atol=1e-4)))
    return seen


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_changes_its_call_later_is_named_on_every_rank(world: int, backend: str) -> None:
    results = run_ranks(_change_later, world, backend)
    assert all(r == results[0] for r in results), results
    error, after = results[0]
    assert after == "True"
    assert error.startswith("RuntimeError: all_gather_matmul: ranks disagree: rank 0 has x.shape=(8, 16)"), error
    assert f"rank {world - 1} has x.shape=(6, 16)" in error and "the group stays usable" in error, error
    assert "data" not in error.split("ranks disagree")[0] and "rebuild" not in error and "build" not in error


def _preconditions(rank: int, world: int, backend: str) -> list[str]:
    """eps, quant and the algorithm are part of the call: differing ones are named on every rank."""
    x, residual, weight, _ = _tensors(rank)
    kw = {"backend": backend}
    with torch.no_grad():
        return outcomes(
            [
                lambda: kernels.all_reduce_rmsnorm(x, residual, weight, 1e-6 if rank == 0 else 1e-5, **kw),
                lambda: kernels.all_reduce_rmsnorm(x, residual, weight, quant="row" if rank else None, **kw),
                lambda: kernels.all_reduce_rmsnorm(
                    x, residual, weight, algorithm="two_shot" if rank else "one_shot", **kw
                ),
                lambda: kernels.all_reduce_rmsnorm(x, residual, weight, **kw),
            ]
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_differing_eps_quant_and_algorithm_are_named_errors(backend: str) -> None:
    results = run_ranks(_preconditions, 2, backend)
    assert results[0] == results[1], results
    eps, quant, algorithm, good = results[0]
    assert "ranks disagree: rank 0 has eps=1e-06, rank 1 has eps=1e-05" in eps, eps
    assert "ranks disagree: rank 0 has quant=None, rank 1 has quant=row" in quant, quant
    assert "ranks disagree: rank 0 has algorithm=one_shot, rank 1 has algorithm=two_shot" in algorithm, algorithm
    assert good == "no error"


def _per_rank_residual(rank: int, world: int, backend: str) -> list[bool]:
    """A residual that differs between ranks: ``residual_r + all_reduce(x)`` on rank r, whichever algorithm (the
    fused size switch) and backend runs."""
    x, _, weight, _ = _tensors(rank)
    residual = torch.full((8, 16), float(rank))
    algorithms = ["one_shot", "two_shot", "unfused"] if backend == "fused" else ["auto"]
    expected = _norm_expected(world, residual)
    got = []
    with torch.no_grad():
        for algorithm in algorithms:
            out = kernels.all_reduce_rmsnorm(x, residual, weight, algorithm=algorithm, backend=backend)
            got.append(bool(torch.allclose(out.residual, expected, atol=1e-5)))
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_residual_that_differs_between_ranks_gives_the_local_sum_on_every_algorithm(backend: str) -> None:
    for got in run_ranks(_per_rank_residual, 2, backend):
        assert all(got), got


def _fused_bad_input_after_heap(rank: int, world: int) -> list[str]:
    """Scenario 4: once the heap exists, one rank's bad input at a fused op's first call raises on every rank at
    once (no timeout on the peers); the next call is right."""
    x, _, _, w = _tensors(rank)
    bad = torch.randn(12, 5) if rank == 0 else w
    with torch.no_grad():
        kernels.all_gather_matmul(x, w, backend="fused")  # the group's heap exists from here
        seen = outcomes([lambda: kernels.matmul_all_reduce(x, bad, backend="fused")])
        y = kernels.all_gather_matmul(x, w, backend="fused")
    xs = torch.cat([_tensors(r)[0] for r in range(world)])
    return seen + [str(torch.allclose(y, xs @ w.T, atol=1e-4))]


def test_fused_bad_input_on_one_rank_raises_on_every_rank_without_a_timeout() -> None:
    results = run_ranks(_fused_bad_input_after_heap, 2, env={"COC_TIMEOUT": "600"}, timeout=300)
    assert results[0] == results[1], results
    error, after = results[0]
    assert error.startswith("ValueError: matmul_all_reduce: rank 0 refused its arguments: k mismatch"), error
    assert after == "True"


def _heap_freed_on_one_rank(rank: int, world: int) -> list[str]:
    """Scenario 5: rank 1 frees its heap of the group (``destroy_heap`` is local) and rank 0 keeps its own; the next
    fused call warns on every rank, every rank builds a new heap at once, and the call and the next are right
    (without the admission's size column rank 1 would create a heap, a collective, while rank 0 waits in the
    call's check kernel)."""
    import torch.distributed as dist

    from kernels.heap import destroy_heap, peek_heap

    group = dist.new_group(list(range(world)))
    x, _, _, w = _tensors(rank)
    xs = torch.cat([_tensors(r)[0] for r in range(world)])
    with torch.no_grad():
        kernels.all_gather_matmul(x, w, backend="fused", group=group)
        old = peek_heap(group, x.device)
        dist.barrier(group)
        if rank == 1:
            destroy_heap(group)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ys = [kernels.all_gather_matmul(x, w, backend="fused", group=group) for _ in range(2)]
    new = peek_heap(group, x.device)
    dist.barrier(group)
    destroy_heap(group)
    return [str(w.message) for w in caught if "heaps of this group differ" in str(w.message)] + [
        str(all(torch.allclose(y, xs @ w.T, atol=1e-4) for y in ys)),
        str(new is not None and new is not old),
    ]


def test_a_heap_freed_on_one_rank_is_rebuilt_on_every_rank_at_the_next_call() -> None:
    results = run_ranks(_heap_freed_on_one_rank, 2, env={"COC_TIMEOUT": "20"}, timeout=120)
    for rank, (message, right, rebuilt) in enumerate(results):
        assert "rank 0: " in message and "rank 1: none" in message, (rank, message)
        assert (right, rebuilt) == ("True", "True"), (rank, results)


def _late_peer_then_refused(rank: int, world: int) -> list[str]:
    """Scenario 6: rank 1 comes to a fused call later than COC_TIMEOUT. Rank 0 raises there, naming the late peer,
    and refuses its next call at once. Rank 1 then runs that fused call alone (admitted by rank 0's row, which was
    sent before rank 0 gave up; its kernels time out and record the failure) and its next call, on a scripted
    backend, raises the refusal at once: it learns of it from rank 0's row, instead of waiting for a rank that will
    never join the exchange until the group's own timeout (30 minutes)."""
    import time

    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    x, _, _, w = _tensors(rank)
    seen = []
    with torch.no_grad():
        kernels.all_gather_matmul(x, w, backend="fused", group=group)
        dist.barrier(group)
        if rank == 1:
            time.sleep(4)  # past COC_TIMEOUT=2 at rank 0's admission
        seen += outcomes([lambda: kernels.all_gather_matmul(x, w, backend="fused", group=group)])
        seen += outcomes([lambda: kernels.all_gather_matmul(x, w, backend="sequential", group=group)])
    return seen


def test_a_refused_group_is_refused_on_every_rank_without_a_wait() -> None:
    # Before the refusal was posted, rank 1's second call waited for rank 0 until the group's own timeout (30
    # minutes): this call's deadline would end it as a hang.
    (late0, refused0), (ran1, refused1) = run_ranks(_late_peer_then_refused, 2, env={"COC_TIMEOUT": "2"}, timeout=120)
    assert "rank 0 waited more than COC_TIMEOUT=2 s at the admission" in late0, late0
    assert "an earlier call on this process group failed at its admission" in refused0, refused0
    assert not ran1.startswith("ValueError"), ran1  # rank 1's call N ran (alone): whatever its kernels recorded
    assert "rank 0 refuses every call on this process group" in refused1, refused1


def _count_admissions(rank: int, world: int, check: str | None) -> int:
    from kernels.protocol import admission

    x, _, _, w = _tensors(rank)
    with torch.no_grad():
        for _ in range(3):
            kernels.all_gather_matmul(x, w)
    return admission.counts.get("all_gather_matmul", 0)


@pytest.mark.parametrize("check, expected", [(None, 3), ("1", 3), ("0", 0)])
def test_every_call_is_admitted_unless_coc_check_is_0(check: str | None, expected: int) -> None:
    assert run_ranks(_count_admissions, 2, check, env={"COC_CHECK": check}) == [expected, expected]
