"""gpu-check section c: the fused ops on W processes sharing one device through the symmetric heap.

Ranks are fresh processes (``spawn``) on a gloo group over a ``file://`` store: the fused path needs
the group only for ``all_gather_object`` (heap handles) and barriers, and NCCL refuses two ranks on
one GPU. Every rank runs on ``cuda:<current device>`` (all on one GPU) or, with ``--allow-cpu``, on
CPU under the Triton interpreter with the shared-memory heap.

Each check returns an item ``{"name", "status": "pass" | "fail" | "skip", "detail", ...}``; the
section merges the ranks' items (an item fails if it fails on any rank).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Environment variable scaling every tolerance of gpu-check (default 1). A negative value makes every
# comparison fail: the CPU test uses it to prove that a wrong result is reported as FAIL.
TOL_SCALE_ENV = "COC_GPU_CHECK_TOL_SCALE"
OPS = ("ag", "ag_v2", "rs", "ar_one", "ar_two", "qar")
STRAGGLER_S = 0.2


def tol_scale() -> float:
    raw = os.environ.get(TOL_SCALE_ENV, "1")
    try:
        return float(raw)
    except ValueError as e:
        raise ValueError(f"{TOL_SCALE_ENV}={raw!r} is not a number") from e


def tolerance(dtype: torch.dtype, k: int, world: int, x_absmax: float, w_absmax: float) -> tuple[float, float]:
    """``(atol, rtol)`` for an op's ``dtype`` output against the fp32 sequential reference.

    The inputs are exact in ``dtype`` and the reference multiplies the same values in fp32, so the
    difference comes from (1) rounding to ``dtype``: each of the W per-rank partials (rs / ar round
    them before the reduction), the reduced sum and the bias add, at most ``W + 2`` roundings of half
    an ulp, ``eps / 2 * |v|`` each; every rounded value is a dot product of at most ``k`` terms of
    magnitude ``<= max|x| max|w|`` with independent signs, so ``|v| <~ sqrt(k) max|x| max|w|`` (random
    normal data: ``max|x| ~ 4 sigma``, so this has a margin of about 3 over the largest partial);
    and (2) fp32 accumulation in another order: k roundings of ``eps32 / 2 * |partial sum|``, a
    random walk of ``sqrt(k)`` steps of size ``<= eps32 sqrt(k) max|x| max|w|``. Both terms get a
    factor 2 of margin; ``rtol = eps(dtype)`` covers the final rounding relative to ``|y|``.
    """
    eps = torch.finfo(dtype).eps
    eps32 = torch.finfo(torch.float32).eps
    scale = x_absmax * w_absmax
    atol = 2.0 * ((world + 2) * eps / 2 * math.sqrt(k) + eps32 * k) * scale
    s = tol_scale()
    return s * atol, s * eps


def compare(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, **extra: Any) -> dict:
    """An item: ``got`` within ``atol + rtol * |want|`` of ``want`` everywhere (shapes must match)."""
    if tuple(got.shape) != tuple(want.shape):
        return {"name": name, "status": "fail", "detail": f"shape {tuple(got.shape)}, want {tuple(want.shape)}"}
    diff = (got.float() - want.float()).abs()
    bound = atol + rtol * want.float().abs()
    excess = diff - bound
    worst = float(excess.max()) if excess.numel() else -1.0
    ok = worst <= 0 and not bool(torch.isnan(got).any())
    max_err = float(diff.max()) if diff.numel() else 0.0
    detail = f"max |err| {max_err:.3g}, atol {atol:.3g}, rtol {rtol:.3g}"
    if not ok:
        detail += f"; exceeds the bound by {worst:.3g} at flat index {int(excess.argmax())}"
    return {"name": name, "status": "pass" if ok else "fail", "detail": detail, "max_err": max_err, **extra}


def item_error(name: str, exc: BaseException) -> dict:
    return {"name": name, "status": "fail", "detail": f"{type(exc).__name__}: {exc}"[:600]}


# ---------------------------------------------------------------------------------------------- ranks

_EARLY: dict[str, Any] = {}  # this rank's number and result queue, for a body that ends its process itself


def _report_early(value: Any) -> None:
    """Hand in this rank's result now and flush it through the queue: the process is about to end."""
    _EARLY["results"].put((_EARLY["rank"], "ok", value))
    _EARLY["results"].close()
    _EARLY["results"].join_thread()


def _rank_entry(
    rank: int, world: int, store_path: str, device_type: str, results: Any, fn: Callable[..., Any], args: tuple
) -> None:
    import datetime

    _EARLY.update(rank=rank, results=results)
    try:
        if device_type == "cuda":
            # Every rank on the one GPU: the processes share it through CUDA IPC.
            torch.cuda.set_device(0)
        else:
            torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store_path, world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        value = fn(rank, world, device_type, *args)
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()[-3000:]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(
    fn: Callable[..., Any], world: int, device_type: str, args: tuple, timeout_s: float
) -> list[tuple[str, Any]]:
    """Run module-level ``fn(rank, world, device_type, *args)`` on ``world`` new processes.

    Returns per rank ``("ok", value)``, ``("error", traceback)``, ``("died", exit code)`` or
    ``("timeout", None)``; a rank that ends its own process hands its result in first
    (:func:`_report_early`). Every process is gone on return (killed past ``timeout_s``).
    :func:`bench.launch.spawn` does not fit here: it takes NCCL and one GPU per rank on CUDA.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    got: dict[int, tuple[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="coc-gpu-check-") as tmp:
        procs = [
            ctx.Process(
                target=_rank_entry,
                name=f"coc-gpu-check-rank{r}",
                daemon=True,
                args=(r, world, os.path.join(tmp, "store"), device_type, results, fn, args),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < world and time.monotonic() < deadline:
                try:
                    rank, status, value = results.get(timeout=0.5)
                    got[rank] = (status, value)
                    continue
                except queue.Empty:
                    pass
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
                if dead:
                    try:  # its result may still be in the queue's pipe
                        rank, status, value = results.get(timeout=2.0)
                        got[rank] = (status, value)
                        continue
                    except queue.Empty:
                        for r in dead:
                            got[r] = ("died", procs[r].exitcode)
                        break
        finally:
            for p in procs:
                p.join(timeout=5 if len(got) == world else 0.1)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return [got.get(r, ("timeout", None)) for r in range(world)]


def merge_rank_items(outcome: list[tuple[str, Any]], what: str) -> list[dict]:
    """One item list from every rank's: an item fails if any rank failed it; a rank that raised,
    died or timed out is an item of its own."""
    merged: dict[str, dict] = {}
    extra: list[dict] = []
    for rank, (status, value) in enumerate(outcome):
        if status != "ok":
            detail = {
                "error": f"raised:\n{value}",
                "died": f"died (exit code {value})",
                "timeout": "gave no answer before the deadline",
            }[status]
            extra.append({"name": f"{what}: rank {rank}", "status": "fail", "detail": f"rank {rank} {detail}"})
            continue
        for it in value or []:
            prev = merged.get(it["name"])
            if prev is None or (prev["status"] != "fail" and it["status"] == "fail"):
                merged[it["name"]] = dict(
                    it,
                    detail=f"rank {rank}: {it.get('detail', '')}" if it["status"] == "fail" else it.get("detail", ""),
                )
    return list(merged.values()) + extra


# ------------------------------------------------------------------------------------------- the ops


def device_of(device_type: str) -> torch.device:
    """The device key the ops use (``x.device``): ``cuda:<index>``, never bare ``cuda``, so that
    :func:`kernels.heap.peek_heap` finds the heap the ops really use."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_case(
    op: str,
    world: int,
    rank: int,
    m_local: int,
    k: int,
    n: int,
    bias: bool,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    """This rank's inputs and the fp32 sequential reference from every rank's inputs (same seed on all)."""
    g = torch.Generator().manual_seed(seed)
    rows = {"ag": m_local, "ag_v2": m_local, "rs": m_local * world}.get(op, 2 * m_local + 1)
    xs = [torch.randn(rows, k, generator=g).to(dtype) for _ in range(world)]
    if op.startswith("ag"):
        ws = [torch.randn(n, k, generator=g).to(dtype)] * world
    else:
        ws = [torch.randn(n, k, generator=g).to(dtype) for _ in range(world)]
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    case: dict[str, Any] = {"op": op, "x": xs[rank].to(device), "b": None if b is None else b.to(device)}
    if op == "qar":
        from kernels.quant import dequantize, quantize_weight

        q = [quantize_weight(w.float(), mode="per_channel") for w in ws]
        case["q"], case["scale"] = q[rank][0].to(device), q[rank][1].to(device)
        # The kernel dequantizes in fp32 and rounds the weight to x.dtype, as kernels.quant documents.
        ws = [dequantize(qw, s).to(dtype) for qw, s in q]
    else:
        case["w"] = ws[rank].to(device)
    # Sequential torch math in fp32 on the same device (fused_world_body turns TF32 off).
    x32 = [x.to(device).float() for x in xs]
    w32 = [w.to(device).float() for w in ws]
    b32 = torch.zeros(n, device=device) if b is None else b.to(device).float()
    if op.startswith("ag"):
        want = torch.cat(x32) @ w32[0].T + b32
        case["gathered"] = torch.cat(xs).to(device)
    else:
        want = sum(x32[i] @ w32[i].T for i in range(world)) + b32
        if op == "rs":
            want = want[rank * m_local : (rank + 1) * m_local]
    case["want"] = want
    k_total = k if op.startswith("ag") else k * world
    case["tol"] = tolerance(
        dtype, k_total, world, max(float(x.abs().max()) for x in x32), max(float(w.abs().max()) for w in w32)
    )
    return case


def run_op(case: dict[str, Any], group: dist.ProcessGroup) -> Any:
    from kernels import fused
    from kernels.fused.gemm_ar import matmul_all_reduce
    from kernels.fused.gemm_ar_w8a16 import matmul_all_reduce_w8a16

    op, x, b = case["op"], case["x"], case["b"]
    if op in ("ag", "ag_v2"):
        return fused.all_gather_matmul(x, case["w"], b, group, op == "ag_v2")
    if op == "rs":
        return fused.matmul_reduce_scatter(x, case["w"], b, group, True)
    if op == "qar":
        return matmul_all_reduce_w8a16(x, case["q"], case["scale"], None, x.shape[1], b, group, True)
    return matmul_all_reduce(x, case["w"], b, group, True, algorithm={"ar_one": "one_shot", "ar_two": "two_shot"}[op])


def check_result(name: str, case: dict[str, Any], got: Any) -> dict:
    if case["op"] == "ag_v2":
        y, xg = got
        if not torch.equal(xg, case["gathered"]):
            return {"name": name, "status": "fail", "detail": "return_gathered: the gathered x differs from the inputs"}
        got = y
    if got.dtype != case["x"].dtype:
        return {"name": name, "status": "fail", "detail": f"dtype {got.dtype}, want {case['x'].dtype}"}
    return compare(name, got, case["want"], *case["tol"])


def scramble(group: dist.ProcessGroup, device: torch.device) -> int:
    """Fill this rank's heap data with random values (the heap the ops use: key ``device``); its bytes.

    The barriers keep every peer out of the heap meanwhile: none is still in the previous call,
    none starts the next before all have scrambled."""
    from kernels.heap import peek_heap

    dist.barrier(group)
    heap = peek_heap(group, device)
    if heap is not None:
        heap.data_view(heap.rank, torch.float32, (heap.data_bytes // 4,)).normal_()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    dist.barrier(group)
    return 0 if heap is None else heap.data_bytes


def shapes(device_type: str) -> list[tuple[int, int, int, bool]]:
    """(m_local, k, n, bias), rows odd. GPU: 128 x 128 tiles, 4 all-gather chunks per shard, 132 SMs
    on an H100: the first shape has several tiles and chunks per shard and a grid of more tiles
    than SMs (one wave) for every op at W >= 2; the second is one partial tile."""
    if device_type == "cuda":
        return [(517, 512, 2560, True), (13, 64, 40, False)]
    # 16 x 16 tiles under the interpreter: several tiles and both all-gather chunks per shard.
    return [(37, 24, 40, True)]


def fused_world_body(
    rank: int, world: int, device_type: str, dtype_names: list[str], calls: int, depart: tuple[str, list[str], float]
) -> list[dict]:
    """Correctness of every op and dtype with a scrambled heap and a straggler, then ``calls``
    back-to-back calls, the heap's teardown, and a departing peer (``depart``: the arguments
    ``mode, ops, timeout_s`` of :func:`departure`). Rank 1 of a departure by "exit" ends its process."""
    from kernels.fused import signals
    from kernels.heap import get_heap

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = device_of(device_type)
    group = dist.new_group(list(range(world)))
    # Presized, so no call grows (and zeroes) the heap the scramble filled.
    get_heap(group, dev, (64 << 20) if device_type == "cuda" else (1 << 20), signals.sig_words(world))
    items: list[dict] = []
    seed = 0
    for dname in dtype_names:
        dtype = getattr(torch, dname)
        for m_local, k, n, bias in shapes(device_type):
            for op in OPS:
                seed += 1
                name = f"W={world} {op} {dname} m_local={m_local} k={k} n={n} bias={bias}"
                try:
                    case = make_case(op, world, rank, m_local, k, n, bias, seed, dtype, dev)
                    heap_bytes = scramble(group, dev)
                    if rank == seed % world:
                        time.sleep(STRAGGLER_S)  # peers must wait for this rank's data, not read stale bytes
                    got = run_op(case, group)
                    items.append(dict(check_result(name, case, got), heap_bytes=heap_bytes, straggler=seed % world))
                except Exception as e:  # one failing op must not hide the others' results
                    items.append(item_error(name, e))
                    dist.barrier(group)
    items.append(back_to_back(rank, world, dev, dtype_names[0], calls, group))
    items.append(teardown(rank, world, dev, group))
    mode, ops, timeout_s = depart
    return items + departure(rank, world, dev, mode, ops, timeout_s, items)


def back_to_back(rank: int, world: int, dev: torch.device, dname: str, calls: int, group: dist.ProcessGroup) -> dict:
    """``calls`` fused calls in a row, ops and shapes changing, no barrier or sync between them."""
    name = f"W={world} {calls} back-to-back calls {dname} (ops and shapes change, no barrier)"
    small = [(13, 64, 40), (40, 128, 72), (7, 32, 130)] if dev.type == "cuda" else [(5, 16, 20), (9, 8, 12)]
    plan = []
    for i in range(calls):
        op = OPS[i % len(OPS)]
        m_local, k, n = small[(i // len(OPS) + i) % len(small)]
        plan.append(make_case(op, world, rank, m_local, k, n, i % 2 == 0, 1000 + i, getattr(torch, dname), dev))
    dist.barrier(group)
    try:
        results = [run_op(case, group) for case in plan]
    except Exception as e:
        return item_error(name, e)
    checked = [check_result(f"call {i}", case, got) for i, (case, got) in enumerate(zip(plan, results, strict=False))]
    bad = [(i, it) for i, it in enumerate(checked) if it["status"] != "pass"]
    if bad:
        return {
            "name": name,
            "status": "fail",
            "detail": f"{len(bad)} of {calls} calls wrong; first: call {bad[0][0]} ({plan[bad[0][0]]['op']}): "
            f"{bad[0][1]['detail']}",
        }
    return {"name": name, "status": "pass", "detail": f"{calls} calls correct"}


def teardown(rank: int, world: int, dev: torch.device, group: dist.ProcessGroup) -> dict:
    """After ``destroy_heap`` no heap of the group is cached and its memory and IPC mappings are gone.

    On one GPU every rank's allocation lives in the same device memory: rank 0 measures free device
    memory before any rank destroys and after all have, which must grow by at least the W
    allocations (a freed allocation whose mapping a peer still holds stays resident until the last
    mapping is closed, so this also proves the mappings were closed)."""
    from kernels import heap as heap_mod

    name = f"W={world} heap and IPC mappings freed after destroy_heap"
    heap = heap_mod.peek_heap(group, dev)
    if heap is None:
        return {"name": name, "status": "fail", "detail": f"no heap cached under {dev} although the ops ran"}
    total = heap.total_bytes
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier(group)
    free_before = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 0
    dist.barrier(group)
    heap_mod.destroy_heap(group)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier(group)
    problems = []
    if heap_mod.peek_heap(group, dev) is not None or any(key[0] == id(group) for key in heap_mod._HEAPS):
        problems.append("a heap of the group is still cached")
    if not heap.closed:
        problems.append("the heap is not closed")
    if getattr(heap, "_opened", []):
        problems.append(f"{len(heap._opened)} IPC mappings still open")
    detail = f"heap of {total} bytes per rank closed"
    if dev.type == "cuda" and rank == 0:
        freed = torch.cuda.mem_get_info(dev)[0] - free_before
        detail += f"; device memory freed {freed} bytes, want >= {world} x {total}"
        if freed < world * total:
            problems.append(f"only {freed} bytes of device memory came back, want >= {world * total}")
    return {
        "name": name,
        "status": "fail" if problems else "pass",
        "detail": "; ".join(problems) if problems else detail,
    }


def departure(
    rank: int, world: int, dev: torch.device, mode: str, ops: list[str], timeout_s: float, items_so_far: list[dict]
) -> list[dict]:
    """Ranks 0 and 1 call every op twice on a 2-rank group of its own; then rank 1 leaves (``mode``
    "stop": it makes no more calls and keeps its memory until rank 0 is done; "exit": its process ends
    at once, after handing in ``items_so_far``) and rank 0 calls each op again with
    ``COC_TIMEOUT=timeout_s``: each call must raise RuntimeError naming rank 1 within that time.
    Ranks 2.. make no fused call and wait for rank 0 at a gloo barrier."""
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    # new_group is collective over the default group: every rank creates every group.
    pairs = {op: dist.new_group([0, 1]) for op in ops}
    hold = dist.new_group([0, 1])
    others = dist.new_group([0] + list(range(2, world))) if world > 2 else None
    if rank >= 2:
        dist.barrier(others)
        return []
    cases = {op: make_case(op, 2, rank, 13, 64, 40, True, i, dtype, dev) for i, op in enumerate(ops)}
    for op in ops:
        # Two calls: every kernel variant the op needs compiles here, not inside the timed wait.
        for _ in range(2):
            run_op(cases[op], pairs[op])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier(hold)
    if rank == 1:
        if mode == "exit":
            _report_early(items_so_far)
            os._exit(0)
        dist.barrier(hold)  # a gloo barrier, not a fused call: held until rank 0 has seen every timeout
        return []
    os.environ["COC_TIMEOUT"] = str(timeout_s)  # read at call time (kernels.config)
    items = []
    for op in ops:
        name = (
            f"W={world} {op} on a 2-rank group: peer {'process exits' if mode == 'exit' else 'stops calling'} "
            "-> RuntimeError"
        )
        start = time.monotonic()
        try:
            run_op(cases[op], pairs[op])
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except RuntimeError as e:
            elapsed, message = time.monotonic() - start, str(e)
        else:
            items.append({"name": name, "status": "fail", "detail": "the call returned although rank 1 never made it"})
            continue
        # Slack past COC_TIMEOUT: the host-side error check and, on CPU, the interpreter's pace.
        slack = 5.0 if dev.type == "cuda" else 15.0
        ok = "rank 1" in message and "COC_TIMEOUT" in message and elapsed <= timeout_s + slack
        items.append(
            {
                "name": name,
                "status": "pass" if ok else "fail",
                "elapsed_s": round(elapsed, 2),
                "detail": f"raised after {elapsed:.2f} s (COC_TIMEOUT={timeout_s:g}, allowed +{slack:g} s): "
                f"{message[:300]}",
            }
        )
    if mode == "stop":
        dist.barrier(hold)
    if others is not None:
        dist.barrier(others)
    return items
