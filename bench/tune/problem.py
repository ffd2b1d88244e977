"""The tuner's problem types (:mod:`bench.tune.tuner`, :mod:`bench.tune.grouped`): shapes, cases, problems and
the correctness bound every plain case is checked with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # kernels imports triton, which must follow TRITON_INTERPRET (bench/__main__.py)
    from kernels.format import OperandFormat


@dataclass(frozen=True)
class TuneShape:
    """One GEMM ``[m, k] x [n, k]^T`` and the ops whose file entries it provides; ``experts`` > 0: a grouped
    GEMM of ``m`` rows spread evenly over that many experts' ``[n, k]`` weights (:mod:`bench.tune.grouped`)."""

    label: str
    m: int
    n: int
    k: int
    ops: tuple[str, ...]
    experts: int = 0

    @property
    def rows(self) -> int:
        """The ``m`` of the shape's file entries and family: ``m``, or a grouped GEMM's rows per expert
        (what its kernel chooses tiles for, :func:`kernels.fused.grouped.config`)."""
        return -(-self.m // self.experts) if self.experts else self.m


@dataclass(frozen=True)
class Case:
    """One pass of the tuner over the shapes: the operand format (:class:`kernels.format.OperandFormat`)
    and x's dtype, as the file's entries name it (the FP8 payload's; the activation's of int8 weights)."""

    fmt: OperandFormat
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def name(self) -> str:
        """``bfloat16`` (plain), ``fp8:block float8_e4m3fn``, ``int8:per_group:128 bfloat16``."""
        return self.dtype_name if self.fmt.kind == "plain" else f"{self.fmt.encode()} {self.dtype_name}"


@dataclass(frozen=True)
class Problem:
    """One shape of one case, ready to run: ``run(cfg)`` computes it with a config of the space,
    ``check(y)`` says whether a result is correct (None) or how it is wrong, ``baseline`` is the
    unfused GEMM timed beside it (None: none runs here)."""

    run: Callable[[object], torch.Tensor]
    check: Callable[[torch.Tensor], str | None]
    baseline: Callable[[], object] | None
    # The config variants ``run`` can launch (None: all); the others are neither run nor chosen.
    variants: tuple[str, ...] | None = None


def rounding_bound(ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on how far a correct config's result may lie from cuBLAS's ``ref``.

    Both sum the exact products in fp32 in some order (each within ``k * 2^-24 * (|x| @ |w|.T)`` of
    the exact sum) and round once to the output dtype (half an ulp each, ``eps * |ref|`` covers both).
    """
    k = x.shape[-1]
    # transpose(-2, -1): also a batch of experts' products (x [E, r, k], w [E, n, k]).
    magnitude = torch.matmul(x.abs().float(), w.abs().float().transpose(-2, -1))
    return torch.finfo(ref.dtype).eps * ref.float().abs() + 2 * k * 2.0**-24 * magnitude + 1e-30


def within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> str | None:
    """None when ``got`` lies within ``bound`` of ``ref`` elementwise, else what is wrong."""
    diff = (got.to(ref.dtype) - ref).abs()
    if bool((diff <= bound).all()):
        return None
    return f"wrong result (max abs. error {diff.nan_to_num(nan=float('inf')).max().item():.3g})"
