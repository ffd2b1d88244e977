"""``python -m autopar.demo``, the main job, end to end, plus its table and verdict logic."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

from kernels.testing import REPO_ROOT


def test_demo_runs_every_path_and_matches_the_reference() -> None:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # Every path on 2 spawned ranks (the default is 4; `make demo` runs the default sizes), at small sizes: the
    # world and the sizes change how much is computed, not which code runs (the demo has no branch on the
    # world beyond its divisibility check, and every rank runs the same code), and each rank is a process that
    # imports torch and runs the fused kernels in the Triton interpreter on a 2-core CI machine.
    cmd = [sys.executable, "-m", "autopar.demo", "--world-size", "2", "--hidden", "8", "--seq", "4", "--steps", "2"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, f"demo exited {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert "2 ranks" in out and "PASSED" in out, out
    for label, num in (("sequential", 1), ("chunked/2", 2), ("chunked/4", 4), ("chunked/8", 8)):
        for sp in ("False", "True"):
            row = re.search(rf"^{re.escape(label)}\s+{num}\s+{sp}\s+(\S+)\s+(\S+)\s+(\S+)\s+ok", out, re.M)
            assert row, f"no passing row for {label} sequence_parallel={sp}:\n{out}"
            step_ms, loss_diff, grad_diff = (float(v) for v in row.groups())
            assert step_ms > 0 and loss_diff <= 1e-4 and grad_diff <= 1e-4
    # On CPU the fused kernels run under the Triton interpreter (the demo selects it), so both
    # fused rows must have run and passed; with GPUs a row may say why it was skipped instead.
    fused = re.findall(r"^fused\s.*$", out, re.M)
    accepted = (" ok",) if not torch.cuda.is_available() else (" ok", "skipped:")
    assert len(fused) == 2 and all(any(a in line for a in accepted) for line in fused), out


def test_demo_under_torchrun_runs_every_path() -> None:
    """``torchrun --nproc-per-node N -m autopar.demo`` on CPU: the fused path included. The variable
    that selects the Triton interpreter is removed first (pytest's conftest sets it), as in a shell:
    the demo must choose the interpreter itself before any kernel is defined."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "autopar.demo", "--hidden", "8", "--seq", "4", "--steps", "2", "--timeout", "300"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, f"torchrun demo exited {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert "2 ranks, gloo on cpu" in out and "PASSED: 10/10" in out, out
    for label in ("sequential", "chunked/2", "chunked/4", "chunked/8", "fused"):
        rows = re.findall(rf"^{re.escape(label)}\s.*\sok\b", out, re.M)
        assert len(rows) == 2, f"{label}: want a passing row per sequence_parallel setting:\n{out}"


def test_table_flags_a_run_that_differs_from_the_reference() -> None:
    from autopar.demo import REL_TOL, Row, format_table

    rows = [
        Row("sequential", 1, False, step_ms=1.0, loss_diff=1e-7, grad_diff=1e-7),
        Row("chunked/2", 2, True, step_ms=1.0, loss_diff=1e-7, grad_diff=10 * REL_TOL),
        Row("fused", 1, True, note="skipped: no peer memory"),
    ]
    table = format_table(rows, 4, "gloo", torch.device("cpu"))
    assert rows[0].ok and not rows[1].ok and rows[2].ok
    assert re.search(r"^chunked/2 .* FAIL$", table, re.M), table
    assert "skipped: no peer memory" in table
    assert table.splitlines()[-1].startswith("FAILED: 2/3"), table


def test_torchrun_on_several_nodes_uses_the_node_gpus(monkeypatch) -> None:
    """Under torchrun a node needs a GPU per local rank, not per rank of the whole world."""
    from autopar.demo import gpus_for_every_rank

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert gpus_for_every_rank(16)  # 2 nodes x 8 GPUs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert not gpus_for_every_rank(16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert gpus_for_every_rank(4) and not gpus_for_every_rank(16)  # spawned: the world is local
