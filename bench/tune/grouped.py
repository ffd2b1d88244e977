"""The tuner's grouped GEMM (:mod:`bench.tune.tuner`): the mixture-of-experts shapes and their problem.

A grouped shape (:class:`bench.tune.problem.TuneShape` with ``experts``) is ``m`` routed rows spread evenly over
``experts`` weights ``[n, k]`` (uniform routing: each expert ``m / E`` rows, the mean the kernel chooses
its tiles for, :func:`kernels.fused.grouped.config`). Its configs run through the grouped kernel
(:func:`kernels.fused.grouped.launch`, the tile core only: "plain" configs), are checked against the
per-expert fp32 product within :func:`bench.tune.problem.rounding_bound` (the dense cases' bound, per expert), and
are timed beside ``torch._grouped_mm`` where this torch runs it (else a loop of per-expert ``torch.mm``).
Plain operands only for now: the FP8 grouped GEMM keeps the defaults (no entry).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.tune.problem import Case, Problem, TuneShape, rounding_bound, within

OPS = ("grouped_matmul",)
FORMATS = ("plain",)
# The grouped kernel is the tile core (kernels.fused.grouped): the other variants are never run.
VARIANTS = ("plain",)

# Qwen3-30B-A3B: 128 experts, hidden 2048, expert intermediate 768, 8 experts per token; 4096 tokens.
QWEN3_EXPERTS = 128
QWEN3_HIDDEN = 2048
QWEN3_INTERMEDIATE = 768
QWEN3_TOP_K = 8
TOKENS = 4096


def gpu_shapes() -> list[TuneShape]:
    """Qwen3-30B-A3B's expert GEMMs of :data:`TOKENS` tokens (``m = tokens * top_k`` routed rows):
    gate+up ``n = 2 * 768, k = 2048`` and down ``n = 2048, k = 768``."""
    m = TOKENS * QWEN3_TOP_K
    return [
        TuneShape("moe gate_up t4096", m, 2 * QWEN3_INTERMEDIATE, QWEN3_HIDDEN, OPS, QWEN3_EXPERTS),
        TuneShape("moe down t4096", m, QWEN3_HIDDEN, QWEN3_INTERMEDIATE, OPS, QWEN3_EXPERTS),
    ]


def cpu_shapes() -> list[TuneShape]:
    """One tiny grouped GEMM for the interpreter: 4 experts of 16 rows (the decode family)."""
    return [TuneShape("cpu moe m64", 64, 32, 32, OPS, 4)]


def problem(case: Case, shape: TuneShape, device: torch.device) -> Problem:
    """The grouped GEMM of ``shape`` (uniform routing) in ``case``'s plain dtype, ready for the tuner."""
    from kernels.format import PLAIN
    from kernels.fused import blocks, grouped

    if case.fmt.kind not in FORMATS:
        raise ValueError(f"case: the grouped tuner builds {FORMATS} operands, not {case.fmt.encode()!r}")
    experts, rows = shape.experts, shape.rows
    if rows * experts != shape.m:
        raise ValueError(f"shape {shape.label!r}: m {shape.m} is not {experts} experts of equal rows")
    m, n, k, dtype = shape.m, shape.n, shape.k, case.dtype
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = torch.randn(experts, n, k, generator=gen, device=device).to(dtype)
    offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows
    xe = x.view(experts, rows, k)
    ref = torch.bmm(xe.float(), w.float().transpose(1, 2))
    bound = rounding_bound(ref.to(dtype), xe, w).reshape(m, n)
    ref = ref.reshape(m, n)

    def check(y: torch.Tensor) -> str | None:
        return within(y.float(), ref, bound)

    def run(cfg: object) -> torch.Tensor:
        out = torch.empty(m, n, dtype=dtype, device=device)
        # ag_splits is the all-gather's: the grouped GEMM has none.
        return grouped.launch(PLAIN, x, w, offsets, out, cfg=blocks.as_blocks(cfg, 1))

    return Problem(run=run, check=check, baseline=_baseline(x, w, offsets, check), variants=VARIANTS)


def _baseline(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, check: Callable[[torch.Tensor], str | None]
) -> Callable[[], object]:
    """``torch._grouped_mm`` where this torch runs it on these operands with a correct result, else the
    per-expert ``torch.mm`` loop (the offsets read once here, as a host loop must)."""
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is not None:
        try:
            if check(grouped_mm(x, w.transpose(-2, -1), offs=offsets)) is None:
                return lambda: grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            pass  # this build or device has no grouped GEMM for these operands: the loop below
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]

    def loop() -> list[torch.Tensor]:
        return [torch.mm(x[s:e], w[i].T) for i, (s, e) in enumerate(zip(starts, ends, strict=True))]

    return loop
