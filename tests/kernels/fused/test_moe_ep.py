"""The fused backend of expert-parallel dispatch / combine (kernels/fused/moe_ep.py), interpreted over the
shared-memory heap at W = 1, 2, 3: every output of the dispatch (rows and handle) and the combine bit for bit equal
to the sequential backend's, in exact and bounded mode, with uneven routing, hidden sizes that are not tile
multiples, repeated calls over a scrambled heap, the bounded overflow raised by name on every rank (and kept for
``moe_check_overflow`` where no host read is allowed), no host read in bounded mode, ranks that disagree refused by
the heap's call check, every launch's programs run in reverse order, and the autograd chain.

Bitwise equality is the claim, not a tolerance: the dispatch copies rows and the combine sums the same returned rows
with the same function (fp32, slot order, one rounding), so any difference is a wrong row.

Cases (``m_local`` per rank, hidden ``k``, experts per rank, top-k, dtype):

* "skewed": 5 tokens, k = 70 (one full and one partial 64-column copy step), 2 experts per rank, top-2, fp32;
  ~70 % of the pairs to expert 1, experts 2 and 3 never chosen (at W = 2 rank 1 receives nothing);
* "single": 6 tokens, k = 9, 1 expert per rank, top-2, bf16; every pair to expert 1 (rank 1 receives all, at
  W = 1 the only expert), and the last rank has no tokens (it sends nothing).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import kernels
from kernels.fused import moe_ep as fused_ep
from kernels.heap import peek_heap
from kernels.ops.moe import ep as moe_ep
from kernels.testing import run_ranks, scramble

# name: (m_local, k, experts per rank, topk, dtype)
CASES = {"skewed": (5, 70, 2, 2, torch.float32), "single": (6, 9, 1, 2, torch.bfloat16)}


def _cap(world: int) -> int:
    """max_tokens of the bounded runs: above every rank's receive count here, not a tile multiple."""
    return 12 * world + 3


def _inputs(world: int, rank: int, case: str) -> dict[str, Any]:
    m, k, per_rank, topk, dtype = CASES[case]
    num_e = per_rank * world if world > 1 else 2
    g = torch.Generator().manual_seed(11 * world + len(case))
    tokens = m * world
    ids = torch.randint(0, num_e, (tokens, topk), generator=g)
    if case == "skewed":
        ids = torch.where(torch.rand(tokens, topk, generator=g) < 0.7, 1, ids)
        ids = torch.where((ids == 2) | (ids == 3), 0, ids)
    else:
        ids = torch.ones_like(ids)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    tw = torch.rand(tokens, topk, generator=g)
    own = slice(rank * m, (rank + 1) * m)
    if case == "single" and rank == world - 1 and world > 1:
        own = slice(0, 0)  # the last rank sends nothing
    return {"x": x[own], "ids": ids[own], "tw": tw[own], "E": num_e}


def _experts(rows: torch.Tensor) -> torch.Tensor:
    """A stand-in expert, elementwise and wider than k (n = k + 3): the same outputs for the same rows."""
    return torch.cat([rows, rows[:, :3]], 1) * 3 - 1


class _Count:
    """Counts the runs of the fused module's dispatch and combine (the ops call them by attribute)."""

    def __init__(self) -> None:
        self.runs = 0
        self.saved = (fused_ep.dispatch, fused_ep.combine)

    def __enter__(self) -> _Count:
        for name, fn in zip(("dispatch", "combine"), self.saved, strict=True):
            setattr(fused_ep, name, self._counted(fn))
        return self

    def _counted(self, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.runs += 1
            return fn(*args, **kwargs)

        return run

    def __exit__(self, *exc: object) -> None:
        fused_ep.dispatch, fused_ep.combine = self.saved


def _heap_calls() -> int:
    """The calls opened on the default group's CPU heap (0 without one)."""
    heap = peek_heap(dist.group.WORLD, torch.device("cpu")) if dist.is_initialized() else None
    return 0 if heap is None else heap.calls


def _one(inp: dict[str, Any], cap: int | None, backend: str) -> tuple:
    rows, h = kernels.moe_dispatch(inp["x"], inp["ids"], inp["tw"], inp["E"], max_tokens=cap, backend=backend)
    return rows, h, kernels.moe_combine(_experts(rows), h, backend=backend)


def _same(a: tuple, b: tuple) -> list[str]:
    """The names of the outputs that differ (bits, dtype or shape)."""
    (rows_a, h_a, out_a), (rows_b, h_b, out_b) = a, b
    differ = [name for name, u, v in (("rows", rows_a, rows_b), ("out", out_a, out_b)) if not _equal(u, v)]
    for field in h_a._fields:
        u, v = getattr(h_a, field), getattr(h_b, field)
        if isinstance(u, torch.Tensor) and not _equal(u, v):
            differ.append(field)
    return differ


def _equal(u: torch.Tensor, v: torch.Tensor) -> bool:
    return (
        u.dtype == v.dtype
        and u.shape == v.shape
        and torch.equal(u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
    )


def _body(rank: int, world: int) -> list[tuple]:
    """Per (case, mode): the outputs that differ from the sequential backend's on the first fused call and on a
    repeat over a scrambled heap (with a fused combine of the sequential handle), and how many fused dispatch /
    combine runs the first made (2 at W > 1, none fell back; 0 at W = 1: a group of one moves rows locally)."""
    results = []
    for case in CASES:
        inp = _inputs(world, rank, case)
        for cap in (None, _cap(world)):
            ref = _one(inp, cap, "sequential")
            with _Count() as count:
                first = _one(inp, cap, "fused")
            calls = count.runs
            if world > 1:
                scramble(dist.group.WORLD, "cpu")
            opened = _heap_calls()
            again = _same(ref, _one(inp, cap, "fused"))
            if world > 1 and _heap_calls() - opened != 2:
                # The heap fits by now: one call for the dispatch (exact mode too), one for the combine.
                again.append(f"{_heap_calls() - opened} heap calls for a dispatch and a combine")
            # A fused combine of the sequential dispatch's handle (every backend's handle carries pair_dest).
            if not _equal(kernels.moe_combine(_experts(ref[0]), ref[1], backend="fused"), ref[2]):
                again.append("fused combine of a sequential handle")
            results.append((case, cap, _same(ref, first), again, calls, int(first[1].valid)))
    return results


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fused_dispatch_and_combine_have_the_sequential_bits(world: int) -> None:
    per_rank = run_ranks(_body, world, timeout=300)
    for rank, results in enumerate(per_rank):
        for case, cap, first, again, calls, valid in results:
            tag = f"{case} cap={cap} W={world} rank={rank}"
            assert first == [] and again == [], (tag, first, again)
            assert calls == (0 if world == 1 else 2), (tag, calls)
            if case == "single":
                # Every pair to expert 1: its rank holds all of them, the others none.
                m, _, per_rank_e, topk, _ = CASES[case]
                senders = world - 1 if world > 1 else 1
                assert valid == (m * topk * senders if rank == 1 // per_rank_e % world else 0), (tag, valid)


def _overflow_body(rank: int, world: int) -> list[str]:
    x, ids, tw = torch.randn(4, 7), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2)
    ids[:, 1] = 1  # every pair to rank 0's experts: it receives 8 * world rows
    seen = []
    try:
        kernels.moe_dispatch(x, ids, tw, 2 * world, max_tokens=5, backend="fused")
    except RuntimeError as e:
        seen.append(str(e))
    rows, h = kernels.moe_dispatch(x, ids, tw, 2 * world, max_tokens=8 * world, backend="fused")  # usable still
    seen.append(str(int(h.valid)))
    # Where no host read is allowed (CUDA eager, capture) the kernels drop the rows past max_tokens and the flag
    # is kept: the next check raises.
    original = moe_ep.wanted
    moe_ep.wanted = lambda device: False
    try:
        rows, h = kernels.moe_dispatch(x, ids, tw, 2 * world, max_tokens=5, backend="fused")
        out = kernels.moe_combine(rows, h, backend="fused")
    finally:
        moe_ep.wanted = original
    seen.append(f"{int(h.valid)} {bool(torch.isfinite(out).all())}")
    try:
        kernels.moe_check_overflow()
    except RuntimeError as e:
        seen.append(str(e))
    # As if captured (no host read, and replays run without the host): the flag is sticky and read at every check
    # (on a fresh group: from now on every dispatch on it reads the flag).
    group = dist.new_group(list(range(world)))
    saved = moe_ep.wanted, moe_ep.capturing
    moe_ep.wanted, moe_ep.capturing = (lambda device: False), (lambda device: True)
    try:
        for cap in (8 * world, 5):
            kernels.moe_dispatch(x, ids, tw, 2 * world, max_tokens=cap, backend="fused", group=group)
            try:
                kernels.moe_check_overflow(group)
                seen.append(f"cap {cap}: no overflow")
            except RuntimeError as e:
                seen.append(f"cap {cap}: {e}")
        kernels.moe_check_overflow(group)
        seen.append("read and cleared")
    finally:
        moe_ep.wanted, moe_ep.capturing = saved
    return seen


def test_fused_bounded_overflow_raises_by_name_on_every_rank() -> None:
    world = 2
    for rank, seen in enumerate(run_ranks(_overflow_body, world, timeout=120)):
        assert len(seen) == 7, (rank, seen)
        assert re.search(rf"max_tokens=5 overflow: rank 0 would receive {8 * world} rows", seen[0]), seen[0]
        assert seen[1] == ("0" if rank else str(8 * world)), seen[1]
        assert seen[2] == ("0 True" if rank else "5 True"), seen[2]
        assert "max_tokens overflow in an earlier bounded call" in seen[3], seen[3]
        assert seen[4] == f"cap {8 * world}: no overflow", seen[4]
        assert seen[5].startswith("cap 5: moe_dispatch: max_tokens overflow in an earlier bounded call"), seen[5]
        assert seen[6] == "read and cleared", seen[6]


def _grad_body(rank: int, world: int) -> list[bool]:
    """The autograd chain on the fused forward (its backward runs the chunked movement): the sequential grads."""
    inp = _inputs(world, rank, "skewed")
    grads = []
    for backend in ("sequential", "fused"):
        x = inp["x"].clone().requires_grad_()
        tw = inp["tw"].clone().requires_grad_()
        rows, h = kernels.moe_dispatch(x, inp["ids"], tw, inp["E"], backend=backend)
        out = kernels.moe_combine(_experts(rows) * rows[:, :1], h, backend=backend)
        (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
        grads.append((x.grad, tw.grad))
    return [torch.equal(a, b) for a, b in zip(*grads, strict=True)]


def test_fused_autograd_has_the_sequential_gradients() -> None:
    for rank, flags in enumerate(run_ranks(_grad_body, 2, timeout=120)):
        assert flags == [True, True], (rank, flags)


class HostRead(Exception):
    """A tensor's value was read on the host."""


@contextlib.contextmanager
def _no_host_reads() -> Iterator[None]:
    """Every way Python code reads a tensor's value on the host raises :class:`HostRead` meanwhile (a CUDA sync
    on a GPU, impossible inside graph capture)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise HostRead

    names = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    for name in names:
        setattr(torch.Tensor, name, refuse)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _host_read_body(rank: int, world: int) -> list[str]:
    """Bounded mode where no host read is allowed (as on CUDA without COC_CHECK), after a warm-up call: a dispatch
    and a combine read no tensor value on the host (what a CUDA-graph capture needs), and give the sequential bits;
    exact mode reads (its output's size), as documented."""
    inp = _inputs(world, rank, "skewed")
    ref = _one(inp, _cap(world), "sequential")
    original = moe_ep.wanted
    moe_ep.wanted = lambda device: False
    seen = []
    try:
        # Warm-up, as before a capture: the first call of a signature is compared across ranks on the host.
        _one(inp, _cap(world), "fused")
        _one(inp, None, "fused")
        kernels.moe_check_overflow()  # nothing pending: the next dispatch has nothing to read
        with _no_host_reads():
            got = _one(inp, _cap(world), "fused")
        seen.append(",".join(_same(ref, got)) or "same bits")
        try:
            with _no_host_reads():
                _one(inp, None, "fused")
            seen.append("exact mode read nothing")
        except HostRead:
            seen.append("exact mode reads on the host")
    finally:
        moe_ep.wanted = original
    # The exact call raised between its fused calls (after its counts call): the group goes on.
    seen.append(",".join(_same(_one(inp, None, "sequential"), _one(inp, None, "fused"))) or "same bits")
    return seen


def test_fused_bounded_mode_reads_nothing_on_the_host() -> None:
    for rank, seen in enumerate(run_ranks(_host_read_body, 2, timeout=120)):
        assert seen == ["same bits", "exact mode reads on the host", "same bits"], (rank, seen)


def _mismatch_body(rank: int, world: int) -> str:
    """On a fresh group (its heap made by a first, matching call), rank 1 asks for another max_tokens: the admission
    refuses it by name on every rank before any kernel runs."""
    group = dist.new_group(list(range(world)))
    inp = _inputs(world, rank, "skewed")
    args = (inp["x"], inp["ids"], inp["tw"], inp["E"])
    kernels.moe_dispatch(*args, max_tokens=_cap(world), backend="fused", group=group)
    try:
        kernels.moe_dispatch(*args, max_tokens=_cap(world) + rank, backend="fused", group=group)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_fused_ranks_that_disagree_are_refused_by_name() -> None:
    for text in run_ranks(_mismatch_body, 2, timeout=120, env={"COC_CHECK": None}):
        assert text.startswith("moe_dispatch: ranks disagree: rank 0 has max_tokens=27, rank 1 has max_tokens=28")
        assert "before any communication of the op" in text, text


def test_fused_any_program_order() -> None:
    """The launches' programs run last first: no program waits on a later program of its own launch."""
    for rank, results in enumerate(run_ranks(_body, 3, timeout=300, env={"COC_TEST_PROGRAM_ORDER": "reverse"})):
        for case, cap, first, again, calls, _ in results:
            assert first == [] and again == [] and calls == 2, (case, cap, rank, first, again, calls)


def _gpu_body(rank: int, world: int) -> list[tuple]:
    """The cases with every tensor on this rank's GPU (compiled kernels, the CUDA IPC heap): the fused outputs,
    brought back, against the sequential backend run on the CPU copies (gloo), bit for bit; the bounded calls 20
    times over (each with the same bits)."""
    from tests.kernels.fused.cases import gpu_device

    dev = gpu_device()
    results = []
    for case in CASES:
        inp = _inputs(world, rank, case)
        on_gpu = {key: v.to(dev) if isinstance(v, torch.Tensor) else v for key, v in inp.items()}
        for cap in (None, _cap(world)):
            ref = _one(inp, cap, "sequential")
            outs = [_one(on_gpu, cap, "fused") for _ in range(1 if cap is None else 20)]
            torch.cuda.synchronize(dev)
            kernels.check_errors()
            kernels.moe_check_overflow()
            differ = set()
            for rows, h, out in outs:
                moved = h._replace(**{f: getattr(h, f).cpu() for f in h._fields if f not in ("call", "topk_weights")})
                differ.update(_same(ref, (rows.cpu(), moved._replace(topk_weights=ref[1].topk_weights), out.cpu())))
            results.append((case, cap, sorted(differ)))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_fused_on_gpu_has_the_sequential_bits(world: int) -> None:
    """On one GPU shared by W processes: the fused kernels compiled (the combine's products uncontracted, mul.rn)
    give the CPU sequential backend's bits."""
    pytest.importorskip("cupy", reason="the CUDA heap needs CuPy")
    from tests.kernels.fused.cases import run_gpu_ranks

    for rank, results in enumerate(run_gpu_ranks(_gpu_body, world, timeout=300)):
        for case, cap, differ in results:
            assert differ == [], (case, cap, world, rank, differ)
