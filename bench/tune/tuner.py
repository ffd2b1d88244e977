"""``python -m bench --mode tune``: time the GEMM configuration space on this GPU, write the winners.

For every case (:func:`gpu_cases`: an operand format and x's dtype, plain bf16 / fp16, FP8 block, row
and tensor scales, int8 weights per_group and per_channel) and every shape of :func:`gpu_shapes`
(LLaMA-2/3-70B TP8 per-rank GEMMs, 8192^3, decode-size and rows-per-owner ``m``) the tuner

1. builds the operands (FP8: ``kernels.quantize_fp8`` of random x and weight; int8:
   ``kernels.quantize_weight``) and times the unfused baseline: cuBLAS (``torch.matmul(x, w.T)``;
   for int8 weights on the dequantized weight, for FP8 ``torch._scaled_mm`` where this torch runs
   the mode's scales, else none),
2. runs every config of the case's space for the shape's family
   (:func:`kernels.fused.gemm_configs.format_space`) once, checks its result (plain and int8:
   against cuBLAS within :func:`rounding_bound`; FP8: against the fp64 product of the dequantized
   operands within ``kernels.fp8.numerics.op_error_bound``; a config that fails to compile or
   computes a wrong result is skipped, and said so), and times it: plain configs through
   ``kernels.fused.matmul.linear`` (every variant), the others through the local GEMM core
   ``kernels.fused.matmul.gemm(fmt, ...)`` with the config's tiles,
3. keeps the fastest config per op: the bare ``matmul`` of plain operands chooses among all variants
   (TMA, persistent, plain); the fused ops (timed at W = 1: their local GEMM is the plain tile core,
   the same kernel body the fused kernels run between their waits), and every op of FP8 and int8
   operands (the tile core is their only kernel), among the plain configs,
4. does the same for the grouped GEMM of mixture-of-experts layers (``grouped_matmul``, plain operands,
   Qwen3-30B-A3B's expert shapes, :mod:`bench.tune.grouped`): its kernel's configs only (the tile core),
   checked per expert against fp32 within :func:`rounding_bound`, beside ``torch._grouped_mm``; its
   entries keyed by the rows per expert,

and writes ``configs/tuned/<gpu-name>.yaml`` (:mod:`kernels.fused.tuned`; entries of another format
than plain carry ``format:``; ``--out-dir`` writes there instead) with the baseline's time beside each
winner, printing each winner as it is found under one header (:func:`table`). Timings are shared: a
config timed on a shape for ``matmul`` is not timed again for a fused op of the same shape and case.

Time bound: the space is small (about a dozen configs per family, each compiled once per case for
all shapes), a timing is a few milliseconds of repeats, and a budget (``budget_s``, default 200 s)
stops starting new shapes once spent (the skipped shapes are listed; the cases run in
:func:`gpu_cases`' order, so the budget cuts from its end), so the whole run fits in gpu-check's 9
minutes. ``--allow-cpu`` runs the same flow on CPU under the interpreter with tiny shapes, the CPU
space and :func:`cpu_cases` (CI); its file, ``cpu.yaml``, always goes to ``--out-dir`` (by default
``./bench_results``): the kernels read a CPU file only from ``COC_TUNED_DIR``, so it has no place in
``configs/tuned``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from bench.tune import grouped
from bench.tune.problem import Case, Problem, TuneShape, rounding_bound
from bench.tune.problem import within as _within

if TYPE_CHECKING:  # kernels imports triton, which must follow TRITON_INTERPRET (run, bench/__main__.py)
    from kernels.format import OperandFormat

# Timer: (callable, key) -> seconds per call. ``key`` names what is timed, (shape label, case name
# (:attr:`Case.name`: the dtype name for plain operands), config label or "cublas" for the baseline),
# so a fake timer in tests can answer per config.
Timer = Callable[[Callable[[], object], tuple[str, str, str]], float]
DEFAULT_BUDGET_S = 200.0
_CUBLAS = "cublas"


def gpu_cases() -> list[Case]:
    """What a GPU run tunes, in this order (the budget cuts from the end): bf16, the FP8 scaling modes
    (e4m3 payloads: block, the DeepSeek-V3 recipe of 1x128 x / 128x128 weight scales, first), int8
    weights with bf16 activations (per_group of 128, per_channel), FP8 tensor, int8 per_tensor, then fp16."""
    from kernels.format import PLAIN, fp8, int8

    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    return [
        Case(PLAIN, bf16),
        Case(fp8("block"), e4m3),
        Case(int8("per_group", 128, False), bf16),
        Case(fp8("row"), e4m3),
        Case(int8("per_channel", 0, False), bf16),
        Case(fp8("tensor"), e4m3),
        Case(int8("per_tensor", 0, False), bf16),
        Case(PLAIN, torch.float16),
    ]


# int8 per_group's group on CPU: the tiny shapes' k of 32 holds two groups.
CPU_GROUP_SIZE = 16


def cpu_cases() -> list[Case]:
    """The interpreter's cases: every format of :func:`gpu_cases`, plain in bf16 only, int8 weights
    with fp16 activations (chosen when the interpreter converted fp32 to bf16 by truncation, so that its bf16
    dequantized weight tiles differed from ``kernels.quant.dequantize``'s by an ulp; it now rounds as the
    reference does, ``kernels/fused/interpreter_compat.py``) and
    per_group of :data:`CPU_GROUP_SIZE`, so ``--allow-cpu`` runs each format's path end to end."""
    from kernels.format import PLAIN, fp8, int8

    e4m3 = torch.float8_e4m3fn
    return [
        Case(PLAIN, torch.bfloat16),
        Case(fp8("block"), e4m3),
        Case(int8("per_group", CPU_GROUP_SIZE, False), torch.float16),
        Case(fp8("row"), e4m3),
        Case(int8("per_channel", 0, False), torch.float16),
        Case(fp8("tensor"), e4m3),
        Case(int8("per_tensor", 0, False), torch.float16),
    ]


_FUSED_AG = ("all_gather_matmul",)
_FUSED_RS = ("matmul_reduce_scatter", "matmul_all_reduce")


def gpu_shapes() -> list[TuneShape]:
    """LLaMA-2/3-70B at TP8 (hidden 8192, FFN 28672, 64 heads / 8 KV heads of 128): per-rank GEMMs of
    4096 tokens, 512 rows (a TP8 owner's rows of 4096 tokens) and 16 (decode), and 8192^3.

    QKV ``n = (8192 + 2 * 1024) / 8``, out-projection ``k = 8192 / 8``, gate+up ``n = 2 * 28672 / 8``,
    down ``k = 28672 / 8``. The column-parallel GEMMs (QKV, gate+up) follow an all-gather, the
    row-parallel ones (out, down) precede a reduce-scatter / all-reduce. Then the grouped GEMMs of
    :func:`bench.tune.grouped.gpu_shapes` (Qwen3-30B-A3B's experts).
    """
    mm = ("matmul",)
    return [
        TuneShape("8192^3", 8192, 8192, 8192, mm),
        TuneShape("qkv m4096", 4096, 1280, 8192, mm + _FUSED_AG),
        TuneShape("gate_up m4096", 4096, 7168, 8192, mm + _FUSED_AG),
        TuneShape("out m4096", 4096, 8192, 1024, mm + _FUSED_RS),
        TuneShape("down m4096", 4096, 8192, 3584, mm + _FUSED_RS),
        TuneShape("gate_up m512", 512, 7168, 8192, mm + _FUSED_AG),
        TuneShape("down m512", 512, 8192, 3584, mm + _FUSED_RS),
        TuneShape("gate_up m16", 16, 7168, 8192, mm + _FUSED_AG),
        TuneShape("down m16", 16, 8192, 3584, mm + _FUSED_RS),
        *grouped.gpu_shapes(),
    ]


def cpu_shapes() -> list[TuneShape]:
    """Tiny shapes for the interpreter (one per family), so ``--allow-cpu`` runs in seconds."""
    all_ops = ("matmul",) + _FUSED_AG + _FUSED_RS
    return [
        TuneShape("cpu m16", 16, 32, 32, all_ops),
        TuneShape("cpu m80", 80, 32, 32, all_ops),
        *grouped.cpu_shapes(),
    ]


def cuda_timer(warmup: int = 2, target_s: float = 0.02, max_reps: int = 50) -> Timer:
    """CUDA-event timer: ``warmup`` calls (the first compiles), then repeats filling about ``target_s``."""

    def timer(fn: Callable[[], object], key: tuple[str, str, str]) -> float:
        for _ in range(warmup):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        once = max(start.elapsed_time(end) / 1e3, 1e-6)
        reps = max(3, min(max_reps, int(target_s / once)))
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    return timer


def cpu_timer(reps: int = 1) -> Timer:
    """Wall-clock timer for the interpreter (times are meaningless; the flow is what CI checks). No
    warm-up: :func:`tune` has run every config once already (its correctness check)."""

    def timer(fn: Callable[[], object], key: tuple[str, str, str]) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    return timer


def select(timings: dict[str, float | None], candidates: list, label: Callable[[object], str]):
    """The fastest candidate with a time (ties: the earlier in ``candidates``), or None."""
    best, best_t = None, float("inf")
    for c in candidates:
        t = timings.get(label(c))
        if t is not None and t < best_t:
            best, best_t = c, t
    return best


def _plain_problem(x: torch.Tensor, w: torch.Tensor) -> Problem:
    """Plain operands: :func:`kernels.fused.matmul.linear` with the config (every variant), against cuBLAS."""
    from kernels.fused import matmul

    ref = torch.matmul(x, w.T)
    bound = rounding_bound(ref, x, w)
    return Problem(
        run=lambda cfg: matmul.linear(x, w, config=cfg, fallback=False),
        check=lambda y: _within(y.float(), ref.float(), bound),
        baseline=lambda: torch.matmul(x, w.T),
    )


def _core_run(fmt: OperandFormat, ops: object, out_dtype: torch.dtype) -> Callable[[object], torch.Tensor]:
    """The local GEMM core (:func:`kernels.fused.matmul.gemm`) of ``fmt`` with a config's tiles."""
    from kernels.fused import blocks, matmul

    def run(cfg: object) -> torch.Tensor:
        # ag_splits is the all-gather's: the local GEMM has none.
        return matmul.gemm(fmt, ops, out_dtype=out_dtype, cfg=blocks.as_blocks(cfg, 1))

    return run


# The FP8 ops' usual output dtype; the core accumulates in fp32 and rounds once to it.
FP8_OUT_DTYPE = torch.bfloat16


def _fp8_problem(case: Case, x: torch.Tensor, w: torch.Tensor) -> Problem:
    """FP8 operands (``case.fmt.mode`` scales), out in bf16: checked against the fp64 product of the
    dequantized operands within :func:`kernels.fp8.numerics.op_error_bound` (promoted accumulation;
    the tensor-core sums at Hopper's precision on a GPU, fp32's under the interpreter), the bound of
    the FP8 tests; the baseline is ``torch._scaled_mm`` where this torch runs the mode's scales."""
    from bench.dense import formats
    from kernels.fp8.numerics import HOPPER_FP8_ACCUMULATOR, U32, op_error_bound
    from kernels.fp8.quantize import expand_scale, quantize_fp8
    from kernels.ops.gemm import Operands

    x_mode, w_mode = formats.FP8_QUANT_MODES[case.fmt.mode]
    xq, xs = quantize_fp8(x, mode=x_mode, dtype=case.dtype)
    wq, ws = quantize_fp8(w, mode=w_mode, dtype=case.dtype)
    dx = xq.double() * expand_scale(xs.double(), x_mode, *x.shape)
    dw = wq.double() * expand_scale(ws.double(), w_mode, *w.shape)
    ref, abs_sum = dx @ dw.T, dx.abs() @ dw.abs().T
    del dx, dw
    u_acc = HOPPER_FP8_ACCUMULATOR if x.is_cuda else U32
    bound = op_error_bound(ref, abs_sum, x.shape[1], 1, out_dtype=FP8_OUT_DTYPE, accumulation="promoted", u_acc=u_acc)
    # torch._scaled_mm is held to the bound bench.dense.formats.fp8_bound gives the library GEMM: promoted at
    # Hopper's accumulator precision on a GPU, plain fp32 sums on CPU.
    library = "promoted" if x.is_cuda else "fp32"
    library_bound = op_error_bound(
        ref, abs_sum, x.shape[1], 1, out_dtype=FP8_OUT_DTYPE, accumulation=library, u_acc=u_acc
    )
    del abs_sum
    baseline = None
    try:
        # The layout of the scales this torch accepts, picked once per mode on a probe product.
        i = formats.scaled_mm_layout(case.fmt.mode, FP8_OUT_DTYPE, str(x.device))
        scale_a, scale_b = formats.scaled_mm_layouts(case.fmt.mode, xs, ws)[i]
        scaled_mm = partial(torch._scaled_mm, xq, wq.t(), scale_a, scale_b, out_dtype=FP8_OUT_DTYPE)
        if _within(scaled_mm().double(), ref, library_bound) is None:
            baseline = scaled_mm
    except (formats.Unsupported, RuntimeError, ValueError, NotImplementedError, TypeError):
        pass  # no baseline: the table shows "-" (this torch cannot run the mode, e.g. e5m2 x e5m2)
    return Problem(
        run=_core_run(case.fmt, Operands(xq, (wq,), (None,), xs, (ws,)), FP8_OUT_DTYPE),
        check=lambda y: _within(y.double(), ref, bound),
        baseline=baseline,
    )


def _int8_problem(case: Case, x: torch.Tensor, w: torch.Tensor) -> Problem:
    """int8 weights (w8A16, ``kernels.quantize_weight`` of ``case.fmt.mode``), x in ``case.dtype``: the
    core computes ``x @ dequant(w).T`` with the dequantized weight rounded to x's dtype, so cuBLAS on
    that weight is both the reference (within :func:`rounding_bound`) and the baseline."""
    from kernels.format import dequantize_weight
    from kernels.ops.gemm import Operands
    from kernels.quant import quantize_weight

    fmt = case.fmt
    q, scale = quantize_weight(w.to(case.dtype), fmt.mode, fmt.group_size or None)
    xd = x.to(case.dtype)
    wd = dequantize_weight(fmt, q, scale, None, xd.dtype)
    ref = torch.matmul(xd, wd.T)
    bound = rounding_bound(ref, xd, wd)
    return Problem(
        run=_core_run(fmt, Operands(xd, (q,), (None,), None, (scale,)), xd.dtype),
        check=lambda y: _within(y.float(), ref.float(), bound),
        baseline=lambda: torch.matmul(xd, wd.T),
    )


def _problem(case: Case, shape: TuneShape, device: torch.device) -> Problem:
    if shape.experts:
        return grouped.problem(case, shape, device)
    gen = torch.Generator(device=device).manual_seed(0)
    if case.fmt.kind == "plain":
        x = torch.randn(shape.m, shape.k, generator=gen, device=device).to(case.dtype)
        w = torch.randn(shape.n, shape.k, generator=gen, device=device).to(case.dtype)
        return _plain_problem(x, w)
    x = torch.randn(shape.m, shape.k, generator=gen, device=device)
    w = torch.randn(shape.n, shape.k, generator=gen, device=device)
    if case.fmt.kind == "fp8":
        # Rows a power of 2 apart, so that a config that misreads the scales computes a wrong result.
        x = x * torch.exp2(torch.randint(-3, 4, (shape.m, 1), generator=gen, device=device).float())
        return _fp8_problem(case, x, w)
    return _int8_problem(case, x, w)


def _time_space(
    problem: Problem, space: list, timer: Timer, where: tuple[str, str]
) -> tuple[dict[str, float | None], dict[str, str]]:
    """Time each config of ``space`` on ``problem`` (``where``: the shape's and case's labels, for the timer):
    ``(timings, notes)`` by config label. A config that fails or computes a wrong result is never timed: its
    time is None and its note says why, so it cannot be chosen."""
    timings: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    for cfg in space:
        try:
            got = problem.run(cfg)
        except Exception as err:  # a config that cannot compile here is reported, not fatal
            timings[cfg.label()], notes[cfg.label()] = None, f"failed: {type(err).__name__}"
            continue
        wrong = problem.check(got)
        if wrong is not None:
            timings[cfg.label()], notes[cfg.label()] = None, wrong
            continue
        timings[cfg.label()] = timer(lambda cfg=cfg, run=problem.run: run(cfg), (*where, cfg.label()))
    return timings, notes


def tune(
    shapes: list[TuneShape],
    cases: list[Case | torch.dtype],
    device: torch.device,
    timer: Timer,
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
    checkpoint: Callable[[list, list[str]], None] | None = None,
) -> tuple[list, list[dict], list[str]]:
    """Time the space of each case (a bare dtype: plain operands) on ``shapes``; ``(file entries, table
    rows, skipped shapes)``. The cases run in the order given, each over every shape; the budget cuts
    from the end.

    ``checkpoint(entries, skipped)`` runs after every shape, so a run killed from outside (gpu-check's
    section deadline) leaves the winners found so far in the file.
    """
    from kernels.format import PLAIN
    from kernels.fused import gemm_configs, tuned

    start = clock()
    entries, rows, skipped = [], [], []
    for case in cases:
        case = case if isinstance(case, Case) else Case(PLAIN, case)
        for shape in shapes:
            if shape.experts and case.fmt.kind not in grouped.FORMATS:
                continue  # a grouped GEMM of a format its tuner does not build (no entry: the defaults)
            if clock() - start > budget_s:
                skipped.append(f"{shape.label} {case.name}")
                continue
            problem = _problem(case, shape, device)
            base = None
            if problem.baseline is not None:
                base = timer(problem.baseline, (shape.label, case.name, _CUBLAS))
            space = gemm_configs.format_space(case.fmt, gemm_configs.family(shape.rows), device.type)
            if problem.variants is not None:
                space = [c for c in space if c.variant in problem.variants]
            timings, notes = _time_space(problem, space, timer, (shape.label, case.name))
            for op in shape.ops:
                plain_core = op != "matmul" or case.fmt.kind != "plain"
                pool = [c for c in space if c.variant == "plain"] if plain_core else space
                best = select(timings, pool, lambda c: c.label())
                if best is None:
                    log(f"tune: {op} {shape.label} {case.name}: no config ran ({notes}); no entry")
                    continue
                t = timings[best.label()]
                base_ms = None if base is None else base * 1e3
                entries.append(
                    tuned.Entry(
                        op, case.dtype_name, shape.rows, shape.n, shape.k, best, t * 1e3, base_ms, case.fmt.encode()
                    )
                )
                row = dict(
                    op=op,
                    shape=shape.label,
                    m=shape.m,
                    n=shape.n,
                    k=shape.k,
                    dtype=case.dtype_name,
                    format=case.fmt.encode(),
                    config=best.label(),
                    ms=t * 1e3,
                    cublas_ms=base_ms,
                    vs_cublas=None if base is None else base / t,
                    tflops=2 * shape.m * shape.n * shape.k / t / 1e12,
                    failed=dict(notes),
                )
                rows.append(row)
                log(_row_text(row))
            if checkpoint is not None:
                checkpoint(entries, skipped)
    return entries, rows, skipped


# (header, width, left-aligned, cell of a row): the header and the rows come from this one list, so every
# column has a header and they stay aligned.
_COLUMNS: tuple[tuple[str, int, bool, Callable[[dict], str]], ...] = (
    ("op", 21, True, lambda r: r["op"]),
    ("shape", 13, True, lambda r: r["shape"]),
    ("dtype", 13, True, lambda r: r["dtype"]),
    ("format", 18, True, lambda r: r.get("format", "plain")),
    ("config", 32, True, lambda r: r["config"]),
    ("ms", 9, False, lambda r: f"{r['ms']:.4f}"),
    ("cuBLAS ms", 9, False, lambda r: "-" if r["cublas_ms"] is None else f"{r['cublas_ms']:.4f}"),
    ("vs cuBLAS", 9, False, lambda r: "-" if r["vs_cublas"] is None else f"{r['vs_cublas']:.2f}x"),
    ("TFLOP/s", 8, False, lambda r: f"{r['tflops']:.1f}"),
)


def _line(cells: list[str]) -> str:
    return "  ".join(
        cell.ljust(width) if left else cell.rjust(width)
        for cell, (_, width, left, _) in zip(cells, _COLUMNS, strict=True)
    ).rstrip()


def _row_text(r: dict) -> str:
    return _line([cell(r) for *_, cell in _COLUMNS])


def header() -> str:
    return _line([name for name, *_ in _COLUMNS])


def table(rows: list[dict]) -> str:
    """Text table of the winners: op, shape, dtype, format, config, time, the baseline's time (``-``: none
    ran), speed relative to it, TFLOP/s."""
    return "\n".join([header()] + [_row_text(r) for r in rows])


def run(
    out_dir: str | None,
    allow_cpu: bool,
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    timer: Timer | None = None,
    cases: list[Case | torch.dtype] | None = None,
    gates: bool | None = None,
) -> dict:
    """Tune on this machine's GPU (or on CPU with ``allow_cpu``) and write the tuned file into ``out_dir``
    (on a GPU, ``None`` writes it where the kernels read it: ``configs/tuned``; a CPU run needs one).

    ``cases``: what to tune (default :func:`gpu_cases` or :func:`cpu_cases`; a bare dtype is plain).
    ``gates``: also measure ``all_reduce_rmsnorm``'s size switch into the same file (:mod:`bench.tune.gates`;
    default: on a GPU, where it needs two of them, not on CPU).
    Returns ``{"path", "rows", "skipped", "seconds", "gates"}``: the file written, the winners' table rows
    (op, shape, dtype, format, config, ms, cublas_ms, vs_cublas, tflops, failed), the shapes the
    budget cut and the gates' rows.
    This is what gpu-check calls first, so its later sections run the tuned tiles.
    """
    from pathlib import Path

    from kernels.fused import tuned

    cuda = torch.cuda.is_available()
    if not cuda and not allow_cpu:
        raise SystemExit("error: --mode tune needs a CUDA GPU (none found); --allow-cpu runs it on CPU")
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("error: --allow-cpu needs TRITON_INTERPRET=1 set before triton is imported")
    import triton

    if out_dir:
        directory = Path(out_dir)
    elif cuda:
        directory = tuned.DEFAULT_DIR
    else:
        raise ValueError(
            "out_dir: a CPU run of the tuner needs one (its cpu.yaml is read only from COC_TUNED_DIR, "
            "never from configs/tuned, so it is not written there)"
        )
    device = torch.device("cuda" if cuda else "cpu")
    t0 = time.monotonic()
    path = directory / f"{tuned.gpu_name(device)}.yaml"

    def write(entries: list, skipped: list[str]) -> None:
        meta = dict(
            gpu=torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter; times are meaningless)",
            triton=str(triton.__version__),
            torch=str(torch.__version__),
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            skipped_by_budget=list(skipped),
        )
        tuned.write(path, entries, meta)

    # The rows are printed as tune() finds them (a GPU run takes minutes), under this header, once.
    print(header())
    entries, rows, skipped = tune(
        gpu_shapes() if cuda else cpu_shapes(),
        cases or (gpu_cases() if cuda else cpu_cases()),
        device,
        timer or (cuda_timer() if cuda else cpu_timer()),
        budget_s=budget_s,
        checkpoint=write,
    )
    write(entries, skipped)
    from bench.tune import gates as tune_gates

    gate_rows = tune_gates.run(path, cuda=cuda) if (cuda if gates is None else gates) else []
    seconds = time.monotonic() - t0
    if skipped:
        print(f"budget of {budget_s:.0f} s spent: not tuned: {', '.join(skipped)}")
    print(f"wrote {path} ({len(entries)} entries) in {seconds:.1f} s")
    return dict(path=str(path), rows=rows, skipped=skipped, seconds=seconds, gates=gate_rows)


def main(out_dir: str | None, allow_cpu: bool) -> int:
    run(out_dir, allow_cpu)
    return 0


if __name__ == "__main__":
    # python -m bench's default --out-dir, where a CPU run's file goes.
    sys.exit(main(None if torch.cuda.is_available() else "bench_results", "--allow-cpu" in sys.argv))
