"""Performance model: PREDICTED times of the sequential, chunked and fused paths.

Everything this module returns is a model output, never a measurement; reports label it so.

Inputs:

* GEMM time ``g(m, k, n)``: measured on one device when a run measured it (:class:`GemmTimes`),
  else a roofline of the GPU generation in ``configs/links.yaml`` (peak x efficiency, wave
  quantisation over the SMs, HBM bound).
* a :class:`LinkModel`: alpha-beta collective times, either from ``configs/links.yaml`` (NVLink
  bandwidth and latency per GPU generation, with sources) or fitted to collective-only timings
  (:func:`calibrate`, used for CPU / gloo runs).

Schedules (S: bytes of the collective's full tensor, W ranks, p chunks):

* sequential: ``g(m, k, n) + c(S)``.
* chunked, compute-first (reduce-scatter, all-reduce): piece i's GEMM ``g(m/p, k, n)`` then its
  async collective ``c(S/p)``. Finish time by the two-stage pipeline recurrence
  ``G_i = G_{i-1} + g_i``, ``C_i = max(C_{i-1}, G_i) + c_i``; a GEMM piece that overlaps a running
  collective loses ``chunked_gemm_slowdown`` of the overlapped time.
* chunked, comm-first (all-gather): ``C_i = C_{i-1} + c_i``, ``G_i = max(G_{i-1}, C_i) + g_i``.
* fused all-gather GEMM: W chunks of rows, own rank's first (no wait); peer shard j arrives at
  ``signal + j * (S / W) / B``; each chunk costs ``g(m, k, n) / W`` (one persistent GEMM keeps the
  whole-GEMM efficiency) times ``1 + fused_gemm_slowdown``.
* fused GEMM reduce-scatter: W chunks, peers' first, each pushed to its owner (``(S / W) / B``)
  while the next is computed; the owner then sums W slots (HBM bound) once the last push lands.
* fused GEMM all-reduce: fused reduce-scatter, then the reduced rows are all-gathered through
  peer memory (two-shot): ``+ signal + (W-1)/W * S / B``.
* baseline: the unfused library path (``F.linear`` or ``torch._scaled_mm``, then an NCCL
  collective); for bf16 / fp16 / fp32 it is ``sequential``.

FP8 (``dtype="fp8"``, :func:`comm_bytes`, :meth:`GpuSpec.gemm_time`): the GEMM runs at the fp8 peak
of links.yaml (twice bf16's on Hopper) with 1-byte operands; an all-gather moves 1 byte per element
plus the fp32 scales of the rows it moves (block: ``rows * ceil(k / 128) * 4`` bytes), half of bf16's
payload. The reducing ops do not halve: the baseline reduces its ``out_dtype`` output, and this
package's FP8 backends reduce fp32 partials so that the result is rounded once (docs/fused.md, "Operand formats"):
twice bf16's bytes. Its ``sequential`` and ``chunked`` FP8 backends are references that multiply
dequantized fp32 operands; pass them an fp32 GEMM time. Quantizing the inputs is not modelled
(inputs arrive quantized), nor is the fused kernel's per-128-k promotion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import yaml

from bench.harness.suites import DTYPE_BYTES, OP_COLLECTIVE, backend_args
from kernels.paths import config_path

LINKS_PATH = str(config_path("links.yaml"))
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
FP8 = "fp8"
FP8_MODES = ("tensor", "row", "block")
FP8_BLOCK = 128  # scale block of the FP8 ops (kernels.fp8)
SCALE_BYTES = 4  # fp32 scales
# Partial products of the FP8 ops' own backends are reduced in fp32 (one rounding to out_dtype).
FP8_PARTIAL_BYTES = 4

GemmFn = Callable[[int, int, int], float]


def bus_factor(collective: str, world: int) -> float:
    """Fraction of the full tensor each rank sends in a ring collective (nccl-tests convention)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    if world <= 1:
        return 0.0
    f = (world - 1) / world
    return 2 * f if collective == "all_reduce" else f


@dataclass(frozen=True)
class CollectiveFit:
    """``t = alpha_s + bus_factor * nbytes / bus_bytes_per_s`` for one collective at one W."""

    alpha_s: float
    bus_bytes_per_s: float
    rel_rms: float = 0.0  # relative RMS residual of the fit on its own samples

    def time(self, nbytes: float, factor: float) -> float:
        return self.alpha_s + factor * nbytes / self.bus_bytes_per_s


@dataclass
class LinkModel:
    name: str
    source: str
    link_bytes_per_s: float | None = None  # effective per direction (bandwidth x efficiency)
    collective_latency_s: float = 0.0
    step_latency_s: float = 0.0
    signal_latency_s: float = 0.0
    launch_s: float = 0.0
    chunked_gemm_slowdown: float = 0.0
    fused_gemm_slowdown: float = 0.0
    hbm_bytes_per_s: float | None = None
    fits: dict[tuple[str, int], CollectiveFit] = field(default_factory=dict)

    def collective_time(self, collective: str, nbytes: float, world: int) -> float:
        if world <= 1:
            return 0.0
        factor = bus_factor(collective, world)
        fit = self.fits.get((collective, world))
        if fit is not None:
            return fit.time(nbytes, factor)
        if self.link_bytes_per_s is None:
            raise ValueError(f"link model {self.name!r} has no fit for {collective} at W={world}")
        steps = (world - 1) * (2 if collective == "all_reduce" else 1)
        return self.collective_latency_s + (steps - 1) * self.step_latency_s + factor * nbytes / self.link_bytes_per_s

    def p2p_time(self, nbytes: float, world: int) -> float:
        """One chunk to one peer through peer memory (fused paths)."""
        if self.link_bytes_per_s is not None:
            return self.signal_latency_s + nbytes / self.link_bytes_per_s
        fit = self.fits.get(("all_gather", world)) or next(iter(self.fits.values()))
        return fit.alpha_s + nbytes / fit.bus_bytes_per_s

    @property
    def models_fused(self) -> bool:
        """The fused schedule needs a peer-memory bandwidth and an HBM bandwidth (GPUs only)."""
        return self.link_bytes_per_s is not None and self.hbm_bytes_per_s is not None

    def describe(self) -> dict:
        d = {"name": self.name, "source": self.source, "kind": "model parameters (not measurements)"}
        if self.link_bytes_per_s is not None:
            d.update(
                link_GBps_effective=self.link_bytes_per_s / 1e9,
                collective_latency_us=self.collective_latency_s * 1e6,
                step_latency_us=self.step_latency_s * 1e6,
                signal_latency_us=self.signal_latency_s * 1e6,
            )
        if self.fits:
            d["fits"] = [
                {
                    "collective": c,
                    "world": w,
                    "alpha_us": f.alpha_s * 1e6,
                    "bus_GBps": f.bus_bytes_per_s / 1e9,
                    "fit_rel_rms": f.rel_rms,
                }
                for (c, w), f in sorted(self.fits.items())
            ]
        d.update(chunked_gemm_slowdown=self.chunked_gemm_slowdown, fused_gemm_slowdown=self.fused_gemm_slowdown)
        return d


@dataclass
class GpuSpec:
    name: str
    peak_tflops: dict[str, float]
    gemm_efficiency: float
    sms: int
    gemm_tiles: tuple[tuple[int, int, float], ...]
    hbm_bytes_per_s: float
    launch_s: float

    def gemm_time(
        self, m: int, k: int, n: int, dtype: str, *, out_dtype: str = "bf16", fp8_mode: str = "block"
    ) -> float:
        """Roofline GEMM time: compute at peak x efficiency, quantised to waves of tiles over the SMs
        (best of the tile shapes), or the HBM traffic, whichever is longer.

        ``dtype="fp8"``: 1-byte operands, their fp32 scales (``fp8_mode``) and an ``out_dtype`` result."""
        if dtype not in self.peak_tflops:
            raise ValueError(
                f"no peak TFLOP/s for dtype {dtype!r} on {self.name} "
                f"(configs/links.yaml has {sorted(self.peak_tflops)})"
            )
        best_rate = 0.0
        for block_m, block_n, tile_eff in self.gemm_tiles:
            tiles = math.ceil(m / block_m) * math.ceil(n / block_n)
            waves = math.ceil(tiles / self.sms)
            # Useful work over issued work: idle SMs in the last wave and masked rows/cols of edge tiles.
            wave_eff = (m * n) / (waves * self.sms * block_m * block_n)
            best_rate = max(best_rate, tile_eff * wave_eff)
        t_compute = 2.0 * m * k * n / (self.peak_tflops[dtype] * 1e12 * self.gemm_efficiency * best_rate)
        if dtype == FP8:
            scales = fp8_scale_bytes(m, k, fp8_mode) + fp8_weight_scale_bytes(n, k, fp8_mode)
            traffic = m * k + k * n + m * n * DTYPE_BYTES[out_dtype] + scales
        else:
            traffic = (m * k + k * n + m * n) * DTYPE_BYTES[dtype]
        t_memory = traffic / self.hbm_bytes_per_s
        return max(t_compute, t_memory) + self.launch_s


def _load_links(path: str | None = None) -> dict:
    with open(path or LINKS_PATH, encoding="utf-8") as f:
        return yaml.safe_load(f)


def known_generations(path: str | None = None) -> list[str]:
    return sorted(_load_links(path)["generations"])


def detect_generation(device_name: str, path: str | None = None) -> str | None:
    """GPU generation in links.yaml whose ``match`` strings occur in a CUDA device name."""
    gens = _load_links(path)["generations"]
    for gen, spec in gens.items():
        if any(s.lower() in device_name.lower() for s in spec.get("match", [gen])):
            return gen
    return None


def load_gpu(generation: str, path: str | None = None) -> tuple[LinkModel, GpuSpec]:
    """Link model and device roofline of one GPU generation from configs/links.yaml."""
    cfg = _load_links(path)
    gens = cfg["generations"]
    if generation not in gens:
        raise ValueError(f"unknown GPU generation {generation!r}; links.yaml has {sorted(gens)}")
    d, g = cfg["defaults"], gens[generation]
    lat = {**d["latency_us"], **g.get("latency_us", {})}
    overlap = {**d["overlap"], **g.get("overlap", {})}
    hbm = g["hbm_gbps"] * 1e9 * g.get("hbm_efficiency", d["hbm_efficiency"])
    link = LinkModel(
        name=generation,
        source=f"configs/links.yaml:{generation}",
        link_bytes_per_s=g["nvlink_gbps"] * 1e9 * g.get("link_efficiency", d["link_efficiency"]),
        collective_latency_s=lat["collective"] * 1e-6,
        step_latency_s=lat["step"] * 1e-6,
        signal_latency_s=lat["signal"] * 1e-6,
        launch_s=lat["launch"] * 1e-6,
        chunked_gemm_slowdown=overlap["chunked_gemm_slowdown"],
        fused_gemm_slowdown=overlap["fused_gemm_slowdown"],
        hbm_bytes_per_s=hbm,
    )
    spec = GpuSpec(
        name=generation,
        peak_tflops={k: float(v) for k, v in g["peak_tflops"].items()},
        gemm_efficiency=g.get("gemm_efficiency", d["gemm_efficiency"]),
        sms=g["sms"],
        gemm_tiles=tuple(tuple(t) for t in g.get("gemm_tiles", d["gemm_tiles"])),
        hbm_bytes_per_s=hbm,
        launch_s=lat["launch"] * 1e-6,
    )
    return link, spec


def calibrate(
    samples: Iterable[tuple[str, int, float, float]], name: str = "cpu-gloo", path: str | None = None
) -> LinkModel:
    """Fit ``alpha + factor * nbytes / B`` per (collective, W) by least squares on relative error.

    ``samples``: (collective, world, nbytes, seconds). Each (collective, W) needs two or more sizes.
    Interference parameters come from the ``cpu-gloo`` entry of links.yaml.
    """
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for coll, world, nbytes, seconds in samples:
        if world > 1:
            groups.setdefault((coll, world), []).append((bus_factor(coll, world) * nbytes, seconds))
    fits = {}
    for key, pts in groups.items():
        if len({p[0] for p in pts}) < 2:
            raise ValueError(f"calibrate: {key} needs samples at two or more sizes, got {len({p[0] for p in pts})}")
        # Weighted least squares on RELATIVE residuals (weights 1 / t^2): the sizes span orders of
        # magnitude, and an absolute fit would let the largest size decide alone, leaving the latency
        # term (what small chunks pay) to noise.
        ws = [1.0 / (y * y) for _, y in pts]
        sw = sum(ws)
        mx = sum(w * x for w, (x, _) in zip(ws, pts, strict=False)) / sw
        my = sum(w * y for w, (_, y) in zip(ws, pts, strict=False)) / sw
        sxx = sum(w * (x - mx) ** 2 for w, (x, _) in zip(ws, pts, strict=False))
        slope = sum(w * (x - mx) * (y - my) for w, (x, y) in zip(ws, pts, strict=False)) / sxx
        # A non-positive slope means latency dominates every size measured: keep a tiny positive
        # slope (finite bandwidth) rather than an infinite one.
        slope = max(slope, 1e-15)
        alpha = max(my - slope * mx, 0.0)
        fit = CollectiveFit(alpha, 1.0 / slope)
        rel = [((fit.time(x, 1.0) - y) / y) ** 2 for x, y in pts]
        fits[key] = CollectiveFit(alpha, 1.0 / slope, math.sqrt(sum(rel) / len(rel)))
    overlap = (_load_links(path).get("cpu-gloo") or {}).get("overlap", {})
    return LinkModel(
        name=name,
        source="fitted to collective-only timings of this run",
        fits=fits,
        chunked_gemm_slowdown=overlap.get("chunked_gemm_slowdown", 0.0),
        fused_gemm_slowdown=overlap.get("fused_gemm_slowdown", 0.0),
    )


def _check_fp8_mode(mode: str) -> None:
    if mode not in FP8_MODES:
        raise ValueError(f"fp8_mode must be one of {FP8_MODES}, got {mode!r}")


def fp8_scale_bytes(rows: int, k: int, mode: str, per_row_tensor: bool = False) -> int:
    """fp32 scale bytes of ``rows`` FP8 activation rows of ``k`` columns: block 1 x 128
    (``rows * ceil(k / 128) * 4``), row ``rows * 4``, tensor one scalar (``0`` moved; ``rows * 4``
    where ``per_row_tensor``: the fused all-gather carries the scalar in each row's scale slot)."""
    _check_fp8_mode(mode)
    if mode == "block":
        return rows * math.ceil(k / FP8_BLOCK) * SCALE_BYTES
    if mode == "row" or per_row_tensor:
        return rows * SCALE_BYTES
    return 0


def fp8_weight_scale_bytes(n: int, k: int, mode: str) -> int:
    """fp32 scale bytes of an FP8 weight ``[n, k]``: block 128 x 128, row ``n``, tensor one."""
    _check_fp8_mode(mode)
    if mode == "block":
        return math.ceil(n / FP8_BLOCK) * math.ceil(k / FP8_BLOCK) * SCALE_BYTES
    return (n if mode == "row" else 1) * SCALE_BYTES


def comm_bytes(
    op: str,
    backend: str,
    gemm_shape: tuple[int, int, int],
    comm_elems: int,
    dtype: str,
    *,
    fp8_mode: str = "block",
    out_dtype: str = "bf16",
) -> float:
    """Bytes of the collective's full tensor (``S`` of the module docstring) for one call.

    bf16 / fp16 / fp32: ``comm_elems`` elements of ``dtype``. FP8 all-gather: 1 byte per element plus
    the scales of the gathered rows (``m = gemm_shape[0]`` rows of ``k``). FP8 reduce-scatter /
    all-reduce: the baseline reduces ``out_dtype``, this package's backends fp32 partials."""
    if dtype != FP8:
        return float(comm_elems * DTYPE_BYTES[dtype])
    kind = backend_args(backend)[0]
    if OP_COLLECTIVE[op] == "all_gather":
        m, k, _ = gemm_shape
        return float(comm_elems + fp8_scale_bytes(m, k, fp8_mode, per_row_tensor=kind == "fused"))
    return float(comm_elems * (DTYPE_BYTES[out_dtype] if kind == "baseline" else FP8_PARTIAL_BYTES))


def chunk_rows(m: int, p: int) -> list[int]:
    """Row counts of p uneven chunks (as the chunked path splits: the first m % p get one more)."""
    base, extra = divmod(m, p)
    return [base + (1 if i < extra else 0) for i in range(p) if base + (1 if i < extra else 0) > 0]


def pipeline_compute_first(g: list[float], c: list[float], slowdown: float) -> float:
    """Finish time of GEMM pieces ``g`` each followed by its async collective ``c``.

    ``slowdown``: fraction of the time a GEMM piece overlaps a running collective that it loses
    (0: perfect overlap, 1: the two serialize)."""
    t_g = t_c = 0.0
    for gi, ci in zip(g, c, strict=False):
        overlap = min(gi, max(0.0, t_c - t_g))  # the previous piece's collective still running
        t_g += gi + slowdown * overlap
        t_c = max(t_c, t_g) + ci
    return max(t_g, t_c)


def pipeline_comm_first(g: list[float], c: list[float], slowdown: float) -> float:
    """Finish time of collectives ``c`` (gathers) each followed by the GEMM piece ``g`` that needs it,
    the next gather running beside the current GEMM piece."""
    t_g = t_c = 0.0
    ends = []
    for ci in c:
        t_c += ci
        ends.append(t_c)
    for i, gi in enumerate(g):
        start = max(t_g, ends[i])
        overlap = min(gi, max(0.0, ends[i + 1] - start)) if i + 1 < len(g) else 0.0
        t_g = start + gi + slowdown * overlap
    return t_g


def predict(
    op: str,
    backend: str,
    world: int,
    gemm_shape: tuple[int, int, int],
    comm_elems: int,
    *,
    dtype: str,
    gemm_time: GemmFn,
    link: LinkModel,
    fp8_mode: str = "block",
    out_dtype: str = "bf16",
) -> float | None:
    """Predicted seconds of one op call; None where the model does not cover the backend.

    ``gemm_time`` is the GEMM of ``dtype`` (for FP8 the caller's FP8 GEMM, e.g. ``GpuSpec.gemm_time(...,
    "fp8")``); ``fp8_mode`` and ``out_dtype`` only matter for ``dtype="fp8"`` (:func:`comm_bytes`)."""
    m, k, n = gemm_shape
    coll = OP_COLLECTIVE[op]
    nbytes = comm_bytes(op, backend, gemm_shape, comm_elems, dtype, fp8_mode=fp8_mode, out_dtype=out_dtype)
    g_full = gemm_time(m, k, n)
    kind, p = backend_args(backend)
    if kind in ("sequential", "baseline"):
        return g_full + link.collective_time(coll, nbytes, world)
    if kind == "chunked":
        rows = chunk_rows(m, p)
        g = [gemm_time(r, k, n) for r in rows]
        c = [link.collective_time(coll, nbytes * r / m, world) for r in rows]
        if coll == "all_gather":
            return pipeline_comm_first(g, c, link.chunked_gemm_slowdown)
        return pipeline_compute_first(g, c, link.chunked_gemm_slowdown)
    if kind == "fused":
        if not link.models_fused:
            return None
        if world == 1:  # nothing to communicate: the fused kernel is its GEMM core
            return g_full
        return _fused_multi_rank_time(coll, world, g_full, nbytes, link)
    raise ValueError(f"unknown backend {backend!r}")


def _fused_multi_rank_time(coll: str, world: int, g_full: float, nbytes: float, link: LinkModel) -> float:
    """The fused kernel at ``world > 1``, one GEMM chunk per shard: for an all-gather each chunk waits for its
    shard's arrival; otherwise each peer's chunk is pushed while the next one computes, then the shards are
    reduced (and, for an all-reduce, gathered back)."""
    g_chunk = g_full / world * (1 + link.fused_gemm_slowdown)
    shard = nbytes / world
    if coll == "all_gather":
        t = 0.0
        for j in range(world):
            arrival = 0.0 if j == 0 else j * link.p2p_time(shard, world)
            t = max(t, arrival) + g_chunk
        return t
    t_g = t_push = 0.0
    for j in range(world):
        t_g += g_chunk
        if j < world - 1:  # peers' chunks first; the own chunk stays local
            t_push = max(t_push, t_g) + link.p2p_time(shard, world)
    reduce_s = (world + 1) * shard / link.hbm_bytes_per_s
    t = max(t_g, t_push) + link.signal_latency_s + reduce_s
    if coll == "all_reduce":
        t += link.signal_latency_s + bus_factor("all_gather", world) * nbytes / link.link_bytes_per_s
    return t


class GemmTimes:
    """Measured GEMM seconds by (m, k, n), with a roofline or flop-scaled fallback for unmeasured shapes."""

    def __init__(self, measured: dict[tuple[int, int, int], float] | None = None, fallback: GemmFn | None = None):
        self.measured = dict(measured or {})
        self.fallback = fallback

    def __call__(self, m: int, k: int, n: int) -> float:
        if (m, k, n) in self.measured:
            return self.measured[(m, k, n)]
        if self.fallback is not None:
            return self.fallback(m, k, n)
        same_kn = [(mm, t) for (mm, kk, nn), t in self.measured.items() if (kk, nn) == (k, n)]
        if not same_kn:
            raise KeyError(f"no measured or modelled GEMM time for {(m, k, n)}")
        mm, t = min(same_kn, key=lambda e: abs(e[0] - m))
        return t * m / mm


def fp8_rows(
    generation: str, suite: str = "llama3-70b", tokens: int = 8192, world: int = 8, fp8_mode: str = "block"
) -> list[dict]:
    """PREDICTED bf16 and FP8 times of every layer of ``suite`` at ``tokens`` and TP ``world`` (roofline GEMMs)."""
    from bench.harness.suites import load_suite

    link, spec = load_gpu(generation)
    rows = []
    for c in load_suite(suite).cases(tokens=[tokens], world_sizes=[world], dtypes=["bf16"]):
        if c.op == "quantized_matmul_all_reduce":
            continue

        def bf16(m: int, k: int, n: int) -> float:
            return spec.gemm_time(m, k, n, "bf16")

        def fp8(m: int, k: int, n: int) -> float:
            return spec.gemm_time(m, k, n, FP8, fp8_mode=fp8_mode)

        row: dict = {"label": f"{c.layer} {c.op}", "gemm_shape": c.gemm_shape, "op": c.op}
        for key, dtype, backend, gemm in (
            ("bf16_sequential", "bf16", "sequential", bf16),
            ("bf16_fused", "bf16", "fused", bf16),
            ("fp8_baseline", FP8, "baseline", fp8),
            ("fp8_fused", FP8, "fused", fp8),
        ):
            row[key] = predict(
                c.op,
                backend,
                world,
                c.gemm_shape,
                c.comm_elems,
                dtype=dtype,
                gemm_time=gemm,
                link=link,
                fp8_mode=fp8_mode,
            )
            row[f"{key}_mb"] = comm_bytes(c.op, backend, c.gemm_shape, c.comm_elems, dtype, fp8_mode=fp8_mode) / 1e6
        rows.append(row)
    return rows


def fp8_table(generation: str, **kwargs) -> list[str]:
    """Markdown lines of :func:`fp8_rows` (milliseconds; every figure a model prediction)."""
    from bench.harness.suites import OP_SHORT

    out = [
        "| layer, local GEMM [m, k, n] | bf16 sequential | bf16 fused | FP8 baseline (_scaled_mm + NCCL) | "
        "FP8 fused | FP8 fused / FP8 baseline | FP8 fused / bf16 sequential | "
        "collective MB bf16 / FP8 base / FP8 fused |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in fp8_rows(generation, **kwargs):
        m, k, n = r["gemm_shape"]
        out.append(
            f"| {r['label'].split()[0]} {OP_SHORT[r['op']]} [{m}, {k}, {n}] | {r['bf16_sequential'] * 1e3:.3f} ms | "
            f"{r['bf16_fused'] * 1e3:.3f} ms | {r['fp8_baseline'] * 1e3:.3f} ms | {r['fp8_fused'] * 1e3:.3f} ms | "
            f"{r['fp8_baseline'] / r['fp8_fused']:.2f}x | {r['bf16_sequential'] / r['fp8_fused']:.2f}x | "
            f"{r['bf16_sequential_mb']:.1f} / {r['fp8_baseline_mb']:.1f} / {r['fp8_fused_mb']:.1f} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.model.dense --gpu H100``: the bf16 and FP8 predictions table (a model, not a measurement)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.model.dense", description=main.__doc__)
    p.add_argument("--gpu", default="H100", help=f"GPU generation of configs/links.yaml ({known_generations()})")
    p.add_argument("--suite", default="llama3-70b")
    p.add_argument("--tokens", type=int, default=8192, help="M, rows across the TP group")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--fp8-mode", default="block", choices=FP8_MODES)
    args = p.parse_args(argv)
    print(
        f"MODEL PREDICTIONS (not measurements): {args.suite} M={args.tokens} TP{args.world} on {args.gpu}, "
        f"FP8 {args.fp8_mode} scales, bf16 outputs"
    )
    print(
        "\n".join(fp8_table(args.gpu, suite=args.suite, tokens=args.tokens, world=args.world, fp8_mode=args.fp8_mode))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
