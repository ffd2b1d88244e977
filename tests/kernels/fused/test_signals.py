"""The GPU build of the spin in ``kernels.fused.signals.wait_signal``: light, and safe to leave per thread.

Compiled for sm_90 in a subprocess without ``TRITON_INTERPRET`` (Triton's bundled ptxas does the
last step), the call-check kernel's PTX is read loop by loop: every loop that sleeps (a spin) must
hold no barrier and no atomic, because its threads leave it independently (a barrier there could
deadlock) and a read-modify-write per iteration is what made the old spin heavy.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.harness import REPO_ROOT

_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.fused import signals

fn = signals._check_call_kernel
signature = dict(sig_tab_ptr="*i64", rank="i32", timeout="i64", must_agree="i64",
                 **{f"d{i}": "i64" for i in range(13)})
constexprs = dict(WORLD=4, DESC_LEN=13, DESC_OFFSET=100, COUNTERS_OFFSET=60, COUNTERS=8, USE_GLOBALTIMER=True)
src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}},
                constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"])
"""


def _spin_loops(ptx: str) -> list[str]:
    """For every ``nanosleep``, the innermost loop around it: the shortest stretch from a label to a
    branch back to that label that encloses it."""
    labels = {m.group(1): m.end() for m in re.finditer(r"^(\$L__BB\d+_\d+):", ptx, flags=re.M)}
    back_edges = [
        (labels[m.group(1)], m.end())
        for m in re.finditer(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", ptx)
        if m.group(1) in labels and labels[m.group(1)] < m.start()
    ]
    loops = []
    for sleep in re.finditer(r"nanosleep", ptx):
        around = [(end - begin, begin, end) for begin, end in back_edges if begin < sleep.start() < end]
        if around:
            _, begin, end = min(around)
            loops.append(ptx[begin:end])
    return loops


def test_spin_holds_no_barrier_and_no_atomic():
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("Triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    loops = _spin_loops(proc.stdout)
    # A spin per peer of the W = 4 check (three descriptor waits), or more if the compiler versions one.
    assert len(loops) >= 3, f"expected a spin loop per peer, found {len(loops)}"
    for body in loops:
        assert "bar.sync" not in body and "barrier" not in body, body
        assert "atom." not in body, body
        assert "ld.volatile.global" in body and "%globaltimer" in body, body
