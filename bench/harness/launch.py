"""Rank launching for ``python -m bench``: pooled ranks of :mod:`kernels.testing`, or the ones torchrun started.

Without torchrun, :func:`spawn` runs a module-level ``fn(rank, world, device, *args)`` on ``W`` ranks
of :func:`kernels.testing.run_ranks` (gloo on CPU, NCCL with one GPU per rank) and returns rank 0's
value. A rank that raises, dies or runs past the deadline ends the run with every rank's story
(:class:`LaunchError`), so nothing hangs. World size 1 runs in the calling process.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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


@dataclass(frozen=True)
class _Job:
    """What a pooled rank runs: ``fn(rank, world, device, *args)`` on ``device_type`` with ``cpu_threads``."""

    device_type: str
    cpu_threads: int
    fn: Callable[..., Any]
    args: tuple


def _pooled_rank(rank: int, world: int, job: _Job) -> Any:
    device = _set_device(job.device_type, rank, world, job.cpu_threads)
    value = job.fn(rank, world, device, *job.args)
    return value if rank == 0 else None


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
    from kernels.testing import RankFailure, run_ranks

    try:
        results = run_ranks(
            _pooled_rank,
            world,
            _Job(device_type, cpu_threads, fn, args),
            backend=dist_backend(device_type),
            device=device_type,
            timeout=timeout_s,
        )
    except RankFailure as e:
        raise LaunchError(f"benchmark on {world} ranks failed (see --timeout for the deadline): {e}") from e
    return results[0]
