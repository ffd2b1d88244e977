"""What every rank runs: correctness check, then timing of each backend, the bare GEMM and the
bare collective; rank 0 derives the figures (TFLOP/s, bus bandwidth, speedup, overlap efficiency)
and the model's predictions.

Every operand format runs through the same code: :mod:`bench.dense.formats` gives a case's operands, the
public function it calls, its unfused baseline (a ``baseline`` row for FP8, whose ``sequential`` is an
fp32 reference; the ``sequential`` row itself for plain and int8) and the bound of its check.

Every rank walks the same cases and backends in the same order and agrees on every skip through an
all-reduce, so no rank ever waits in a collective its peers have left.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.dense import formats
from bench.dense.formats import TORCH_DTYPES, CommSpec
from bench.harness.suites import Case, backend_args
from bench.harness.timing import Stats, Timer
from bench.model import dense as perf_model

if TYPE_CHECKING:
    from kernels.ops.gemm import Operands


@dataclass
class RunOptions:
    backends: list[str]
    warmup: int
    repeats: int
    seed: int = 0
    progress: bool = True
    calibrate: bool = False
    gpu_generation: str | None = None  # links.yaml generation for the model on GPUs
    model: bool = True
    stat: str = "median"  # statistic of the repeats behind every derived figure: "median" or "min"


class Progress:
    """A progress bar on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int, title: str, enabled: bool):
        self.total, self.title, self.enabled = total, title, enabled and total > 0
        self.done = 0
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        self.done += 1
        width = 24
        filled = int(width * self.done / self.total)
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        line = (
            f"{self.title} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"{elapsed:5.1f}s elapsed, ~{eta:4.0f}s left  {label}"
        )
        if self.tty:
            sys.stderr.write("\r\033[K" + line + ("\n" if self.done == self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def has_op(case: Case) -> bool:
    """Whether this build of ``kernels`` has the public function ``case`` calls
    (:func:`bench.dense.formats.public_functions`)."""
    try:
        return (case.collective, case.kind) in formats.public_functions()
    except (ImportError, AttributeError):
        return False


def _comm_module() -> Any:
    from kernels import comm

    return comm


@dataclass(frozen=True)
class Reference:
    """The ``sequential`` backend's result on this rank and the magnitude its bound scales with."""

    out: torch.Tensor
    magnitude: torch.Tensor


@dataclass(frozen=True)
class RankContext:
    """What every case of one world size shares on one rank."""

    rank: int
    world: int
    device: torch.device
    timer: Timer
    opts: RunOptions
    gemm_cache: dict = dataclasses.field(default_factory=dict)


def agreement(case: Case, backend: str, out: torch.Tensor, reference: Reference) -> tuple[bool, float]:
    """``(ok, worst)``: whether ``backend``'s result agrees with ``sequential``'s elementwise within the
    sum of both results' bounds (:func:`bench.dense.formats.allowed_difference`: plain and int8 twice
    ``kernels.testing.tolerance``, FP8 the bounds of ``kernels.fp8.numerics``), ``worst`` the largest
    ``|out - sequential| / allowed``. ``reference.magnitude``: ``sum_r |x_r| @ |w_r|.T`` of the
    dequantized operands or an upper bound of it (``kernels.testing.row_norm_bound``), shaped like the
    2-D result."""
    allowed = formats.allowed_difference(case, backend, reference.magnitude, out.device)
    return formats.within(out, reference.out, allowed)


def _row_norms(case: Case, inputs: Operands) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = formats.dequantized(case, inputs)
    return x.reshape(-1, x.shape[-1]).double().norm(dim=-1), w.double().norm(dim=-1)


def magnitude_bound(case: Case, inputs: Operands, rank: int, world: int) -> torch.Tensor:
    """An elementwise upper bound of ``sum |x| @ |w|.T`` (dequantized operands) over what this rank's
    output sums: every rank's rows against this rank's weight (all-gather), or every rank's products
    (reductions), from the ranks' row norms (collective when ``world > 1``: every rank calls it)."""
    from kernels.testing import row_norm_bound

    xn, wn = _row_norms(case, inputs)
    if world > 1:
        xs = [torch.empty_like(xn) for _ in range(world)]
        ws = [torch.empty_like(wn) for _ in range(world)]
        dist.all_gather(xs, xn)
        dist.all_gather(ws, wn)
    else:
        xs, ws = [xn], [wn]
    if case.op == "all_gather_matmul":
        return row_norm_bound([torch.cat(xs)], [wn])
    full = row_norm_bound(xs, ws)
    if case.op == "matmul_reduce_scatter":
        rows = full.shape[0] // world
        return full[rank * rows : (rank + 1) * rows]
    return full


def make_inputs(case: Case, rank: int, seed: int, device: torch.device) -> Operands:
    """This rank's operands of one case (``kernels.ops.gemm.Operands`` in the case's format, from
    :func:`bench.dense.formats.operands`); x differs per rank, values scaled so outputs are O(1)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    m, k = case.x_shape
    return formats.operands(case, (m, k, case.w_shape[0]), g, device)


def op_call(case: Case, backend: str, inputs: Operands) -> Callable[[], torch.Tensor]:
    """The case's op with bench backend ``backend``; ``baseline``: the unfused FP8 path
    (:func:`bench.dense.formats.baseline_call`)."""
    if backend == "baseline":
        return formats.baseline_call(case, inputs, None)
    kind, p = backend_args(backend)
    return formats.op_call(case, inputs, backend=kind, parallel_num=p)


def backends_of(case: Case, backends: list[str]) -> list[str]:
    """The rows of one case: the selected backends, with the unfused ``baseline`` after ``sequential``
    where it is not ``sequential`` itself (FP8)."""
    if not formats.has_baseline_row(case):
        return list(backends)
    i = backends.index("sequential") + 1 if "sequential" in backends else 0
    return backends[:i] + ["baseline"] + backends[i:]


def gemm_call(
    case: Case, shape: tuple[int, int, int], device: torch.device, *, library: bool
) -> Callable[[], torch.Tensor]:
    """A bare local GEMM of ``shape`` on fresh operands: the format's library GEMM (``library=True``:
    ``F.linear``, ``torch._scaled_mm``, dequantize + ``F.linear``; :class:`bench.dense.formats.Unsupported`
    where torch cannot run it), or ``F.linear`` in :func:`bench.dense.formats.compute_dtype` (what the
    ops' reference backends multiply)."""
    g = torch.Generator().manual_seed(sum(shape))
    if library:
        return formats.library_gemm(case, formats.operands(case, shape, g, device))
    m, k, n = shape
    td = TORCH_DTYPES[formats.compute_dtype(case)]
    x = torch.randn(m, k, generator=g).to(device=device, dtype=td)
    w = (torch.randn(n, k, generator=g) / math.sqrt(max(k, 1))).to(device=device, dtype=td)
    return functools.partial(F.linear, x, w)


def _comm_buffers(spec: CommSpec, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of a bare collective; one buffer twice for the in-place all-reduce. Zeros stay
    zeros under repeated in-place sums: no overflow however many repeats."""
    full = torch.zeros(spec.rows, spec.row_len, dtype=spec.dtype, device=device)
    if spec.collective == "all_reduce":
        return full, full
    part = torch.zeros(spec.rows // world, spec.row_len, dtype=spec.dtype, device=device)
    return (part, full) if spec.collective == "all_gather" else (full, part)


def comm_call(spec: CommSpec, world: int, device: torch.device, *, async_op: bool = False) -> Callable[[], object]:
    """The bare collective of the unfused path (:func:`bench.dense.formats.comm_spec`) on its full tensor."""
    comm = _comm_module()
    inp, out = _comm_buffers(spec, world, device)
    if spec.collective == "all_gather":
        return functools.partial(comm.all_gather, out, inp, None, async_op=async_op)
    if spec.collective == "reduce_scatter":
        return functools.partial(comm.reduce_scatter, out, inp, None, async_op=async_op)
    return functools.partial(comm.all_reduce, inp, None, async_op=async_op)


def calibration_samples(ctx: RankContext, cases: list[Case]) -> list[tuple[str, int, float, float]]:
    """Collective-only timings at sizes spanning the cases' (and their chunks') sizes, for the fit."""
    samples: list[tuple[str, int, float, float]] = []
    by_coll: dict[tuple[str, torch.dtype], list[int]] = {}
    for c in cases:
        spec = formats.comm_spec(c)
        by_coll.setdefault((spec.collective, spec.dtype), []).append(spec.rows * spec.row_len)
    world, opts = ctx.world, ctx.opts
    p_max = max([backend_args(b)[1] or 1 for b in opts.backends] + [world])
    for (coll, dtype), sizes in sorted(by_coll.items(), key=lambda item: (item[0][0], str(item[0][1]))):
        lo, hi = max(world * 64, min(sizes) // (2 * p_max)), max(sizes)
        points = sorted({int(lo * (hi / lo) ** (i / 4)) // (world * 64) * (world * 64) or world * 64 for i in range(5)})
        for elems in points:
            spec = CommSpec(coll, elems // 64, 64, dtype)
            stats = ctx.timer.run(comm_call(spec, world, ctx.device), opts.warmup, opts.repeats)
            samples.append((coll, world, float(spec.nbytes), stats.pick(opts.stat)))
    return samples


def fallback_reason(caught: list[warnings.WarningMessage]) -> str | None:
    """The dispatcher's warning that a fused request ran on the chunked path, if one was caught."""
    for w in caught:
        msg = str(w.message)
        if "fused" in msg and ("instead" in msg or "fall" in msg):
            return msg
    return None


FUSED_FALLBACK: dict[str, str] = {}  # the dispatcher warns once per process: remember why


def check_backend(case: Case, backend: str, inputs: Operands, *, reference: Reference, timer: Timer) -> dict[str, Any]:
    """Run once, compare with sequential (:func:`agreement`); every rank returns the same status."""
    rec: dict[str, Any] = {"backend": backend}
    error = None
    out = None
    fallback_key = f"{case.op} {case.kind}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = op_call(case, backend, inputs)()
        except (NotImplementedError, ImportError, formats.Unsupported) as e:
            error = f"not available: {type(e).__name__}: {e}"
        except Exception as e:  # reported per backend; the other backends still run
            error = f"{type(e).__name__}: {e}"
    if backend == "fused":
        reason = fallback_reason(caught)
        if reason:
            FUSED_FALLBACK[fallback_key] = reason
        if error is None and fallback_key in FUSED_FALLBACK:
            rec["fallback"] = FUSED_FALLBACK[fallback_key]
    ran = timer.all_ranks_true(error is None)
    if not ran:
        rec.update(status="skipped", reason=error or "failed on another rank")
        return rec
    ok, worst = agreement(case, backend, out, reference)
    ok_all = timer.all_ranks_true(ok)
    diff = (out.float() - reference.out.float()).abs()
    errs = timer.max_over_ranks([diff.max().item() if diff.numel() else 0.0, worst])
    rec.update(max_abs_err=errs[0], error_over_bound=errs[1])
    rec["status"] = "ok" if ok_all else "incorrect"
    if not ok_all:
        rule = "kernels.fp8.numerics" if case.kind == "fp8" else "twice kernels.testing.tolerance"
        rec["reason"] = (
            f"|out - sequential| exceeds the bound ({rule}) {errs[1]:.3g}-fold (max |out - sequential| = {errs[0]:.3g})"
        )
    return rec


def _linear_shapes(case: Case, opts: RunOptions) -> set[tuple[int, int, int]]:
    """The shapes whose bare ``F.linear`` is timed: the full GEMM, and with the model on, each chunk of every
    chunked backend (the model predicts a chunked run from its chunks' GEMM times)."""
    m, k, n = case.gemm_shape
    shapes = {(m, k, n)}
    if opts.model:
        for b in opts.backends:
            kind, p = backend_args(b)
            if kind == "chunked":
                shapes.update((r, k, n) for r in perf_model.chunk_rows(m, p))
    return shapes


def _gemm_timings(case: Case, ctx: RankContext) -> tuple[dict[tuple[str, tuple[int, int, int]], Stats], str | None]:
    """Bare GEMM timings of one case: ``("library", shape)`` (the unfused baseline's GEMM at the full
    shape) and ``("linear", shape)`` (``F.linear`` in the compute dtype at the shapes the model
    needs: full, and each chunk's); the same timing for both where they are one GEMM (plain). Returns
    them and why the library GEMM was not timed (None when it was)."""
    opts, timer = ctx.opts, ctx.timer
    m, k, n = case.gemm_shape
    out: dict[tuple[str, tuple[int, int, int]], Stats] = {}
    for shape in sorted(_linear_shapes(case, opts)):
        key = ("linear", shape, formats.compute_dtype(case))
        if key not in ctx.gemm_cache:
            ctx.gemm_cache[key] = timer.run(
                gemm_call(case, shape, ctx.device, library=False), opts.warmup, opts.repeats
            )
        out[("linear", shape)] = ctx.gemm_cache[key]
    if case.kind == "plain":
        out[("library", (m, k, n))] = out[("linear", (m, k, n))]
        return out, None
    key = ("library", (m, k, n), case.dtype, case.fmt)
    why = None
    if key not in ctx.gemm_cache:
        try:
            fn = gemm_call(case, (m, k, n), ctx.device, library=True)
        except formats.Unsupported as e:
            fn, why = None, str(e)
        if timer.all_ranks_true(fn is not None):
            ctx.gemm_cache[key] = timer.run(fn, opts.warmup, opts.repeats)
        else:
            ctx.gemm_cache[key] = why or "not available on another rank"
    value = ctx.gemm_cache[key]
    if isinstance(value, str):
        return out, value
    out[("library", (m, k, n))] = value
    return out, None


def run_case(case: Case, index: int, ctx: RankContext) -> dict[str, Any]:
    inputs = make_inputs(case, ctx.rank, ctx.opts.seed + index, ctx.device)
    reference = Reference(op_call(case, "sequential", inputs)(), magnitude_bound(case, inputs, ctx.rank, ctx.world))
    rows = []
    for backend in backends_of(case, ctx.opts.backends):
        rec = check_backend(case, backend, inputs, reference=reference, timer=ctx.timer)
        interpreted = ctx.device.type == "cpu" and "fallback" not in rec
        if rec["status"] == "ok" and backend == "fused" and interpreted:
            # Triton's interpreter runs the kernel's programs one by one in Python: a time would say
            # nothing about the design, and the check above already proved that the path runs.
            rec["interpreted"] = True
        elif rec["status"] == "ok":
            rec["time"] = ctx.timer.run(op_call(case, backend, inputs), ctx.opts.warmup, ctx.opts.repeats)
        rows.append(rec)
    del inputs, reference
    gemm_times, gemm_skipped = _gemm_timings(case, ctx)
    comm = concurrent = None
    if ctx.world > 1:
        spec = formats.comm_spec(case)
        comm = ctx.timer.run(comm_call(spec, ctx.world, ctx.device), ctx.opts.warmup, ctx.opts.repeats)
        if calibrating(ctx.opts, ctx.device):
            run = concurrent_call(case, ctx.world, ctx.device)
            concurrent = ctx.timer.run(run, ctx.opts.warmup, ctx.opts.repeats)
    return {
        "case": case,
        "backends": rows,
        "gemm": gemm_times,
        "gemm_skipped": gemm_skipped,
        "comm": comm,
        "concurrent": concurrent,
    }


def calibrating(opts: RunOptions, device: torch.device) -> bool:
    """The link model is fitted to this run's timings (always on CPU, where no datasheet applies)."""
    return opts.model and (opts.calibrate or device.type != "cuda")


def concurrent_call(case: Case, world: int, device: torch.device) -> Callable[[], None]:
    """The bare collective started asynchronously, the bare GEMM (``F.linear`` in the compute dtype) beside
    it, then the wait: what the two cost when they share the machine (on CPU, gloo's threads and the GEMM
    share the cores)."""
    gemm = gemm_call(case, case.gemm_shape, device, library=False)
    start = comm_call(formats.comm_spec(case), world, device, async_op=True)

    def run() -> None:
        work = start()
        gemm()
        work.wait()

    return run


def interference(t_gemm: float, t_comm: float, t_concurrent: float) -> float:
    """Fraction of the overlapped time lost when a GEMM and a collective run side by side, from the
    three bare timings: 0 when together they take max(t_gemm, t_comm), 1 when they serialize
    (t_gemm + t_comm or worse; clamped, so timing noise cannot claim more than serializing)."""
    shorter = min(t_gemm, t_comm)
    if shorter <= 0:
        return 0.0
    return min(1.0, max(0.0, (t_concurrent - max(t_gemm, t_comm)) / shorter))


def _model_gemm(case: Case, backend: str, gemm: dict, stat: str) -> perf_model.GemmTimes:
    """The GEMM times the model predicts ``backend`` from: FP8's baseline and fused paths multiply FP8
    operands (the library GEMM, ``torch._scaled_mm``); every other path the ``F.linear`` of its compute
    dtype (FP8's reference backends multiply dequantized fp32; int8's dequantization is not modelled)."""
    kind = "library" if case.kind == "fp8" and backend_args(backend)[0] in ("baseline", "fused") else "linear"
    return perf_model.GemmTimes({shape: st.pick(stat) for (k, shape), st in gemm.items() if k == kind})


def roofline_gemm(spec: Any, case: Case, backend: str) -> perf_model.GemmTimes:
    """The roofline GEMM of GPU ``spec`` (``--mode model``) that ``backend`` of ``case`` is predicted from, the
    GEMMs :func:`_model_gemm` picks from timings: FP8's baseline and fused paths at the FP8 rate, FP8's
    reference backends in fp32, every other case in its dtype."""
    if case.kind == "fp8" and backend_args(backend)[0] in ("baseline", "fused"):
        return perf_model.GemmTimes(
            fallback=lambda m, k, n: spec.gemm_time(m, k, n, perf_model.FP8, out_dtype=case.dtype, fp8_mode=case.mode)
        )
    dtype = formats.compute_dtype(case)
    return perf_model.GemmTimes(fallback=lambda m, k, n: spec.gemm_time(m, k, n, dtype))


def predict(case: Case, backend: str, gemm: perf_model.GemmTimes, link: perf_model.LinkModel) -> float | None:
    """The model's seconds for ``backend`` of ``case`` (None where it does not cover the backend, or
    where the GEMM it needs was not timed)."""
    try:
        return perf_model.predict(
            case.op,
            backend,
            case.world,
            case.gemm_shape,
            case.comm_elems,
            dtype=formats.model_dtype(case),
            gemm_time=gemm,
            link=link,
            fp8_mode=case.mode if case.kind == "fp8" else "block",
            out_dtype=case.dtype,
        )
    except KeyError:  # GemmTimes without the shape: the library GEMM could not run
        return None


def derive(
    result: dict[str, Any], link: perf_model.LinkModel | None, stat: str = "median", overlap_meaningful: bool = True
) -> dict[str, Any]:
    """Figures of one case from its timings (rank 0); model predictions when a link model is given.

    ``stat`` ("median" or "min") is the statistic of the repeats that every derived figure uses.
    ``overlap_meaningful`` False (CPU ranks): overlap efficiency is left out (``None``). It compares the
    op with a GEMM and a collective that could run at once on separate engines; on CPU gloo's
    collective and the GEMM share the same cores, so the figure measures scheduling (values like
    -9932 % were printed), not overlap. Speedup is over the unfused baseline: the ``baseline`` row
    where the case has one (FP8), else ``sequential``."""
    case: Case = result["case"]
    t_gemm: Stats | None = result["gemm"].get(("library", case.gemm_shape))
    t_comm: Stats | None = result["comm"]
    g = t_gemm.pick(stat) if t_gemm is not None else None
    c = t_comm.pick(stat) if t_comm is not None else None
    comm_bytes = formats.comm_spec(case).nbytes
    out: dict[str, Any] = {
        **case.to_dict(),
        "label": case.label,
        "stat": stat,
        "gemm_ms": t_gemm.to_ms() if t_gemm is not None else None,
        "gemm_tflops": case.flops / g / 1e12 if g else None,
        "comm_ms": t_comm.to_ms() if t_comm else None,
        "comm_bytes": comm_bytes,
        "comm_busbw_GBps": perf_model.bus_factor(case.collective, case.world) * comm_bytes / c / 1e9 if c else None,
        "backends": [],
    }
    if result.get("gemm_skipped"):
        out["gemm_skipped"] = result["gemm_skipped"]
    concurrent: Stats | None = result.get("concurrent")
    if concurrent is not None and link is not None and c is not None:
        t_linear = result["gemm"][("linear", case.gemm_shape)].pick(stat)
        slowdown = interference(t_linear, c, concurrent.pick(stat))
        out["concurrent_ms"] = concurrent.to_ms()
        out["model_gemm_slowdown"] = slowdown
        link = dataclasses.replace(link, chunked_gemm_slowdown=slowdown, fused_gemm_slowdown=slowdown)
    base_name = "baseline" if formats.has_baseline_row(case) else "sequential"
    base = next((r["time"].pick(stat) for r in result["backends"] if r["backend"] == base_name and "time" in r), None)
    for r in result["backends"]:
        row = {key: v for key, v in r.items() if key != "time"}
        t = r["time"].pick(stat) if "time" in r else None
        if t is not None:
            row["ms"] = r["time"].to_ms()
            row["tflops"] = case.flops / t / 1e12
            row["speedup"] = base / t if base else None
            row["overlap_eff"] = (g + c - t) / min(g, c) if g and c and overlap_meaningful else None
        if link is not None:
            pred = predict(case, r["backend"], _model_gemm(case, r["backend"], result["gemm"], stat), link)
            row["model_ms"] = pred * 1e3 if pred is not None else None
            if pred is not None and t is not None:
                row["model_rel_err"] = (pred - t) / t
        out["backends"].append(row)
    return out


def run_world(rank: int, world: int, device: torch.device, cases: list[Case], opts: RunOptions) -> dict[str, Any]:
    """All cases of one world size on this rank; rank 0 returns the derived records."""
    ctx = RankContext(rank, world, device, Timer(device), opts)
    progress = Progress(len(cases), f"W={world}", opts.progress and rank == 0)
    link = None
    calib: list[tuple[str, int, float, float]] = []
    if opts.model and world > 1:
        if calibrating(opts, device):
            calib = calibration_samples(ctx, cases)
            link = perf_model.calibrate(calib, name=f"{device.type}-{dist.get_backend()}-calibrated")
        elif opts.gpu_generation:
            link, _ = perf_model.load_gpu(opts.gpu_generation)
    elif opts.model and world == 1 and device.type == "cuda" and opts.gpu_generation:
        link, _ = perf_model.load_gpu(opts.gpu_generation)
    elif opts.model and world == 1:
        link = perf_model.LinkModel(name="no-communication", source="world size 1: no collective")
    results = []
    for i, case in enumerate(cases):
        results.append(run_case(case, i, ctx))
        progress.step(case.label)
    if rank != 0:
        return {}
    records = [derive(r, link, opts.stat, overlap_meaningful=device.type == "cuda") for r in results]
    return {
        "world": world,
        "records": records,
        "link_model": link.describe() if link is not None else None,
        "calibration_samples": [{"collective": c, "world": w, "bytes": b, "seconds": s} for c, w, b, s in calib],
    }
