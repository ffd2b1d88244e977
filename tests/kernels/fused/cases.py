"""Rank bodies shared by the fused-kernel tests (module level so the rank pools can unpickle them)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kernels.testing import (
    OPS,
    assert_close,
    heap_device,
    make_inputs,
    presize,
    quantized_weights,
    reference,
    run_ranks,
    scramble,
)

STRAGGLER_S = 0.25


def fused_call(pattern: str, group: Any, fmt: Any = None, **fields: Any) -> Any:
    """The :class:`kernels.ops.gemm.GemmCall` of a fused call on ``group`` (None: the default group)."""
    from kernels.format import PLAIN
    from kernels.ops.gemm import PUBLIC_NAMES, GemmCall

    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    fmt = fmt or PLAIN
    op = PUBLIC_NAMES[(pattern, fmt.kind)]
    return GemmCall(op=op, pattern=pattern, fmt=fmt, group_name=group.group_name, world=world, **fields)


def run_op(
    op: str,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    group: Any,
    fmt: Any = None,
    *,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    deterministic: bool = True,
) -> Any:
    """One op of :data:`OPS` through the pattern modules' ``run`` with operands of ``fmt`` (default plain;
    an int8 weight without offset): ``ag_v2`` returns the gathered x too (and for FP8 the gathered scale
    rows), ``ar`` lets the all-reduce choose its algorithm."""
    from kernels.format import PLAIN
    from kernels.fused import all_gather, all_reduce, scatter
    from kernels.ops.gemm import Operands

    fmt = fmt or PLAIN
    scales = () if w_scale is None else (w_scale,)
    ops = Operands(x, (w,), (b,), x_scale, scales, (None,) * len(scales))
    if op in ("ag", "ag_v2"):
        call = fused_call("all_gather", group, fmt, out_dtype=out_dtype, return_gathered=op == "ag_v2")
        ys, x_gathered, gathered_scales = all_gather.run(call, ops)
        if op == "ag":
            return ys[0]
        return (ys[0], x_gathered, gathered_scales) if fmt.scaled_rows else (ys[0], x_gathered)
    pattern = "reduce_scatter" if op == "rs" else "all_reduce"
    call = fused_call(pattern, group, fmt, out_dtype=out_dtype, deterministic=deterministic)
    if op == "rs":
        return scatter.run(call, ops)
    return all_reduce.run(call, ops, {"ar_one": "one_shot", "ar_two": "two_shot"}.get(op, "auto"))


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
    xs, ws, b = make_inputs(
        op, world, m_local, k, n, bias=bias, seed=seed, noncontig=noncontig, dtype=dtype, device=str(device)
    )
    what = f"{op} W={world} m_local={m_local} k={k} n={n} bias={bias} noncontig={noncontig} rank={rank}"
    scramble(group, device)
    if rank == seed % world:
        # A straggler: without its waits a peer would read this rank's stale (scrambled) data.
        time.sleep(STRAGGLER_S)
    got = run_op(op, xs[rank], ws[rank], b, group)
    assert_close(what, got, reference(op, xs, ws, b, rank), dtype)


CORRECTNESS_CASES = ((13, 24, 20, False, False), (13, 24, 20, True, False), (17, 40, 48, True, True))
CORRECTNESS_CASES += ((17, 40, 48, False, True),)


def correctness_body(
    rank: int,
    world: int,
    op: str,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    cases: tuple[tuple[int, int, int, bool, bool], ...] = CORRECTNESS_CASES,
) -> int:
    """``(m_local, k, n, bias, noncontig)`` cases in turn on a scrambled heap; returns how many ran."""
    dev = torch.device(device)
    group = dist.group.WORLD
    presize(group, dev)
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
        xs, ws, b = make_inputs(op, world, 19, 32, 24, bias=True, seed=7)
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
        xs, ws, b = make_inputs(op, world, m_local, k, n, bias=i % 2 == 0, seed=100 + i)
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
    """Both ranks call once; then rank 1 leaves and rank 0 calls again and must get a RuntimeError naming the peer
    within COC_TIMEOUT (at the call's admission, which rank 1 never makes).

    On CPU rank 1 frees its heap at once (rank 0's own mapping keeps the segment alive). On GPU it
    keeps its memory for ``linger_s`` instead: rank 0 may still write into it through CUDA IPC.
    """
    import kernels

    group = dist.new_group(list(range(world)))
    xs, ws, b = make_inputs(op, world, 13, 24, 20, bias=True, seed=3, dtype=dtype, device=device)
    public = {"ag": kernels.all_gather_matmul, "rs": kernels.matmul_reduce_scatter}.get(op, kernels.matmul_all_reduce)

    def run_op(op: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: Any) -> torch.Tensor:
        return public(x, w, b, group=group, backend="fused")

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
    # Fail-stop: the group's ranks are out of step now (rank 0 gave up at the admission rank 1 never made), so
    # every later call on it raises at once instead of pairing with some other call of a peer.
    start = time.monotonic()
    try:
        run_op(op, xs[rank], ws[rank], b, group)
    except RuntimeError as e:
        assert "an earlier call on this process group failed at its admission" in str(e), e
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
    assert_close("ag_v2 W=1", run_op("ag_v2", x, w, b, group), reference("ag_v2", [x], [w], b, 0), torch.float32)
    ref = reference("ar", [x], [w], b, 0)
    assert_close("rs W=1", run_op("rs", x, w, b, group), ref, torch.float32)
    assert_close("ar W=1", run_op("ar", x, w, b, group), ref, torch.float32)
    return 3


def public_api_body(rank: int, world: int) -> int:
    """The public ops with ``USE_COC_FUSED_KERNEL=1`` (set by the test) on 3-D inputs, on the fused heap,
    against the fp64 reference."""
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
            # The 3-D inputs flattened to the 2-D calls the reference describes.
            flat = [t.reshape(-1, k) for t in xs]
            if op == "all_gather_matmul":
                ref = reference("ag_v2", flat, [w] * world, b, rank)
                got = (got[0].reshape(-1, n), got[1].reshape(-1, k))
            else:
                every = [torch.cat(flat)] * world  # each rank passes all of x
                ref = reference("rs" if op == "matmul_reduce_scatter" else "ar", every, [w] * world, b, rank)
                got = got.reshape(-1, n)
            assert_close(f"{op} (public API, fused) rank={rank}", got, ref, torch.float32)
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


def run_gpu_ranks(fn: Callable[..., Any], world: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Ranks that run compiled kernels on the GPU(s), sharing one when there are fewer GPUs than ranks:
    :func:`kernels.testing.run_ranks` with ``device="cuda"`` (a gloo group; NCCL refuses two ranks
    on one device)."""
    return run_ranks(fn, world, *args, device="cuda", **kwargs)


def spawn_probe_body(rank: int, world: int, fail_rank: int) -> tuple[int, int, str | None]:
    """For checking the GPU pools of :func:`run_gpu_ranks`: a collective, then maybe a failure."""
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
        xs, ws, b = make_inputs(op, world, m_local, k, n, bias=True, seed=seed)
        if op.startswith("ar") and m_local == 0:
            xs = [x[:1] for x in xs]  # a single row: two-shot owners 1.. hold none
        what = f"edge {op} W={world} rows={xs[0].shape[0]} k={k} n={n} rank={rank}"
        scramble(group, dev)
        assert_close(what, run_op(op, xs[rank], ws[rank], b, group), reference(op, xs, ws, b, rank), torch.float32)
    return len(cases)


def _uneven_n_inputs(world: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's x ``[24, 20]`` and column shard ``[n, 20]``, n = 16 on even ranks and 64 on odd ones."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(24, 20, generator=g) for _ in range(world)]
    return xs, [torch.randn(16 if r % 2 == 0 else 64, 20, generator=g) for r in range(world)]


def per_rank_tiles_body(rank: int, world: int) -> list[int]:
    """``all_gather_matmul`` on uneven column shards (n = 16 on even ranks, 64 on odd ones) under a tuned
    file (``COC_TUNED_DIR``, written by the test) that gives each n another tile height: the tiles are
    each rank's own choice, while the chunks a rank pushes and the flags its peers wait on must not
    depend on them. Returns the tile heights the ranks ran with."""
    from kernels.format import PLAIN
    from kernels.fused import blocks

    dev = torch.device("cpu")
    group = dist.group.WORLD
    presize(group, dev)
    xs, ws = _uneven_n_inputs(world, 11)
    m_local, k = xs[0].shape
    ns = [w.shape[0] for w in ws]
    cfg = blocks.block_config(PLAIN, dev, m_local, k, dtype=torch.float32, op="all_gather_matmul", n=ns[rank])
    for op in ("ag", "ag_v2"):
        scramble(group, dev)
        if rank == 0:
            time.sleep(STRAGGLER_S)  # its peers' tiles of its rows must wait for every chunk they cover
        got = run_op(op, xs[rank], ws[rank], None, group)
        want = reference(op, xs, [ws[rank]], None, rank)
        assert_close(f"{op} n={ns[rank]} block_m={cfg.block_m} rank={rank}", got, want, torch.float32)
    return [cfg.block_m]


def withheld_chunk_body(rank: int, world: int) -> str | None:
    """Ranks as in :func:`per_rank_tiles_body` (rank 1's tiles 32 rows tall, its peers' chunks 16),
    with rank 0 pushing only its first chunk: rank 1's tile over rows 0-23 of rank 0's shard must
    wait for the second chunk too, and time out, not read rows 16-23 unpushed. Run with a short
    ``COC_TIMEOUT``; returns rank 1's error (rank 0's call may pass or fail: rank 1 is then gone)."""
    from dataclasses import replace

    from kernels.fused import all_gather

    group = dist.new_group(list(range(world)))
    xs, ws = _uneven_n_inputs(world, 12)
    real = all_gather._push
    if rank == 0:
        # One chunk of chunk_rows rows (rank 0's rows land at offset 0 of every gather buffer).
        all_gather._push = lambda call, fmt, ops, chunk, side: real(
            call, fmt, replace(ops, x=ops.x[:chunk]), chunk, side
        )
    # Both calls start together, so the short bound can only run out on the withheld chunk.
    dist.barrier(group)
    try:
        run_op("ag", xs[rank], ws[rank], None, group)
    except RuntimeError as e:
        return str(e) if rank == 1 else None
    finally:
        all_gather._push = real
    if rank == 1:
        raise AssertionError("rank 1 returned a result although rank 0's second chunk never arrived")
    return None


def interrupted_call_body(rank: int, world: int, delay_s: float) -> None:
    """Rank 0's host abandons a reduce-scatter between its launches (an exception after the scatter)
    while rank 1's scatter of that call is ``delay_s`` late, so its increments reach rank 0's
    counters after rank 0 started the next call. The next call must still be exact: the late
    increments count for the abandoned call, not the next one."""
    from kernels.fused import scatter

    group = dist.group.WORLD
    presize(group, torch.device("cpu"))
    check_case(rank, world, "rs", 5, 12, 9, True, 1, False, group, torch.float32, torch.device("cpu"))
    xs, ws, b = make_inputs(
        "rs", world, 5, 12, 9, bias=True, seed=4, noncontig=False, dtype=torch.float32, device="cpu"
    )
    real = scatter.scatter_partials
    if rank == 0:

        def injected(*args: Any, **kwargs: Any) -> Any:
            raise MemoryError("injected between launches")

        saved, scatter.reduce_slots = scatter.reduce_slots, injected
        try:
            run_op("rs", xs[rank], ws[rank], b, group)
            raise AssertionError("the injected failure did not propagate")
        except MemoryError:
            pass
        finally:
            scatter.reduce_slots = saved
    else:

        def late(*args: Any, **kwargs: Any) -> Any:
            time.sleep(delay_s)
            return real(*args, **kwargs)

        scatter.scatter_partials = late
        run_op("rs", xs[rank], ws[rank], b, group)
    # No barrier before the next call (check_case's scramble has one): rank 0 enters it while rank
    # 1 is still in the late call, and rank 1's scatter is late in it too, so a stale count would
    # let rank 0 sum the abandoned call's slot.
    xs, ws, b = make_inputs(
        "rs", world, 5, 12, 9, bias=True, seed=5, noncontig=False, dtype=torch.float32, device="cpu"
    )
    try:
        got = run_op("rs", xs[rank], ws[rank], b, group)
    finally:
        if rank != 0:
            scatter.scatter_partials = real
    assert_close(f"rs after an abandoned call, rank {rank}", got, reference("rs", xs, ws, b, rank), torch.float32)


def failed_call_body(rank: int, world: int, op: str) -> float:
    """One fused call fails on every rank after its first launch; the next call must run normally.

    Returns how long the next (correct) call took: it must not sit out a COC_TIMEOUT waiting for
    a ``DONE`` signal of the abandoned call.
    """
    from kernels.fused import all_reduce, scatter

    group = dist.group.WORLD
    xs, ws, b = make_inputs(op, world, 5, 12, 9, bias=True, seed=3, noncontig=False, dtype=torch.float32, device="cpu")
    check_case(rank, world, op, 5, 12, 9, True, 1, False, group, torch.float32, torch.device("cpu"))

    def injected(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected failure")

    saved = scatter.reduce_slots
    scatter.reduce_slots = all_reduce.reduce_slots = injected
    try:
        run_op(op, xs[rank], ws[rank], b, group)
        raise AssertionError("the injected failure did not propagate")
    except RuntimeError as e:
        assert "injected failure" in str(e), e
    finally:
        scatter.reduce_slots = all_reduce.reduce_slots = saved
    start = time.monotonic()
    got = run_op(op, xs[rank], ws[rank], b, group)
    elapsed = time.monotonic() - start
    assert_close(f"{op} after a failed call, rank {rank}", got, reference(op, xs, ws, b, rank), torch.float32)
    return elapsed


# ----------------------------------------------------------------------------------- GPU-only bodies
# Run by the gpu-marked tests through run_gpu_ranks: every rank is a process of its own on the GPU(s).


def gpu_device() -> torch.device:
    """The key the ops' heap is cached under on this rank's GPU (``cuda:<index>``)."""
    return heap_device("cuda")


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
    from kernels.format import int8
    from kernels.fused import all_reduce
    from kernels.ops.gemm import Operands

    xs, ws, b = make_inputs(
        "ar", world, m_local, k, n, bias=bias, seed=seed, noncontig=False, dtype=dtype, device=str(device)
    )
    quantized, deq = quantized_weights(ws, dtype)
    scramble(group, device)
    if rank == seed % world:
        time.sleep(STRAGGLER_S)
    q, s = quantized[rank]
    call = fused_call("all_reduce", group, int8("per_channel", 0, False), deterministic=True)
    got = all_reduce.run(call, Operands(xs[rank], (q,), (b,), None, (s,), (None,)))
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


def gpu_streams_body(rank: int, world: int) -> int:
    """Back-to-back calls on one group from two streams in turn, with nothing ordering the streams
    but the fused path itself: all inputs ready first, then eight calls (reduce-scatter, two-shot
    all-reduce and all-gather in turn) on a grid over one wave, each checked against fp64 torch
    math after a single synchronization. A call whose check overtook the previous call's reduce
    would let peers overwrite slots still being read."""
    dev = gpu_device()
    group = dist.group.WORLD
    presize(group, dev, 64 << 20)
    m_local, k, n = gpu_wave_shape(world)
    calls = [(("rs", "ar_two", "ag")[i % 3], i) for i in range(8)]
    inputs = [
        make_inputs(
            op, world, m_local, k, n, bias=True, seed=seed, noncontig=False, dtype=torch.float16, device=str(dev)
        )
        for op, seed in calls
    ]
    streams = (torch.cuda.current_stream(dev), torch.cuda.Stream(dev))
    torch.cuda.synchronize(dev)
    outs = []
    for i, ((op, _), (xs, ws, b)) in enumerate(zip(calls, inputs, strict=True)):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(run_op(op, xs[rank], ws[rank], b, group))
    torch.cuda.synchronize(dev)
    for (op, seed), (xs, ws, b), got in zip(calls, inputs, outs, strict=True):
        assert_close(f"{op} call {seed} rank={rank}", got, reference(op, xs, ws, b, rank), torch.float16)
    return len(calls)


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
        xs, ws, b = make_inputs(
            op, world, m_local, k, n, bias=i % 2 == 0, seed=100 + i, noncontig=False, dtype=dtype, device=str(dev)
        )
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
    """The public w8A16 all-reduce in bf16 (one-shot and two-shot sizes) against fp64 math on the
    dequantized weights rounded to bf16 (the weights the kernel multiplies by)."""
    import kernels

    done = 0
    for rows in (3, 40):
        g = torch.Generator().manual_seed(rows)
        xs = [torch.randn(rows, 24, generator=g).to(torch.bfloat16) for _ in range(world)]
        quantized, deq = quantized_weights([torch.randn(20, 24, generator=g) for _ in range(world)], torch.bfloat16)
        got = kernels.quantized_matmul_all_reduce(xs[rank], *quantized[rank], backend="fused")
        assert_close(f"w8A16 bf16 rows={rows}", got, reference("ar", xs, deq, None, rank), torch.bfloat16)
        done += 1
    return done


def gpu_teardown_body(rank: int, world: int) -> str:
    """After ``destroy_heap`` no heap of the group is cached, the heap is closed with its IPC mappings,
    and (rank 0) the device memory of all W allocations came back: on one GPU every rank's allocation
    lives in the same device memory, and a freed allocation a peer still maps stays resident until
    the last mapping is closed. Returns what rank 0 measured."""
    from kernels import heap as heap_mod

    dev = gpu_device()
    group = dist.new_group(list(range(world)))
    presize(group, dev, 64 << 20)
    xs, ws, b = make_inputs(
        "ar", world, 13, 64, 40, bias=True, seed=0, noncontig=False, dtype=torch.float16, device=str(dev)
    )
    assert_close(
        "ar before teardown",
        run_op("ar_one", xs[rank], ws[rank], b, group),
        reference("ar", xs, ws, b, rank),
        torch.float16,
    )
    heap = heap_mod.peek_heap(group, dev)
    assert heap is not None, f"no heap cached under {dev} although an op ran"
    total = heap.total_bytes
    torch.cuda.synchronize(dev)
    dist.barrier(group)
    free_before = torch.cuda.mem_get_info(dev)[0]
    dist.barrier(group)
    heap_mod.destroy_heap(group)
    torch.cuda.synchronize(dev)
    dist.barrier(group)
    assert heap_mod.peek_heap(group, dev) is None and not heap_mod.heaps_of(group), "a heap of the group is cached"
    assert heap.closed, "the heap is not closed"
    assert not getattr(heap, "_opened", []), f"{len(heap._opened)} IPC mappings still open"
    if rank != 0:
        return ""
    freed = torch.cuda.mem_get_info(dev)[0] - free_before
    assert freed >= world * total, f"only {freed} bytes of device memory came back, want >= {world} x {total}"
    return f"freed {freed} bytes, want >= {world} x {total}"


def departed_peer_body(rank: int, world: int, op: str, timeout_s: float) -> tuple[float, str] | None:
    """Two warm calls on a group of every rank; then rank 1's process ends (``os._exit``) and rank 0
    calls again with ``COC_TIMEOUT=timeout_s``: the call must raise, naming rank 1, in about that time.
    The other ranks make no further call. Run with ``allow_dead``: rank 1's result is ``None``."""
    dev = gpu_device()
    dtype = torch.float16
    group = dist.new_group(list(range(world)))
    xs, ws, b = make_inputs(op, world, 13, 64, 40, bias=True, seed=3, noncontig=False, dtype=dtype, device=str(dev))
    for _ in range(2):  # every kernel variant compiles here, not inside the timed wait
        run_op(op, xs[rank], ws[rank], b, group)
    torch.cuda.synchronize(dev)
    dist.barrier(group)
    if rank == 1:
        os._exit(0)
    if rank != 0:
        return None
    os.environ["COC_TIMEOUT"] = str(timeout_s)  # read at call time
    start = time.monotonic()
    try:
        run_op(op, xs[rank], ws[rank], b, group)
        torch.cuda.synchronize(dev)
    except RuntimeError as e:
        return time.monotonic() - start, str(e)
    raise AssertionError(f"{op}: the call returned although rank 1's process had ended")
