"""The README's Python examples run as shown, under torchrun on CPU ranks: each block is written to a file
untouched and launched as the README's commands launch it (the two blocks run on the same command share one
launch, one after the other)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kernels.testing import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")


def _python_blocks() -> list[str]:
    with open(README, encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.M | re.S)


def test_every_python_block_is_run_below() -> None:
    assert len(_python_blocks()) == 3, "a README Python block was added or removed: run it in this file too"


def _launch(code: str, world: int, env: dict[str, str], tmp_path, args: list[str]) -> subprocess.CompletedProcess:
    """``code`` as a script with ``args`` under torchrun on ``world`` CPU ranks, in ``tmp_path``."""
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    full = {k: v for k, v in os.environ.items() if not k.startswith("COC_") and k != "TRITON_INTERPRET"}
    full.update(env, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    # --tee 3: each rank's lines prefixed with its rank, whole (the ranks' prints would interleave).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--tee", "3"]
    cmd += ["--nproc-per-node", str(world), str(script), *args]
    return subprocess.run(cmd, cwd=str(tmp_path), env=full, capture_output=True, text=True, timeout=600)


def _torchrun(code: str, world: int, env: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    proc = _launch(code, world, env, tmp_path, [])
    assert proc.returncode == 0, f"exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def test_two_rank_example_at_any_world(tmp_path) -> None:
    # Three ranks (the example is written for any W) on the README's chunked command; its plain command runs
    # the sequential backend, every op test's reference, and a torchrun launch costs a torch import per rank.
    world = 3
    out = _torchrun(_python_blocks()[0], world, {"COC_PARALLEL_NUM": "4"}, tmp_path).stdout
    assert sorted(re.findall(r"^\S*\]:(\d+) True$", out, re.M)) == [str(r) for r in range(world)], out


# The Hugging Face and FP8 blocks run on the README's plain command (2 ranks, sequential backend) in one torchrun
# launch: each block's file, untouched, runs as ``__main__`` (runpy) in turn, and the group a block leaves up is
# destroyed before the next block makes its own (a launch costs a torch import per rank and for the agent).
_DRIVER = """
import gc, runpy, sys

import torch.distributed as dist

for name in sys.argv[1:]:
    runpy.run_path(name, run_name="__main__")
    gc.collect()  # the block's modules hold the group: release them before destroying it
    if dist.is_initialized():
        dist.destroy_process_group()
    print("ran", name, flush=True)
"""
_SHARED_BLOCKS = {"hugging_face": 1, "fp8": 2}


@pytest.fixture(scope="module")
def shared_launch(tmp_path_factory) -> subprocess.CompletedProcess:
    """The shared launch's result: its return code is each test's to check, with the blocks that ran."""
    tmp_path = tmp_path_factory.mktemp("readme")
    blocks = _python_blocks()
    for name, index in _SHARED_BLOCKS.items():
        (tmp_path / f"{name}.py").write_text(blocks[index], encoding="utf-8")
    return _launch(_DRIVER, 2, {}, tmp_path, [f"{name}.py" for name in _SHARED_BLOCKS])


def _ran_on_both_ranks(proc: subprocess.CompletedProcess, name: str) -> None:
    ranks = sorted(re.findall(rf"^\S*?(\d+)\]:ran {name}\.py$", proc.stdout, re.M))
    assert ranks == ["0", "1"], f"exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_hugging_face_example(shared_launch) -> None:
    _ran_on_both_ranks(shared_launch, "hugging_face")


def test_fp8_example(shared_launch) -> None:
    _ran_on_both_ranks(shared_launch, "fp8")
    assert shared_launch.returncode == 0, shared_launch.stderr[-6000:]
