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
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import yaml

from bench.suites import DTYPE_BYTES, OP_COLLECTIVE, REPO_ROOT, backend_args

LINKS_PATH = os.path.join(REPO_ROOT, "configs", "links.yaml")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")

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

    def gemm_time(self, m: int, k: int, n: int, dtype: str) -> float:
        """Roofline GEMM time: compute at peak x efficiency, quantised to waves of tiles over the SMs
        (best of the tile shapes), or the HBM traffic, whichever is longer."""
        if dtype not in self.peak_tflops:
            raise ValueError(f"no peak TFLOP/s for dtype {dtype!r} on {self.name}")
        best_rate = 0.0
        for block_m, block_n, tile_eff in self.gemm_tiles:
            tiles = math.ceil(m / block_m) * math.ceil(n / block_n)
            waves = math.ceil(tiles / self.sms)
            # Useful work over issued work: idle SMs in the last wave and masked rows/cols of edge tiles.
            wave_eff = (m * n) / (waves * self.sms * block_m * block_n)
            best_rate = max(best_rate, tile_eff * wave_eff)
        t_compute = 2.0 * m * k * n / (self.peak_tflops[dtype] * 1e12 * self.gemm_efficiency * best_rate)
        t_memory = (m * k + k * n + m * n) * DTYPE_BYTES[dtype] / self.hbm_bytes_per_s
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
    dtype: str,
    gemm_time: GemmFn,
    link: LinkModel,
) -> float | None:
    """Predicted seconds of one op call; None where the model does not cover the backend."""
    m, k, n = gemm_shape
    eb = DTYPE_BYTES[dtype]
    coll = OP_COLLECTIVE[op]
    nbytes = comm_elems * eb
    g_full = gemm_time(m, k, n)
    kind, p = backend_args(backend)
    if kind == "sequential":
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
    raise ValueError(f"unknown backend {backend!r}")


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
