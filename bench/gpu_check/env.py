"""gpu-check's environment report: versions, GPU, driver, MPS, and the revision of the code that ran."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import time
from typing import Any

from bench.harness.suites import REPO_ROOT


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception as e:  # a broken install raises anything from its own imports
        return f"not importable ({type(e).__name__}: {str(e)[:120]})"
    return getattr(mod, "__version__", "unknown")


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:2])


def _git_revision() -> dict[str, Any]:
    from bench.harness.report import git_revision

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


def environment(device_type: str) -> tuple[dict[str, Any], list[dict]]:
    """``(facts, items)``: versions, device, driver, MPS and revision; items pass, warn or skip."""
    items: list[dict] = []

    def item(name: str, status: str, detail: str) -> None:
        items.append({"name": name, "status": status, "detail": detail})

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
    if device_type == "cuda":
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
        item(
            "CUDA GPU",
            "pass",
            f"{props.name}, {props.multi_processor_count} SMs, "
            f"{info['memory_GiB']} GiB, sm_{props.major}{props.minor}, driver {info['driver']}",
        )
        cupy_ok = not str(info["cupy"]).startswith("not importable")
        item("CuPy (CUDA IPC handles of the heap)", "pass" if cupy_ok else "fail", str(info["cupy"]))
        on, why = mps_status()
        info["mps"] = {"on": on, "evidence": why}
        # Under MPS kernels of several processes run at once: spinning grids can starve a peer's producer.
        item("MPS", "warn" if on else "pass", ("ON: " if on else "off: ") + why)
    else:
        item("CUDA GPU", "skip", "no CUDA GPU: --allow-cpu runs on CPU under the Triton interpreter")
        item("CuPy (CUDA IPC handles of the heap)", "skip", f"needs CUDA (cupy: {info['cupy']})")
        item("MPS", "skip", "needs CUDA")
    tv, trv = _vtuple(torch.__version__), _vtuple(str(info["triton"]))
    ok = tv >= (2, 11) and trv >= (3, 6)
    item(
        "torch >= 2.11 and triton >= 3.6 (the supported range)",
        "pass" if ok else "warn",
        f"torch {torch.__version__}, triton {info['triton']}",
    )
    return info, items
