"""The rank pools leave nothing in the temp dir: no /tmp/pymp-* dir, no listening socket.

Ranks that return tensors start multiprocessing's resource sharer (a Unix socket in a pymp-* dir);
a rank the pool kills never removed it, so every failing test left one behind in /tmp.
"""

import os
import shutil
import stat
import subprocess
import sys
import tempfile

import torch

from kernels.testing import REPO_ROOT

_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from kernels import testing
from tests.testing.test_harness_cleanup import _fail_on_rank_0, _tensor
assert testing.run_ranks(_tensor, 2)[1].tolist() == [1.0, 1.0]
try:
    testing.run_ranks(_fail_on_rank_0, 2)
    raise SystemExit("the failing call did not fail")
except testing.RankFailure:
    pass  # the pool was killed with the sharer's socket open
assert testing.run_ranks(_tensor, 2)[0].tolist() == [0.0, 0.0]
testing.close_pools()
"""


def _tensor(rank, world):
    return torch.full((2,), float(rank))


def _fail_on_rank_0(rank, world):
    if rank == 0:
        raise ValueError("rank 0 fails on purpose")
    return torch.ones(2)


def test_pool_start_failure_and_close_leave_no_tmp_listener():
    # A short private TMPDIR: Unix socket paths are limited to 107 bytes, which pytest's
    # tmp_path plus the pool's and pymp's dirs would exceed.
    tmp = tempfile.mkdtemp(prefix="coc-t-", dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        env = dict(os.environ, TMPDIR=tmp)
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT.format(root=REPO_ROOT)],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        left = []
        for dirpath, dirnames, filenames in os.walk(tmp):
            left += [os.path.join(dirpath, d) for d in dirnames if d.startswith("pymp-")]
            left += [
                os.path.join(dirpath, f) for f in filenames if stat.S_ISSOCK(os.lstat(os.path.join(dirpath, f)).st_mode)
            ]
        assert left == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
