"""The one rank spawner: pools of spawned ranks reused across calls (tests, gpu-check, the demo).

Starting a rank costs seconds (importing torch), so one pool of ``W`` processes is spawned per
``(world_size, backend, device)`` and kept for the whole session, like PyTorch's
``MultiProcContinuousTest``. Ranks are forked from multiprocessing's fork server, which imports torch
once (``set_forkserver_preload``) and nothing else: no Triton, no CUDA context, no threads to fork. A
rank starts with torch already imported, then takes the starting process's environment as its own
(the fork server's is that of the first pool's start) with the pool's variables applied, before it
imports anything else. A rank body is a module-level function ``fn(rank, world_size, *args)``;
:func:`run_ranks` ships it (by reference, through pickle) to every rank of the pool, waits for all
of them with a deadline and returns their results in rank order.

Kinds of pool (``device`` and ``backend`` of :func:`run_ranks`):

* ``device="cpu"`` (gloo): Triton kernels run in the interpreter (``TRITON_INTERPRET=1``), one
  torch thread per rank;
* ``device="cuda"`` with ``backend="gloo"``: compiled kernels, rank ``r`` on GPU
  ``r % device_count``, so with fewer GPUs than ranks several processes share one GPU (CUDA IPC
  works between them; NCCL refuses two ranks on one device). Without a GPU the ranks still start
  (compiled-kernel code paths that need no device can be checked anywhere);
* ``backend="nccl"``: one process per GPU (``device`` is then ``cuda``); fewer GPUs than ranks is a
  named error.

Failure handling, so that no test can hang the suite:

* a rank that raises: its traceback (and every other rank's) is reported in one ``RankFailure``;
  ranks still running after a short grace period are presumed stuck in a collective, and the pool
  is killed and respawned on next use;
* a call that exceeds ``timeout``: the pool is killed, the failure names the ranks that did not
  answer and quotes each one's stack (written by the rank itself on SIGUSR1, just before the kill);
* a call interrupted from outside (a test-level timeout, Ctrl-C): the pool is killed, since its
  ranks may still be inside the task; answers carry their task's serial, so none is taken for a
  later task's;
* a rank process that dies (killed, ``os._exit``): reported as dead; with ``allow_dead=True`` its
  result is ``None`` instead of a failure (used by the absent-peer tests).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from kernels.testing import program_order

# The checkout holding kernels/ (and tests/, whose rank bodies the ranks import by reference).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# CPU ranks run Triton kernels through the interpreter: there is no GPU on CI machines and the
# fused kernels must still execute there. Threads are pinned to 1 because up to 4 ranks share 2
# cores; oversubscription would make the timing-free tests slow, not wrong. GPU ranks run compiled
# kernels: the interpreter cannot address GPU memory of another process.
RANK_ENV: dict[str, dict[str, str | None]] = {
    "cpu": {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"},
    "cuda": {"TRITON_INTERPRET": None, "OMP_NUM_THREADS": "1"},
}

DEFAULT_TIMEOUT = 120.0
# The process group's own collective timeout. Hangs are bounded by each call's deadline (the pool is
# killed past it), so this only has to outlast the slowest legitimate wait: a rank idling in a
# collective while a peer runs interpreted kernels or a benchmark's long case.
GROUP_TIMEOUT_S = 1800.0
_GRACE_AFTER_ERROR = 3.0
# How much of a hung rank's stack dump a failure quotes.
_STACK_CHARS = 12000


class RankFailure(AssertionError):
    """One or more ranks failed, hung or died; the message holds every rank's story."""


@dataclass
class _Outcome:
    rank: int
    ok: bool
    value: Any
    # The task's serial number in its pool (0: the start). An answer to an earlier task, which a rank gives after
    # that task's deadline passed, is never taken for the current one's.
    serial: int = 0


class Task(NamedTuple):
    """One call every rank runs: ``fn(rank, world_size, *args, **kwargs)`` with ``env`` set for its duration (what
    travels to each rank's task queue)."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    env: dict[str, str | None]


def _private_pymp_dir(parent: str) -> None:
    """Make this process's multiprocessing temp dir (``pymp-*``) under ``parent``.

    torch passes tensors between processes as file descriptors, served by multiprocessing's
    resource sharer from a listening socket in that dir, which only a clean exit removes. The pool
    kills ranks (after a failure, a timeout, or a slow close): under the pool's own temporary dir
    the leftovers go when kill() removes it. Only this one dir moves: ``tempfile.tempdir`` is
    restored, so other temp files (compiler caches) stay where they were.
    """
    saved = tempfile.tempdir
    tempfile.tempdir = parent
    try:
        mp_util.get_temp_dir()  # created now and kept for the life of the process
    finally:
        tempfile.tempdir = saved


def _apply_env(env: dict[str, str | None], into: MutableMapping[str, str] = os.environ) -> None:
    for k, v in env.items():
        if v is None:
            into.pop(k, None)
        else:
            into[k] = v


# A rank's first code: nothing of this package may be imported before the environment is the starting
# process's (TRITON_INTERPRET decides how triton behaves from its import on; ``import kernels`` reads
# COC_INDUCTOR_PASS). The fork server imports the target's module while unpickling it, so the target is
# the builtin ``exec`` running this text, which imports the package only once the environment is set.
_BOOT = """
import os, sys
os.environ.clear()
os.environ.update(environ)
sys.path.insert(0, repo_root)
from kernels.testing.ranks import _worker
_worker(**worker_args)
"""


def _fresh_program() -> None:
    """Start a task as a new program would: the admission's exchange counts back at zero
    (:data:`kernels.protocol.admission.counts`, what tests and the benchmark read)."""
    admission = sys.modules.get("kernels.protocol.admission")
    if admission is not None:
        admission.counts.clear()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _innermost_first(dump: str) -> str:
    """The first ``_STACK_CHARS`` characters of a faulthandler dump with the calling thread's block first: each
    block lists its frames most recent first, so the head holds the call the rank waits in."""
    blocks = dump.strip().split("\n\n")
    blocks.sort(key=lambda block: not block.startswith("Current thread"))
    return "\n\n".join(blocks)[:_STACK_CHARS]


def _stack_path(store_path: str, rank: int) -> str:
    return os.path.join(os.path.dirname(store_path), f"stack-{rank}")


def _worker(*, rank: int, world_size: int, backend: str, store_path: str, tasks: Any, results: Any) -> None:
    _private_pymp_dir(os.path.dirname(store_path))
    import datetime
    import faulthandler

    # A rank that misses its deadline is asked (SIGUSR1) where every one of its threads is before the pool kills
    # it: the failure then says which call a hung rank waits in, not only that it hung.
    stacks = open(_stack_path(store_path, rank), "w")  # open for the life of the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.environ.get("TRITON_INTERPRET") is None and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    )
    results.put(_Outcome(rank, True, "ready"))
    while True:
        item = tasks.get()
        if item is None:
            break
        serial, (fn, args, kwargs, task_env) = item
        saved = {k: os.environ.get(k) for k in task_env}
        _apply_env(task_env)
        try:
            # Set by the call's env or inherited by the pool: read per call, like every other variable.
            program_order.install_if_requested()
            _fresh_program()
            value = fn(rank, world_size, *args, **kwargs)
            outcome = _Outcome(rank, True, value, serial)
        except BaseException:
            outcome = _Outcome(rank, False, traceback.format_exc(), serial)
        finally:
            _apply_env(saved)
        try:
            results.put(outcome)
        except Exception:
            results.put(_Outcome(rank, False, "result could not be pickled:\n" + traceback.format_exc(), serial))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class RankPool:
    """``world_size`` spawned processes forming one default process group."""

    def __init__(self, world_size: int, backend: str = "gloo", device: str = "cpu", start_timeout: float = 120.0):
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.dead = False
        self._closing = False
        self._serial = 0
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch"])
        # Removed by kill(), after the ranks are gone, not by a TemporaryDirectory finalizer: that
        # one runs at interpreter exit before close_pools() and would pull the dir from under
        # ranks still removing their own pymp-* dir in it.
        self._tmp = tempfile.mkdtemp(prefix="coc-pool-")
        store_path = self._store_path = os.path.join(self._tmp, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        environ = dict(os.environ)
        _apply_env(RANK_ENV[device], environ)
        self._procs = [
            ctx.Process(
                target=exec,
                daemon=True,
                name=f"coc-rank{r}-of{world_size}-{device}",
                args=(
                    _BOOT,
                    {
                        "environ": environ,
                        "repo_root": REPO_ROOT,
                        "worker_args": {
                            "rank": r,
                            "world_size": world_size,
                            "backend": backend,
                            "store_path": store_path,
                            "tasks": self._tasks[r],
                            "results": self._results,
                        },
                    },
                ),
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        ready = self._collect(start_timeout, allow_dead=False)
        bad = [o for o in ready if o is None or not o.ok]
        if bad:
            self.kill()
            raise RankFailure(f"rank pool of {world_size} ({backend}, {device}) failed to start: {ready}")

    @property
    def alive(self) -> bool:
        return not self.dead and all(p.is_alive() for p in self._procs)

    def _collect(self, timeout: float, allow_dead: bool) -> list[_Outcome | None]:
        deadline = time.monotonic() + timeout
        got: dict[int, _Outcome] = {}
        first_error_at: float | None = None
        while len(got) < self.world_size:
            now = time.monotonic()
            if first_error_at is not None and now - first_error_at > _GRACE_AFTER_ERROR:
                break
            if now > deadline:
                break
            try:
                o = self._results.get(timeout=0.05)
                if o.serial != self._serial:
                    continue
                got[o.rank] = o
                if not o.ok and first_error_at is None:
                    first_error_at = time.monotonic()
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
            if dead:
                if allow_dead:
                    # An expected death: the live ranks get the whole deadline (one may be waiting
                    # out a timeout the dead rank caused on purpose).
                    if all(r in got or not self._procs[r].is_alive() for r in range(self.world_size)):
                        break
                elif first_error_at is None:
                    # Drain what the dead rank's peers managed to report before deciding.
                    first_error_at = time.monotonic()
        return [got.get(r) for r in range(self.world_size)]

    def run(self, task: Task, *, timeout: float, allow_dead: bool) -> list[Any]:
        self._serial += 1
        for q in self._tasks:
            q.put((self._serial, task))
        try:
            outcomes = self._collect(timeout, allow_dead)
        except BaseException:
            # Interrupted (a test-level timeout, Ctrl-C): the ranks may still be inside this task, so the pool must
            # not serve the next one.
            self.kill()
            raise
        failures = []
        hung = [r for r, o in enumerate(outcomes) if o is None and self._procs[r].is_alive()]
        stacks = self._stacks(hung)
        for r, o in enumerate(outcomes):
            if o is None:
                if not self._procs[r].is_alive():
                    if not allow_dead:
                        failures.append(f"--- rank {r}: process died (exit code {self._procs[r].exitcode})")
                else:
                    failures.append(
                        f"--- rank {r}: no answer (hung or still running after the "
                        f"{timeout:.0f} s limit or after a peer failed); where it was:\n{stacks[r]}"
                    )
            elif not o.ok:
                failures.append(f"--- rank {r} raised:\n{o.value}")
        if failures or any(o is None for o in outcomes):
            # A rank that did not answer may be stuck in a collective: the pool is unusable.
            self.kill()
        if failures:
            name = getattr(task.fn, "__qualname__", repr(task.fn))
            raise RankFailure(f"{name} on {self.world_size} rank(s):\n" + "\n".join(failures))
        return [o.value if o is not None else None for o in outcomes]

    def _stacks(self, ranks: list[int], wait_s: float = 2.0) -> dict[int, str]:
        """Every thread's stack of each rank in ``ranks``, as the rank itself writes it on SIGUSR1 (the calling
        thread's first, innermost frames first, at most ``_STACK_CHARS`` characters)."""
        paths = {r: _stack_path(self._store_path, r) for r in ranks}
        sizes = {r: _size(p) for r, p in paths.items()}
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_size(p) <= sizes[r] for r, p in paths.items()):
            time.sleep(0.05)
        time.sleep(0.1)  # the dump's last lines
        out = {}
        for r, p in paths.items():
            try:
                with open(p, errors="replace") as f:
                    f.seek(sizes[r])
                    text = f.read()
            except OSError as e:
                text = f"(no stack: {e})"
            out[r] = _innermost_first(text) if text else "(no stack: the rank did not answer the signal)"
        return out

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        shutil.rmtree(self._tmp, ignore_errors=True)
        self.dead = True

    def request_close(self) -> None:
        """Ask the ranks to leave their loop; :meth:`close` waits for them."""
        if self.alive and not self._closing:
            self._closing = True
            for q in self._tasks:
                q.put(None)

    def close(self) -> None:
        if not self.alive:
            self.kill()
            return
        self.request_close()
        for p in self._procs:
            p.join(timeout=10)
        self.kill()


_POOLS: dict[tuple[int, str, str], RankPool] = {}


def _check_kind(world_size: int, backend: str, device: str) -> str:
    """The pool's device; ValueError naming a bad ``world_size``, ``backend`` or ``device``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if backend == "nccl":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < world_size:
            raise ValueError(
                f"backend='nccl' needs one GPU per rank: world_size={world_size}, {count} GPU(s) here "
                "(backend='gloo', device='cuda' shares GPUs between ranks)"
            )
        return "cuda"
    return device


def get_pool(world_size: int, backend: str = "gloo", device: str = "cpu") -> RankPool:
    device = _check_kind(world_size, backend, device)
    key = (world_size, backend, device)
    pool = _POOLS.get(key)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.kill()
        pool = RankPool(world_size, backend, device)
        _POOLS[key] = pool
    return pool


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str | None] | None = None,
    backend: str = "gloo",
    device: str = "cpu",
    allow_dead: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank of a pooled group.

    ``fn`` must be importable by reference (a module-level function). ``env`` entries are set in
    every rank for the duration of the call (``None`` unsets). ``device`` and ``backend`` pick the
    pool (module docstring). Returns the per-rank results; raises :class:`RankFailure` naming every
    rank that raised, hung past ``timeout`` or died (a dead rank's result is ``None`` with
    ``allow_dead``).
    """
    task = Task(fn, args, kwargs, env or {})
    return get_pool(world_size, backend, device).run(task, timeout=timeout, allow_dead=allow_dead)


def assert_no_errors(results: list[list[str]]) -> None:
    """For rank bodies that return their failures as text: every rank returned none (AssertionError
    listing each rank's otherwise)."""
    msgs = [f"rank {r}: {e}" for r, errs in enumerate(results) for e in errs]
    assert not msgs, "\n".join(msgs)


def close_pools() -> None:
    pools = list(_POOLS.values())
    _POOLS.clear()
    # Every pool's ranks shut down (process group, interpreter exit) at once, not one pool after another.
    for pool in pools:
        pool.request_close()
    for pool in pools:
        pool.close()


atexit.register(close_pools)
