"""The sections of ``python -m bench --mode gpu-check``, each run in a process of its own.

``python -m bench.gpu_check_sections SECTION OUT PARAMS_JSON`` runs one section and appends JSON
lines to ``OUT`` as results come (``{"item": {...}}``, ``{"info": {...}}``, ``{"note": "..."}``), so
the parent (:mod:`bench.gpu_check`) still has every finished item when it kills the section at its
time limit. ``PARAMS_JSON``: ``{"device_type": "cuda" | "cpu", "deadline": <time.time() seconds>}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

from bench.suites import REPO_ROOT


class Emitter:
    def __init__(self, path: str):
        self.path = path

    def _write(self, obj: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj, default=str) + "\n")

    def item(self, name: str, status: str, detail: str = "", **extra: Any) -> None:
        self._write({"item": {"name": name, "status": status, "detail": detail, **extra}})

    def raw_item(self, it: dict) -> None:
        self._write({"item": it})

    def info(self, **values: Any) -> None:
        self._write({"info": values})

    def note(self, text: str) -> None:
        self._write({"note": text})


def _left(params: dict) -> float:
    return params["deadline"] - time.time()


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception as e:  # a broken install raises anything from its own imports
        return f"not importable ({type(e).__name__}: {str(e)[:120]})"
    return getattr(mod, "__version__", "unknown")


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:2])


# ------------------------------------------------------------------------------------ a: environment


def _git_revision() -> dict[str, Any]:
    from bench.report import git_revision

    rev = git_revision()
    if rev.get("revision") is None:
        # A copy of the working tree without git: .git/HEAD may still be there, or nothing is.
        head = os.path.join(REPO_ROOT, ".git", "HEAD")
        try:
            with open(head, encoding="utf-8") as f:
                ref = f.read().strip()
            if ref.startswith("ref: "):
                with open(os.path.join(REPO_ROOT, ".git", ref[5:]), encoding="utf-8") as f:
                    ref = f.read().strip()
            rev = {"revision": ref, "dirty": None, "source": ".git files (no git binary)"}
        except OSError:
            rev = {"revision": None, "dirty": None, "source": "no git and no .git: see source_sha256"}
    return rev


def source_fingerprint() -> str:
    """sha256 over the Python sources of kernels/, bench/ and tests/ (ties a report to code without git)."""
    h = hashlib.sha256()
    for top in ("kernels", "bench", "tests"):
        for root, dirs, files in sorted(os.walk(os.path.join(REPO_ROOT, top))):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    h.update(os.path.relpath(path, REPO_ROOT).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()[:16]


def mps_status() -> tuple[bool, str]:
    """Whether CUDA MPS is on: the pipe-directory variable, the default control pipe, an MPS daemon here,
    or an MPS server among the GPU's processes (nvidia-smi)."""
    reasons = []
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe_dir:
        reasons.append(f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}")
    if os.path.exists("/tmp/nvidia-mps/control"):
        reasons.append("/tmp/nvidia-mps/control exists")
    try:
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
                        comm = f.read().strip()
                except OSError:
                    continue
                if comm.startswith("nvidia-cuda-mps"):
                    reasons.append(f"process {comm} (pid {pid})")
    except OSError:
        pass
    try:  # an MPS server started outside this container still shows among the GPU's processes
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=process_name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        if "nvidia-cuda-mps-server" in apps:
            reasons.append("nvidia-smi lists nvidia-cuda-mps-server")
    except (OSError, subprocess.SubprocessError):
        pass
    return bool(reasons), "; ".join(reasons) or "no MPS pipe variable, control pipe, daemon or server process"


def _nvidia_smi(query: str) -> str | None:
    try:
        return (
            subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def section_env(params: dict, out: Emitter) -> None:
    import platform

    import torch

    info: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "cupy": _version("cupy"),
        "numpy": _version("numpy"),
        "git": _git_revision(),
        "source_sha256": source_fingerprint(),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        "COC_env": {k: v for k, v in os.environ.items() if k.startswith("COC_")},
    }
    if params["device_type"] == "cuda":
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        info.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            sms=props.multi_processor_count,
            memory_GiB=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            driver=_nvidia_smi("driver_version"),
        )
        if info["driver"] is None:
            try:
                import cupy

                info["driver"] = f"CUDA driver API {cupy.cuda.runtime.driverGetVersion()} (no nvidia-smi)"
            except Exception:
                info["driver"] = "unknown (no nvidia-smi, no CuPy)"
        out.item(
            "CUDA GPU",
            "pass",
            f"{props.name}, {props.multi_processor_count} SMs, "
            f"{info['memory_GiB']} GiB, sm_{props.major}{props.minor}, driver {info['driver']}",
        )
        cupy_ok = not str(info["cupy"]).startswith("not importable")
        out.item("CuPy (CUDA IPC handles of the heap)", "pass" if cupy_ok else "fail", str(info["cupy"]))
        on, why = mps_status()
        info["mps"] = {"on": on, "evidence": why}
        # Under MPS kernels of several processes run at once: spinning grids can starve a peer's producer.
        out.item("MPS", "warn" if on else "pass", ("ON: " if on else "off: ") + why)
    else:
        out.item("CUDA GPU", "skip", "no CUDA GPU: --allow-cpu runs on CPU under the Triton interpreter")
        out.item("CuPy (CUDA IPC handles of the heap)", "skip", f"needs CUDA (cupy: {info['cupy']})")
        out.item("MPS", "skip", "needs CUDA")
    tv, trv = _vtuple(torch.__version__), _vtuple(str(info["triton"]))
    ok = tv >= (2, 11) and trv >= (3, 6)
    out.item(
        "torch >= 2.11 and triton >= 3.6 (the supported range)",
        "pass" if ok else "warn",
        f"torch {torch.__version__}, triton {info['triton']}",
    )
    out.info(**info)


# -------------------------------------------------------------------------------------- b: pytest

# Run first (pytest keeps the command-line order): if the section runs out of time, these have run.
_FIRST = ("test_fused_ops.py", "test_fused_stress.py", "test_fused_graphs.py", "test_ops.py", "test_soc.py")


def gpu_test_files() -> list[str]:
    """tests/ files with gpu-marked tests, the fused ones first."""
    files = []
    tests = os.path.join(REPO_ROOT, "tests")
    for name in sorted(os.listdir(tests)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(tests, name), encoding="utf-8") as f:
                if "pytest.mark.gpu" in f.read():
                    files.append(f"tests/{name}")
    return sorted(files, key=lambda f: (_FIRST.index(f[6:]) if f[6:] in _FIRST else len(_FIRST), f))


_VERBOSE_LINE = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def _junit_items(path: str) -> list[dict]:
    items = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        status, detail = "pass", f"{float(case.get('time', 0)):.1f} s"
        for tag, st in (("failure", "fail"), ("error", "fail"), ("skipped", "skip")):
            el = case.find(tag)
            if el is not None:
                status = st
                detail = (el.get("message") or el.text or "")[:500]
                break
        items.append({"name": name, "status": status, "detail": detail, "time_s": float(case.get("time", 0))})
    return items


def section_pytest(params: dict, out: Emitter) -> None:
    import importlib.util

    files = gpu_test_files()
    out.info(files=files)
    junit = os.path.join(os.path.dirname(out.path), "pytest-gpu.xml")
    per_test = 150 if params["device_type"] == "cuda" else 60
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-v",
        "-p",
        "no:cacheprovider",
        "-o",
        "junit_family=xunit2",
        f"--junitxml={junit}",
        *files,
    ]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append(f"--timeout={per_test}")
    else:
        out.note("pytest-timeout is not installed: no per-test time limit, only the section's")
    out.info(command=" ".join(cmd[1:]))
    limit = max(5.0, _left(params) - 5)
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=limit)
        stdout, rc = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = None
    if rc is not None and os.path.exists(junit):
        items = _junit_items(junit)
    else:
        # Killed before writing the XML: the -v progress lines still tell what finished.
        status = {
            "PASSED": "pass",
            "FAILED": "fail",
            "ERROR": "fail",
            "SKIPPED": "skip",
            "XFAIL": "pass",
            "XPASS": "fail",
        }
        items = [
            {"name": m.group(1), "status": status[m.group(2)], "detail": "from pytest -v (no junit: killed)"}
            for m in (_VERBOSE_LINE.match(line) for line in stdout.splitlines())
            if m
        ]
        out.note(f"pytest ran past {limit:.0f} s and was stopped; tests after the last listed one did not run")
    for it in items:
        out.raw_item(it)
    if rc not in (0, 5, None) and not any(it["status"] == "fail" for it in items):
        out.item("pytest run", "fail", f"exit status {rc} without a failing test: {stdout[-1500:]}")
    out.info(pytest_exit_status=rc, pytest_tail=stdout[-2500:])


# ----------------------------------------------------------------------------------- d: chunked


def chunked_world_body(
    rank: int, world: int, device_type: str, dtype_names: list[str], m: int, k: int, n: int
) -> list[dict]:
    """Chunked (``parallel_num=4``) against sequential and fp32 math on a gloo group of ``world`` ranks."""
    import torch
    import torch.distributed as dist

    import kernels
    from bench.gpu_check_cases import compare, device_of, item_error, tolerance

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = device_of(device_type)
    group = dist.group.WORLD if world > 1 else None
    items: list[dict] = []
    for dname in dtype_names:
        dtype = getattr(torch, dname)
        g = torch.Generator().manual_seed(7)
        xs = [torch.randn(m, k, generator=g).to(dtype) for _ in range(world)]
        w = torch.randn(n, k, generator=g).to(dtype)
        x, wd = xs[rank].to(dev), w.to(dev)
        x32, w32 = [t.to(dev).float() for t in xs], w.to(dev).float()
        for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
            name = f"W={world} chunked x4 {op} {dname} [{m}, {k}] x [{n}, {k}]"
            fn = getattr(kernels, op)
            if op == "all_gather_matmul":
                want, kk = torch.cat(x32) @ w32.T, k
            else:
                want, kk = sum(xi @ w32.T for xi in x32), k * world
                if op == "matmul_reduce_scatter":
                    rows = m // world
                    want = want[rank * rows : (rank + 1) * rows]
            atol, rtol = tolerance(dtype, kk, world, max(float(t.abs().max()) for t in x32), float(w32.abs().max()))
            try:
                fn(x, wd, group=group, backend="sequential")
            except Exception as e:  # the bare collective itself is unsupported here: not the chunked path's fault
                why = f"the sequential backend cannot run here either: {type(e).__name__}: {e}"
                items.append({"name": name, "status": "skip", "detail": why[:400]})
                continue
            try:
                if dev.type == "cuda":
                    # Freed NaN blocks: a read of a piece before its collective finished would see NaN.
                    torch.full((m * world, max(k, n)), float("nan"), device=dev, dtype=dtype)
                got = fn(x, wd, group=group, backend="chunked", parallel_num=4)
                items.append(compare(name, got, want, atol, rtol))
            except Exception as e:
                items.append(item_error(name, e))
    return items


def section_chunked(params: dict, out: Emitter) -> None:
    from bench.gpu_check_cases import merge_rank_items, spawn_ranks

    cuda = params["device_type"] == "cuda"
    dtypes = ["bfloat16", "float16"] if cuda else ["float32", "float16"]
    m, k, n = (8192, 1024, 1024) if cuda else (64, 32, 24)
    if cuda:
        out.note("world 1: pieces and their collectives (local copies at W=1) in stream order, results vs fp32 math")
    else:
        out.note("CPU: no CUDA streams; the chunked path's collectives run directly on gloo")
    for it in chunked_world_body(0, 1, params["device_type"], dtypes, m, k, n):
        out.raw_item(it)
    # Two ranks on the one GPU: NCCL refuses that, so gloo carries CUDA tensors (where it can).
    outcome = spawn_ranks(
        chunked_world_body, 2, params["device_type"], (dtypes, m // 4, k, n), timeout_s=max(5.0, _left(params) - 5)
    )
    for it in merge_rank_items(outcome, "W=2 chunked"):
        out.raw_item(it)
    if cuda:
        out.note(
            "W=2: gloo on CUDA tensors (NCCL refuses two ranks on one GPU); a collective gloo lacks on CUDA is "
            "reported as skipped"
        )


# ------------------------------------------------------------------------------------- c: fused


def section_fused(params: dict, out: Emitter) -> None:
    from bench.gpu_check_cases import fused_world_body, merge_rank_items, spawn_ranks

    cuda = params["device_type"] == "cuda"
    dtypes = ["float16", "bfloat16"] if cuda else ["float32", "float16"]
    if not cuda:
        out.note(
            "CPU: bf16 is not run, it needs CUDA to be meaningful (the Triton interpreter's own bf16 dot is "
            "wrong; the fused kernels widen bf16 operands there, which tests/test_fused_ops.py covers); "
            "fp32 and fp16 run instead"
        )
    calls = 50 if cuda else 8
    # 3 s and the 60 s below are both over 2**31 ns, so the GPU spin bound keeps its integer type and
    # lowering COC_TIMEOUT compiles no new kernel variant inside the timed call.
    timeout_s = 3.0
    # CPU: one op per kind of departure, to keep the CI run short.
    stop_ops, exit_ops = (["ag", "rs", "ar_two"],) * 2 if cuda else (["ag"], ["rs"])
    # W = 2 ends with a peer that stops calling, W = 4 with one whose process exits (rank 1 of a
    # 2-rank group inside each, so the error must name it).
    plan = [
        (2, dtypes, ("stop", stop_ops, timeout_s), 0.5),
        (4, dtypes if cuda else dtypes[1:], ("exit", exit_ops, timeout_s), 1.0),
    ]
    if not cuda:
        out.note("CPU: W=4 runs fp16 only; a peer that stops is checked on ag, one that exits on rs (CI time)")
    for world, names, depart, share in plan:
        # Long enough for the interpreter on a loaded CPU or a kernel compile in the middle of a peer's
        # wait; departure() lowers it to timeout_s for the calls its peer never makes.
        os.environ["COC_TIMEOUT"] = "60"
        started = time.time()
        what = f"W={world} fused"
        outcome = spawn_ranks(
            fused_world_body, world, params["device_type"], (names, calls, depart), timeout_s=_budget(params, share)
        )
        items = merge_rank_items(outcome, what)
        for it in items:
            out.raw_item(it)
        out.info(**{f"{what} seconds": round(time.time() - started, 1)})


def _budget(params: dict, share: float) -> float:
    """A share of the time left (at least 5 s) for one spawn, so one stuck spawn leaves time for the next."""
    return max(5.0, share * (_left(params) - 3))


# ---------------------------------------------------------------------------------------- e: speed


def section_speed(params: dict, out: Emitter) -> None:
    from bench import launch
    from bench.runner import RunOptions
    from bench.single import run_single
    from bench.suites import Case, load_suite

    cuda = params["device_type"] == "cuda"
    out.info(timings_meaningful=cuda)
    out.note(
        "timings of several processes sharing one GPU (section c) are correctness checks, not speedups: "
        "the processes share the SMs and time-slice. This section times one process on one GPU."
    )
    if cuda:
        cases: list[Case] = []
        for suite, tokens in (("llama2-70b", 4096), ("llama3-70b", 8192)):
            cases += [
                c
                for c in load_suite(suite).cases(ops=None, tokens=[tokens], world_sizes=[8], dtypes=["bf16", "fp16"])
                if c.op != "quantized_matmul_all_reduce"
            ]
        cases += [Case("square", "8192^3", "matmul_all_reduce", 8192, 8192, 8192, 1, d) for d in ("bf16", "fp16")]
        opts = RunOptions(backends=[], warmup=5, repeats=30, seed=0, progress=False)
    else:
        out.note("CPU: tiny shapes under the Triton interpreter; the times test the code path and mean nothing")
        cases = [
            Case("tiny", "qkv", "all_gather_matmul", 64, 32, 96, 2, "fp16"),
            Case("tiny", "out", "matmul_reduce_scatter", 64, 64, 32, 2, "fp16"),
        ]
        opts = RunOptions(backends=[], warmup=1, repeats=2, seed=0, progress=False)
    # One shape at a time, so the finished ones are kept if the section runs out of time; bf16 (the
    # dtype of the targets) first.
    groups: dict[tuple, list[Case]] = {}
    for c in sorted(cases, key=lambda c: c.dtype != "bf16"):
        groups.setdefault(c.gemm_shape + (c.dtype,), []).append(c)
    for _key, group_cases in groups.items():
        if _left(params) < 10:
            out.note(f"out of time before {len(groups)} shapes were done")
            break
        res = launch.run_in_process(run_single, params["device_type"], max(10.0, _left(params)), group_cases, opts)
        label = f"{group_cases[0].suite}/{group_cases[0].layer} M={group_cases[0].tokens}"
        for rec in res["records"]:
            _speed_items(out, rec, label)


def _speed_items(out: Emitter, rec: dict, label: str) -> None:
    m, k, n = rec["gemm_shape"]
    shape = f"{rec['dtype']} {label} gemm [{m}, {k}, {n}]"
    if "core_skipped" in rec:
        out.item(f"core {shape}", "skip", rec["core_skipped"])
    else:
        ok = rec.get("core_correct", False)
        detail = (
            (
                f"core {rec['core_tflops']:.1f} TFLOP/s, cuBLAS {rec['torch_tflops']:.1f} TFLOP/s, "
                f"core/cuBLAS speed {rec['core_vs_torch']:.3f}x"
            )
            if ok
            else "differs from torch beyond tolerance"
        )
        out.item(
            f"core {shape}",
            "pass" if ok else "fail",
            detail,
            kind="core",
            shape=shape,
            dtype=rec["dtype"],
            m=m,
            core_vs_torch=rec.get("core_vs_torch"),
            core_tflops=rec.get("core_tflops"),
            torch_tflops=rec.get("torch_tflops"),
        )
    for row in rec["ops"]:
        for label_key, ratio_key, kind in (
            ("fused", "fused_over_gemm", "fused_w1"),
            ("chunked4", "chunked4_over_sequential", "chunked4_w1"),
        ):
            name = f"{kind} {row['op']} {shape}"
            skipped = row.get(f"{label_key}_skipped")
            if skipped:
                out.item(name, "fail" if "differs" in skipped else "skip", skipped, kind=kind)
            elif ratio_key in row:
                what = "fused at world 1 / bare GEMM" if kind == "fused_w1" else "chunked x4 / unchunked at world 1"
                out.item(
                    name,
                    "pass",
                    f"{what} = {row[ratio_key]:.3f}",
                    kind=kind,
                    shape=shape,
                    op=row["op"],
                    dtype=rec["dtype"],
                    m=m,
                    ratio=row[ratio_key],
                )


SECTIONS: dict[str, Callable[[dict, Emitter], None]] = {
    "a": section_env,
    "b": section_pytest,
    "c": section_fused,
    "d": section_chunked,
    "e": section_speed,
}


def main(argv: list[str]) -> int:
    section, path, raw = argv
    params = json.loads(raw)
    out = Emitter(path)
    try:
        SECTIONS[section](params, out)
    except BaseException as e:
        import traceback

        out.item(f"section {section} raised", "fail", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
