"""What every rank of ``python -m bench --mode moe`` runs (:mod:`bench.moe.mode`): each case's operands, its check
against plain torch math, the timing of each backend and of the bare parts the model needs, and the link model.

The plain math is written here in fp64, not taken from the package's references: grouped GEMM rows
``x[r] @ w[expert(r)].T``; the reduce-scatter op's top-k weighted sum over the ranks; the rows a dispatch must
deliver (grouped by local expert, then source rank, token and slot) compared bit for bit; a combine whose
expert e multiplied its rows by ``1 + e``. Every rank walks the same cases and backends in the same order and
agrees on every skip through an all-reduce, so no rank waits in a collective its peers have left.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from bench.harness.suites import backend_args
from bench.harness.timing import Timer
from bench.model import dense as perf_model
from bench.model.moe import (
    A2A,
    AG,
    DISPATCH,
    GROUPED,
    GROUPED_BACKENDS,
    RS,
    Models,
    MoeCase,
    MoeShape,
    derive,
)

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class MoeOptions:
    backends: list[str]
    warmup: int
    repeats: int
    seed: int = 0
    stat: str = "median"
    model: bool = True
    gpu_generation: str | None = None


@contextlib.contextmanager
def interpreter(on: bool) -> Iterator[None]:
    """Triton's interpreter on or off for the calls inside (CPU ranks start with it on). The MoE ops read
    ``TRITON_INTERPRET`` per call to decide whether their grouped GEMM kernel runs on CPU tensors."""
    before = os.environ.get("TRITON_INTERPRET")
    if before is None:  # a CUDA process: leave it alone
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        os.environ["TRITON_INTERPRET"] = before


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, scale: float, dtype: str, device: torch.device) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(device=device, dtype=TORCH_DTYPES[dtype])


def _ids(tokens: int, s: MoeShape, seed: int, device: torch.device) -> torch.Tensor:
    """Top-k distinct experts per token (a random permutation's first topk: the router's argtopk)."""
    scores = torch.rand(tokens, s.experts, generator=_gen(seed))
    return scores.argsort(dim=1)[:, : s.topk].to(device)


def _grouped_rows(x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``x[r] @ w[experts[r]].T`` in fp64 per row group: the plain math every grouped result is checked with."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    for e in experts.unique().tolist():
        rows = (experts == e).nonzero().flatten()
        out[rows] = x[rows].double() @ w[e].double().T
    return out


def _bound(dtype: str, k: int, magnitude: torch.Tensor, *, world: int = 1, operand: bool = False) -> torch.Tensor:
    """``kernels.testing.tolerance`` times ``magnitude``; ``operand``: the summed terms were rounded to
    ``dtype`` first (the combine's expert outputs)."""
    from kernels.testing import tolerance

    eps = torch.finfo(TORCH_DTYPES[dtype]).eps if operand else 0.0
    tf32 = 2.0**-10 if magnitude.is_cuda and dtype == "fp32" else 0.0  # the kernel may multiply in TF32
    return tolerance(TORCH_DTYPES[dtype], k, world, operand_eps=max(eps, tf32)) * magnitude + 1e-30


def _over(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    """Largest ``|got - want| / bound`` (<= 1: within the bound)."""
    return float(((got.double() - want).abs() / bound).max()) if got.numel() else 0.0


def _ranks_cat(t: torch.Tensor, world: int) -> torch.Tensor:
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


@dataclass
class Prepared:
    """A case's calls on this rank: ``call(backend)`` the op (None where this build or torch lacks it),
    whose result ``check`` compares with plain math (the error over its bound, <= 1 agrees); ``parts`` the
    bare timings the model needs."""

    call: Callable[[str], Callable[[], Any] | None]
    check: Callable[[Any], float]
    parts: dict[str, Callable[[], Any]]


def _grouped_call(x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor) -> Callable[[], Any]:
    """The bare grouped GEMM of rows ``x`` (grouped by ``expert``, ascending): the Triton kernel on CUDA,
    the per-expert ``torch.mm`` loop elsewhere (what the ops' backends multiply with on that device)."""
    import kernels

    ends = torch.bincount(expert, minlength=w.shape[0]).cumsum(0)
    if x.is_cuda:
        return lambda: kernels.grouped_matmul(x, w, ends, backend="fused")
    host_ends = ends.tolist()

    def loop() -> torch.Tensor:
        out, start = x.new_empty(x.shape[0], w.shape[1]), 0
        for e, end in enumerate(host_ends):
            out[start:end] = torch.mm(x[start:end], w[e].T)
            start = end
        return out

    return loop


def _prepare_grouped(case: MoeCase, rank: int, device: torch.device, seed: int) -> Prepared:
    import kernels

    s = case.shape
    expert = _ids(s.tokens, s, seed, device).flatten().sort().values
    x = _randn(s.rows, s.k, seed=seed + 1, scale=1.0, dtype=s.dtype, device=device)
    w = _randn(s.experts, s.n, s.k, seed=seed + 2, scale=1 / math.sqrt(s.k), dtype=s.dtype, device=device)
    offsets = torch.bincount(expert, minlength=s.experts).cumsum(0)
    want = _grouped_rows(x, w, expert)
    bound = _bound(s.dtype, s.k, _grouped_rows(x.abs(), w.abs(), expert))

    def loop() -> torch.Tensor:  # the host reads the offsets, as any per-expert loop must
        out, start = x.new_empty(s.rows, s.n), 0
        for e, end in enumerate(offsets.tolist()):
            out[start:end] = torch.mm(x[start:end], w[e].T)
            start = end
        return out

    def call(name: str) -> Callable[[], Any] | None:
        if name == "loop":
            return loop
        if name == "kernel":
            return lambda: kernels.grouped_matmul(x, w, offsets, backend="fused")
        if not hasattr(torch, "_grouped_mm"):
            return None
        offs, wt = offsets.to(torch.int32), w.transpose(1, 2)
        return lambda: torch._grouped_mm(x, wt, offs=offs)

    # The dense GEMM of all rows against one expert: the work of the grouped GEMM without its groups.
    dense = w[0].T.contiguous()
    return Prepared(call, lambda out: _over(out, want, bound), {"dense": lambda: torch.mm(x, dense)})


def _routing(ids: torch.Tensor, s: MoeShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(token of each output row, expert of each row) of the gathered ``ids``: pairs sorted stably by expert."""
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    return order // s.topk, flat[order]


def _prepare_tp(case: MoeCase, rank: int, device: torch.device, seed: int) -> Prepared:
    import kernels

    s = case.shape
    m_local = s.tokens // s.world
    ids_all = _ids(s.tokens, s, seed, device)
    ids = ids_all[rank * m_local : (rank + 1) * m_local]
    token, expert = _routing(ids_all, s)
    dtype = TORCH_DTYPES[s.dtype]
    if case.op == AG:
        x = _randn(m_local, s.k, seed=seed + 10 + rank, scale=1.0, dtype=s.dtype, device=device)
        w = _randn(s.experts, s.n, s.k, seed=seed + 20 + rank, scale=1 / math.sqrt(s.k), dtype=s.dtype, device=device)
        rows = _ranks_cat(x, s.world)[token]
        want = _grouped_rows(rows, w, expert)
        bound = _bound(s.dtype, s.k, _grouped_rows(rows.abs(), w.abs(), expert))

        def call(b: str) -> Callable[[], Any]:
            kind, p = backend_args(b)
            return lambda: kernels.all_gather_grouped_matmul(x, ids, w, backend=kind, parallel_num=p)[0]

        comm = _comm_call("all_gather", (m_local, s.k), world=s.world, dtype=dtype, device=device)
    else:
        rows = _randn(s.rows, s.k, seed=seed + 30 + rank, scale=1.0, dtype=s.dtype, device=device)
        scale = 1 / math.sqrt(s.k * s.world)
        w = _randn(s.experts, s.n, s.k, seed=seed + 40 + rank, scale=scale, dtype=s.dtype, device=device)
        tw = torch.rand(s.tokens, s.topk, generator=_gen(seed + 50)).to(device)
        # The routing the first op returns (the sequential backend on a one-column weight: cheap).
        zeros = torch.zeros(s.experts, 1, 1, dtype=dtype, device=device)
        routing = kernels.all_gather_grouped_matmul(
            torch.zeros(m_local, 1, dtype=dtype, device=device), ids, zeros, backend="sequential"
        )[1]
        slot_rows = _slot_rows(ids_all)
        mine = slice(rank * m_local, (rank + 1) * m_local)
        want = _combined(_grouped_rows(rows, w, expert), slot_rows, tw, s.world)[mine]
        magnitude = _combined(_grouped_rows(rows.abs(), w.abs(), expert), slot_rows, tw, s.world)[mine]
        bound = _bound(s.dtype, s.k * s.world + s.topk, magnitude, world=s.world)

        def call(b: str) -> Callable[[], Any]:
            kind, p = backend_args(b)
            return lambda: kernels.grouped_matmul_reduce_scatter(rows, w, routing, tw, backend=kind, parallel_num=p)

        # The op reduces fp32 partials: the bare exchange moves fp32.
        comm = _comm_call(A2A, (s.tokens, s.n), world=s.world, dtype=torch.float32, device=device)
    # A chunked piece of t tokens multiplies their pairs' rows, spread over the experts as the whole.
    parts = {f"gemm@{t}": _grouped_call(rows[token < t], w, expert[token < t]) for t in _token_counts(s)}
    return Prepared(call, lambda out: _over(out, want, bound), {**parts, "comm": comm})


def _token_counts(s: MoeShape) -> list[int]:
    """The token counts whose grouped GEMM the model needs: all tokens and each chunked piece's."""
    counts = {s.tokens}
    for p in (2, 4, 8):
        counts.update(perf_model.chunk_rows(s.tokens, p))
    return sorted(counts)


def _slot_rows(ids: torch.Tensor) -> torch.Tensor:
    """``rows[t, slot]``: the output row of pair (t, slot) when the pairs are sorted stably by expert."""
    order = ids.flatten().argsort(stable=True)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=order.device)
    return rows.view(ids.shape)


def _combined(partial: torch.Tensor, slot_rows: torch.Tensor, tw: torch.Tensor, world: int) -> torch.Tensor:
    """Each token's top-k weighted sum of its rows (fp64), summed over the ranks."""
    combined = (partial[slot_rows] * tw.double()[..., None]).sum(1)
    if world > 1:
        dist.all_reduce(combined)
    return combined


def _prepare_ep(case: MoeCase, rank: int, device: torch.device, seed: int) -> Prepared:
    import kernels

    s = case.shape
    x = _randn(s.tokens, s.k, seed=seed + 60 + rank, scale=1.0, dtype=s.dtype, device=device)
    ids = _ids(s.tokens, s, seed + 70 + rank, device)
    tw = torch.rand(s.tokens, s.topk, generator=_gen(seed + 80 + rank)).to(device)
    per_rank = s.experts // s.world
    xg, idg = _ranks_cat(x, s.world), _ranks_cat(ids, s.world)
    src_token = torch.arange(s.world * s.tokens, device=device).repeat_interleave(s.topk)
    mine = (idg.flatten() // per_rank) == rank
    # Rows grouped by local expert, then source rank, token and slot: a stable sort of the pairs in that order.
    want_rows = xg[src_token[mine][idg.flatten()[mine].argsort(stable=True)]]

    def dispatch(b: str) -> Callable[[], Any]:
        kind, p = backend_args(b)
        return lambda: kernels.moe_dispatch(x, ids, tw, s.experts, backend=kind, parallel_num=p)

    source = want_rows if want_rows.shape[0] else x[:1]
    copy_index = torch.randperm(source.shape[0], generator=_gen(seed)).to(device)
    parts = {
        "local": lambda: source.index_select(0, copy_index),
        "comm": _comm_call(A2A, (s.rows, s.k), world=s.world, dtype=TORCH_DTYPES[s.dtype], device=device),
    }
    if case.op == DISPATCH:
        return Prepared(dispatch, lambda out: 0.0 if torch.equal(out[0], want_rows) else math.inf, parts)
    # Expert e multiplies its rows by 1 + e, so a row sent back to the wrong pair shows in the sum.
    want = x.double() * (tw.double() * (1 + ids.double())).sum(1, keepdim=True)
    bound = _bound(s.dtype, s.topk, want.abs(), operand=True)

    def combine(b: str) -> Callable[[], Any]:
        kind, p = backend_args(b)
        state: dict[str, Any] = {}

        def run() -> Any:
            if not state:  # every rank's first call (the check) dispatches, in the same order
                rows, handle = dispatch(b)()
                ends = handle.expert_offsets
                local = torch.bucketize(torch.arange(rows.shape[0], device=device), ends, right=True)
                state["args"] = (rows * (1 + rank * per_rank + local)[:, None].to(rows.dtype), handle)
            y, handle = state["args"]
            return kernels.moe_combine(y, handle, backend=kind, parallel_num=p)

        return run

    return Prepared(combine, lambda out: _over(out, want, bound), parts)


def _comm_call(
    collective: str, shape: tuple[int, int], *, world: int, dtype: torch.dtype, device: torch.device
) -> Callable[[], Any]:
    """The bare collective of the unfused path: an all-gather of ``shape = [rows, cols]`` per rank, or an
    all-to-all of a ``[rows, cols]`` send buffer (zeros: repeats never overflow)."""
    from kernels import comm

    rows, cols = shape
    if world == 1:
        inp = torch.zeros(rows, cols, dtype=dtype, device=device)
        return inp.clone
    if collective == "all_gather":
        inp = torch.zeros(rows, cols, dtype=dtype, device=device)
        out = inp.new_empty(rows * world, cols)
        return lambda: comm.all_gather(out, inp, None)
    per = max(1, math.ceil(rows / world))
    inp = torch.zeros(per * world, cols, dtype=dtype, device=device)
    out = torch.empty_like(inp).view(world, per, cols)
    return lambda: comm.all_to_all(out, inp, None)


def _prepare(case: MoeCase, rank: int, device: torch.device, seed: int) -> Prepared:
    if case.op == GROUPED:
        return _prepare_grouped(case, rank, device, seed)
    if case.op in (AG, RS):
        return _prepare_tp(case, rank, device, seed)
    return _prepare_ep(case, rank, device, seed)


def backends_of(case: MoeCase, backends: list[str]) -> list[str]:
    return list(GROUPED_BACKENDS) if case.op == GROUPED else backends


def _check_and_time(case: MoeCase, backend: str, prep: Prepared, *, timer: Timer, opts: MoeOptions) -> dict[str, Any]:
    """Run once (the interpreter on, so CPU runs the kernels' code path), compare with plain math, then time
    with the interpreter off; every rank returns the same status."""
    import warnings

    rec: dict[str, Any] = {"backend": backend}
    error, worst = None, math.inf
    with warnings.catch_warnings(record=True) as caught, interpreter(True):
        warnings.simplefilter("always")
        try:
            fn = prep.call(backend)
            if fn is None:
                error = f"this torch ({torch.__version__}) has no torch._grouped_mm"
            else:
                worst = prep.check(fn())
        except Exception as e:  # reported per backend; the other backends still run
            error = f"{type(e).__name__}: {str(e)[:300]}"
    fallback = next((str(w.message) for w in caught if "fused" in str(w.message)), None)
    if backend == "fused" and fallback:
        rec["fallback"] = fallback[:300]
    if not timer.all_ranks_true(error is None):
        rec.update(status="skipped", reason=error or "failed on another rank")
        return rec
    worst = timer.max_over_ranks([worst])[0]
    rec.update(error_over_bound=worst, status="ok" if worst <= 1.0 else "incorrect")
    if rec["status"] != "ok":
        rec["reason"] = f"differs from plain torch math: {worst:.3g} x the bound"
    elif timer.device.type == "cpu" and backend == "kernel":
        rec["interpreted"] = True  # the interpreter's time would say nothing about the kernel
    else:
        with interpreter(False):
            rec["time"] = timer.run(fn, opts.warmup, opts.repeats)
    return rec


def _calibration(timer: Timer, cases: list[MoeCase], opts: MoeOptions) -> list[tuple[str, int, float, float]]:
    """Collective-only timings at five sizes spanning the cases' (and their pieces'), for the link fit."""
    world, device = cases[0].shape.world, timer.device
    sizes: dict[str, list[int]] = {}
    for c in cases:
        s = c.shape
        coll, nbytes = (
            ("all_gather", s.tokens * s.k * 4) if c.op == AG else (A2A, (s.tokens if c.op == RS else s.rows) * s.n * 4)
        )
        sizes.setdefault(coll, []).append(nbytes)
    samples = []
    for coll, found in sorted(sizes.items()):
        lo, hi = max(256 * world, min(found) // 8), max(max(found), 1024 * world)
        for i in range(5):
            rows = max(1, int(lo * (hi / lo) ** (i / 4)) // (64 * 4 * world))
            fn = _comm_call(coll, (rows, 64), world=world, dtype=torch.float32, device=device)
            per_rank = rows if coll == "all_gather" else max(1, math.ceil(rows / world)) * world
            nbytes = float(per_rank * 64 * 4 * (world if coll == "all_gather" else 1))
            samples.append((coll, world, nbytes, timer.run(fn, opts.warmup, opts.repeats).pick(opts.stat)))
    return samples


def run_world(rank: int, world: int, device: torch.device, cases: list[MoeCase], opts: MoeOptions) -> dict[str, Any]:
    """Every case of one world size on this rank; rank 0 returns the records (with the model's predictions)."""
    timer = Timer(device)
    results = []
    for i, case in enumerate(cases):
        prep = _prepare(case, rank, device, opts.seed + 101 * i)
        rows = [_check_and_time(case, b, prep, timer=timer, opts=opts) for b in backends_of(case, opts.backends)]
        with interpreter(False):
            parts = {name: timer.run(fn, opts.warmup, opts.repeats) for name, fn in prep.parts.items()}
        results.append((case, rows, parts))
    link, samples = _link_model(world, device, cases, timer, opts)
    if rank != 0:
        return {}
    spec = perf_model.load_gpu(opts.gpu_generation)[1] if opts.gpu_generation else None
    models = Models(link, spec)
    return {
        "world": world,
        "records": [derive(case, rows, parts, models=models, stat=opts.stat) for case, rows, parts in results],
        "link_model": link.describe() if link is not None else None,
        "calibration_samples": [{"collective": c, "world": w, "bytes": b, "seconds": t} for c, w, b, t in samples],
    }


def _link_model(
    world: int, device: torch.device, cases: list[MoeCase], timer: Timer, opts: MoeOptions
) -> tuple[perf_model.LinkModel | None, list]:
    if not opts.model:
        return None, []
    if world == 1:
        return perf_model.LinkModel(name="no-communication", source="world size 1: no collective"), []
    if device.type == "cuda" and opts.gpu_generation:
        return perf_model.load_gpu(opts.gpu_generation)[0], []
    samples = _calibration(timer, cases, opts)
    return perf_model.calibrate(samples, name=f"{device.type}-{dist.get_backend()}-calibrated"), samples
