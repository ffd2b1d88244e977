"""``COC_PARALLEL_NUM=auto``: choose the split count of an op shape by measurement, once.

On the first call of a tuning key ``(op, m, k, n, dtype, world, device type, candidate set)``
every rank of the group enters :func:`choose_parallel_num` (the ops are collective, so they all
do), and:

1. rank 0 of the group looks the key up in the JSON file named by ``COC_TUNE_CACHE`` and
   broadcasts what it found, so ranks whose file copies differ still agree;
2. on a miss, every candidate (1, 2, 4, 8, and ``"fused"`` where the fused backend can run on
   this group) runs once to warm up and then :data:`TUNE_REPS` times under the wall clock; the
   per-candidate medians are all-reduced with MAX (exact, so every rank holds the same numbers)
   and the fastest is taken (ties go to the smaller split count, identically on every rank);
3. the choice is kept in memory per group for the life of the process and rank 0 merges it into
   the cache file. Later calls of the key return the cached choice without any communication or
   timing, so nothing is re-tuned inside a training step after warm-up.

The choice is logged once per key (logger ``kernels.tune``, INFO, on group rank 0). Tuning runs
the implementations of the call's op (its table entry's, ``kernels.ops.table.OPS``) on random plain operands of the
call's shapes and output dtype (seeded alike on every rank) with ``deterministic=False``: the split count trades
matmul efficiency against overlap, which neither the values nor the operand format change much.
Under ``torch.compile`` it runs while tracing, once, like every other part of the backend choice.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from . import capture
from .config import ENV_TUNE_CACHE, PARALLEL_NUMS, get_config
from .format import PLAIN
from .ops.gemm import GemmCall, Operands
from .protocol.spec import forget_signatures

Choice = int | str
Impls = dict[str, Callable[..., Any]]

TUNE_REPS = 3
CACHE_VERSION = 1
_FUSED = "fused"

log = logging.getLogger("kernels.tune")

# Keyed by (tuning key, the group's global ranks): a rank in several groups of one size (the dims
# of a square mesh) must not reuse one group's choice in another, whose other ranks may hold a
# different one (they would then run mismatched collectives).
_memory: dict[tuple[str, tuple[int, ...]], Choice] = {}
_file_cache: dict[tuple[str, int], dict[str, Choice]] = {}


def tuning_key(
    op: str, shape: tuple[int, int, int], dtype: torch.dtype, world: int, *, device_type: str, allow_fused: bool
) -> str:
    """The cache key: one line of text, readable in the JSON file."""
    m, k, n = shape
    candidates = "fused+chunked" if allow_fused else "chunked"
    return f"{op} m={m} k={k} n={n} {str(dtype).replace('torch.', '')} W={world} {device_type} {candidates}"


def memory_key(key: str, group: dist.ProcessGroup | None, world: int) -> tuple[str, tuple[int, ...]]:
    """The in-memory cache key of ``key`` on ``group``: the choice is agreed per group, not per size."""
    if world == 1:
        return key, ()
    return key, tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def clear_memory_cache() -> None:
    """Forget every in-memory choice (tests, or a user who changed the machine under a process)."""
    _memory.clear()
    _file_cache.clear()
    # A signature resolved before carries the choice made then: forget it too, or it would outlive the cache.
    forget_signatures()


def _check_choice(value: Any, where: str) -> Choice:
    if value == _FUSED or (value in PARALLEL_NUMS and not isinstance(value, bool)):
        return value
    raise ValueError(
        f"{where}: choice {value!r} is not accepted; a cache entry must be one of "
        f"{PARALLEL_NUMS} or {_FUSED!r} (delete the entry or the file to re-tune)"
    )


def read_cache_file(path: str) -> dict[str, Choice]:
    """The entries of a cache file (empty when it does not exist); bad content raises ValueError."""
    try:
        mtime = os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return {}
    cached = _file_cache.get((path, mtime))
    if cached is not None:
        return cached
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{ENV_TUNE_CACHE}={path!r} cannot be read as a tuning cache ({e}); fix or delete the file"
        ) from None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        raise ValueError(
            f"{ENV_TUNE_CACHE}={path!r} is not a version-{CACHE_VERSION} tuning cache "
            "({'version': 1, 'entries': {key: choice}}); fix or delete the file"
        )
    entries = {str(k): _check_choice(v, f"{ENV_TUNE_CACHE}={path!r} entry {k!r}") for k, v in data["entries"].items()}
    _file_cache[(path, mtime)] = entries
    return entries


def write_cache_entry(path: str, key: str, choice: Choice) -> None:
    """Merge one entry into the cache file under an exclusive lock, replacing it atomically.

    The lock serializes writers (several groups may tune at once); the rename means a reader
    never sees a half-written file.
    """
    directory = os.path.dirname(path) or "."
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entries = dict(read_cache_file(path))
            entries[key] = choice
            fd, tmp = tempfile.mkstemp(prefix=".coc-tune-", dir=directory)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _encode(choice: Choice | None) -> int:
    if choice is None:
        return 0
    return 9 if choice == _FUSED else int(choice)


def _decode(code: int) -> Choice | None:
    if code == 0:
        return None
    return _FUSED if code == 9 else code


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _src_global_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def _fused_available(group: dist.ProcessGroup | None, device: torch.device, world: int) -> bool:
    try:
        from . import fused

        ok = fused.unavailable_reason(group, device) is None
    except (NotImplementedError, ImportError, AttributeError):
        ok = False
    if world > 1:
        # Every rank must time the same candidate list, or the timing collectives would mismatch.
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        ok = bool(flag.item())
    return ok


def _runner(call: GemmCall, x: torch.Tensor, weight: torch.Tensor, impl: Impls) -> Callable[[str, int], Any]:
    """The call's pattern on random plain operands of its shapes, in its output dtype: the split count trades
    the GEMM's efficiency on fewer rows against the overlap, which neither the values nor the operand
    format change much (and random FP8 or int8 operands would need scales of their own)."""
    # Random operands of the call's shapes: the caller may pass stand-ins without memory (a compiled
    # call decides while tracing, on fake tensors), and the timing does not depend on the values. The
    # same seed on every rank keeps the operands, and so the work, identical.
    gen = torch.Generator(device=x.device).manual_seed(0)
    x = torch.randn(tuple(x.shape), dtype=x.dtype, device=x.device, generator=gen)
    weight = torch.randn(tuple(weight.shape), dtype=x.dtype, device=x.device, generator=gen)
    plain = replace(call, fmt=PLAIN, out_dtype=None, return_gathered=False, deterministic=False)
    ops = Operands(x=x, weights=(weight,), biases=(None,))
    return lambda backend, num: impl[backend](replace(plain, backend=backend, parallel_num=num), ops)


def _time(fn: Callable[[], Any], device: torch.device, group: dist.ProcessGroup | None, world: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up: first-call costs (allocations, kernel compilation) are not the op's speed
    sync()
    if world > 1:
        # Start the clocks together: a rank still finishing the previous candidate would
        # otherwise count its wait inside this candidate's collectives.
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    samples = []
    for _ in range(TUNE_REPS):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _measure(
    call: GemmCall, x: torch.Tensor, weight: torch.Tensor, impl: Impls, candidates: list[Choice]
) -> tuple[Choice, list[float]]:
    world, group = call.world, call.group
    run = _runner(call, x, weight, impl)
    times = []
    with torch.no_grad():
        for c in candidates:
            if c == _FUSED:
                times.append(_time(lambda: run(_FUSED, 1), x.device, group, world))
            else:
                backend = "chunked" if c > 1 else "sequential"
                times.append(_time(lambda b=backend, n=c: run(b, n), x.device, group, world))
    t = torch.tensor(times, dtype=torch.float64, device=x.device)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    agreed = t.tolist()
    best = min(range(len(candidates)), key=lambda i: (agreed[i], i))
    return candidates[best], agreed


def _agreed_cache_entry(call: GemmCall, key: str, path: str | None, rank: int, device: torch.device) -> Choice | None:
    """Rank 0's cache entry for ``key``, broadcast: ranks whose file copies differ must still all hit or all
    tune, or one would time candidates (collectively) alone."""
    found: Choice | None = None
    if path is not None and rank == 0:
        found = read_cache_file(path).get(key)
    if call.world > 1:
        code = torch.tensor([_encode(found)], dtype=torch.int32, device=device)
        dist.broadcast(code, src=_src_global_rank(call.group), group=call.group)
        found = _decode(int(code.item()))
    return found


def choose_parallel_num(
    call: GemmCall, x: torch.Tensor, weight: torch.Tensor, impl: Impls, allow_fused: bool = True
) -> Choice:
    """The agreed split count (1, 2, 4, 8) or ``"fused"`` for ``call`` of ``x [m, k]`` and ``weight [n, k]``
    (stand-ins: only shapes, dtypes and the device are read), timing ``impl`` (backend -> implementation of the
    call's op); tunes on first use.

    Collective on the first call of a key (every rank of ``group`` must call it, as they do
    for the ops themselves); free afterwards.
    """
    world, group = call.world, call.group
    key = tuning_key(
        call.op,
        (x.shape[0], x.shape[1], weight.shape[0]),
        x.dtype,
        world,
        device_type=x.device.type,
        allow_fused=allow_fused,
    )
    mem_key = memory_key(key, group, world)
    choice = _memory.get(mem_key)
    if choice is not None:
        return choice
    if capture.capturing(x.device):
        # Tuning communicates, times on the host and synchronizes: none of it can be captured.
        raise RuntimeError(
            f"COC_PARALLEL_NUM=auto: the first call of {key!r} is inside CUDA graph capture; "
            "run the op once (a warm-up step) before capturing, so its split count is chosen"
        )
    path = get_config().tune_cache
    rank = _group_rank(group) if world > 1 else 0
    found = _agreed_cache_entry(call, key, path, rank, x.device)
    if found is not None:
        choice = found
        if found == _FUSED and not _fused_available(group, x.device, world):
            raise ValueError(
                f"{ENV_TUNE_CACHE}={path!r} entry {key!r} chose 'fused' but the fused backend "
                "cannot run here; delete the entry to re-tune"
            )
        if rank == 0:
            log.info("COC_PARALLEL_NUM=auto: %s -> %s (from %s)", key, choice, path)
    else:
        candidates: list[Choice] = list(PARALLEL_NUMS)
        if allow_fused and _fused_available(group, x.device, world):
            candidates.append(_FUSED)
        choice, agreed = _measure(call, x, weight, impl, candidates)
        if rank == 0:
            timings = ", ".join(f"{c}: {t * 1e3:.3f} ms" for c, t in zip(candidates, agreed, strict=False))
            log.info("COC_PARALLEL_NUM=auto: %s -> %s (tuned; %s)", key, choice, timings)
            if path is not None:
                write_cache_entry(path, key, choice)
    _memory[mem_key] = choice
    return choice


def _stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` without its memory (one element, expanded): the tuner's key reads the shape, dtype and
    device, and its runs make operands of their own."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def tuner(impl: Impls) -> Callable[..., Choice]:
    """The ``tune`` of a dense op's table entry (:class:`kernels.protocol.OpSpec`): :func:`choose_parallel_num` for
    a call of ``shape = (m, k, n)`` with ``dtypes = (x's, the weight's)`` on ``device``, timing ``impl``."""

    def tune(
        call: GemmCall, shape: tuple[int, int, int], dtypes: tuple, device: torch.device, allow_fused: bool
    ) -> Choice:
        m, k, n = shape
        x, weight = _stand_in((m, k), dtypes[0], device), _stand_in((n, k), dtypes[1], device)
        return choose_parallel_num(call, x, weight, impl, allow_fused=allow_fused)

    return tune
