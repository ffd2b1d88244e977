"""Compiling Triton kernels for a Hopper GPU (sm_90a) without one, and reading what came out.

The method of every ``*compile_sm90*`` test: each kernel is compiled under the argument
specialization a real launch of it gets (:func:`compile_like_launch`), in a subprocess without
``TRITON_INTERPRET`` (:func:`run_compile_check`), by Triton's bundled ptxas; the tests then read the
cubin (:func:`resources`, :func:`sass`) and the PTX. The example arguments of the reduction kernels
that every format shares are built here once (:func:`reduce_slots_args`, :func:`gather_rows_args`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from kernels.testing import REPO_ROOT

GPU_TARGET = ("cuda", 90, 32)
# A 16-byte cp.async from global to shared memory: a pipelined operand tile load.
CP_ASYNC_16 = re.compile(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (?:16|0x10)\b")


def tool(name: str) -> str:
    """The path of one of Triton's bundled CUDA tools (``ptxas``, ``cuobjdump``)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_like_launch(fn: Any, args: dict, num_warps: int, num_stages: int = 3) -> Any:
    """Compile ``fn`` for sm_90a as ``fn[grid](**args, num_warps=..., num_stages=...)`` would on an
    H100: the JIT's binder computes the signature, constants and alignment attributes (pointers of
    torch tensors 16-byte aligned, integers divisible by 16 marked so, integers equal to 1 constants,
    ``do_not_specialize`` honoured)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    missing = set(fn.arg_names) - set(args)
    if missing:
        raise TypeError(f"{fn.__name__}: no example value for {sorted(missing)}")
    target = GPUTarget(*GPU_TARGET)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    bound, specialization, opts = binder(**args, **options)
    opts, signature, constexprs, attrs = fn._pack_args(backend, options, bound, specialization, opts)
    return compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=opts.__dict__)


def _cuobjdump(kernel: Any, flag: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([tool("cuobjdump"), flag, path], capture_output=True, text=True, check=True).stdout


def resources(kernel: Any) -> tuple[int, int]:
    """``(registers, local bytes)`` per thread of a compiled kernel, read from its cubin.

    Triton kernels have no local arrays and no calls, so local memory (the stack frame, which is
    what the driver reports as a kernel's ``n_spills``) holds only register spills.
    """
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", _cuobjdump(kernel, "-res-usage")))
    return int(usage["REG"]), int(usage["STACK"]) + int(usage["LOCAL"])


def sass(kernel: Any) -> str:
    """The SASS of a compiled kernel."""
    return _cuobjdump(kernel, "-sass")


def run_compile_check(module: str, expect: str, timeout: int = 900, entry: str = "main") -> None:
    """Run ``module.<entry>()`` (default ``main``) in a subprocess without ``TRITON_INTERPRET`` (Triton's
    default FP fusion, whatever this environment says) and assert it exited 0 and printed ``expect``; skip where
    Triton's bundled ptxas or cuobjdump is missing. ``timeout`` bounds a hang, not the speed."""
    if not all(os.path.exists(tool(name)) for name in ("ptxas", "cuobjdump")):
        pytest.skip("Triton's bundled ptxas or cuobjdump is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module} as t; t.{entry}()"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert expect in proc.stdout


def compile_jobs(job: Any, jobs: list) -> tuple[int, Any]:
    """``(processes, results in order)``: ``job(j)`` for each ``j`` of ``jobs`` in one forked process per
    core (at most 4). Compiles are independent and spend their time in MLIR and ptxas, outside the GIL;
    jobs are indices or plain data, rebuilt into kernels in the worker (kernels do not pickle)."""
    import multiprocessing

    workers = max(1, min(4, os.cpu_count() or 1))

    def results() -> Any:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            yield from pool.imap(job, jobs)

    return workers, results()


def report_failures(failures: list[str], success: str) -> None:
    """Print ``success``, or the failures and exit 1 (the last words of a compile check's ``main``)."""
    if failures:
        print("FAILED\n" + "\n".join(failures))
        sys.exit(1)
    print(success)


def reduce_slots_args(
    tab: Any, bias: Any, out: Any, shape: tuple, push: bool, cfg: Any, timeout: int, residual: Any = None
) -> dict:
    """Example arguments of ``scatter._reduce_slots_kernel`` as the reduce-scatter (``push=False``) or
    the two-shot all-reduce (``push=True``) launches it; ``shape = (rows per owner, n, slot row
    stride, world)``; the slot dtype is ``out``'s, or the ``residual``'s where one is added (fp32 out:
    all_reduce_rmsnorm)."""
    import triton.language as tl

    from kernels.fused import blocks, scatter, signals

    rows, n, ld, world = shape
    return dict(
        heap=(
            tab,
            tab,
            signals.channel_offset(signals.CH_RS, world),
            signals.channel_offset(signals.CH_DONE, world),
            signals.channel_offset(signals.CH_AR, world),
            world * rows * ld,
        ),
        OUT=(out, n, 1, bias, residual, 0 if residual is None else n, 1),
        dims=(rows, rows, n, ld),
        rank=world - 2,
        target=7 * world,
        timeout=timeout,
        TILE=scatter.SlotTile(cfg.block_m, cfg.block_n),
        PROTO=scatter.ReduceProto(world, signals.CH_RS, push, True),
        ACC_DTYPE=blocks.acc_dtype(out.dtype),
        SLOT_DTYPE=getattr(tl, str((out if residual is None else residual).dtype).removeprefix("torch.")),
    )


def gather_rows_args(tab: Any, out: Any, shape: tuple, cfg: Any, timeout: int, residual: Any = None) -> dict:
    """Example arguments of ``all_reduce._gather_rows_kernel`` as the two-shot all-reduce launches it;
    ``shape = (rows per owner, n, slot row stride, world)``; ``residual``: this rank's rows added as they are
    gathered (fp32 out: all_reduce_rmsnorm and the GEMM epilogue)."""
    from kernels.fused import all_reduce, scatter, signals

    rows, n, ld, world = shape
    return dict(
        heap=(tab, tab, world * rows * ld, signals.channel_offset(signals.CH_AR, world)),
        OUT=(out, n, 1, residual, 0 if residual is None else n, 0 if residual is None else 1),
        dims=(world * rows, n, ld, rows),
        rank=world - 2,
        target=7 * world,
        timeout=timeout,
        TILE=scatter.SlotTile(cfg.block_m, cfg.block_n),
        PROTO=all_reduce.GatherRowsProto(world, signals.CH_AR, True),
    )
