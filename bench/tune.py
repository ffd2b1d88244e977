"""``python -m bench --mode tune``: time the GEMM configuration space on this GPU, write the winners.

For every shape of :func:`gpu_shapes` (LLaMA-2/3-70B TP8 per-rank GEMMs, 8192^3, decode-size and
rows-per-owner ``m``) and dtype (bf16, fp16) the tuner

1. times cuBLAS (``torch.matmul(x, w.T)``),
2. runs every config of the shape's family (:mod:`kernels.fused.gemm_configs`) once, checks its
   result against cuBLAS's (a config that fails to compile or computes a wrong result is skipped,
   and said so), and times it,
3. keeps the fastest config per op: the bare ``matmul`` chooses among all variants (TMA,
   persistent, plain); the fused ops (timed at W = 1: their local GEMM is the plain tile core, the
   same kernel body the fused kernels run between their waits) among the plain configs,

and writes ``configs/tuned/<gpu-name>.yaml`` (:mod:`kernels.fused.tuned`; ``--out-dir`` writes
there instead) with cuBLAS's time beside each winner, printing each winner as it is found under one
header (:func:`table`). Timings are shared: a config timed on a shape for ``matmul`` is not timed
again for a fused op of the same shape.

Time bound: the space is small (about a dozen configs per family, each compiled once per dtype for
all shapes), a timing is a few milliseconds of repeats, and a budget (``budget_s``, default 200 s)
stops starting new shapes once spent (the skipped shapes are listed), so the whole run fits in
gpu-check's 9 minutes. ``--allow-cpu`` runs the same flow on CPU under the interpreter with tiny
shapes and the CPU space (CI); its file, ``cpu.yaml``, always goes to ``--out-dir`` (by default
``./bench_results``): the kernels read a CPU file only from ``COC_TUNED_DIR``, so it has no place in
``configs/tuned``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Timer: (callable, key) -> seconds per call. ``key`` names what is timed, (shape label, dtype name,
# config label or "cublas"), so a fake timer in tests can answer per config.
Timer = Callable[[Callable[[], object], tuple[str, str, str]], float]
DEFAULT_BUDGET_S = 200.0
_CUBLAS = "cublas"


@dataclass(frozen=True)
class TuneShape:
    """One GEMM ``[m, k] x [n, k]^T`` and the ops whose file entries it provides."""

    label: str
    m: int
    n: int
    k: int
    ops: tuple[str, ...]


_FUSED_AG = ("all_gather_matmul",)
_FUSED_RS = ("matmul_reduce_scatter", "matmul_all_reduce")


def gpu_shapes() -> list[TuneShape]:
    """LLaMA-2/3-70B at TP8 (hidden 8192, FFN 28672, 64 heads / 8 KV heads of 128): per-rank GEMMs of
    4096 tokens, 512 rows (a TP8 owner's rows of 4096 tokens) and 16 (decode), and 8192^3.

    QKV ``n = (8192 + 2 * 1024) / 8``, out-projection ``k = 8192 / 8``, gate+up ``n = 2 * 28672 / 8``,
    down ``k = 28672 / 8``. The column-parallel GEMMs (QKV, gate+up) follow an all-gather, the
    row-parallel ones (out, down) precede a reduce-scatter / all-reduce.
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
    ]


def cpu_shapes() -> list[TuneShape]:
    """Tiny shapes for the interpreter (one per family), so ``--allow-cpu`` runs in seconds."""
    all_ops = ("matmul",) + _FUSED_AG + _FUSED_RS
    return [TuneShape("cpu m16", 16, 32, 32, all_ops), TuneShape("cpu m80", 80, 32, 32, all_ops)]


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


def rounding_bound(ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on how far a correct config's result may lie from cuBLAS's ``ref``.

    Both sum the exact products in fp32 in some order (each within ``k * 2^-24 * (|x| @ |w|.T)`` of
    the exact sum) and round once to the output dtype (half an ulp each, ``eps * |ref|`` covers both).
    """
    k = x.shape[1]
    magnitude = torch.matmul(x.abs().float(), w.abs().float().T)
    return torch.finfo(ref.dtype).eps * ref.float().abs() + 2 * k * 2.0**-24 * magnitude + 1e-30


def select(timings: dict[str, float | None], candidates: list, label: Callable[[object], str]):
    """The fastest candidate with a time (ties: the earlier in ``candidates``), or None."""
    best, best_t = None, float("inf")
    for c in candidates:
        t = timings.get(label(c))
        if t is not None and t < best_t:
            best, best_t = c, t
    return best


def tune(
    shapes: list[TuneShape],
    dtypes: list[torch.dtype],
    device: torch.device,
    timer: Timer,
    budget_s: float = DEFAULT_BUDGET_S,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
    checkpoint: Callable[[list, list[str]], None] | None = None,
) -> tuple[list, list[dict], list[str]]:
    """Time the space on ``shapes``; ``(file entries, table rows, skipped shapes)``.

    ``checkpoint(entries, skipped)`` runs after every shape, so a run killed from outside (gpu-check's
    section deadline) leaves the winners found so far in the file.
    """
    from kernels.fused import gemm_configs, matmul, tuned

    start = clock()
    entries, rows, skipped = [], [], []
    for dtype in dtypes:
        dname = tuned.dtype_name(dtype)
        for shape in shapes:
            if clock() - start > budget_s:
                skipped.append(f"{shape.label} {dname}")
                continue
            gen = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(shape.m, shape.k, generator=gen, device=device).to(dtype)
            w = torch.randn(shape.n, shape.k, generator=gen, device=device).to(dtype)
            ref = torch.matmul(x, w.T)
            bound = rounding_bound(ref, x, w)
            cublas = timer(lambda x=x, w=w: torch.matmul(x, w.T), (shape.label, dname, _CUBLAS))
            fam = gemm_configs.family(shape.m)
            space = gemm_configs.space(fam, device.type)
            timings: dict[str, float | None] = {}
            notes: dict[str, str] = {}
            for cfg in space:
                try:
                    got = matmul.linear(x, w, config=cfg, fallback=False)
                except Exception as err:  # a config that cannot compile here is reported, not fatal
                    timings[cfg.label()], notes[cfg.label()] = None, f"failed: {type(err).__name__}"
                    continue
                diff = (got.float() - ref.float()).abs()
                if not bool((diff <= bound).all()):
                    err = diff.max().item()
                    timings[cfg.label()], notes[cfg.label()] = None, f"wrong result (max abs. error {err:.3g})"
                    continue
                timings[cfg.label()] = timer(
                    lambda x=x, w=w, cfg=cfg: matmul.linear(x, w, config=cfg, fallback=False),
                    (shape.label, dname, cfg.label()),
                )
            for op in shape.ops:
                pool = space if op == "matmul" else [c for c in space if c.variant == "plain"]
                best = select(timings, pool, lambda c: c.label())
                if best is None:
                    log(f"tune: {op} {shape.label} {dname}: no config ran ({notes}); no entry")
                    continue
                t = timings[best.label()]
                entries.append(tuned.Entry(op, dname, shape.m, shape.n, shape.k, best, t * 1e3, cublas * 1e3))
                row = dict(
                    op=op,
                    shape=shape.label,
                    m=shape.m,
                    n=shape.n,
                    k=shape.k,
                    dtype=dname,
                    config=best.label(),
                    ms=t * 1e3,
                    cublas_ms=cublas * 1e3,
                    vs_cublas=cublas / t,
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
    ("dtype", 8, True, lambda r: r["dtype"]),
    ("config", 32, True, lambda r: r["config"]),
    ("ms", 9, False, lambda r: f"{r['ms']:.4f}"),
    ("cuBLAS ms", 9, False, lambda r: f"{r['cublas_ms']:.4f}"),
    ("vs cuBLAS", 9, False, lambda r: f"{r['vs_cublas']:.2f}x"),
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
    """Text table of the winners: op, shape, dtype, config, time, cuBLAS time, speed relative to cuBLAS, TFLOP/s."""
    return "\n".join([header()] + [_row_text(r) for r in rows])


def run(
    out_dir: str | None,
    allow_cpu: bool,
    budget_s: float = DEFAULT_BUDGET_S,
    timer: Timer | None = None,
    dtypes: list[torch.dtype] | None = None,
) -> dict:
    """Tune on this machine's GPU (or on CPU with ``allow_cpu``) and write the tuned file into ``out_dir``
    (on a GPU, ``None`` writes it where the kernels read it: ``configs/tuned``; a CPU run needs one).

    Returns ``{"path", "rows", "skipped", "seconds"}``: the file written, the winners' table rows
    (op, shape, dtype, config, ms, cublas_ms, vs_cublas, tflops) and the shapes the budget cut.
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
        dtypes or ([torch.bfloat16, torch.float16] if cuda else [torch.bfloat16]),
        device,
        timer or (cuda_timer() if cuda else cpu_timer()),
        budget_s,
        checkpoint=write,
    )
    write(entries, skipped)
    seconds = time.monotonic() - t0
    if skipped:
        print(f"budget of {budget_s:.0f} s spent: not tuned: {', '.join(skipped)}")
    print(f"wrote {path} ({len(entries)} entries) in {seconds:.1f} s")
    return dict(path=str(path), rows=rows, skipped=skipped, seconds=seconds)


def main(out_dir: str | None, allow_cpu: bool) -> int:
    run(out_dir, allow_cpu)
    return 0


if __name__ == "__main__":
    # python -m bench's default --out-dir, where a CPU run's file goes.
    sys.exit(main(None if torch.cuda.is_available() else "bench_results", "--allow-cpu" in sys.argv))
