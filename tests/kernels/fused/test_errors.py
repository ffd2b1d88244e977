"""The fused path's error reporting without host synchronization, and its host-side guards.

Rank bodies live in this module (the rank pools import them by reference).
"""

import os
import sys
import time
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from kernels.testing import REPO_ROOT, run_ranks
from tests.kernels.fused import cases as fused_cases

# The host protocol around the kernels test_ops.py checks under both Triton versions.
pytestmark = pytest.mark.one_triton

TIMEOUT_S = 2.0
# The raise must come at COC_TIMEOUT, not at the harness deadline; the slack is generous because the
# interpreted spin loop is slow on a loaded machine, and still far below the deadline.
SLACK_S = 30.0
KERNELS_DIR = os.path.join(REPO_ROOT, "kernels") + os.sep
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# Calls that make the host wait for the device when their tensor lives on a GPU, by what they do:
# read values on the host, decide an output size from the data, or copy to host memory. A
# TorchFunctionMode sees every torch call (methods, functions, conversions) from the code under
# test, so nothing depends on spying a fixed set of methods; on a GPU,
# test_steady_state_fused_calls_never_sync_gpu asks CUDA itself (set_sync_debug_mode).
_VALUE_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"}
_DATA_DEPENDENT = {
    "equal",
    "allclose",
    "nonzero",
    "argwhere",
    "unique",
    "unique_consecutive",
    "masked_select",
    "is_nonzero",
    "bincount",
    "histc",
}
_SYNC_PRIMITIVES = ("synchronize", "Stream.synchronize", "Event.synchronize", "Stream.query", "Event.query")


def _is_host(device: Any) -> bool:
    return (isinstance(device, str) and device.startswith("cpu")) or (
        isinstance(device, torch.device) and device.type == "cpu"
    )


def _syncs(name: str, args: tuple, kwargs: dict) -> bool:
    if name in _VALUE_READS or name in _DATA_DEPENDENT or name == "cpu":
        return True
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    if name == "to":
        targets = list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]
        return any(_is_host(a) or (isinstance(a, torch.Tensor) and a.device.type == "cpu") for a in targets)
    if name in ("copy_", "pin_memory"):
        return name == "pin_memory" or (isinstance(args[0], torch.Tensor) and args[0].is_pinned())
    return False


def _caller_under(root: str) -> tuple[str, int] | None:
    """The innermost frame outside torch and this module, if it lies under ``root``."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename.startswith(root):
        return frame.f_code.co_filename, frame.f_lineno
    return None


class HostSyncRecorder(TorchFunctionMode):
    """Record every torch call made from code under ``kernels/`` that would wait for a GPU.

    A registered ``coc`` operator runs its Python implementation with this mode still active (the
    dispatcher would otherwise run it with the mode popped, hiding everything the op does)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str, int]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _syncs(name, args, kwargs):
            where = _caller_under(KERNELS_DIR)
            if where is not None:
                self.reads.append((name, *where))
        if isinstance(func, torch._ops.OpOverload) and func.namespace == "coc":
            from kernels.protocol.registry import IMPLEMENTATION_OF

            impl = IMPLEMENTATION_OF[func]
            with self:
                return impl(*args, **kwargs)
        return func(*args, **kwargs)


def spy_body(rank: int, world: int) -> tuple[list, list]:
    """Host syncs made by code under kernels/ during steady-state fused calls."""
    group = dist.new_group(list(range(world)))
    plan = _steady_state_plan(rank, world, group)
    for call in plan:  # the first calls create the heap, its error record and compile the kernels
        call()
    recorder = HostSyncRecorder()
    saved = {name: _sync_target(name) for name in _SYNC_PRIMITIVES}

    def sync(name: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> None:
            recorder.reads.append((f"torch.cuda.{name}", "", 0))

        return wrapper

    for name in _SYNC_PRIMITIVES:
        _set_sync_target(name, sync(name))
    try:
        with recorder:
            # The recorder itself works: reads, a host copy and a data-dependent size made from a
            # file under kernels/ are caught.
            probe_src = "t.item(); t.to('cpu'); t.nonzero(); bool(t); torch.cuda.synchronize()"
            exec(
                compile(probe_src, os.path.join(KERNELS_DIR, "probe.py"), "exec"), {"t": torch.ones(1), "torch": torch}
            )
            probe, recorder.reads[:] = list(recorder.reads), []
            for _ in range(3):
                for call in plan:
                    call()
    finally:
        for name, real in saved.items():
            _set_sync_target(name, real)
    return probe, recorder.reads


def _sync_target(name: str) -> Any:
    owner, _, attr = name.rpartition(".")
    return getattr(getattr(torch.cuda, owner) if owner else torch.cuda, attr)


def _set_sync_target(name: str, value: Any) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(getattr(torch.cuda, owner) if owner else torch.cuda, attr, value)


def _steady_state_plan(rank: int, world: int, group: Any, device: str = "cpu") -> list:
    import kernels

    g = torch.Generator().manual_seed(rank)
    x, w, b = torch.randn(6, 16, generator=g), torch.randn(12, 16, generator=g), torch.randn(12, generator=g)
    x_rs = torch.randn(2 * world, 16, generator=g)
    x, w, b, x_rs = (t.to(device) for t in (x, w, b, x_rs))
    return [
        lambda: kernels.all_gather_matmul(x, w, b, group=group, backend="fused", return_gathered=True),
        lambda: kernels.matmul_reduce_scatter(x_rs, w, b, group=group, backend="fused"),
        lambda: kernels.matmul_all_reduce(x, w, b, group=group, backend="fused", deterministic=True),
    ]


def test_steady_state_fused_calls_never_read_device_memory():
    for probe, reads in run_ranks(spy_body, 2):
        assert [name for name, _, _ in probe] == ["item", "to", "nonzero", "__bool__", "torch.cuda.synchronize"]
        assert reads == [], reads


def _gpu_steady_state(rank: int, world: int) -> str:
    group = dist.new_group(list(range(world)))
    plan = _steady_state_plan(rank, world, group, device="cuda")
    for call in plan:
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for call in plan:
                call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return "ok"


@pytest.mark.gpu
def test_steady_state_fused_calls_never_sync_gpu():
    """On a GPU, CUDA's own sync detector: any device-to-host wait inside a steady-state fused call raises."""
    assert fused_cases.run_gpu_ranks(_gpu_steady_state, 2) == ["ok", "ok"]


def deferred_error_body(rank: int, world: int, how: str) -> tuple[float, str, bool, bool]:
    """Both ranks admit a call, but rank 1's kernels never run (as a GPU stuck on other work: its implementation is
    replaced by nothing here); rank 0's kernels time out waiting for it while its host reads the error record too
    early (as on a GPU, where the kernels have not run when the host reads), so the call returns NaN outputs. The
    failure must surface at ``kernels.check_errors`` or at the next call's admission, on every rank alike, and the
    call after that answers (every rank rebuilt its heap)."""
    import kernels
    from kernels.fused import runtime
    from kernels.ops import reduce_scatter

    group = dist.new_group(list(range(world)))
    xs, ws, b = fused_cases.make_inputs("rs", world, 3, 8, 6, bias=True, seed=5)

    def call() -> torch.Tensor:
        return kernels.matmul_reduce_scatter(xs[rank], ws[rank], b, group=group, backend="fused", deterministic=True)

    call()
    start = time.monotonic()
    impl, real = reduce_scatter.SPEC.impl, runtime.raise_recorded
    saved = impl["fused"]
    if rank == 1:
        impl["fused"] = lambda c, ops: torch.zeros(1, 6).expand(1, 6)
    runtime.raise_recorded = lambda heap: None
    try:
        y = call()
    finally:
        impl["fused"], runtime.raise_recorded = saved, real
    poisoned = bool(torch.isnan(y).all()) if rank == 0 else True
    if rank == 1:
        # Under the interpreter rank 0's host waits out its kernels' COC_TIMEOUT (a GPU's host would not): the
        # next admission must not find rank 1 waiting as long for it.
        time.sleep(TIMEOUT_S)
    message = ""
    if how == "check_errors":
        if rank == 0:
            try:
                kernels.check_errors()
            except RuntimeError as e:
                message = str(e)
        call()  # every rank retires its heap at this admission (rank 0 raised its failure already): it answers
    else:
        try:
            call()
        except RuntimeError as e:
            message = str(e)
    elapsed = time.monotonic() - start
    y = call()
    right = bool(torch.allclose(y.double(), fused_cases.reference("rs", xs, ws, b, rank)[0], atol=1e-4))
    return elapsed, message, poisoned, right


@pytest.mark.parametrize("how", ["check_errors", "next_call"])
def test_failure_recorded_by_kernels_surfaces_later_without_sync(how):
    results = run_ranks(deferred_error_body, 2, how, env={"COC_TIMEOUT": str(TIMEOUT_S)}, timeout=90)
    for rank, (elapsed, message, poisoned, right) in enumerate(results):
        assert poisoned, "the failed call's output was not filled with NaN"
        assert right, f"rank {rank}: the call after the failure was wrong"
        if how == "check_errors" and rank == 1:
            assert message == "", message  # rank 1 recorded nothing: only rank 0 reads its own record
            continue
        assert TIMEOUT_S * 0.9 <= elapsed <= TIMEOUT_S + 2 * SLACK_S, elapsed
        assert "fused matmul_reduce_scatter: rank 0" in message, message
        assert "for rank 1 (group rank 1) to publish its call descriptor" in message, message
        assert "COC_TIMEOUT=2" in message, message
        if how == "next_call":
            assert message.startswith("matmul_reduce_scatter: an earlier fused call on this group failed"), message


def test_check_errors_without_fused_calls_is_silent():
    import kernels

    kernels.check_errors()
    kernels.check_errors(None)


def test_capture_refuses_heap_creation_and_growth_only():
    """Inside capture a call that would create or grow the heap raises, naming the warm-up it needs;
    a call that fits the heap passes (the multi-rank replay tests run those)."""

    from kernels.fused import runtime

    with pytest.raises(RuntimeError, match="first fused call.*inside CUDA-graph capture.*once before capturing"):
        runtime.refuse_capture("matmul_all_reduce", None, 4096)
    heap = SimpleNamespace(data_bytes=4096)
    with pytest.raises(RuntimeError, match="needs a heap of 8192 bytes.*has 4096.*largest call once"):
        runtime.refuse_capture("matmul_all_reduce", heap, 8192)
    runtime.refuse_capture("matmul_all_reduce", heap, 4096)
    # Only a CUDA stream can be capturing.
    assert not runtime.capturing(torch.device("cpu"))


def test_mps_warns_once(monkeypatch, tmp_path):
    from kernels.fused import runtime

    (tmp_path / "control").touch()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    monkeypatch.setattr(runtime, "_mps_warned", False)
    with pytest.warns(RuntimeWarning, match="MPS"):
        runtime._warn_if_mps(torch.device("cuda", 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runtime._warn_if_mps(torch.device("cuda", 0))


@pytest.mark.parametrize("cuda, extra", [("12.4", "cuda12"), ("13.0", "cuda13"), (None, "cuda12")])
def test_cupy_hint_names_the_wheel_for_torchs_cuda(monkeypatch, cuda, extra):
    from kernels import heap

    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert f"pip install coc-overlap[{extra}]" in heap.cupy_install_hint()
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if no CuPy wheel were installed
    with pytest.raises(ImportError, match=rf"pip install coc-overlap\[{extra}\]"):
        heap.import_cupy()


def test_peer_views_must_not_be_copies(monkeypatch):
    from kernels.heap import cuda_ipc

    # A torch that copies instead of wrapping the IPC address must be refused, not used.
    monkeypatch.setattr(torch, "as_tensor", lambda obj, device=None: torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="copied the CUDA IPC mapping"):
        cuda_ipc._as_tensor(0x1000, 8, torch.device("cpu"))


def gated_push_body(rank: int, world: int) -> bool | None:
    """Rank 1 is alive but late: rank 0's call check times out, and its all-gather must then push
    nothing into rank 1's gather buffer (rank 1 could still be reading it for its previous call)."""
    from kernels.heap import peek_heap

    group = dist.new_group(list(range(world)))
    xs, ws, b = fused_cases.make_inputs("ag", world, 4, 8, 6, bias=False, seed=2)
    fused_cases.run_op("ag", xs[rank], ws[rank], b, group)
    heap = peek_heap(group, torch.device("cpu"))
    rows = heap.data_view(heap.rank, torch.float32, (world * 4, 8))[:4]  # where rank 0's shard lands
    if rank == 1:
        rows.fill_(7.0)
    dist.barrier(group)  # the sentinel is in place before rank 0's late call
    if rank == 0:
        with pytest.raises(RuntimeError, match="to publish its call descriptor"):
            fused_cases.run_op("ag", xs[rank], ws[rank], b, group)
    dist.barrier(group)  # rank 0's call is over (timed out) before rank 1 looks
    return bool((rows == 7.0).all()) if rank == 1 else None


def test_timed_out_check_pushes_nothing_into_peers():
    results = run_ranks(gated_push_body, 2, env={"COC_TIMEOUT": "1"}, timeout=90)
    assert results[1] is True, "rank 0 pushed into rank 1's gather buffer after its call check timed out"


def gated_scatter_body(rank: int, world: int, op: str) -> bool | None:
    """The reducing ops' twin of :func:`gated_push_body`: after rank 0's call check timed out, its
    GEMM stores no tile into rank 1's slots and its reduce pushes nothing (rank 1's previous call is
    over, so only the failed check can hold them back)."""
    from kernels.heap import destroy_heap, heaps_of, peek_heap

    group = dist.new_group(list(range(world)))
    xs, ws, b = fused_cases.make_inputs(op, world, 2 * world, 8, 6, bias=False, seed=2)
    fused_cases.run_op(op, xs[rank], ws[rank], b, group)
    heap = peek_heap(group, torch.device("cpu"))
    data = heap.data_view(heap.rank, torch.uint8, (heap.data_bytes,))
    if rank == 1:
        data.fill_(0x5A)
    dist.barrier(group)
    if rank == 0:
        with pytest.raises(RuntimeError, match="to publish its call descriptor"):
            fused_cases.run_op(op, xs[rank], ws[rank], b, group)
        # Retired, not freed: rank 1 is slow, not gone, and could still store into it.
        assert peek_heap(group, heap.device) is None and heaps_of(group) == [heap] and not heap.closed
    dist.barrier(group)
    intact = bool((data == 0x5A).all())
    dist.barrier(group)
    destroy_heap(group)
    assert heap.closed and not heaps_of(group)
    return intact if rank == 1 else None


@pytest.mark.parametrize("op", ["rs", "ar_one", "ar_two"])
def test_timed_out_check_scatters_nothing_into_peers(op):
    results = run_ranks(gated_scatter_body, 2, op, env={"COC_TIMEOUT": "1"}, timeout=90)
    assert results[1] is True, f"{op}: rank 0 wrote into rank 1's heap after its call check timed out"


def growth_failure_body(rank: int, world: int) -> bool:
    """A call that needs a larger heap while rank 1 makes none: rank 0's check, run on the old heap
    before growth, times out, and the call raises from ``begin``; the old heap is retired with its
    pad clock stopped (no thread keeps ticking for a heap nothing uses)."""
    from kernels.heap import destroy_heap, heaps_of, peek_heap

    group = dist.new_group(list(range(world)))
    xs, ws, b = fused_cases.make_inputs("rs", world, 2 * world, 8, 6, bias=False, seed=2)
    fused_cases.run_op("rs", xs[rank], ws[rank], b, group)
    heap = peek_heap(group, torch.device("cpu"))
    dist.barrier(group)
    if rank == 0:
        big_xs, big_ws, _ = fused_cases.make_inputs("rs", world, 64 * world, 8, 256, bias=False, seed=3)
        with pytest.raises(RuntimeError, match="to publish its call descriptor"):
            fused_cases.run_op("rs", big_xs[rank], big_ws[rank], None, group)
        assert heaps_of(group) == [heap] and not heap.closed
        assert not heap._clock._armed.is_set(), "the retired heap's clock is still armed"
    dist.barrier(group)
    destroy_heap(group)
    return True


def test_failure_before_growth_retires_the_old_heap_with_its_clock_stopped():
    assert run_ranks(growth_failure_body, 2, env={"COC_TIMEOUT": "1"}, timeout=90) == [True, True]


@pytest.mark.parametrize(
    ("op", "channel", "words"),
    [
        ("moe_dispatch", "CH_AG", "to publish its per-expert token counts"),
        ("moe_dispatch", "CH_RS", "to write its tokens' rows into this rank's heap"),
        ("moe_combine", "CH_RS", "to publish its experts' output rows"),
        ("matmul_reduce_scatter", "CH_RS", "to push its partial products"),
        ("all_gather_grouped_matmul", "CH_AG", "to push its input shard"),
    ],
)
def test_a_timeout_names_what_the_peer_had_not_done_in_that_op(op: str, channel: str, words: str) -> None:
    # The expert-parallel ops reuse the AG / RS signal channels for counts and rows: a timed-out wait must
    # not tell the user an all-gather or reduce-scatter stalled where none runs.
    from kernels.fused import runtime, signals
    from kernels.protocol import check_words

    heap = SimpleNamespace(world_size=2, rank=1, global_ranks=[0, 1], device=torch.device("cpu"))
    mine = list(check_words(runtime.op_word(op), ()))
    code = 1 + 0 + heap.world_size * getattr(signals, channel)
    text = runtime._message(heap, code, 7, (mine, mine), 5000)
    assert text.startswith(f"fused {op}: rank 1 (group rank 1) waited more than COC_TIMEOUT=5 s for rank 0 ")
    assert f"{words} (epoch 7)" in text, text


@pytest.mark.parametrize("failed", [True, False])
def test_failed_call_poisons_byte_rows_as_nan_in_every_format(failed: bool) -> None:
    # Packed FP8 rows (payload and fp32 scale bytes, kernels.format.pack_rows) are uint8 outputs: a NaN stored
    # into them would read as zero bytes, zero payload with a zero scale, a plausible value. All-ones bytes are
    # NaN as e4m3fn, e5m2 and fp32. No failure: nothing is written and DONE is signalled.
    from kernels.fused import signals

    pad = torch.zeros(64, dtype=torch.int64)
    pad[signals.ERROR_WORD] = 5 if failed else 0
    pad[signals.EPOCH_WORD] = 7
    heap = SimpleNamespace(world_size=1, rank=0, sig_ptrs=torch.tensor([pad.data_ptr()], dtype=torch.int64))
    rows = torch.zeros(3, 12, dtype=torch.uint8)  # 8 payload bytes, then one fp32 scale per row
    out = torch.zeros(5)
    signals.finish_call(heap, (rows, out), programs=1)
    if not failed:
        assert not rows.any() and not out.any()
        assert pad[signals.channel_offset(signals.CH_DONE, 1)] == 7
        return
    assert pad[signals.channel_offset(signals.CH_DONE, 1)] == 0
    assert bool((rows == 255).all()) and bool(out.isnan().all())
    assert rows[:, :8].view(torch.float8_e4m3fn).float().isnan().all()
    assert rows[:, :8].view(torch.float8_e5m2).float().isnan().all()
    assert rows[:, 8:].contiguous().view(torch.float32).isnan().all()
