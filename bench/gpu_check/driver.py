"""``python -m bench --mode gpu-check``: one command that turns a GPU machine into a correctness and speed report.

Made for a bare GPU image (``PYTHONPATH=. python3 -m bench --mode gpu-check --out-dir bench/results``):
installs nothing, needs no network, and the whole run, cold ``import torch`` included, ends within
9 minutes (:data:`TOTAL_BUDGET_S`, counted from the start of the process). Sections, in run order:

* ``env``: versions, GPU, driver, MPS, git revision (in this process);
* ``tune``: :func:`bench.tune.tuner.run` times the GEMM configuration space and writes
  ``configs/tuned/<gpu>.yaml``, so the sections after it run the tuned tiles (with ``--allow-cpu``:
  ``cpu.yaml`` into ``--out-dir``, since the kernels read a CPU file only from ``COC_TUNED_DIR``);
* ``tests``: ``pytest -m gpu``, the tests that matter most first (:data:`PRIORITY`: CUDA-graph
  replay and the fused ops on the CUDA-IPC heap), each under a time limit; this module is loaded
  into that pytest as a plugin (``-p bench.gpu_check.driver``), which orders the tests and writes each
  result as it comes;
* ``speed``: one process on one GPU (:mod:`bench.gpu_check.speed`).

``tune``, ``tests`` and ``speed`` each run in a process of their own, killed with everything it
started at its budget and reported as TIMEOUT with the items it finished; the command goes on.
Written: ``<device>-gpu-check-<UTC date>.md`` and ``.json`` under ``--out-dir``; the summary table
is printed last. With ``--allow-cpu`` (no GPU) the same flow runs on CPU under the Triton
interpreter with tiny shapes; the gpu-marked tests are then all skipped, and the report says so.
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

from bench.gpu_check.env import environment
from bench.harness.suites import REPO_ROOT

SECTIONS = ("env", "tune", "tests", "speed")
TITLES = {
    "env": "environment",
    "tune": "GEMM tuner (configs/tuned)",
    "tests": "gpu-marked pytest tests",
    "speed": "single-GPU speed",
}
# 9 minutes is the GPU's whole allowance; 15 s of it stay free for writing the report and exiting.
TOTAL_BUDGET_S = {"cuda": 525.0, "cpu": 900.0}
# Upper bounds per section; the speed section is kept its reserve, the tests get the rest.
TUNE_BUDGET_S = {"cuda": 150.0, "cpu": 120.0}
SPEED_RESERVE_S = {"cuda": 100.0, "cpu": 120.0}
# The speed section's last seconds go to the MoE rows (bench.gpu_check.moe), which the dense rows would otherwise spend.
MOE_RESERVE_S = {"cuda": 30.0, "cpu": 30.0}
# And the seconds after those to the decode rows (bench.gpu_check.decode).
DECODE_RESERVE_S = {"cuda": 25.0, "cpu": 30.0}
PER_TEST_S = {"cuda": 240, "cpu": 120}
# Node-id prefixes run first, in this order: the claims a GPU run exists to prove.
PRIORITY = (
    "tests/kernels/fused/test_graphs.py::test_captured_call_replays_on_gpu",
    "tests/kernels/test_compile.py::test_linears_cuda_graph_replays_on_one_gpu",
    "tests/kernels/fused/test_ops.py::test_fused_ops_gpu",
    "tests/kernels/fused/test_fp8_gpu.py::test_fused_fp8_ops_gpu",
    "tests/kernels/fused/test_gpu_heap.py",
    "tests/kernels/fused/test_stress.py",
    "tests/kernels/test_compile.py::test_linears_cuda_graph_replays_match_eager",
)
RESULTS_ENV = "COC_GPU_CHECK_RESULTS"
STATUS_ORDER = ("fail", "warn", "pass", "skip")
NOTE_SHARED = (
    "The gpu-marked tests run several processes on one GPU: a correctness check only (the processes "
    "share the SMs and time-slice, so their timings are not speedups). Speed is the speed section."
)


def process_start() -> float:
    """When this process started (``time.time()`` seconds), so the budget counts the cold ``import torch``."""
    now = time.time()
    try:
        with open("/proc/self/stat", encoding="utf-8") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="utf-8") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return now
    # A clock that disagrees (containers, VMs) must not eat or extend the budget by minutes.
    return started if now - 120 <= started <= now else now


# ------------------------------------------------------------------------------ the pytest plugin


def _priority(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(PRIORITY) if nodeid.startswith(prefix)), len(PRIORITY))


def pytest_collection_modifyitems(config: Any, items: list) -> None:
    items.sort(key=lambda item: _priority(item.nodeid))  # stable: file order within a priority


def pytest_runtest_logreport(report: Any) -> None:
    """One JSON line per test outcome (the call, or a setup that skipped or failed, or a failed
    teardown), appended to ``$COC_GPU_CHECK_RESULTS`` as it happens."""
    path = os.environ.get(RESULTS_ENV)
    if not path or not (report.when == "call" or report.failed or (report.when == "setup" and report.skipped)):
        return
    status = "pass" if report.passed else "skip" if report.skipped else "fail"
    if report.skipped and isinstance(report.longrepr, tuple):
        detail = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        detail = str(report.longrepr)[-1500:]
    else:
        detail = f"{report.duration:.1f} s"
    name = f"{report.nodeid} ({report.when})" if report.failed and report.when != "call" else report.nodeid
    _append(path, {"item": {"name": name, "status": status, "detail": detail, "seconds": round(report.duration, 1)}})


def _append(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")


# ------------------------------------------------------------------------------ sections


def _section_cmd(name: str, device_type: str, deadline: float, out: str, tuned_dir: str | None) -> list[str]:
    if name == "tests":
        return [
            sys.executable,
            "-m",
            "pytest",
            "tests",
            "-m",
            "gpu",
            "-p",
            "bench.gpu_check.driver",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--timeout={PER_TEST_S[device_type]}",
        ]
    return [sys.executable, "-m", "bench.gpu_check.driver", name, device_type, str(deadline), out, tuned_dir or ""]


def section_main(name: str, device_type: str, deadline: float, out: str, tuned_dir: str | None = None) -> int:
    """Body of the ``tune`` and ``speed`` processes: items as JSON lines into ``out``; the tuner writes
    into ``tuned_dir`` (None: ``configs/tuned``, a GPU run's place)."""

    def emit(item: dict) -> None:
        _append(out, {"item": item})

    if name == "speed":
        from bench.gpu_check import decode, moe, speed

        decode_at = deadline - DECODE_RESERVE_S[device_type]
        speed.run(device_type, decode_at - MOE_RESERVE_S[device_type], emit)
        moe.gpu_check_items(device_type, decode_at, emit)
        decode.gpu_check_items(device_type, deadline, emit)
        return 0
    try:
        from bench.tune import tuner
    except ImportError as e:
        emit({"name": "tuner", "status": "skip", "detail": f"bench.tune.tuner is not available ({e})"})
        return 0
    result = tuner.run(tuned_dir, device_type == "cpu", budget_s=max(5.0, deadline - time.time() - 10))
    emit({"name": "tuned file", "status": "pass", "detail": f"{result['path']} in {result['seconds']:.0f} s"})
    for row in result["rows"]:
        emit({"name": f"tuned {row.get('op')} {row.get('dtype')} {row.get('shape')}", "status": "pass", **row})
    for shape in result["skipped"]:
        emit({"name": f"not tuned {shape}", "status": "skip", "detail": "the tuner's budget was spent"})
    return 0


def run_section(
    name: str, device_type: str, budget_s: float, work: str, tuned_dir: str | None = None
) -> dict[str, Any]:
    """Run a section in its own process session, killed with its children after ``budget_s``; the
    tuner writes into ``tuned_dir`` (an absolute path: the section runs in the repository root)."""
    out = os.path.join(work, f"{name}.jsonl")
    started = time.time()
    env = dict(os.environ, **{RESULTS_ENV: out})
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if device_type == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # compiled kernels: the interpreter cannot address GPU memory
    proc = subprocess.Popen(
        _section_cmd(name, device_type, started + budget_s - 3, out, tuned_dir),
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
    try:  # whatever the section left running (rank pools normally exit with it)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    items = []
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            items = [json.loads(line)["item"] for line in f if line.strip()]
    notes = []
    rc = None if timed_out else proc.returncode
    if timed_out:
        notes.append(f"TIMED OUT after {budget_s:.0f} s: killed; the items listed finished before that")
    # pytest: 0 all passed, 1 some failed (items say which), 5 none selected.
    elif rc not in (0, 1, 5) or (rc == 1 and not any(it["status"] == "fail" for it in items)):
        items.append({"name": f"{name} process", "status": "fail", "detail": f"exit status {rc}: {log[-1500:]}"})
    return _section(
        name, items, started, budget_s, notes=notes, timed_out=timed_out, log=log if (timed_out or rc) else ""
    )


def _section(
    name: str, items: list[dict], started: float, budget_s: float, *, notes: list[str], timed_out: bool, log: str = ""
) -> dict[str, Any]:
    statuses = {it["status"] for it in items}
    verdict = "FAIL" if "fail" in statuses else "TIMEOUT" if timed_out else "WARN" if "warn" in statuses else None
    if verdict is None:
        # A section that checked nothing has not passed; one whose items all skipped says SKIP.
        verdict = "FAIL" if not statuses else "SKIP" if statuses == {"skip"} else "PASS"
    return {
        "section": name,
        "title": TITLES[name],
        "verdict": verdict,
        "seconds": round(time.time() - started, 1),
        "budget_s": round(budget_s),
        "items": items,
        "notes": notes,
        "counts": {s: sum(it["status"] == s for it in items) for s in STATUS_ORDER},
        "log_tail": log[-3000:],
    }


def budget_for(name: str, device_type: str, left: float, chosen: list[str]) -> float:
    """Seconds for section ``name`` with ``left`` of the total remaining: the tuner at most its cap,
    the tests all but the speed reserve, the last section all that is left."""
    later = chosen[chosen.index(name) + 1 :]
    kept = SPEED_RESERVE_S[device_type] if "speed" in later else 0.0
    if name == "tune":
        # The tests after the tuner keep at least 2 minutes: they hold the correctness claims.
        return min(TUNE_BUDGET_S[device_type], left - kept - (120 if "tests" in later else 0))
    return left - kept


# ------------------------------------------------------------------------------ the report


def summary_line(sec: dict[str, Any], cuda: bool) -> str:
    """The section's verdict and counts; for speed on a GPU the targets as numbers (CPU times mean nothing)."""
    from bench.gpu_check.moe import moe_summary
    from bench.gpu_check.speed import summary

    c = sec["counts"]
    parts = [f"{c[s]} {s}" for s in STATUS_ORDER if c.get(s)]
    line = f"{sec['verdict']}: " + (", ".join(parts) if parts else "nothing checked")
    speed = sec["section"] == "speed" and cuda
    extra = "; ".join(x for x in (summary(sec["items"]), moe_summary(sec["items"])) if x) if speed else ""
    fails = [it["name"] for it in sec["items"] if it["status"] == "fail"]
    return line + (f"; {extra}" if extra else "") + (f"; first failure: {fails[0]}" if fails else "")


def render_markdown(doc: dict[str, Any]) -> str:
    from bench.gpu_check.speed import table as speed_table

    meta = doc["meta"]
    cuda = meta["device_type"] == "cuda"
    lines = [
        f"# gpu-check report: {meta['device']}",
        "",
        f"Date (UTC): {meta['date_utc']}. Command: `{meta['command']}`. Total {meta['seconds']} s "
        f"(from process start, of {meta['total_budget_s']:.0f}). Overall: **{doc['overall']}**.",
        "",
    ]
    if meta["device_type"] != "cuda":
        lines += ["**No GPU: this run used `--allow-cpu`** (Triton interpreter, tiny shapes; times mean nothing).", ""]
    lines += [NOTE_SHARED, "", "| section | verdict | pass | fail | skip | warn | seconds / budget |"]
    lines.append("|---|---|---|---|---|---|---|")
    for sec in doc["sections"]:
        c = sec["counts"]
        lines.append(
            f"| {sec['title']} | {sec['verdict']} | {c['pass']} | {c['fail']} | {c['skip']} | {c['warn']} | "
            f"{sec['seconds']} / {sec['budget_s']} |"
        )
    for sec in doc["sections"]:
        lines += ["", f"## {sec['title']}", "", f"Verdict: **{summary_line(sec, cuda)}**", ""]
        lines += [f"- note: {note}" for note in sec["notes"]]
        if sec["section"] == "env":
            lines += [f"- {key}: `{json.dumps(value, default=str)}`" for key, value in doc["environment"].items()]
        if sec["section"] == "speed":
            lines += speed_table(sec["items"])
        if sec["items"]:
            lines += ["", "| status | check | detail |", "|---|---|---|"]
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
        summary = summary_line(sec, doc["meta"]["device_type"] == "cuda").split(": ", 1)[-1]
        rows.append(
            (sec["title"][:30], sec["verdict"], *(str(c[s]) for s in ("pass", "fail", "skip")), f"{sec['seconds']:.0f}")
            + (summary[:110],)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    text.insert(1, "-" * len(text[0]))
    text.append(f"overall: {doc['overall']} ({doc['meta']['device']}, {doc['meta']['seconds']} s)")
    return "\n".join(text)


def main(out_dir: str, allow_cpu: bool, sections: list[str] | None = None) -> int:
    import datetime

    start = process_start()
    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cpu" and not allow_cpu:
        print(
            "gpu-check needs a CUDA GPU (none found). --allow-cpu runs the same flow on CPU under the Triton "
            "interpreter with tiny shapes, to test the command itself.",
            file=sys.stderr,
        )
        return 2
    chosen = [s for s in SECTIONS if s in (sections or SECTIONS)]
    for s in sections or []:
        if s not in SECTIONS:
            raise SystemExit(f"error: --sections: {s!r} is not one of {', '.join(SECTIONS)}")
    now = datetime.datetime.now(datetime.timezone.utc)
    total = TOTAL_BUDGET_S[device_type]
    env, env_items = environment(device_type)
    results = [_section("env", env_items, start, 0, notes=[], timed_out=False)] if "env" in chosen else []
    # A CPU tuned file is read only from COC_TUNED_DIR, so it goes beside the report, not into configs/tuned.
    tuned_dir = os.path.abspath(out_dir) if device_type == "cpu" else None
    with tempfile.TemporaryDirectory(prefix="coc-gpu-check-") as work:
        for name in (s for s in chosen if s != "env"):
            left = total - (time.time() - start)
            budget = budget_for(name, device_type, left, chosen)
            if budget < 5:
                notes = ["not started: the time budget was spent"]
                results.append(_section(name, [], time.time(), 0, notes=notes, timed_out=True))
                continue
            print(f"gpu-check: {name} ({TITLES[name]}), budget {budget:.0f} s ...", file=sys.stderr, flush=True)
            results.append(run_section(name, device_type, budget, work, tuned_dir))
            print(f"gpu-check: {name}: {summary_line(results[-1], device_type == 'cuda')}", file=sys.stderr, flush=True)
    verdicts = {sec["verdict"] for sec in results}
    overall = next((v for v in ("FAIL", "TIMEOUT", "WARN") if v in verdicts), "PASS")
    device = env.get("gpu") or "cpu (--allow-cpu)"
    doc = {
        "schema": "coc-gpu-check/2",
        "overall": overall,
        "note": NOTE_SHARED,
        "meta": {
            "device": device,
            "device_type": device_type,
            "date_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": "python -m bench " + " ".join(sys.argv[1:]),
            "seconds": round(time.time() - start, 1),
            "total_budget_s": total,
        },
        "environment": env,
        "sections": results,
    }
    os.makedirs(out_dir, exist_ok=True)
    slug = "".join(ch if ch.isalnum() else "-" for ch in device.lower()).strip("-") if device_type == "cuda" else "cpu"
    stem = os.path.join(out_dir, f"{slug}-gpu-check-{now.strftime('%Y%m%d-%H%M%S')}")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(render_markdown(doc))
    print(f"wrote {stem}.md and {stem}.json", file=sys.stderr)
    print(table(doc))
    return 0 if overall in ("PASS", "WARN") else 1


if __name__ == "__main__":
    _name, _device_type, _deadline, _out, _tuned_dir = sys.argv[1:]
    if _device_type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(section_main(_name, _device_type, float(_deadline), _out, _tuned_dir or None))
