"""Host-side plumbing shared by the fused ops: group, heap, call check, errors, CUDA-graph capture.

A fused call never reads device memory on the host. Kernels that fail (a wait that timed out, a
peer whose call descriptor differs) store a code in the heap's error record, a small tensor in
pinned host memory (a plain CPU tensor under the interpreter) that the kernels reach through
unified addressing. The host reads that record with ordinary CPU loads, without synchronizing: at the
end of every call (under the interpreter every kernel has finished when its launch returns, so the
failing call itself raises there), at the admission of every later fused call on the group
(:mod:`kernels.protocol.admission`: every rank raises a failure any rank's record holds, and every rank
retires its heap of the group at that same call, so the next fused call builds a new heap on every rank
at once) and in :func:`check_errors`. On a GPU a failure surfaces at the first of those reads after the
kernel ran; the outputs of the failed call hold NaN.

CUDA graphs: a call's launches carry no per-call host value (the epoch and the counters live in
the signal pad, :mod:`kernels.fused.signals`), so a captured call replays correctly, any number of
times, in stream order with eager calls. What cannot be captured is refused with a RuntimeError
inside capture: the group's first fused call on the device (it creates the heap with collectives)
and a call that needs a larger heap (growth synchronizes and exchanges handles). A heap a graph
captured is retired, not freed, when growth replaces it (the graph holds its addresses); so is
every heap of a failed call (a slow peer may still store into it). Failures of a replayed call
surface like those of an eager one: at the next fused call on the group or at :func:`check_errors`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ..capture import capturing
from ..config import get_config
from ..heap import CallMismatch, SymmetricHeap, get_heap, heaps_of, mark_failed, peek_heap
from ..protocol.call import CHECK_FIELDS, Call, check_words, shown_check_word
from . import signals


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def group_of(call: Call) -> dist.ProcessGroup:
    """The process group ``call`` names (``""``: the default group)."""
    return resolve_group(call.group)


def world_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group``; 1 without torch.distributed initialized (docs/api.md: W == 1 needs no process group).
    A fused call runs what the protocol admitted, which refused a launch of several processes without a process
    group (``kernels.checks.group_size``) before this reads the size."""
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def triton_interpreted() -> bool:
    """Whether Triton kernels run through the interpreter (decided when triton.jit decorated them)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The op words of the heap's call check (a CRC of the op's name: the same on every rank) -> the names seen here.
_OP_NAMES: dict[int, str] = {}


def op_word(op: str) -> int:
    """The heap check's word for ``op`` (a CRC of its name: the same on every rank), remembered for messages."""
    word = zlib.crc32(op.encode()) & 0x7FFFFFFF
    _OP_NAMES[word] = op
    return word


def describe(call: Call, operands: object, tiles: tuple[int, int] | None = None) -> tuple[int, ...]:
    """This rank's descriptor of ``call`` for the heap's call check (:func:`kernels.protocol.check_words`): the
    digest of what the ranks must agree on (the admission compared it already, unless ``COC_CHECK=0`` or a
    CUDA graph replays the call) and the fused GEMM's ``tiles``, which each rank reads from its own tuned file.

    Kept with the call object (its fields never change) by its operands' items and the tiles: a resolved
    signature's calls share one call object, and the digest of its items costs more than the rest of a call's host
    work (about 10 us)."""
    memo = vars(call).setdefault("_descriptors", {})
    key = (call.operand_items(operands), tiles)
    words = memo.get(key)
    if words is None:
        if len(memo) >= _DESCRIPTORS_PER_CALL:
            memo.clear()
        words = memo[key] = check_words(op_word(call.op), call.items(operands), tiles)
    return words


C = TypeVar("C", bound=Call)

# A call object serves one signature on the resolved path; a few keep the memo bounded wherever else one is reused.
_DESCRIPTORS_PER_CALL = 8


def as_fused(call: C) -> C:
    """``call`` as the fused kernels describe it (backend ``"fused"``, no split count), made once per call object
    and kept with it: a resolved signature's calls then share one fused call and its descriptor memo
    (:func:`describe`)."""
    if call.backend == "fused" and call.parallel_num is None:
        return call
    fused = vars(call).get("_as_fused")
    if fused is None:
        fused = vars(call)["_as_fused"] = replace(call, backend="fused", parallel_num=None)
    return fused


@dataclass
class FusedCall:
    """One fused call on a heap: its descriptor and the spin bound in the kernels' clock ticks."""

    op: str
    heap: SymmetricHeap
    descriptor: tuple[int, ...]
    timeout_ticks: int
    use_globaltimer: bool
    # The tensors the call returns: filled with NaN if a wait or the check failed.
    outputs: tuple[torch.Tensor, ...] = ()

    @property
    def rank(self) -> int:
        return self.heap.rank

    @property
    def world_size(self) -> int:
        return self.heap.world_size


def refuse_capture(op: str, heap: SymmetricHeap | None, data_bytes: int) -> None:
    """Inside CUDA-graph capture: raise if the call would create or grow the heap (collectives, a sync)."""
    if heap is None:
        raise RuntimeError(
            f"fused {op}: the group's first fused call on this device is inside CUDA-graph capture; it creates "
            "the symmetric heap with collectives, which cannot be captured. Make the same call once before "
            "capturing (the usual warm-up), then capture"
        )
    if heap.data_bytes < data_bytes:
        raise RuntimeError(
            f"fused {op}: inside CUDA-graph capture this call needs a heap of {data_bytes} bytes and the group's "
            f"has {heap.data_bytes}; growing it exchanges handles and synchronizes, which cannot be captured. "
            "Make the largest call once before capturing (the usual warm-up), then capture"
        )


_mps_warned = False


def _warn_if_mps(device: torch.device) -> None:
    global _mps_warned
    if _mps_warned or device.type != "cuda":
        return
    _mps_warned = True
    # A running MPS daemon has a control pipe in its pipe directory (default /tmp/nvidia-mps).
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    if os.path.exists(os.path.join(pipes, "control")):
        warnings.warn(
            "fused kernels under CUDA MPS: kernels of several processes share the GPU at once, and a "
            "spinning grid larger than its share can starve a peer's producer until COC_TIMEOUT",
            RuntimeWarning,
            stacklevel=4,
        )


def _attach_record(heap: SymmetricHeap) -> np.ndarray:
    """The heap's host error record as a NumPy view (created on first use; its address goes into the pad)."""
    if heap.error_record is None:
        pinned = heap.device.type == "cuda"
        record = torch.zeros(signals.RECORD_WORDS, dtype=torch.int64, pin_memory=pinned)
        address = torch.tensor([record.data_ptr()], dtype=torch.int64)
        # Once per heap, before its first kernel: a blocking copy is fine here.
        heap.sig_view(heap.rank)[signals.RECORD_WORD : signals.RECORD_WORD + 1].copy_(address)
        heap.error_record = record
        heap.error_view = record.numpy()
        heap.unreported_failure = functools.partial(_recorded, heap)
    return heap.error_view


def _verdict(op: str, group: dist.ProcessGroup) -> functools.partial[str | None]:
    """The judge of the descriptors exchanged when the group's heap is created."""
    return functools.partial(_first_mismatch, op, group)


def _labels(group: dist.ProcessGroup) -> list[str]:
    """Rank names: the group rank, and the global one if it differs."""
    ranks = dist.get_process_group_ranks(group)
    return [str(r) if r == g else f"{r} (global {g})" for r, g in enumerate(ranks)]


# What to do about a difference the heap's check finds (the admission names every other field first).
_HINTS = {
    "tiles": "every rank must read the same tuned file (COC_TUNED_DIR, configs/tuned)",
    "call": "the call digests differ: run with COC_CHECK unset or 1 to have the admission name the field",
    "version": "every rank must run the same build of this package",
    "op": "every rank must make the same call",
}


def _differences(labels: tuple[str, str], mine: Sequence[int], theirs: Sequence[int]) -> str:
    """``rank a has <field>=<value>, rank b has <field>=<value>; <what to do>`` for the first check field
    (:data:`kernels.protocol.call.CHECK_FIELDS`) in which two descriptors differ."""
    for i, name in enumerate(CHECK_FIELDS):
        a = int(mine[i]) if i < len(mine) else 0
        b = int(theirs[i]) if i < len(theirs) else 0
        if a != b:
            if name == "op":
                shown = (_OP_NAMES.get(a, str(a)), _OP_NAMES.get(b, "another op"))
            else:
                shown = (shown_check_word(name, a), shown_check_word(name, b))
            return f"rank {labels[0]} has {name}={shown[0]}, rank {labels[1]} has {name}={shown[1]}; {_HINTS[name]}"
    return "their call descriptors differ"


def _first_mismatch(op: str, group: dist.ProcessGroup, descriptors: Sequence[object]) -> str | None:
    labels = _labels(group)
    me = dist.get_rank(group)
    mine = descriptors[me]
    for peer, theirs in enumerate(descriptors):
        if peer != me and tuple(theirs) != tuple(mine):  # type: ignore[arg-type]
            return (
                f"fused {op}: ranks disagree: {_differences((labels[me], labels[peer]), mine, theirs)} (found at "  # type: ignore[arg-type]
                "the group's first fused call, before its heap was created; nothing was allocated and the group "
                "stays usable)"
            )
    return None


def _follow_last_call(heap: SymmetricHeap) -> None:
    """Queue the next call on ``heap`` behind the previous eager one, whatever stream either is on.

    The protocol's flow control is stream order: a call's check must follow the previous call's
    last launch, whose reduce may still read slots that peers overwrite once this check passes,
    and whose counter bank this check zeroes. Calls from one stream are ordered already; a call
    from another stream first waits for the previous call's. Inside capture no wait on an uncaptured
    stream is possible: replays must be ordered with the eager calls by the caller (docs/fused.md).
    """
    if heap.device.type != "cuda" or capturing(heap.device):
        return
    stream = torch.cuda.current_stream(heap.device)
    if heap.last_stream is not None and heap.last_stream != stream:
        stream.wait_stream(heap.last_stream)
    heap.last_stream = stream


def _open(op: str, heap: SymmetricHeap, descriptor: tuple[int, ...]) -> FusedCall:
    """The call check of the next call on ``heap`` queued (it advances the epoch on the device)."""
    _attach_record(heap)
    timeout = get_config().timeout
    use_globaltimer = heap.device.type == "cuda"
    # GPU spins read %globaltimer (ns); interpreter spins read the pad clock (ms).
    ticks = int(timeout * 1e9) if use_globaltimer else max(1, int(timeout * 1e3))
    heap.calls += 1
    if capturing(heap.device):
        # The graph will hold this heap's addresses: never free it while the graph may replay.
        heap.captured = True
    heap.arm_clock(True)
    _follow_last_call(heap)
    signals.check_call(heap, descriptor, (1 << len(descriptor)) - 1, ticks, use_globaltimer)
    return FusedCall(op, heap, descriptor, ticks, use_globaltimer)


def begin(
    op: str, group: dist.ProcessGroup, device: torch.device, data_bytes: int, descriptor: tuple[int, ...]
) -> FusedCall:
    """Open the next call on the group's heap: check it against every peer's, then grow the heap if needed.

    The heap is created (first call) with the descriptors exchanged alongside the handles, so ranks
    that disagree raise together before anything is allocated. Later calls compare descriptors in
    the check kernel; a call that needs a larger heap first waits for that verdict (growth
    synchronizes the device anyway), so no rank enters the growth collective unless every peer
    described the same call, which implies the same size. A failure recorded before the call is not
    raised here, on this rank alone: the call's admission reported what was visible then, and what a
    kernel records later is the next admission's (this call's kernels skip their work, outputs NaN); only
    the growth path raises its own check's failure (it must not enter the growth collective alone).
    """
    _warn_if_mps(device)
    words = signals.sig_words(dist.get_world_size(group))
    heap = peek_heap(group, device)
    if capturing(device):
        refuse_capture(op, heap, data_bytes)
    if heap is None:
        heap = get_heap(group, device, data_bytes, words, descriptor=descriptor, verdict=_verdict(op, group))
    call = _open(op, heap, descriptor)
    if heap.data_bytes < data_bytes:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # The check's verdict before the growth collective: a rank whose check failed (a peer absent, or another
        # call) must not enter it alone; its peers' checks of this epoch failed alike.
        raise_recorded(heap)
        # The call opened on the old heap ends with its check: mark it done there, so that a graph
        # replaying on the old heap (kept when captured) finds DONE of this epoch. get_heap
        # synchronizes before its collective, and a peer frees its old heap only after that
        # collective, so this rank's DONE stores land before any peer unmaps the old pads.
        signals.finish_call(heap, (), 1)
        heap.arm_clock(False)
        heap = get_heap(group, device, data_bytes, words, descriptor=descriptor, verdict=_verdict(op, group))
        call = _open(op, heap, descriptor)
    return call


@contextlib.contextmanager
def fused_call(
    op: str, group: dist.ProcessGroup, device: torch.device, data_bytes: int, descriptor: tuple[int, ...]
) -> Iterator[FusedCall]:
    """``begin`` ... ``finish`` around the launches of one fused call.

    The body sets ``call.outputs`` (the tensors it returns), which ``finish`` fills with NaN if a
    wait or the check failed. An exception between the launches (a compile error, an interrupt)
    still marks the call done: the next call of every peer starts by waiting for this rank's
    descriptor, queued after this ``DONE``, which would otherwise cost a timeout. The group stays
    usable: peers' increments for the abandoned call that arrive late count in its counter bank,
    not the next call's (:mod:`kernels.fused.signals`).
    """
    try:
        call = begin(op, group, device, data_bytes, descriptor)
    except CallMismatch as e:
        raise RuntimeError(str(e)) from None
    try:
        yield call
    except BaseException:
        try:
            signals.finish_call(call.heap, (), 1)
        finally:
            call.heap.arm_clock(False)
        raise
    finish(call, call.outputs)


def finish(call: FusedCall, outputs: Sequence[torch.Tensor | None] = ()) -> None:
    """Signal ``DONE`` (or poison ``outputs`` after a failure) and raise if a failure is already known."""
    heap = call.heap
    try:
        largest = max((o.numel() for o in outputs if o is not None), default=0)
        programs = 1 if triton_interpreted() else max(1, min(132, -(-largest // 1024)))
        signals.finish_call(heap, tuple(outputs), programs)
    finally:
        heap.arm_clock(False)
    raise_recorded(heap)


def _recorded(heap: SymmetricHeap) -> str | None:
    """The message of the failure recorded on ``heap`` and not raised yet, else None (a CPU read, no device sync)."""
    if heap.error_record is None or heap.closed or heap.failure_reported:
        return None
    view = heap.error_view
    code = int(view[signals.RECORD_CODE])
    if code == 0:
        return None
    n = len(CHECK_FIELDS)
    mine = [int(v) for v in view[signals.RECORD_MINE : signals.RECORD_MINE + n]]
    peer_words = [int(v) for v in view[signals.RECORD_DESC : signals.RECORD_DESC + n]]
    epoch, ticks = int(view[signals.RECORD_EPOCH]), int(view[signals.RECORD_TIMEOUT])
    return _message(heap, code, epoch, (mine, peer_words), ticks)


def _message(
    heap: SymmetricHeap, code: int, epoch: int, descriptors: tuple[Sequence[int], Sequence[int]], ticks: int
) -> str:
    """The error message of a recorded failure; ``descriptors``: this rank's and the peer's (mismatch)."""
    mine, peer_words = descriptors
    phase, peer = signals.decode_error(code, heap.world_size)
    op = _OP_NAMES.get(mine[CHECK_FIELDS.index("op")], "(an unknown op)")
    me = f"rank {heap.global_ranks[heap.rank]} (group rank {heap.rank})"
    them = f"rank {heap.global_ranks[peer]} (group rank {peer})"
    if phase == signals.MISMATCH:
        labels = (
            f"{heap.global_ranks[heap.rank]} (group rank {heap.rank})",
            f"{heap.global_ranks[peer]} (group rank {peer})",
        )
        return (
            f"fused {op}: ranks disagree: {_differences(labels, mine, peer_words)} (epoch {epoch}; found by the "
            "heap's call check before any data moved: no output of that call holds a result (NaN); every rank "
            "retires its heap at the next call's admission and the group goes on)"
        )
    # The bound the kernel ran with (a replayed graph keeps its capture's COC_TIMEOUT).
    timeout = ticks / (1e9 if heap.device.type == "cuda" else 1e3)
    what = signals.phase_text(op, phase)
    return (
        f"fused {op}: {me} waited more than COC_TIMEOUT={timeout:g} s for {them} to {what} (epoch {epoch}); "
        "the peer is dead, stuck, or did not make the same call"
    )


def raise_recorded(heap: SymmetricHeap) -> None:
    """Raise ``RuntimeError`` if a kernel recorded a failure on ``heap`` (a CPU read, no device sync).

    The heap is then retired on this rank (no longer used: its flags are inconsistent; kept mapped until
    ``kernels.heap.destroy_heap`` or exit, since a slow peer may still store into it), and the next fused
    call's admission has every rank of the group retire theirs too, so they build a new one together.
    """
    message = _recorded(heap)
    if message is None:
        return
    heap.failure_reported = True
    # Not freed, so no synchronization either (inside capture there could be none): kernels queued
    # after the failure and replays of a graph that captured a call on the heap still address it;
    # they find the error word set, skip their work and fill their outputs with NaN. The pad clock
    # of a call that raises here (growth path) would otherwise keep running until exit.
    heap.arm_clock(False)
    mark_failed(heap.group, heap.device, message)
    raise RuntimeError(message)


def check_errors(group: dist.ProcessGroup | None = None) -> None:
    """Raise the ``RuntimeError`` of a failed fused call not reported yet (on ``group``, or any group if None).

    Reads host memory only, so it never waits for the device: on a GPU it reports the failures of
    kernels that have run by now (after ``torch.cuda.synchronize()``: of every call made so far).
    """
    for heap in heaps_of(group):
        raise_recorded(heap)
