"""The GPU build of the call-check kernel in ``kernels.fused.signals``, read from its sm_90 PTX.

Compiled for sm_90 in a subprocess without ``TRITON_INTERPRET`` (Triton's bundled ptxas does the
last step), with the launch options ``check_call`` really uses:

* every loop that sleeps (a spin) holds no barrier and no atomic, because its threads leave it
  independently (a barrier there could deadlock) and a read-modify-write per iteration is what made
  the old spin heavy;
* the epoch's read-modify-write cannot race: every thread loads the epoch word and one stores it, so
  the launch must be a single warp and a barrier must order the loads before the store (with four
  warps and no barrier, a late warp could read the advanced epoch and wait on the wrong slot).
"""

import os
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from kernels.testing import REPO_ROOT

_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.fused import signals

fn = signals._check_call_kernel
signature = dict(sig_tab_ptr="*i64", rank="i32", timeout="i64", must_agree="i64",
                 **{a: "i64" for a in fn.arg_names if a[0] == "d" and a[1:].isdigit()})
constexprs = dict(WORLD=4, DESC_LEN=13, DESC_OFFSET=100, COUNTERS_OFFSET=60, COUNTERS=8, USE_GLOBALTIMER=True)
src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}},
                constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS}).asm["ptx"])
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


def _launch_options() -> dict:
    """The keyword options ``signals.check_call`` launches the check kernel with."""
    from kernels.fused import signals

    seen: dict = {}

    class _Kernel:
        def __getitem__(self, grid: tuple) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                seen.update(grid=grid, **{k: v for k, v in kwargs.items() if not k.isupper()})

            return launch

    heap = SimpleNamespace(world_size=4, sig_ptrs=None, rank=0)
    saved = signals._check_call_kernel
    signals._check_call_kernel = _Kernel()
    try:
        signals.check_call(heap, tuple(range(13)), must_agree=0, timeout=1, use_globaltimer=True)
    finally:
        signals._check_call_kernel = saved
    return seen


def _check_kernel_ptx(num_warps: int) -> str:
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("Triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    script = _SCRIPT.replace("NUM_WARPS", str(num_warps))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_spin_holds_no_barrier_and_no_atomic():
    loops = _spin_loops(_check_kernel_ptx(_launch_options().get("num_warps", 4)))
    # A spin per peer of the W = 4 check (three descriptor waits), or more if the compiler versions one.
    assert len(loops) >= 3, f"expected a spin loop per peer, found {len(loops)}"
    for body in loops:
        assert "bar.sync" not in body and "barrier" not in body, body
        assert "atom." not in body, body
        assert "ld.volatile.global" in body and "%globaltimer" in body, body


def test_epoch_update_is_one_warp_with_a_barrier_between_load_and_store():
    options = _launch_options()
    assert options["grid"] == (1,)
    # Triton's default is 4 warps; the launch must ask for one.
    num_warps = options.get("num_warps", 4)
    assert num_warps == 1, options
    ptx = _check_kernel_ptx(num_warps)
    assert re.search(r"\.(reqntid|maxntid)\s+32(,\s*1,\s*1)?\s*$", ptx, flags=re.M), "not a single-warp kernel"
    # The epoch store is the kernel's first global store; its address register was loaded from
    # before it, and a barrier must lie between that load and the store.
    store = re.search(r"st\.global\S*\s+\[\s*(%rd\d+)\s*\+\s*0\s*\]", ptx)
    assert store, "no global store in the check kernel"
    address = re.escape(store.group(1))
    loads = list(re.finditer(rf"ld\.global\S*\s+(?:\{{\s*)?%rd\d+(?:\s*\}})?,\s*\[\s*{address}\s*\+\s*0\s*\]", ptx))
    loads = [m for m in loads if m.start() < store.start()]
    assert loads, "the epoch store has no load of the same word before it"
    between = ptx[loads[-1].end() : store.start()]
    assert "bar.sync" in between or "barrier.sync" in between, between
