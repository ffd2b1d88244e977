"""What every rank runs: correctness check, then timing of each backend, the bare GEMM and the
bare collective; rank 0 derives the figures (TFLOP/s, bus bandwidth, speedup, overlap efficiency)
and the model's predictions.

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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench import model as perf_model
from bench.suites import DTYPE_BYTES, Case, backend_args
from bench.timing import Stats, Timer

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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


def _kernels() -> Any:
    import kernels

    return kernels


def has_op(op: str) -> bool:
    try:
        return callable(getattr(_kernels(), op, None)) and (
            op != "quantized_matmul_all_reduce" or callable(getattr(_kernels(), "quantize_weight", None))
        )
    except ImportError:
        return False


def _comm_module() -> Any:
    from kernels import comm

    return comm


def agreement(
    out: torch.Tensor, other: torch.Tensor, magnitude: torch.Tensor, dtype: str, k: int, world: int
) -> tuple[bool, float]:
    """``(ok, worst)``: whether two results of one op agree elementwise within twice the bound of
    ``kernels.testing.tolerance`` (each is within it of the exact result), ``worst`` the largest
    ``|out - other| / allowed`` (NaN counts as infinite). ``magnitude``: ``sum_r |x_r| @ |w_r|.T``
    or an upper bound of it (``kernels.testing.row_norm_bound``), shaped like the 2-D result. With
    TF32 allowed for fp32 matmuls on a GPU, cuBLAS and the fused kernels round the operands to TF32."""
    from kernels.testing import tolerance

    if out.numel() == 0:
        return True, 0.0
    td = TORCH_DTYPES[dtype]
    tf32 = td is torch.float32 and out.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    allowed = 2 * tolerance(td, k, world, operand_eps=2.0**-10 if tf32 else 0.0) * magnitude.to(out.device)
    diff = (out.double() - other.double()).reshape(allowed.shape).abs()
    ratio = (diff / allowed.clamp_min(torch.finfo(torch.float64).tiny)).nan_to_num(nan=float("inf"))
    worst = float(ratio.max())
    return worst <= 1.0, worst


def _row_norms(case: Case, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    x = inputs["x"]
    if case.op == "quantized_matmul_all_reduce":
        from kernels.quant import dequantize

        w = dequantize(inputs["qweight"], inputs["scale"], dtype=torch.float32)
    else:
        w = inputs["weight"]
    return x.reshape(-1, x.shape[-1]).double().norm(dim=-1), w.double().norm(dim=-1)


def magnitude_bound(case: Case, inputs: dict[str, Any], rank: int, world: int) -> torch.Tensor:
    """An elementwise upper bound of ``sum |x| @ |w|.T`` over what this rank's output sums: every
    rank's rows against this rank's weight (all-gather), or every rank's products (reductions), from
    the ranks' row norms (collective when ``world > 1``: every rank calls it)."""
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


def make_inputs(case: Case, rank: int, seed: int, device: torch.device) -> dict[str, Any]:
    """Operands of one case; x differs per rank, values scaled so outputs are O(1)."""
    dtype = TORCH_DTYPES[case.dtype]
    g = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    x = torch.randn(case.x_shape, generator=g, device=device).to(dtype)
    w = (torch.randn(case.w_shape, generator=g, device=device) / math.sqrt(case.k)).to(dtype)
    inputs = {"x": x, "weight": w}
    if case.op == "quantized_matmul_all_reduce":
        qweight, scale = _kernels().quantize_weight(w, mode="per_channel")
        inputs.update(qweight=qweight, scale=scale)
    return inputs


def op_call(case: Case, backend: str, inputs: dict[str, Any]) -> Callable[[], torch.Tensor]:
    fn = getattr(_kernels(), case.op)
    kind, p = backend_args(backend)
    if case.op == "quantized_matmul_all_reduce":
        return lambda: fn(inputs["x"], inputs["qweight"], inputs["scale"], backend=kind, parallel_num=p)
    return lambda: fn(inputs["x"], inputs["weight"], backend=kind, parallel_num=p)


def gemm_call(m: int, k: int, n: int, dtype: str, device: torch.device) -> Callable[[], torch.Tensor]:
    """The bare local GEMM (``torch.nn.functional.linear``, cuBLAS on GPUs)."""
    x = torch.randn(m, k, device=device).to(TORCH_DTYPES[dtype])
    w = (torch.randn(n, k, device=device) / math.sqrt(k)).to(TORCH_DTYPES[dtype])
    return lambda: F.linear(x, w)


def comm_call(
    collective: str, elems: int, row_len: int, world: int, dtype: str, device: torch.device
) -> Callable[[], object]:
    """The bare collective of the op's sequential path on a full tensor of ``elems`` elements."""
    comm = _comm_module()
    td = TORCH_DTYPES[dtype]
    rows = elems // row_len
    if collective == "all_gather":
        inp = torch.zeros(rows // world, row_len, dtype=td, device=device)
        out = torch.empty(rows, row_len, dtype=td, device=device)
        return lambda: comm.all_gather(out, inp, None)
    if collective == "reduce_scatter":
        inp = torch.zeros(rows, row_len, dtype=td, device=device)
        out = torch.empty(rows // world, row_len, dtype=td, device=device)
        return lambda: comm.reduce_scatter(out, inp, None)
    # Zeros stay zeros under repeated in-place sums: no overflow however many repeats.
    buf = torch.zeros(rows, row_len, dtype=td, device=device)
    return lambda: comm.all_reduce(buf, None)


def calibration_samples(
    timer: Timer, world: int, device: torch.device, cases: list[Case], opts: RunOptions
) -> list[tuple[str, int, float, float]]:
    """Collective-only timings at sizes spanning the cases' (and their chunks') sizes, for the fit."""
    samples: list[tuple[str, int, float, float]] = []
    by_coll: dict[tuple[str, str], list[int]] = {}
    for c in cases:
        by_coll.setdefault((c.collective, c.dtype), []).append(c.comm_elems)
    p_max = max([backend_args(b)[1] or 1 for b in opts.backends] + [world])
    for (coll, dtype), sizes in sorted(by_coll.items()):
        lo, hi = max(world * 64, min(sizes) // (2 * p_max)), max(sizes)
        points = sorted({int(lo * (hi / lo) ** (i / 4)) // (world * 64) * (world * 64) or world * 64 for i in range(5)})
        for elems in points:
            stats = timer.run(comm_call(coll, elems, 64, world, dtype, device), opts.warmup, opts.repeats)
            samples.append((coll, world, float(elems * DTYPE_BYTES[dtype]), stats.pick(opts.stat)))
    return samples


def fallback_reason(caught: list[warnings.WarningMessage]) -> str | None:
    """The dispatcher's warning that a fused request ran on the chunked path, if one was caught."""
    for w in caught:
        msg = str(w.message)
        if "fused" in msg and ("instead" in msg or "fall" in msg):
            return msg
    return None


FUSED_FALLBACK: dict[str, str] = {}  # the dispatcher warns once per process: remember why


def check_backend(
    case: Case, backend: str, inputs: dict[str, Any], ref: torch.Tensor, magnitude: torch.Tensor, timer: Timer
) -> dict[str, Any]:
    """Run once, compare with sequential (:func:`agreement`); every rank returns the same status."""
    rec: dict[str, Any] = {"backend": backend}
    error = None
    out = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = op_call(case, backend, inputs)()
        except (NotImplementedError, ImportError) as e:
            error = f"not available: {type(e).__name__}: {e}"
        except Exception as e:  # reported per backend; the other backends still run
            error = f"{type(e).__name__}: {e}"
    if backend == "fused":
        reason = fallback_reason(caught)
        if reason:
            FUSED_FALLBACK[case.op] = reason
        if error is None and case.op in FUSED_FALLBACK:
            rec["fallback"] = FUSED_FALLBACK[case.op]
    ran = timer.all_ranks_true(error is None)
    if not ran:
        rec.update(status="skipped", reason=error or "failed on another rank")
        return rec
    world = dist.get_world_size(timer.group) if timer.distributed else 1
    ok, worst = agreement(out, ref, magnitude, case.dtype, case.k, world)
    ok_all = timer.all_ranks_true(ok)
    diff = (out.float() - ref.float()).abs()
    errs = timer.max_over_ranks([diff.max().item() if diff.numel() else 0.0, worst])
    rec.update(max_abs_err=errs[0], error_over_bound=errs[1])
    rec["status"] = "ok" if ok_all else "incorrect"
    if not ok_all:
        rec["reason"] = (
            f"|out - sequential| exceeds twice the tolerance bound (kernels.testing.tolerance) {errs[1]:.3g}-fold "
            f"(max |out - sequential| = {errs[0]:.3g})"
        )
    return rec


def run_case(
    case: Case,
    index: int,
    rank: int,
    world: int,
    device: torch.device,
    timer: Timer,
    opts: RunOptions,
    gemm_cache: dict,
) -> dict[str, Any]:
    inputs = make_inputs(case, rank, opts.seed + index, device)
    ref = op_call(case, "sequential", inputs)()
    magnitude = magnitude_bound(case, inputs, rank, world)
    rows = []
    for backend in opts.backends:
        rec = check_backend(case, backend, inputs, ref, magnitude, timer)
        if rec["status"] == "ok" and backend == "fused" and device.type == "cpu" and "fallback" not in rec:
            # Triton's interpreter runs the kernel's programs one by one in Python: a time would say
            # nothing about the design, and the check above already proved that the path runs.
            rec["interpreted"] = True
        elif rec["status"] == "ok":
            rec["time"] = timer.run(op_call(case, backend, inputs), opts.warmup, opts.repeats)
        rows.append(rec)
    del inputs, ref, magnitude
    m, k, n = case.gemm_shape
    shapes = {(m, k, n)}
    if opts.model:
        for b in opts.backends:
            kind, p = backend_args(b)
            if kind == "chunked":
                shapes.update((r, k, n) for r in perf_model.chunk_rows(m, p))
    gemm_times = {}
    for shape in sorted(shapes):
        key = shape + (case.dtype,)
        if key not in gemm_cache:
            gemm_cache[key] = timer.run(gemm_call(*shape, case.dtype, device), opts.warmup, opts.repeats)
        gemm_times[shape] = gemm_cache[key]
    comm = concurrent = None
    if world > 1:
        row_len = case.n if case.row_parallel else case.k
        comm_fn = comm_call(case.collective, case.comm_elems, row_len, world, case.dtype, device)
        comm = timer.run(comm_fn, opts.warmup, opts.repeats)
        if calibrating(opts, device):
            concurrent = timer.run(concurrent_call(case, world, device), opts.warmup, opts.repeats)
    return {"case": case, "backends": rows, "gemm": gemm_times, "comm": comm, "concurrent": concurrent}


def calibrating(opts: RunOptions, device: torch.device) -> bool:
    """The link model is fitted to this run's timings (always on CPU, where no datasheet applies)."""
    return opts.model and (opts.calibrate or device.type != "cuda")


def concurrent_call(case: Case, world: int, device: torch.device) -> Callable[[], None]:
    """The bare collective started asynchronously, the bare GEMM beside it, then the wait: what the
    two cost when they share the machine (on CPU, gloo's threads and the GEMM share the cores)."""
    comm = _comm_module()
    m, k, n = case.gemm_shape
    gemm = gemm_call(m, k, n, case.dtype, device)
    td = TORCH_DTYPES[case.dtype]
    row_len = case.n if case.row_parallel else case.k
    rows = case.comm_elems // row_len
    if case.collective == "all_gather":
        inp = torch.zeros(rows // world, row_len, dtype=td, device=device)
        out = torch.empty(rows, row_len, dtype=td, device=device)
        start = functools.partial(comm.all_gather, out, inp, None, async_op=True)
    elif case.collective == "reduce_scatter":
        inp = torch.zeros(rows, row_len, dtype=td, device=device)
        out = torch.empty(rows // world, row_len, dtype=td, device=device)
        start = functools.partial(comm.reduce_scatter, out, inp, None, async_op=True)
    else:
        buf = torch.zeros(rows, row_len, dtype=td, device=device)
        start = functools.partial(comm.all_reduce, buf, None, async_op=True)

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


def derive(
    result: dict[str, Any], link: perf_model.LinkModel | None, stat: str = "median", overlap_meaningful: bool = True
) -> dict[str, Any]:
    """Figures of one case from its timings (rank 0); model predictions when a link model is given.

    ``stat`` ("median" or "min") is the statistic of the repeats that every derived figure uses.
    ``overlap_meaningful`` False (CPU ranks): overlap efficiency is left out (``None``). It compares the
    op with a GEMM and a collective that could run at once on separate engines; on CPU gloo's
    collective and the GEMM share the same cores, so the figure measures scheduling (values like
    -9932 % were printed), not overlap."""
    case: Case = result["case"]
    t_gemm: Stats = result["gemm"][case.gemm_shape]
    t_comm: Stats | None = result["comm"]
    g = t_gemm.pick(stat)
    c = t_comm.pick(stat) if t_comm is not None else None
    comm_bytes = case.comm_elems * DTYPE_BYTES[case.dtype]
    out: dict[str, Any] = {
        **case.to_dict(),
        "label": case.label,
        "stat": stat,
        "gemm_ms": t_gemm.to_ms(),
        "gemm_tflops": case.flops / g / 1e12,
        "comm_ms": t_comm.to_ms() if t_comm else None,
        "comm_bytes": comm_bytes,
        "comm_busbw_GBps": perf_model.bus_factor(case.collective, case.world) * comm_bytes / c / 1e9 if c else None,
        "backends": [],
    }
    gemm_fn = perf_model.GemmTimes({shape: st.pick(stat) for shape, st in result["gemm"].items()})
    concurrent: Stats | None = result.get("concurrent")
    if concurrent is not None and link is not None and c is not None:
        slowdown = interference(g, c, concurrent.pick(stat))
        out["concurrent_ms"] = concurrent.to_ms()
        out["model_gemm_slowdown"] = slowdown
        link = dataclasses.replace(link, chunked_gemm_slowdown=slowdown, fused_gemm_slowdown=slowdown)
    seq = next((r["time"].pick(stat) for r in result["backends"] if r["backend"] == "sequential" and "time" in r), None)
    for r in result["backends"]:
        row = {key: v for key, v in r.items() if key != "time"}
        t = r["time"].pick(stat) if "time" in r else None
        if t is not None:
            row["ms"] = r["time"].to_ms()
            row["tflops"] = case.flops / t / 1e12
            row["speedup"] = seq / t if seq else None
            row["overlap_eff"] = (g + c - t) / min(g, c) if c and overlap_meaningful else None
        if link is not None:
            pred = perf_model.predict(
                case.op,
                r["backend"],
                case.world,
                case.gemm_shape,
                case.comm_elems,
                dtype=case.dtype,
                gemm_time=gemm_fn,
                link=link,
            )
            row["model_ms"] = pred * 1e3 if pred is not None else None
            if pred is not None and t is not None:
                row["model_rel_err"] = (pred - t) / t
        out["backends"].append(row)
    return out


def run_world(rank: int, world: int, device: torch.device, cases: list[Case], opts: RunOptions) -> dict[str, Any]:
    """All cases of one world size on this rank; rank 0 returns the derived records."""
    timer = Timer(device)
    progress = Progress(len(cases), f"W={world}", opts.progress and rank == 0)
    link = None
    calib: list[tuple[str, int, float, float]] = []
    if opts.model and world > 1:
        if calibrating(opts, device):
            calib = calibration_samples(timer, world, device, cases, opts)
            link = perf_model.calibrate(calib, name=f"{device.type}-{dist.get_backend()}-calibrated")
        elif opts.gpu_generation:
            link, _ = perf_model.load_gpu(opts.gpu_generation)
    elif opts.model and world == 1 and device.type == "cuda" and opts.gpu_generation:
        link, _ = perf_model.load_gpu(opts.gpu_generation)
    elif opts.model and world == 1:
        link = perf_model.LinkModel(name="no-communication", source="world size 1: no collective")
    gemm_cache: dict = {}
    results = []
    for i, case in enumerate(cases):
        results.append(run_case(case, i, rank, world, device, timer, opts, gemm_cache))
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
