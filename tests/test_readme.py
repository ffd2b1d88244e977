"""The README's Python examples run as shown, under torchrun on CPU ranks: each block is written to a file
untouched and launched as the README's commands launch it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from kernels.testing import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")


def _python_blocks() -> list[str]:
    with open(README, encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.M | re.S)


def test_every_python_block_is_run_below() -> None:
    assert len(_python_blocks()) == 3, "a README Python block was added or removed: run it in this file too"


def _torchrun(code: str, world: int, env: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    full = {k: v for k, v in os.environ.items() if not k.startswith("COC_") and k != "TRITON_INTERPRET"}
    full.update(env, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    # --tee 3: each rank's lines prefixed with its rank, whole (the ranks' prints would interleave).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--tee", "3"]
    cmd += ["--nproc-per-node", str(world), str(script)]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=full, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def test_two_rank_example_at_any_world(tmp_path) -> None:
    # Three ranks (the example is written for any W) on the README's chunked command; its plain command runs
    # the sequential backend, every op test's reference, and a torchrun launch costs a torch import per rank.
    world = 3
    out = _torchrun(_python_blocks()[0], world, {"COC_PARALLEL_NUM": "4"}, tmp_path).stdout
    assert sorted(re.findall(r"^\S*\]:(\d+) True$", out, re.M)) == [str(r) for r in range(world)], out


def test_hugging_face_example(tmp_path) -> None:
    _torchrun(_python_blocks()[1], 2, {}, tmp_path)


def test_fp8_example(tmp_path) -> None:
    _torchrun(_python_blocks()[2], 2, {}, tmp_path)
