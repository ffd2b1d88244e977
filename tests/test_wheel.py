"""The package as a user installs it: a wheel (``pip install .``, not editable) used from another directory.

The wheel is built once from a copy of the sources, then installed with ``--no-deps`` into a fresh virtual
environment that borrows this environment's torch, triton, numpy and pyyaml through a ``.pth`` file: path
entries of a ``.pth`` are not scanned for ``.pth`` files themselves, so this checkout's editable install
stays invisible there, and nothing is downloaded (the build too runs offline where this environment's
setuptools can build wheels). In that environment, with the working directory outside the checkout, it runs
an op on each backend at world 1, ``python -m bench --help``, a model run (the suites and links.yaml) and a
tuned-file lookup that must find the installed ``configs/tuned``. It also checks that every third-party
module the installed code imports at module level is a declared requirement.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from kernels.testing import REPO_ROOT

pytestmark = pytest.mark.wheel

FIRST_PARTY = ("kernels", "autopar", "bench")
SOURCES = ("setup.py", "pyproject.toml", "README.md", "configs", *FIRST_PARTY)
# A tuned file shipped only in the test's wheel: found through the installed configs/tuned or not at all.
TUNED_NAME = "nvidia-wheel-test"
TUNED_CONFIG = dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=5, group_m=8, variant="tma")
TUNED_FILE = {
    "version": 1,
    "gpu": "test",
    "entries": [dict(op="matmul", dtype="bfloat16", m=4096, n=8192, k=8192, config=TUNED_CONFIG)],
}

# Runs in the fresh environment; prints one JSON object of what it found.
INSTALLED_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch
    import kernels
    from kernels import paths
    from kernels.fused import tuned

    x, w = torch.randn(8, 16), torch.randn(12, 16)
    errors = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fused request that falls back warns: fail instead
        for backend in ("sequential", "chunked", "fused"):
            y = kernels.matmul_all_reduce(x, w, backend=backend)
            errors[backend] = float((y - x @ w.T).abs().max())
    tuned._cuda_name = lambda index: sys.argv[1]  # stands in for the GPU's name: no GPU here
    cuda = torch.device("cuda", 0)
    found = tuned.lookup(tuned.Query("matmul", torch.bfloat16, 4096, 8192, 8192), cuda)
    print(json.dumps({
        "kernels": kernels.__file__,
        "sys_path": [os.path.realpath(p) for p in sys.path],
        "errors": errors,
        "configs_dir": str(paths.CONFIGS_DIR),
        "coc_yaml": os.path.isfile(paths.config_path("coc.yaml")),
        "tuned_path": str(tuned.tuned_path(cuda)),
        "tuned_config": None if found is None else found.to_dict(),
    }))
    """
)


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _offline_build_flags() -> list[str]:
    """pip flags building from this environment's setuptools without the index where it can (setuptools
    70.1 builds wheels itself; older needs the wheel package), else none: an isolated build fetches
    setuptools (never torch: --no-deps)."""
    try:
        import setuptools
    except ImportError:
        return []
    major, minor = (int(p) for p in re.findall(r"\d+", setuptools.__version__)[:2])
    if (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None:
        return ["--no-build-isolation", "--no-index"]
    return []


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = Path(REPO_ROOT) / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    import yaml

    (src / "configs" / "tuned" / f"{TUNED_NAME}.yaml").write_text(yaml.safe_dump(TUNED_FILE))
    (src / "configs" / "tuned" / "cpu.yaml").write_text(yaml.safe_dump({"version": 1, "entries": []}))
    dist = tmp / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *_offline_build_flags(), "-w", str(dist), str(src)],
        cwd=tmp,
    )
    (wheel,) = dist.glob("coc_overlap-*.whl")
    return wheel


def _fresh_env(tmp: Path, wheel: Path) -> tuple[Path, Path]:
    """A venv without pip whose site-packages holds the wheel, and sees this environment's packages."""
    env_dir = tmp / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=tmp)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(_run([str(python), "-c", where], cwd=tmp).strip())
    (purelib / "_borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(purelib), str(wheel)],
        cwd=tmp,
    )
    return python, purelib


def _requirements(wheel: Path) -> set[str]:
    """Names of the wheel's unconditional requirements (extras left out), normalized."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [line.split(":", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    return {_normalize(re.match(r"\s*([A-Za-z0-9._-]+)", r).group(1)) for r in reqs if "extra ==" not in r}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _module_level_imports(root: Path) -> dict[str, str]:
    """Third-party top-level modules imported in a module's body (not in functions or try blocks, the
    optional imports), each with one file that imports it."""
    found: dict[str, str] = {}
    for top in FIRST_PARTY:
        for path in sorted((root / top).rglob("*.py")):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    mod = name.split(".")[0]
                    if mod not in sys.stdlib_module_names and mod not in (*FIRST_PARTY, "__future__"):
                        found.setdefault(mod, str(path.relative_to(root)))
    return found


@pytest.mark.timeout(600)
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n for n in names if n.startswith("kernels/_configs/")}
    configs = Path(REPO_ROOT) / "configs"
    sources = [p.relative_to(configs).as_posix() for p in configs.rglob("*") if p.suffix in (".yaml", ".md")]
    expected = {f"kernels/_configs/{name}" for name in sources if name != "tuned/cpu.yaml"}
    assert expected | {f"kernels/_configs/tuned/{TUNED_NAME}.yaml"} <= shipped, sorted(shipped)
    assert "kernels/_configs/tuned/cpu.yaml" not in shipped  # read only from COC_TUNED_DIR

    python, purelib = _fresh_env(tmp_path, wheel)
    imported = _module_level_imports(purelib)
    provided = importlib.metadata.packages_distributions()
    required = _requirements(wheel)
    undeclared = {
        mod: where
        for mod, where in imported.items()
        if not {_normalize(d) for d in provided.get(mod, [mod])} & required
    }
    assert not undeclared, f"imported at module level but not in install_requires: {undeclared} ({required})"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("COC_")}
    env["TRITON_INTERPRET"] = "1"
    facts = json.loads(_run([str(python), "-c", INSTALLED_SCRIPT, TUNED_NAME], cwd=elsewhere, env=env))
    assert Path(facts["kernels"]).is_relative_to(purelib), facts["kernels"]
    assert os.path.realpath(REPO_ROOT) not in facts["sys_path"]
    assert facts["errors"] == {"sequential": 0.0, "chunked": 0.0, "fused": pytest.approx(0.0, abs=1e-4)}
    assert facts["configs_dir"] == str(purelib / "kernels" / "_configs") and facts["coc_yaml"]
    assert facts["tuned_path"] == str(purelib / "kernels" / "_configs" / "tuned" / f"{TUNED_NAME}.yaml")
    assert facts["tuned_config"] == TUNED_CONFIG

    help_text = _run([str(python), "-m", "bench", "--help"], cwd=elsewhere, env=env)
    assert "Suites (configs/bench/): " in help_text and "tiny" in help_text
    out = elsewhere / "out"
    model = _run(
        [str(python), "-m", "bench", "--mode", "model", "--gpu", "H100", "--suite", "tiny", "--out-dir", str(out)],
        cwd=elsewhere,
        env=env,
    )
    assert "MODEL PREDICTIONS for H100" in model
    assert [p.name for p in elsewhere.iterdir()] == ["out"]
