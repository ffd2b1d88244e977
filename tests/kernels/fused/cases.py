"""Rank bodies shared by the fused-kernel tests (module level so the rank pools can unpickle them)."""

from __future__ import annotations

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

from bench.gpu_check_cases import scramble
from tests.harness import REPO_ROOT

OPS = ("ag", "ag_v2", "rs", "ar_one", "ar_two")
STRAGGLER_S = 0.25


def make_inputs(
    op: str,
    world: int,
    m_local: int,
    k: int,
    n: int,
    bias: bool,
    seed: int,
    noncontig: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """Every rank's x and weight (identical on all ranks: same seed), and the bias.

    ``ag``: x ``[m_local, k]`` per rank, one weight ``[n, k]``; ``rs``: x ``[m_local * W, k]``;
    ``ar``: x ``[2 * m_local + 1, k]`` (not a multiple of W nor of a tile). With ``noncontig`` x and
    weight are transposed views and bias a stride-2 view, so the kernels must honour strides.
    """
    g = torch.Generator().manual_seed(seed)
    rows = {"ag": m_local, "ag_v2": m_local, "rs": m_local * world}.get(op, 2 * m_local + 1)

    def rand(*shape: int) -> torch.Tensor:
        if noncontig:
            return torch.randn(*reversed(shape), generator=g).t().to(device=device, dtype=dtype)
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    xs = [rand(rows, k) for _ in range(world)]
    if op.startswith("ag"):
        ws = [rand(n, k)] * world
    else:
        ws = [rand(n, k) for _ in range(world)]
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype) if bias else None
    if b is not None and noncontig:
        # Every other element of a [2n] tensor: the kernels must not assume a unit bias stride.
        b = torch.stack([b, torch.full_like(b, float("nan"))], dim=1)[:, 0]
    return xs, ws, b


def reference(
    op: str, xs: list[torch.Tensor], ws: list[torch.Tensor], b: torch.Tensor | None, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Plain torch math in fp64 from all ranks' inputs: ``(y, error_bound, x_gathered or None)``.

    The bound is elementwise, from the summation error analysis: each partial dot product of length
    k accumulated in fp32 errs by at most ``k * eps32 * S`` with ``S = sum |x| |w|``; summing W
    partials and the bias in fp32 adds ``(W + 2) * eps32 * S``; rounding the partials and the
    result to the output dtype adds ``2 * eps_dtype * S``.
    """
    world = len(xs)
    dtype = xs[0].dtype
    eps32, eps = torch.finfo(torch.float32).eps, torch.finfo(dtype).eps
    k = xs[0].shape[1]
    ws64 = [w.double().cpu() for w in ws]
    b64 = b.double().cpu() if b is not None else torch.zeros(ws[0].shape[0], dtype=torch.float64)
    gathered = None
    if op.startswith("ag"):
        xg = torch.cat([x.double().cpu() for x in xs])
        y = xg @ ws64[0].T + b64
        s = xg.abs() @ ws64[0].abs().T + b64.abs()
        if op == "ag_v2":
            gathered = torch.cat([x.cpu() for x in xs])
    else:
        xs64 = [x.double().cpu() for x in xs]
        y = sum(xs64[i] @ ws64[i].T for i in range(world)) + b64
        s = sum(xs64[i].abs() @ ws64[i].abs().T for i in range(world)) + b64.abs()
        if op == "rs":
            rows = y.shape[0] // world
            y, s = y[rank * rows : (rank + 1) * rows], s[rank * rows : (rank + 1) * rows]
    return y, (k + world + 2) * eps32 * s + 2 * eps * s, gathered


def assert_close(
    what: str, got: Any, ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], dtype: torch.dtype
) -> None:
    want, bound, gathered = ref
    if gathered is not None:
        y, xg = got
        assert torch.equal(xg.cpu(), gathered), f"{what}: gathered x differs"
        got = y
    assert tuple(got.shape) == tuple(want.shape) and got.dtype == dtype, (
        f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {dtype}"
    )
    excess = (got.double().cpu() - want).abs() - bound
    assert got.numel() == 0 or float(excess.max()) <= 0, (
        f"{what}: error exceeds the bound by {float(excess.max()):.3g} at {int(excess.argmax())}"
    )


def run_op(op: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: Any) -> Any:
    from kernels import fused
    from kernels.fused.gemm_ar import matmul_all_reduce

    if op == "ag":
        return fused.all_gather_matmul(x, w, b, group, False)
    if op == "ag_v2":
        return fused.all_gather_matmul(x, w, b, group, True)
    if op == "rs":
        return fused.matmul_reduce_scatter(x, w, b, group, True)
    if op == "ar":
        return fused.matmul_all_reduce(x, w, b, group, True)
    return matmul_all_reduce(x, w, b, group, True, algorithm={"ar_one": "one_shot", "ar_two": "two_shot"}[op])


def presize(group: Any, device: torch.device, nbytes: int = 1 << 20) -> None:
    """Create the group's heap big enough for every case, so no call grows (and zeroes) it."""
    from kernels.fused import signals
    from kernels.heap import get_heap

    get_heap(group, device, nbytes, signals.sig_words(dist.get_world_size(group)))


def check_case(
    rank: int,
    world: int,
    op: str,
    m_local: int,
    k: int,
    n: int,
    bias: bool,
    seed: int,
    noncontig: bool,
    group: Any,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    xs, ws, b = make_inputs(op, world, m_local, k, n, bias, seed, noncontig, dtype, str(device))
    what = f"{op} W={world} m_local={m_local} k={k} n={n} bias={bias} noncontig={noncontig} rank={rank}"
    scramble(group, device)
    if rank == seed % world:
        # A straggler: without its waits a peer would read this rank's stale (scrambled) data.
        time.sleep(STRAGGLER_S)
    got = run_op(op, xs[rank], ws[rank], b, group)
    assert_close(what, got, reference(op, xs, ws, b, rank), dtype)


def correctness_body(rank: int, world: int, op: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> int:
    dev = torch.device(device)
    group = dist.group.WORLD
    presize(group, dev)
    cases = [(13, 24, 20, False, False), (13, 24, 20, True, False), (17, 40, 48, True, True), (17, 40, 48, False, True)]
    for seed, (m_local, k, n, bias, noncontig) in enumerate(cases):
        check_case(rank, world, op, m_local, k, n, bias, seed, noncontig, group, dtype, dev)
    return len(cases)


def fp64_body(rank: int, world: int) -> int:
    """Every op once in fp64 (the linears' reference tests use fp64): fp64 accumulation throughout."""
    dev = torch.device("cpu")
    group = dist.group.WORLD
    presize(group, dev)
    for seed, op in enumerate(OPS):
        check_case(rank, world, op, 13, 24, 20, True, seed, True, group, torch.float64, dev)
    return len(OPS)


def determinism_body(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    dev = torch.device("cpu")
    group = dist.group.WORLD
    presize(group, dev)
    outs: dict[str, list[torch.Tensor]] = {}
    for op in ("rs", "ar_one", "ar_two"):
        xs, ws, b = make_inputs(op, world, 19, 32, 24, True, 7)
        outs[op] = []
        for _ in range(3):
            scramble(group, dev)
            outs[op].append(run_op(op, xs[rank], ws[rank], b, group))
    return outs


def back_to_back_body(rank: int, world: int, calls: int) -> int:
    """``calls`` fused calls in a row on a fresh group: alternating ops and shapes, no barrier between.

    The fresh group's heap starts small, so the larger shape makes it grow (collectively) mid-run.
    """
    group = dist.new_group(list(range(world)))
    ops = ("ag", "rs", "ar", "ag_v2", "ar_two", "ar_one")
    shapes = ((13, 24, 20), (5, 16, 33), (21, 24, 20), (29, 32, 36))
    # Inputs are made up front so the ranks' call streams stay tight (back-to-back epochs).
    plan = []
    for i in range(calls):
        op = ops[i % len(ops)]
        m_local, k, n = shapes[(i // len(ops) + i) % len(shapes)]
        xs, ws, b = make_inputs(op, world, m_local, k, n, i % 2 == 0, 100 + i)
        plan.append((op, xs, ws, b))
    results = [run_op(op, xs[rank], ws[rank], b, group) for op, xs, ws, b in plan]
    for i, ((op, xs, ws, b), got) in enumerate(zip(plan, results, strict=False)):
        assert_close(f"call {i} ({op}, rank {rank})", got, reference(op, xs, ws, b, rank), torch.float32)
    from kernels.heap import destroy_heap, peek_heap

    heap = peek_heap(group, torch.device("cpu"))
    assert heap is not None and heap.data_bytes > 4096, "the heap never grew past its first size"
    dist.barrier(group)
    destroy_heap(group)
    return calls


def absent_peer_body(
    rank: int, world: int, op: str, dtype: torch.dtype = torch.float32, device: str = "cpu", linger_s: float = 0.0
) -> tuple[float, str] | None:
    """Both ranks call once; then rank 1 leaves and rank 0 calls again and must get a RuntimeError.

    On CPU rank 1 frees its heap at once (rank 0's own mapping keeps the segment alive). On GPU it
    keeps its memory for ``linger_s`` instead: rank 0 may still write into it through CUDA IPC.
    """
    group = dist.new_group(list(range(world)))
    xs, ws, b = make_inputs(op, world, 13, 24, 20, True, 3, dtype=dtype, device=device)
    run_op(op, xs[rank], ws[rank], b, group)
    if rank != 0:
        if linger_s:
            time.sleep(linger_s)
            return None
        from kernels.heap import destroy_heap

        destroy_heap(group)
        return None
    start = time.monotonic()
    try:
        run_op(op, xs[rank], ws[rank], b, group)
    except RuntimeError as e:
        elapsed, message = time.monotonic() - start, str(e)
    else:
        raise AssertionError("the second call returned although rank 1 never made it")
    # Fail-stop: the group's ranks disagree on the call sequence now, so every later fused call on
    # it raises at once instead of pairing its heap rebuild with some other call of a peer.
    start = time.monotonic()
    try:
        run_op(op, xs[rank], ws[rank], b, group)
    except RuntimeError as e:
        assert "earlier fused call on this process group failed" in str(e), e
        assert time.monotonic() - start < 1.0
    else:
        raise AssertionError("a fused call on a group with a timed-out call ran")
    return elapsed, message


def singleton_body(rank: int, world: int) -> int:
    """W == 1 groups: no communication, plain GEMM (with bias) for every op."""
    from kernels import fused

    groups = [dist.new_group([r]) for r in range(world)]
    group = groups[rank]
    assert fused.unavailable_reason(group, torch.device("cpu")) is None
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(11, 24, generator=g)
    w = torch.randn(20, 24, generator=g)
    b = torch.randn(20, generator=g)
    assert_close(
        "ag_v2 W=1", fused.all_gather_matmul(x, w, b, group, True), reference("ag_v2", [x], [w], b, 0), torch.float32
    )
    ref = reference("ar", [x], [w], b, 0)
    assert_close("rs W=1", fused.matmul_reduce_scatter(x, w, b, group, False), ref, torch.float32)
    assert_close("ar W=1", fused.matmul_all_reduce(x, w, b, group, False), ref, torch.float32)
    return 3


def public_api_body(rank: int, world: int) -> int:
    """The public ops with ``USE_COC_FUSED_KERNEL=1`` (set by the test) on 3-D inputs vs ``backend="sequential"``."""
    import warnings

    import kernels

    g = torch.Generator().manual_seed(11)
    s_local, batch, k, n = 5, 3, 24, 20
    xs = [torch.randn(s_local, batch, k, generator=g) for _ in range(world)]
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    from kernels.heap import peek_heap

    def epoch() -> tuple[int, int] | None:
        heap = peek_heap(dist.group.WORLD, torch.device("cpu"))
        return None if heap is None else (id(heap), heap.calls)

    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a silent fallback to another backend would warn
        for op, kwargs in (
            ("all_gather_matmul", {"return_gathered": True}),
            ("matmul_reduce_scatter", {"deterministic": True}),
            ("matmul_all_reduce", {"deterministic": True}),
        ):
            x = xs[rank] if op == "all_gather_matmul" else torch.cat(xs)
            fn = getattr(kernels, op)
            before = epoch()
            got = fn(x, w, b, **kwargs)
            assert epoch() not in (None, before), f"{op} did not run on the fused heap"
            want = fn(x, w, b, backend="sequential", **kwargs)
            if op == "all_gather_matmul":
                assert torch.equal(got[1], want[1]), "gathered x differs"
                got, want = got[0], want[0]
            assert got.shape == want.shape, (op, got.shape, want.shape)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * k)
            checked += 1
    return checked


def reasons_body(rank: int, world: int) -> list[str | None]:
    """unavailable_reason on: the default group (CPU), a device without a heap backend, and a group
    whose ranks claim different host names (as on a multi-node job)."""
    import socket
    from unittest import mock

    from kernels import fused

    ok = fused.unavailable_reason(None, torch.device("cpu"))
    meta = fused.unavailable_reason(dist.new_group(list(range(world))), torch.device("meta"))
    with mock.patch.object(socket, "gethostname", return_value=f"node{rank}"):
        hosts = fused.unavailable_reason(dist.new_group(list(range(world))), torch.device("cpu"))
    return [ok, meta, hosts]


def _spawned_worker(
    rank: int, world: int, store_path: str, results: Any, fn: Callable[..., Any], args: tuple, env: dict[str, str]
) -> None:
    os.environ.update(env)
    # Compiled kernels: the interpreter cannot address peer GPU memory.
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, REPO_ROOT)
    import datetime

    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def run_gpu_ranks(
    fn: Callable[..., Any], world: int, *args: Any, env: dict[str, str] | None = None, timeout: float = 300.0
) -> list[Any]:
    """Run ``fn`` on ``world`` fresh processes, one GPU each (round robin, so several processes share
    a GPU when there are fewer GPUs than ranks: CUDA IPC works between them), on a gloo group.

    The rank pools of tests.harness cannot do this: a pool shares one GPU between ranks only with
    NCCL, which refuses two ranks on one device, and its gloo pools run the interpreter.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_spawned_worker,
                daemon=True,
                args=(r, world, os.path.join(tmp, "store"), results, fn, args, env or {}),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world and time.monotonic() < deadline:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    if any(not p.is_alive() and r not in got for r, p in enumerate(procs)):
                        break
                    continue
                got[rank] = (ok, value)
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    failures = [
        f"rank {r}: " + (str(got[r][1]) if r in got else "no answer (died or hung)")
        for r in range(world)
        if r not in got or not got[r][0]
    ]
    assert not failures, "\n".join(failures)
    return [got[r][1] for r in range(world)]


def spawn_probe_body(rank: int, world: int, fail_rank: int) -> tuple[int, int, str | None]:
    """For checking :func:`run_gpu_ranks` itself: a collective, then maybe a failure."""
    t = torch.tensor([rank])
    dist.all_reduce(t)
    if rank == fail_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    return rank, int(t), os.environ.get("TRITON_INTERPRET")


def edge_shapes_body(rank: int, world: int) -> int:
    """Degenerate sizes: one row, one column, k = 1, empty inputs, fewer rows than ranks (two-shot
    owners without rows)."""
    dev = torch.device("cpu")
    group = dist.group.WORLD
    presize(group, dev)
    cases = [
        ("ag", 1, 1, 1),
        ("ag_v2", 0, 5, 3),
        ("rs", 1, 1, 1),
        ("rs", 0, 4, 3),
        ("ar_two", 0, 3, 2),
        ("ar_one", 0, 2, 1),
        ("ar_two", 1, 1, 1),
        ("ag_v2", 2, 3, 0),
    ]
    for seed, (op, m_local, k, n) in enumerate(cases):
        xs, ws, b = make_inputs(op, world, m_local, k, n, True, seed)
        if op.startswith("ar") and m_local == 0:
            xs = [x[:1] for x in xs]  # a single row: two-shot owners 1.. hold none
        what = f"edge {op} W={world} rows={xs[0].shape[0]} k={k} n={n} rank={rank}"
        scramble(group, dev)
        assert_close(what, run_op(op, xs[rank], ws[rank], b, group), reference(op, xs, ws, b, rank), torch.float32)
    return len(cases)


def interrupted_call_body(rank: int, world: int, delay_s: float) -> None:
    """Rank 0's host abandons a reduce-scatter between its launches (an exception after the scatter)
    while rank 1's scatter of that call is ``delay_s`` late, so its increments reach rank 0's
    counters after rank 0 started the next call. The next call must still be exact: the late
    increments count for the abandoned call, not the next one."""
    from kernels.fused import gemm_rs

    group = dist.group.WORLD
    presize(group, torch.device("cpu"))
    check_case(rank, world, "rs", 5, 12, 9, True, 1, False, group, torch.float32, torch.device("cpu"))
    xs, ws, b = make_inputs("rs", world, 5, 12, 9, True, 4, False, torch.float32, "cpu")
    real = gemm_rs.scatter_partials
    if rank == 0:

        def injected(*args: Any, **kwargs: Any) -> Any:
            raise MemoryError("injected between launches")

        saved, gemm_rs.reduce_slots = gemm_rs.reduce_slots, injected
        try:
            run_op("rs", xs[rank], ws[rank], b, group)
            raise AssertionError("the injected failure did not propagate")
        except MemoryError:
            pass
        finally:
            gemm_rs.reduce_slots = saved
    else:

        def late(*args: Any, **kwargs: Any) -> Any:
            time.sleep(delay_s)
            return real(*args, **kwargs)

        gemm_rs.scatter_partials = late
        run_op("rs", xs[rank], ws[rank], b, group)
    # No barrier before the next call (check_case's scramble has one): rank 0 enters it while rank
    # 1 is still in the late call, and rank 1's scatter is late in it too, so a stale count would
    # let rank 0 sum the abandoned call's slot.
    xs, ws, b = make_inputs("rs", world, 5, 12, 9, True, 5, False, torch.float32, "cpu")
    try:
        got = run_op("rs", xs[rank], ws[rank], b, group)
    finally:
        if rank != 0:
            gemm_rs.scatter_partials = real
    assert_close(f"rs after an abandoned call, rank {rank}", got, reference("rs", xs, ws, b, rank), torch.float32)


def failed_call_body(rank: int, world: int, op: str) -> float:
    """One fused call fails on every rank after its first launch; the next call must run normally.

    Returns how long the next (correct) call took: it must not sit out a COC_TIMEOUT waiting for
    a ``DONE`` signal of the abandoned call.
    """
    from kernels.fused import gemm_ar, gemm_rs

    group = dist.group.WORLD
    xs, ws, b = make_inputs(op, world, 5, 12, 9, True, 3, False, torch.float32, "cpu")
    check_case(rank, world, op, 5, 12, 9, True, 1, False, group, torch.float32, torch.device("cpu"))

    def injected(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected failure")

    saved = gemm_rs.reduce_slots
    gemm_rs.reduce_slots = gemm_ar.reduce_slots = injected
    try:
        run_op(op, xs[rank], ws[rank], b, group)
        raise AssertionError("the injected failure did not propagate")
    except RuntimeError as e:
        assert "injected failure" in str(e), e
    finally:
        gemm_rs.reduce_slots = gemm_ar.reduce_slots = saved
    start = time.monotonic()
    got = run_op(op, xs[rank], ws[rank], b, group)
    elapsed = time.monotonic() - start
    assert_close(f"{op} after a failed call, rank {rank}", got, reference(op, xs, ws, b, rank), torch.float32)
    return elapsed


# ----------------------------------------------------------------------------------- GPU-only bodies
# Run by the gpu-marked tests through run_gpu_ranks: every rank is a process of its own on the GPU(s).


def gpu_device() -> torch.device:
    """The key the ops' heap is cached under: ``x.device`` of a CUDA tensor always carries its index,
    so a bare ``"cuda"`` would find (and scramble) no heap, or a different one."""
    return torch.device("cuda", torch.cuda.current_device())


def gpu_wave_shape(world: int) -> tuple[int, int, int]:
    """(m_local, k, n) with several 128-row tiles and all-gather chunks per shard (m_local odd) and,
    for every op at W >= 2, a grid of more output tiles than the GPU has SMs (more than one wave)."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    m_local = 517  # 5 row tiles of 128 per shard: the 4 all-gather chunks each hold a tile or two
    row_tiles = -(-min(2 * m_local + 1, world * m_local) // 128)
    n_tiles = -(-(sms + 1) // row_tiles) + 1
    return m_local, 256, n_tiles * 128 - 24


def check_w8a16_case(
    rank: int,
    world: int,
    m_local: int,
    k: int,
    n: int,
    bias: bool,
    seed: int,
    group: Any,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """The fused w8A16 all-reduce against fp64 math on the weights it dequantizes (rounded to ``dtype``)."""
    from kernels.fused.gemm_ar_w8a16 import matmul_all_reduce_w8a16
    from kernels.quant import dequantize, quantize_weight

    xs, ws, b = make_inputs("ar", world, m_local, k, n, bias, seed, False, dtype, str(device))
    quantized = [quantize_weight(w.float(), mode="per_channel") for w in ws]
    deq = [dequantize(q, s).to(dtype) for q, s in quantized]
    scramble(group, device)
    if rank == seed % world:
        time.sleep(STRAGGLER_S)
    q, s = quantized[rank]
    got = matmul_all_reduce_w8a16(xs[rank], q, s, None, k, b, group, True)
    assert_close(
        f"w8a16 W={world} m={xs[0].shape[0]} k={k} n={n} bias={bias} rank={rank}",
        got,
        reference("ar", xs, deq, b, rank),
        dtype,
    )


def gpu_correctness_body(rank: int, world: int, dtypes: tuple[torch.dtype, ...]) -> int:
    """Every op (and w8A16) in each dtype on a heap scrambled before every call, with a straggler:
    a grid over one wave with several tiles and chunks, and a single odd tile."""
    dev = gpu_device()
    group = dist.group.WORLD
    presize(group, dev, 64 << 20)
    big = gpu_wave_shape(world)
    cases = [big + (True, False), (13, 24, 20, True, True)]
    checked = 0
    for dtype in dtypes:
        for m_local, k, n, bias, noncontig in cases:
            for op in OPS:
                checked += 1
                check_case(rank, world, op, m_local, k, n, bias, checked, noncontig, group, dtype, dev)
            checked += 1
            check_w8a16_case(rank, world, m_local, k, n, bias, checked, group, dtype, dev)
    return checked


def gpu_back_to_back_body(rank: int, world: int, calls: int, dtype: torch.dtype) -> int:
    """``calls`` fused calls in a row on the GPU, ops and shapes changing, no barrier or sync between
    them (the kernels' own flags order every call after the previous one), checked at the end."""
    from kernels.heap import destroy_heap

    dev = gpu_device()
    group = dist.new_group(list(range(world)))
    ops = ("ag", "rs", "ar", "ag_v2", "ar_two", "ar_one")
    shapes = ((13, 64, 40), (300, 128, 200), (5, 16, 33), gpu_wave_shape(world))
    plan = []
    for i in range(calls):
        op = ops[i % len(ops)]
        m_local, k, n = shapes[(i // len(ops) + i) % len(shapes)]
        xs, ws, b = make_inputs(op, world, m_local, k, n, i % 2 == 0, 100 + i, False, dtype, str(dev))
        plan.append((op, xs, ws, b))
    dist.barrier(group)
    results = [run_op(op, xs[rank], ws[rank], b, group) for op, xs, ws, b in plan]
    for i, ((op, xs, ws, b), got) in enumerate(zip(plan, results, strict=False)):
        assert_close(f"call {i} ({op}, rank {rank})", got, reference(op, xs, ws, b, rank), dtype)
    torch.cuda.synchronize(dev)
    dist.barrier(group)
    destroy_heap(group)
    return calls


def w8a16_bf16_body(rank: int, world: int) -> int:
    """The fused w8A16 all-reduce in bf16 (one-shot and two-shot sizes) against fp64 math on the
    dequantized weights; bf16 rounding of the dequantized weight and of the result bound the error."""
    import kernels
    from kernels.quant import dequantize

    done = 0
    for rows in (3, 40):
        g = torch.Generator().manual_seed(rows)
        xs = [torch.randn(rows, 24, generator=g).to(torch.bfloat16) for _ in range(world)]
        qs = [kernels.quantize_weight(torch.randn(20, 24, generator=g), "per_channel") for _ in range(world)]
        got = kernels.quantized_matmul_all_reduce(xs[rank], *qs[rank], backend="fused")
        ws = [dequantize(q, s, None, None, torch.bfloat16).double() for q, s in qs]
        want = sum(x.double() @ w.T for x, w in zip(xs, ws, strict=False))
        scale = sum(x.double().abs() @ w.abs().T for x, w in zip(xs, ws, strict=False))
        eps32, eps = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
        bound = (24 + world + 2) * eps32 * scale + 2 * eps * scale
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert float(((got.double() - want).abs() - bound).max()) <= 0, f"w8A16 bf16 rows={rows}"
        done += 1
    return done
