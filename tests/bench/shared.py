"""One run of an expensive command per test session, shared by the tests that assert on it, whichever xdist
worker each of them lands on (a module-scoped fixture alone runs once per worker)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from filelock import FileLock  # a dependency of torch


def run_once(factory: pytest.TempPathFactory, name: str, run: Callable[[Path], dict]) -> tuple[SimpleNamespace, Path]:
    """``run(folder)`` once per session (its JSON-able result kept in ``folder``, a directory all the
    workers of this session share); ``(the result as attributes, folder)``. The other workers wait for it."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/popen-gwK: pytest-N is the session's, shared by its workers
    folder = root / f"shared-{name}"
    done = root / f"shared-{name}.json"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(run(folder)))
    return SimpleNamespace(**json.loads(done.read_text())), folder


def completed(proc: subprocess.CompletedProcess) -> dict:
    """What the tests read of a finished process."""
    return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
