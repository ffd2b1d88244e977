"""Rank launching for ``python -m bench``: its own processes, or the ones torchrun started.

Without torchrun, :func:`spawn` starts W processes (``spawn`` start method), each initializing a
process group over a file store (gloo on CPU, NCCL on GPUs, one GPU per rank), runs a module-level
``fn(rank, world, *args)`` and sends rank 0's return value back. A rank that raises or dies ends
the run with its traceback; a run past its deadline is killed, so nothing hangs. World size 1 runs
in the calling process.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.suites import REPO_ROOT


class LaunchError(RuntimeError):
    """A benchmark rank failed, died or ran past the deadline."""


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def dist_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def rank_env(device_type: str, cpu_threads: int) -> dict[str, str]:
    """Environment every rank needs before importing torch / triton."""
    env = {}
    if device_type == "cpu":
        # Without a GPU the fused Triton kernels can only run through the interpreter.
        env["TRITON_INTERPRET"] = "1"
        env["OMP_NUM_THREADS"] = str(cpu_threads)
    return env


def _set_device(device_type: str, local_rank: int, world: int, cpu_threads: int = 1) -> torch.device:
    if device_type == "cuda":
        count = torch.cuda.device_count()
        if world > count:
            raise LaunchError(f"world size {world} needs {world} GPUs on this node, found {count}")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    # A fixed thread count per rank: OpenMP teams larger than the cores left free spin at their
    # barriers whenever one thread is descheduled, which turns timings into scheduler noise.
    torch.set_num_threads(cpu_threads)
    return torch.device("cpu")


def init_torchrun(device_type: str, timeout_s: float, cpu_threads: int = 1) -> tuple[int, int, torch.device]:
    """Join the process group torchrun set up the environment for."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _set_device(
        device_type, int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", world)), cpu_threads
    )
    if not dist.is_initialized():
        dist.init_process_group(dist_backend(device_type), timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, device


def _entry(
    rank: int,
    world: int,
    device_type: str,
    store_path: str,
    timeout_s: float,
    cpu_threads: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    os.environ.update(rank_env(device_type, cpu_threads))
    sys.path.insert(0, REPO_ROOT)
    # A rank that sends tensors serves them from a socket in its multiprocessing temp dir
    # (pymp-*), removed only on a clean exit; made under the launch's own temp dir, it goes with
    # that dir when a failed rank is killed. tempfile.tempdir is restored for everything else.
    saved_tempdir, tempfile.tempdir = tempfile.tempdir, os.path.dirname(store_path)
    try:
        mp_util.get_temp_dir()
    finally:
        tempfile.tempdir = saved_tempdir
    try:
        device = _set_device(device_type, rank, world, cpu_threads)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            dist_backend(device_type),
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        value = fn(rank, world, device, *args)
        results.put((rank, True, value if rank == 0 else None))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_in_process(fn: Callable[..., Any], device_type: str, timeout_s: float, *args: Any, cpu_threads: int = 1) -> Any:
    """World size 1 in this process: a one-rank group so the ops see an initialized default group."""
    os.environ.update(rank_env(device_type, cpu_threads))
    device = _set_device(device_type, 0, 1, cpu_threads)
    with tempfile.TemporaryDirectory(prefix="coc-bench-") as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(
            dist_backend(device_type), store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s)
        )
        try:
            return fn(0, 1, device, *args)
        finally:
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any], world: int, device_type: str, timeout_s: float, *args: Any, cpu_threads: int = 1
) -> Any:
    """Run module-level ``fn(rank, world, device, *args)`` on ``world`` new ranks; rank 0's result.

    ``cpu_threads``: torch intra-op threads per rank on CPU."""
    if world == 1:
        return run_in_process(fn, device_type, timeout_s, *args, cpu_threads=cpu_threads)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="coc-bench-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                name=f"coc-bench-rank{r}",
                daemon=True,
                args=(r, world, device_type, store_path, timeout_s, cpu_threads, fn, args, results),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        got: dict[int, tuple[bool, Any]] = {}
        error: str | None = None

        def receive(wait_s: float) -> str | None:
            """Record one rank's result (raises queue.Empty if none came); its error, if it raised."""
            rank, ok, value = results.get(timeout=wait_s)
            got[rank] = (ok, value)
            return None if ok else f"rank {rank} raised:\n{value}"

        try:
            while len(got) < world and error is None:
                if time.monotonic() > deadline:
                    missing = [r for r in range(world) if r not in got]
                    error = f"ranks {missing} did not finish within {timeout_s:.0f} s (see --timeout)"
                    break
                try:
                    error = receive(0.2)
                    continue
                except queue.Empty:
                    pass
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
                if dead:
                    # Give its result a moment to arrive through the queue before calling it dead.
                    try:
                        error = receive(2.0)
                    except queue.Empty:
                        error = f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
        finally:
            for p in procs:
                p.join(timeout=10 if error is None else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    if error is not None:
        raise LaunchError(f"benchmark on {world} ranks failed: {error}")
    return got[0][1]
