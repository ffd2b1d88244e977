"""Performance model of the mixture-of-experts ops: PREDICTED times, never measurements.

It extends :mod:`bench.model.dense` (same link models, same pipeline recurrences) to the ops of
:mod:`kernels.ops.moe` and :mod:`kernels.ops.moe.ep`. Routing is modelled as balanced (every expert gets
``rows / E`` rows); the routing computation itself (an argsort of the ids) is not modelled.

* Grouped GEMM ``[rows, k] x [E, n, k]``: on a GPU a roofline (:func:`grouped_roofline`): the tiles of
  every expert quantised in waves over the SMs, or the HBM traffic of the rows, the E weights and the output,
  whichever is longer. The per-expert ``torch.mm`` loop is E roofline GEMMs of ``rows / E`` rows, one
  launch each (:func:`loop_roofline`). Where a run measured GEMMs (CPU), the caller passes measured times.
* ``all_gather_grouped_matmul`` (TP, column shard ``[E, n / W, k]``): the dense all-gather schedule of
  :func:`bench.model.dense.predict` with the GEMM of ``tokens`` gathered tokens being the grouped GEMM of their
  ``tokens * topk`` rows, the collective moving x's rows plus the int64 ids.
* ``grouped_matmul_reduce_scatter`` (TP, row shard ``[E, k_out, n / W]``): the dense reduce-scatter
  schedule, the collective moving fp32 partials (the op combines in fp32 and rounds once, after the sum).
  The sequential and chunked backends exchange them with an all-to-all, which sends the same ``(W-1)/W``
  of the bytes per rank as a ring reduce-scatter: the model times it with the reduce-scatter entry
  (:data:`A2A`), on CPU fitted to all-to-all timings.
* ``moe_dispatch`` / ``moe_combine`` (EP): the counts' all-gather, the rows' all-to-all and the local
  placement (an index copy, HBM bound) or weighted sum; chunked: the same all-to-all cut in pieces, all
  in flight at once, only the last piece's local work exposed; fused (the design: rows written to their
  final place over peer memory, counts through the signal area): a signal and the bytes at link rate.

``fused`` predicts the fused design where the link model has peer-memory and HBM bandwidths (GPU
generations of configs/links.yaml); this build's MoE ops run ``fused`` on the chunked path (they warn by
name), so a measured fused row times the chunked schedule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from bench.harness.suites import DTYPE_BYTES, backend_args
from bench.harness.timing import Stats
from bench.model import dense as perf_model

# The link-model entry the all-to-alls are timed with (module docstring).
A2A = "reduce_scatter"
ID_BYTES = 8  # int64 routing ids travel with the rows
COUNT_BYTES = 8  # int64 per-expert counts
PARTIAL_BYTES = 4  # fp32 partials of grouped_matmul_reduce_scatter

GROUPED = "grouped_matmul"
AG, RS = "all_gather_grouped_matmul", "grouped_matmul_reduce_scatter"
DISPATCH, COMBINE = "moe_dispatch", "moe_combine"
GROUPED_BACKENDS = ("loop", "torch._grouped_mm", "kernel")  # grouped_matmul's rows: no TP backends
MODEL_NOTE = "model = bench/model/moe.py PREDICTION (balanced routing), not a measurement"

RowsTime = Callable[[int], float]  # seconds of the op's grouped GEMM for a number of TOKENS


@dataclass(frozen=True)
class MoeShape:
    """One MoE op at one size. ``tokens``: TP: rows across the group; EP: tokens per rank. ``k``: the GEMM's
    reduction dim per rank; ``n``: its output dim per rank (EP: the hidden size the rows carry)."""

    tokens: int
    k: int
    n: int
    experts: int
    topk: int
    world: int
    dtype: str

    @property
    def rows(self) -> int:
        """Grouped GEMM rows: one per (token, slot) pair."""
        return self.tokens * self.topk

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.k * self.n


@dataclass(frozen=True)
class MoeCase:
    """One MoE op at one size, per rank (:class:`bench.model.moe.MoeShape` plus where it comes from)."""

    suite: str
    layer: str  # "up" (first projection), "down" (second), "rows" (EP: the hidden rows moved)
    op: str
    shape: MoeShape

    @property
    def label(self) -> str:
        s = self.shape
        return f"{self.suite}/{self.layer}/{self.op} T={s.tokens} k={s.k} n={s.n} E={s.experts} top{s.topk} W={s.world}"

    def to_dict(self) -> dict[str, Any]:
        return {"suite": self.suite, "layer": self.layer, "op": self.op, **dataclasses.asdict(self.shape)}


def grouped_roofline(spec: perf_model.GpuSpec, shape: MoeShape) -> float:
    """A persistent grouped GEMM of ``shape``'s rows over its ``experts`` equal groups: compute at peak x efficiency
    quantised to waves of all experts' tiles (best tile shape), or the HBM traffic (rows, every expert's weight,
    the output), whichever is longer, plus one launch."""
    rows, k, n, experts, dtype = shape.rows, shape.k, shape.n, shape.experts, shape.dtype
    per_expert = math.ceil(rows / experts)
    best = 0.0
    for block_m, block_n, tile_eff in spec.gemm_tiles:
        tiles = experts * math.ceil(per_expert / block_m) * math.ceil(n / block_n)
        waves = math.ceil(tiles / spec.sms)
        best = max(best, tile_eff * rows * n / (waves * spec.sms * block_m * block_n))
    compute = 2.0 * rows * k * n / (spec.peak_tflops[dtype] * 1e12 * spec.gemm_efficiency * best)
    memory = (rows * k + experts * n * k + rows * n) * DTYPE_BYTES[dtype] / spec.hbm_bytes_per_s
    return max(compute, memory) + spec.launch_s


def loop_roofline(spec: perf_model.GpuSpec, shape: MoeShape) -> float:
    """The per-expert ``torch.mm`` loop: E roofline GEMMs of ``rows / E`` rows (each with its launch)."""
    return shape.experts * spec.gemm_time(math.ceil(shape.rows / shape.experts), shape.k, shape.n, shape.dtype)


def _tp_bytes(op: str, shape: MoeShape) -> int:
    if op == "all_gather_grouped_matmul":
        return shape.tokens * (shape.k * DTYPE_BYTES[shape.dtype] + shape.topk * ID_BYTES)
    return shape.tokens * shape.n * PARTIAL_BYTES


def predict_tp(op: str, backend: str, shape: MoeShape, *, gemm: RowsTime, link: perf_model.LinkModel) -> float | None:
    """Seconds of one TP MoE call (None where the model does not cover the backend). ``gemm(tokens)``: the
    op's grouped GEMM for ``tokens`` tokens' rows (measured, or :func:`grouped_roofline`)."""
    dense = {"all_gather_grouped_matmul": "all_gather_matmul", "grouped_matmul_reduce_scatter": "matmul_reduce_scatter"}
    if op not in dense:
        raise ValueError(f"op must be one of {sorted(dense)}, got {op!r}")
    # The dense schedule counts the collective in elements of a dtype: the bytes as fp32 elements.
    elems = _tp_bytes(op, shape) / DTYPE_BYTES["fp32"]
    return perf_model.predict(
        dense[op],
        backend,
        shape.world,
        (shape.tokens, shape.k, shape.n),
        elems,  # a float count keeps the bytes exact
        dtype="fp32",
        gemm_time=lambda m, k, n: gemm(m),
        link=link,
    )


def ep_bytes(shape: MoeShape) -> int:
    """Bytes one rank sends in a dispatch (and receives in the combine): every (token, slot) pair's row."""
    return shape.rows * shape.n * DTYPE_BYTES[shape.dtype]


def predict_ep(
    op: str, backend: str, shape: MoeShape, *, link: perf_model.LinkModel, local_s: float | None = None
) -> float | None:
    """Seconds of one ``moe_dispatch`` or ``moe_combine`` call. ``local_s``: the local placement (dispatch)
    or weighted sum (combine) of all rows, measured; None: from the HBM bandwidth (rows read and written;
    the combine also reads topk weights, negligible)."""
    if op not in ("moe_dispatch", "moe_combine"):
        raise ValueError(f"op must be moe_dispatch or moe_combine, got {op!r}")
    nbytes = ep_bytes(shape)
    if local_s is None:
        if link.hbm_bytes_per_s is None:
            return None
        local_s = 2 * nbytes / link.hbm_bytes_per_s
    kind, p = backend_args(backend)
    if shape.world == 1:
        return local_s
    counts = 0.0
    if op == "moe_dispatch":
        counts = link.collective_time("all_gather", shape.world * shape.experts * COUNT_BYTES, shape.world)
    a2a = link.collective_time(A2A, nbytes, shape.world)
    if kind == "sequential":
        return counts + a2a + local_s
    if kind == "chunked":
        # Every piece's all-to-all is in flight at once: p - 1 more latencies; the pieces' local work hides
        # under the later pieces' transfers except the last one's.
        alpha = link.collective_time(A2A, 0.0, shape.world)
        return counts + a2a + (p - 1) * alpha + local_s / p
    if kind == "fused":
        if not link.models_fused:
            return None
        moved = perf_model.bus_factor("all_gather", shape.world) * nbytes / link.link_bytes_per_s
        # Rows land in their final place: no placement copy; the combine still sums the top-k rows.
        return link.signal_latency_s + moved + (local_s if op == "moe_combine" else 0.0)
    raise ValueError(f"unknown backend {backend!r}")


def predict_case(
    case: MoeCase,
    backend: str,
    *,
    link: perf_model.LinkModel | None,
    spec: perf_model.GpuSpec | None,
    measured: dict[str, float],
) -> float | None:
    """The model's seconds for one row: from the ``measured`` bare parts (seconds by part name) where the
    run timed them, else the roofline of ``spec``; None where neither covers it."""
    s = case.shape
    if case.op == GROUPED:
        if spec is not None:
            fn = loop_roofline if backend == "loop" else grouped_roofline
            return fn(spec, s)
        return measured.get("dense")
    if link is None:
        return None
    if case.op in (AG, RS):
        if any(key.startswith("gemm@") for key in measured):
            gemm = lambda t: measured[f"gemm@{t}"]  # noqa: E731 - the GEMM times of the pieces measured
        elif spec is not None:
            gemm = lambda t: grouped_roofline(spec, dataclasses.replace(s, tokens=t))  # noqa: E731
        else:
            return None
        try:
            return predict_tp(case.op, backend, s, gemm=gemm, link=link)
        except KeyError:  # a piece size the run did not time
            return None
    return predict_ep(case.op, backend, s, link=link, local_s=measured.get("local"))


class Models(NamedTuple):
    """What :func:`predict_case` predicts from: the ``link`` model of the collectives and the GPU roofline ``spec``
    (either None where the run has none)."""

    link: perf_model.LinkModel | None
    spec: perf_model.GpuSpec | None


def derive(case: MoeCase, rows: list[dict], parts: dict[str, Stats], *, models: Models, stat: str) -> dict[str, Any]:
    """One case's record: each backend's times, speedup over the unfused baseline (sequential; grouped
    GEMM: the per-expert loop), the model's prediction and its error."""
    link, spec = models
    measured = {name: st.pick(stat) for name, st in parts.items()}
    base_name = "loop" if case.op == GROUPED else "sequential"
    base = next((r["time"].pick(stat) for r in rows if r["backend"] == base_name and "time" in r), None)
    out = {**case.to_dict(), "label": case.label, "stat": stat, "parts_ms": {k: v.to_ms() for k, v in parts.items()}}
    out["backends"] = []
    for r in rows:
        row = {key: v for key, v in r.items() if key != "time"}
        t = r["time"].pick(stat) if "time" in r else None
        if t is not None:
            row.update(ms=r["time"].to_ms(), speedup=base / t if base else None, tflops=None)
            if case.op in (GROUPED, AG, RS):
                row["tflops"] = case.shape.flops / t / 1e12
        pred = predict_case(case, r["backend"], link=link, spec=spec, measured=measured)
        row["model_ms"] = pred * 1e3 if pred is not None else None
        row["model_rel_err"] = (pred - t) / t if pred is not None and t else None
        out["backends"].append(row)
    return out
