"""Reports: run metadata, the terminal table, JSON / CSV files and the optional PNG plot."""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Any

import torch

from bench.harness.suites import OP_SHORT, REPO_ROOT

SCHEMA = "coc-bench/1"
MODEL_NOTE = (
    "model = bench/model/dense.py PREDICTION from the measured GEMM times and the link model "
    "named in the header; it is not a measurement"
)


def git_revision() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    rev = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"revision": rev, "dirty": bool(status) if status is not None else None}


def device_info(device_type: str) -> dict[str, Any]:
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()  # a tuple in current torch, an int in old releases
        return {
            "type": "cuda",
            "name": props.name,
            "count": torch.cuda.device_count(),
            "memory_GiB": round(props.total_memory / 2**30, 1),
            "sms": props.multi_processor_count,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        }
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count()}


def metadata(device_type: str, argv: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "schema": SCHEMA,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_info(device_type),
        "dist_backend": "nccl" if device_type == "cuda" else "gloo",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version},
        "git": git_revision(),
        # Load average: CPU timings on a shared machine are only as good as the machine was idle.
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "argv": argv,
        **extra,
    }


def case_label(rec: dict[str, Any]) -> str:
    """``layer/op M= W= dtype`` of a record, and its operand format unless plain."""
    fmt = rec.get("format", "plain")
    label = f"{rec['layer']}/{OP_SHORT[rec['op']]} M={rec['tokens']} W={rec['world']} {rec['dtype']}"
    return label if fmt == "plain" else f"{label} {fmt}"


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _overlap_cell(b: dict[str, Any], rec: dict[str, Any]) -> str:
    """The unfused paths (sequential, FP8's baseline) have nothing to overlap (blank); ``n/a`` where the
    figure has no meaning (CPU ranks, world size 1, an untimed backend)."""
    if b["backend"] in ("sequential", "baseline"):
        return ""
    return "n/a" if b.get("overlap_eff") is None else format(b["overlap_eff"], ".0%")


def table(records: list[dict[str, Any]], model_label: str | None) -> str:
    """One line per (case, backend): measured figures, then the model's prediction."""
    stat = records[0].get("stat", "median") if records else "median"
    head = [
        "case",
        "backend",
        "status",
        f"ms ({stat})",
        "spread",
        "TFLOP/s",
        "speedup",
        "overlap",
        "gemm ms",
        "comm ms",
        "busbw GB/s",
    ]
    if model_label:
        head += ["model ms", "model err"]
    lines = [head]
    for rec in records:
        label = case_label(rec)
        for i, b in enumerate(rec["backends"]):
            status = b["status"] + ("*" if b.get("fallback") else "") + ("(i)" if b.get("interpreted") else "")
            ms = b.get("ms", {})
            row = [
                label if i == 0 else "",
                b["backend"],
                status,
                _fmt(ms.get(stat), ".3f"),
                _fmt(ms.get("spread"), ".1%") if ms else "-",
                _fmt(b.get("tflops"), ".3g"),
                _fmt(b.get("speedup"), ".2f") + ("x" if b.get("speedup") else ""),
                _overlap_cell(b, rec),
                _fmt(rec["gemm_ms"][stat] if rec["gemm_ms"] else None, ".3f") if i == 0 else "",
                _fmt(rec["comm_ms"][stat] if rec["comm_ms"] else None, ".3f") if i == 0 else "",
                _fmt(rec["comm_busbw_GBps"], ".3g") if i == 0 else "",
            ]
            if model_label:
                row += [_fmt(b.get("model_ms"), ".3f"), _fmt(b.get("model_rel_err"), "+.0%")]
            lines.append(row)
    widths = [max(len(r[c]) for r in lines) for c in range(len(head))]
    out = [
        "  ".join(cell.ljust(w) if c < 3 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths, strict=False)))
        for r in lines
    ]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out + [""] + _table_notes(records, model_label, stat))


def _table_notes(records: list[dict[str, Any]], model_label: str | None, stat: str) -> list[str]:
    """The lines under :func:`table`: what its marks (``*``, ``(i)``) and columns mean, and why a row has no time."""
    notes = []
    if any(b.get("fallback") for rec in records for b in rec["backends"]):
        notes.append("* fused fell back to the chunked path (the dispatcher's warning is in the JSON)")
    if any(b.get("interpreted") for rec in records for b in rec["backends"]):
        notes.append(
            "(i) the fused Triton kernels ran in Triton's interpreter (no GPU): checked against "
            "sequential, not timed (an interpreter's time is not a performance figure)"
        )
    for rec in records:
        if rec.get("gemm_skipped"):
            notes.append(f"{rec['label']}: bare GEMM not timed: {rec['gemm_skipped']}")
        for b in rec["backends"]:
            if b["status"] in ("skipped", "incorrect"):
                notes.append(f"{rec['label']} {b['backend']}: {b['status']}: {b.get('reason', '')}".strip())
    if model_label:
        notes.append(f"{MODEL_NOTE} ({model_label}); model err = (model - measured) / measured")
    notes.append(
        "overlap = (t_gemm + t_comm - t_op) / min(t_gemm, t_comm), from the bare GEMM and bare "
        "collective timed alone (n/a on CPU, where both share the cores, at world 1 and when not timed); "
        "speedup = t_baseline / t_op, the baseline being the unfused path (sequential; FP8: the baseline row, "
        "torch._scaled_mm + the collective); gemm ms = the baseline's GEMM (F.linear; torch._scaled_mm; "
        "int8: dequantize + F.linear); times are the " + stat + " over repeats "
        "(each repeat the max over ranks); spread = (p80 - p20) / median"
    )
    return notes


def model_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median |relative error| of the model per backend over the cases that were both measured and modelled."""
    errs: dict[str, list[float]] = {}
    for rec in records:
        for b in rec["backends"]:
            if b.get("model_rel_err") is not None:
                errs.setdefault(b["backend"], []).append(abs(b["model_rel_err"]))
    out = {}
    for backend, e in errs.items():
        out[backend] = {"cases": len(e), "median_abs_rel_err": statistics.median(e), "max_abs_rel_err": max(e)}
    return out


def flat_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for rec in records:
        stat = rec.get("stat", "median")
        base = {
            "stat": stat,
            "suite": rec["suite"],
            "layer": rec["layer"],
            "op": rec["op"],
            "tokens": rec["tokens"],
            "k": rec["k"],
            "n": rec["n"],
            "world": rec["world"],
            "dtype": rec["dtype"],
            "format": rec.get("format", "plain"),
            "gemm_m": rec["gemm_shape"][0],
            "gemm_k": rec["gemm_shape"][1],
            "gemm_n": rec["gemm_shape"][2],
            "gemm_ms": rec["gemm_ms"][stat] if rec["gemm_ms"] else None,
            "gemm_tflops": rec["gemm_tflops"],
            "comm_ms": rec["comm_ms"][stat] if rec["comm_ms"] else None,
            "comm_bytes": rec["comm_bytes"],
            "comm_busbw_GBps": rec["comm_busbw_GBps"],
        }
        for b in rec["backends"]:
            ms = b.get("ms", {})
            rows.append(
                {
                    **base,
                    "backend": b["backend"],
                    "status": b["status"],
                    "fallback": bool(b.get("fallback")),
                    "max_abs_err": b.get("max_abs_err"),
                    "ms_median": ms.get("median"),
                    "ms_p20": ms.get("p20"),
                    "ms_p80": ms.get("p80"),
                    "ms_min": ms.get("min"),
                    "ms_max": ms.get("max"),
                    "repeats": ms.get("n"),
                    "tflops": b.get("tflops"),
                    "speedup": b.get("speedup"),
                    "overlap_eff": b.get("overlap_eff"),
                    "model_ms": b.get("model_ms"),
                    "model_rel_err": b.get("model_rel_err"),
                    "reason": b.get("reason", ""),
                }
            )
    return rows


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")


def write_csv(path: str, records: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    rows = flat_rows(records)
    with open(path, "w", newline="", encoding="utf-8") as f:
        # Provenance travels with the figures even when the CSV is read on its own.
        f.write(
            f"# {meta['schema']} {meta['date_utc']} device={meta['device']['name']} "
            f"torch={meta['versions']['torch']} triton={meta['versions']['triton']} "
            f"git={meta['git']['revision']}{'+dirty' if meta['git']['dirty'] else ''}\n"
        )
        if not rows:
            return
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_plot(path: str, records: list[dict[str, Any]], title: str) -> str | None:
    """Speedup over the unfused baseline per case and backend. Returns why it was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or the package's [plot] extra)"
    labels = [
        f"{r['layer']}/{OP_SHORT[r['op']]}\nM={r['tokens']} W={r['world']}"
        + ("" if r.get("format", "plain") == "plain" else f"\n{r['format']}")
        for r in records
    ]
    unfused = ("sequential", "baseline")
    backends = sorted({b["backend"] for r in records for b in r["backends"] if b["backend"] not in unfused})
    if not records or not backends:
        return "nothing to plot (no backend besides sequential)"
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(records) * max(1, len(backends)) / 2), 4.5))
    width = 0.8 / len(backends)
    for j, backend in enumerate(backends):
        ys = []
        for r in records:
            b = next((b for b in r["backends"] if b["backend"] == backend), None)
            ys.append(b.get("speedup") or 0.0 if b else 0.0)
        ax.bar([i + j * width for i in range(len(records))], ys, width, label=backend)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(backends) - 1) / 2 for i in range(len(records))])
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("speedup over the unfused baseline (measured)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def default_stem(meta: dict[str, Any], name: str | None) -> str:
    if name:
        return name
    stamp = meta["date_utc"].replace(":", "").replace("-", "")
    if meta["device"]["type"] == "model":
        return f"{meta['device']['name']}-{stamp}"
    dev = meta["device"]["name"] if meta["device"]["type"] == "cuda" else "cpu"
    slug = "".join(ch if ch.isalnum() else "-" for ch in dev.lower()).strip("-")
    return f"{slug}-{meta['dist_backend']}-{stamp}"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
