"""``python -m bench --mode gpu-check``: one command that turns a GPU machine into a correctness and speed report.

Made for a bare GPU image (``PYTHONPATH=. python3 -m bench --mode gpu-check --out-dir bench/results``):
installs nothing, needs no network, and ends within :data:`TOTAL_BUDGET_S` (520 s on a GPU). Each
section runs in a process of its own (:mod:`bench.gpu_check_sections`) under a time budget; past it the section's
whole process group is killed, reported as TIMEOUT with the items it finished, and the command goes
on. Sections:

a. environment; b. the ``gpu``-marked pytest tests; c. the fused ops on 2 and 4 processes sharing
the GPU; d. the chunked path with CUDA streams; e. single-GPU speed. Written:
``<device>-gpu-check-<UTC date>.md`` and ``.json`` under ``--out-dir``; the summary table is
printed last. With ``--allow-cpu`` (no GPU) the same flow runs on CPU under the Triton
interpreter with tiny shapes, and the report says what needed CUDA.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.suites import REPO_ROOT

TITLES = {
    "a": "environment",
    "b": "gpu-marked pytest tests",
    "c": "fused ops, W = 2 and 4 processes on one device",
    "d": "chunked path (CUDA streams), W = 1 and 2",
    "e": "single-GPU speed",
}
# Run order: the fused section first compiles the kernels into Triton's cache, which the pytest
# section then reuses; the report lists sections a..e.
ORDER = ("a", "c", "d", "e", "b")
# Seconds per section; the section run last gets whatever the others leave of TOTAL_BUDGET_S, which
# on a GPU stays under the 9 minutes the command may take on one H100 (540 s) with room for start-up.
# The CPU flow (--allow-cpu) has no such limit, and CI machines are slow and shared.
BUDGETS = {
    "cuda": {"a": 30, "c": 170, "d": 50, "e": 100, "b": 150},
    "cpu": {"a": 30, "c": 300, "d": 90, "e": 60, "b": 60},
}
TOTAL_BUDGET_S = {"cuda": 520.0, "cpu": 560.0}
STATUS_ORDER = ("fail", "warn", "pass", "skip")

NOTE_SHARED = (
    "Fused ops on several processes sharing one GPU (section c) are a correctness check only: the "
    "processes share the SMs and time-slice, so their timings are not speedups. Speed is measured "
    "on one process (section e)."
)


def _verdict(items: list[dict], timed_out: bool, rc: int | None) -> str:
    statuses = {it["status"] for it in items}
    if "fail" in statuses:
        return "FAIL"
    if timed_out:
        return "TIMEOUT"
    if rc not in (0, None):
        return "FAIL"
    if "warn" in statuses:
        return "WARN"
    if statuses and statuses <= {"skip"}:
        return "SKIP"
    if not statuses:
        return "FAIL"  # a section that checked nothing has not passed
    return "PASS"


def run_section(name: str, device_type: str, budget_s: float, work: str) -> dict[str, Any]:
    """Run section ``name`` in its own process group, killed after ``budget_s``; its results."""
    out = os.path.join(work, f"section-{name}.jsonl")
    params = {"device_type": device_type, "deadline": time.time() + budget_s - 2}
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if device_type == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # compiled kernels: the interpreter cannot address GPU memory
    started = time.time()
    # A session of its own: on timeout the section, its rank processes and pytest all go together.
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.gpu_check_sections", name, out, json.dumps(params)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        log, _ = proc.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    else:
        try:  # rank processes a section left behind (it normally reaps them)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    items: list[dict] = []
    info: dict[str, Any] = {}
    notes: list[str] = []
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                if "item" in rec:
                    items.append(rec["item"])
                elif "info" in rec:
                    info.update(rec["info"])
                else:
                    notes.append(rec["note"])
    rc = None if timed_out else proc.returncode
    if timed_out:
        notes.append(f"TIMED OUT after {budget_s:.0f} s: killed; the items above finished before that")
    elif rc != 0 and not items:
        notes.append(f"the section's process exited with status {rc}: {(log or '')[-1500:]}")
    return {
        "section": name,
        "title": TITLES[name],
        "verdict": _verdict(items, timed_out, rc),
        "seconds": round(time.time() - started, 1),
        "budget_s": round(budget_s),
        "items": items,
        "info": info,
        "notes": notes,
        "counts": {s: sum(it["status"] == s for it in items) for s in STATUS_ORDER},
        "log_tail": (log or "")[-3000:] if (timed_out or rc) else "",
    }


def summary_line(sec: dict[str, Any]) -> str:
    c = sec["counts"]
    parts = [f"{c[s]} {s}" for s in STATUS_ORDER if c.get(s)]
    line = f"{sec['verdict']}: " + (", ".join(parts) if parts else "nothing checked")
    extra = _speed_summary(sec) if sec["section"] == "e" and sec["info"].get("timings_meaningful") else ""
    if extra:
        line += "; " + extra
    fails = [it["name"] for it in sec["items"] if it["status"] == "fail"]
    if fails:
        line += f"; first failure: {fails[0]}"
    return line


def _median(values: list[float]) -> float | None:
    v = sorted(values)
    return None if not v else (v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2)


def _speed_summary(sec: dict[str, Any]) -> str:
    """The performance targets, as numbers (benchmarks, not pass/fail tests)."""
    items = sec["items"]
    out = []
    core = [
        it["core_vs_torch"]
        for it in items
        if it.get("kind") == "core" and it.get("core_vs_torch") and it.get("dtype") == "bf16"
    ]
    if core:
        out.append(f"core/cuBLAS bf16 min {min(core):.2f}x median {_median(core):.2f}x (target >= 0.90)")
    fused = [it["ratio"] for it in items if it.get("kind") == "fused_w1" and it.get("ratio")]
    if fused:
        out.append(f"fused W=1 / GEMM max {max(fused):.3f} (target <= 1.03)")
    chunk = [it["ratio"] for it in items if it.get("kind") == "chunked4_w1" and it.get("ratio") and it["m"] >= 4096]
    if chunk:
        out.append(f"chunked x4 / unchunked at M >= 4096 max {max(chunk):.3f} (target <= 1.05)")
    return "; ".join(out)


def device_slug(device_type: str) -> str:
    if device_type != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0)
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")


def speed_table(items: list[dict]) -> list[str]:
    """Section e's measurements, one row per GEMM shape and dtype (markdown lines; none if nothing was timed)."""
    from bench.suites import OP_SHORT

    rows: dict[str, dict[str, str]] = {}
    for it in items:
        if "shape" not in it:
            continue
        row = rows.setdefault(it["shape"], {})
        if it.get("kind") == "core" and it.get("core_vs_torch"):
            row.update(
                cublas=f"{it['torch_tflops']:.0f}", core=f"{it['core_tflops']:.0f}", ratio=f"{it['core_vs_torch']:.3f}"
            )
        elif it.get("ratio") is not None:
            key = "fused" if it["kind"] == "fused_w1" else "chunked"
            cell = f"{OP_SHORT.get(it['op'], it['op'])} {it['ratio']:.3f}"
            row[key] = f"{row[key]}, {cell}" if key in row else cell
    if not rows:
        return []
    out = [
        "| dtype, shape, local GEMM [m, k, n] | cuBLAS TFLOP/s | core TFLOP/s | core / cuBLAS speed | "
        "fused W=1 / GEMM time | chunked x4 / unchunked time |",
        "|---|---|---|---|---|---|",
    ]
    for shape, row in rows.items():
        out.append(
            f"| {shape} | "
            + " | ".join(row.get(k, "-") for k in ("cublas", "core", "ratio", "fused", "chunked"))
            + " |"
        )
    return out + [""]


def render_markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    lines = [
        f"# gpu-check report: {meta['device']}",
        "",
        f"Date (UTC): {meta['date_utc']}. Command: `{meta['command']}`. Total {meta['seconds']} s. "
        f"Overall: **{doc['overall']}**.",
        "",
    ]
    if meta["device_type"] != "cuda":
        lines += [
            "**No GPU: this run used `--allow-cpu`** (Triton interpreter, tiny shapes). What needs CUDA is "
            "skipped and says so; times mean nothing.",
            "",
        ]
    lines += [
        NOTE_SHARED,
        "",
        "| section | verdict | pass | fail | skip | warn | seconds / budget |",
        "|---|---|---|---|---|---|---|",
    ]
    for sec in doc["sections"]:
        c = sec["counts"]
        lines.append(
            f"| {sec['section']}. {sec['title']} | {sec['verdict']} | {c['pass']} | {c['fail']} | "
            f"{c['skip']} | {c['warn']} | {sec['seconds']} / {sec['budget_s']} |"
        )
    for sec in doc["sections"]:
        lines += ["", f"## {sec['section']}. {sec['title']}", "", f"Verdict: **{summary_line(sec)}**", ""]
        for note in sec["notes"]:
            lines.append(f"- note: {note}")
        if sec["section"] == "a":
            for key, value in sec["info"].items():
                lines.append(f"- {key}: `{json.dumps(value, default=str)}`")
        if sec["notes"] or sec["section"] == "a":
            lines.append("")
        if sec["section"] == "e":
            lines += speed_table(sec["items"])
        if sec["items"]:
            lines += ["| status | check | detail |", "|---|---|---|"]
            for it in sec["items"]:
                detail = str(it.get("detail", "")).replace("|", "\\|").replace("\n", " ")[:400]
                lines.append(f"| {it['status'].upper()} | {it['name']} | {detail} |")
        if sec.get("log_tail"):
            lines += ["", "Output tail:", "", "```", sec["log_tail"][-2000:], "```"]
    return "\n".join(lines) + "\n"


def table(doc: dict[str, Any]) -> str:
    rows = [("section", "verdict", "pass", "fail", "skip", "time s", "summary")]
    for sec in doc["sections"]:
        c = sec["counts"]
        summary = summary_line(sec).split(": ", 1)[-1]
        rows.append(
            (
                f"{sec['section']}. {sec['title'][:34]}",
                sec["verdict"],
                str(c["pass"]),
                str(c["fail"]),
                str(c["skip"]),
                f"{sec['seconds']:.0f}",
                summary[:110],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows]
    text.insert(1, "-" * len(text[0]))
    text.append(f"overall: {doc['overall']} ({doc['meta']['device']}, {doc['meta']['seconds']} s)")
    return "\n".join(text)


def main(out_dir: str, allow_cpu: bool, sections: list[str] | None = None) -> int:
    import datetime

    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cpu" and not allow_cpu:
        print(
            "gpu-check needs a CUDA GPU (none found). --allow-cpu runs the same flow on CPU under the Triton "
            "interpreter with tiny shapes, to test the command itself.",
            file=sys.stderr,
        )
        return 2
    chosen = sections or list(ORDER)
    for s in chosen:
        if s not in TITLES:
            raise SystemExit(f"error: --sections: {s!r} is not one of {', '.join(TITLES)}")
    start = time.time()
    now = datetime.datetime.now(datetime.timezone.utc)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="coc-gpu-check-") as work:
        for name in ORDER:
            if name not in chosen:
                continue
            left = TOTAL_BUDGET_S[device_type] - (time.time() - start)
            last = name == [s for s in ORDER if s in chosen][-1]
            # The last section also gets what the earlier ones left unused.
            budget = left - 5 if last else min(BUDGETS[device_type][name], left - 5)
            if left - 5 < 1:
                results[name] = {
                    "section": name,
                    "title": TITLES[name],
                    "verdict": "TIMEOUT",
                    "seconds": 0,
                    "budget_s": 0,
                    "items": [],
                    "info": {},
                    "counts": {s: 0 for s in STATUS_ORDER},
                    "notes": ["not started: the command's total time budget was spent"],
                    "log_tail": "",
                }
                continue
            print(f"gpu-check: section {name} ({TITLES[name]}), budget {budget:.0f} s ...", file=sys.stderr, flush=True)
            results[name] = run_section(name, device_type, budget, work)
            print(f"gpu-check: section {name}: {summary_line(results[name])}", file=sys.stderr, flush=True)
    ordered = [results[s] for s in sorted(results)]
    verdicts = {sec["verdict"] for sec in ordered}
    overall = next((v for v in ("FAIL", "TIMEOUT", "WARN") if v in verdicts), "PASS")
    env = results.get("a", {}).get("info", {})
    device = env.get("gpu") or ("cpu (--allow-cpu)" if device_type == "cpu" else device_slug(device_type))
    doc = {
        "schema": "coc-gpu-check/1",
        "overall": overall,
        "note": NOTE_SHARED,
        "meta": {
            "device": device,
            "device_type": device_type,
            "date_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": "python -m bench " + " ".join(sys.argv[1:]),
            "seconds": round(time.time() - start, 1),
            "total_budget_s": TOTAL_BUDGET_S[device_type],
        },
        "sections": ordered,
    }
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{device_slug(device_type)}-gpu-check-{now.strftime('%Y%m%d-%H%M%S')}")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(render_markdown(doc))
    print(f"wrote {stem}.md and {stem}.json", file=sys.stderr)
    print(table(doc))
    return 0 if overall in ("PASS", "WARN") else 1
