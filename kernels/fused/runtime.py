"""Host-side plumbing shared by the fused ops: group, heap and epoch per call, timeout, error check."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from ..checks import group_size
from ..config import get_config
from ..heap import SymmetricHeap, destroy_heap, get_heap
from . import signals


def resolve_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def world_size(group: Optional[dist.ProcessGroup]) -> int:
    """Size of ``group``; 1 without torch.distributed initialized (api.md: W == 1 needs no process group)."""
    return group_size(group)


def triton_interpreted() -> bool:
    """Whether Triton kernels run through the interpreter (decided when triton.jit decorated them)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass
class FusedCall:
    """One fused call on a heap: its epoch and the spin bound in the kernels' clock ticks."""

    op: str
    heap: SymmetricHeap
    epoch: int
    timeout_s: float
    timeout_ticks: int
    use_globaltimer: bool

    @property
    def rank(self) -> int:
        return self.heap.rank

    @property
    def world_size(self) -> int:
        return self.heap.world_size


# Groups on which a fused wait timed out, with the error (the group is kept alive so its id is not
# reused). After a timeout the ranks no longer agree on how many fused calls they have made: the
# one that gave up drops its heap and would rebuild it at its next call, pairing that heap-creation
# collective with a peer's later call. Failing every further call on the group keeps that from
# ever silently mixing two calls' data.
_FAILED_GROUPS: dict[int, tuple[dist.ProcessGroup, str]] = {}


def begin(op: str, group: dist.ProcessGroup, device: torch.device, data_bytes: int) -> FusedCall:
    """Get (or grow) the group's heap for ``data_bytes`` and open the next epoch on it."""
    failed = _FAILED_GROUPS.get(id(group))
    if failed is not None and failed[0] is group:
        raise RuntimeError(f"fused {op}: an earlier fused call on this process group timed out ({failed[1]}); "
                           "its ranks no longer agree on the call sequence, so the fused path refuses the group. "
                           "Create a new process group (or restart the job) to use it again")
    world = dist.get_world_size(group)
    heap = get_heap(group, device, data_bytes, signals.sig_words(world))
    timeout = get_config().timeout
    use_globaltimer = device.type == "cuda"
    # GPU spins read %globaltimer (ns); interpreter spins read the pad clock (ms).
    ticks = int(timeout * 1e9) if use_globaltimer else max(1, int(timeout * 1e3))
    heap.arm_clock(True)
    return FusedCall(op, heap, heap.next_epoch(), timeout, ticks, use_globaltimer)


@contextlib.contextmanager
def fused_call(op: str, group: dist.ProcessGroup, device: torch.device, data_bytes: int) -> Iterator[FusedCall]:
    """``begin`` ... ``finish`` around the launches of one fused call.

    An exception between them (a compile error, an interrupt) still marks the call done: the
    next call of every peer starts by waiting for this rank's ``DONE >= epoch``, which would
    otherwise never come and turn one failed call into a timeout of the next. The heap is kept,
    so its epochs stay in step with the peers'.
    """
    call = begin(op, group, device, data_bytes)
    try:
        yield call
    except BaseException:
        try:
            signals.signal_all(call.heap, signals.CH_DONE, call.epoch)
        finally:
            call.heap.arm_clock(False)
        raise
    finish(call)


def finish(call: FusedCall) -> None:
    """Tell every peer this rank is done with the call's heap regions, then raise if any wait timed out."""
    try:
        signals.signal_all(call.heap, signals.CH_DONE, call.epoch)
        check(call)
    finally:
        call.heap.arm_clock(False)


def check(call: FusedCall) -> None:
    """Raise ``RuntimeError`` naming op, rank and peer if a wait of this call timed out (syncs on GPU)."""
    heap = call.heap
    code = int(heap.sig_view(heap.rank)[signals.ERROR_WORD].item())
    if code == 0:
        return
    channel, peer = signals.decode_error(code, heap.world_size)
    message = (
        f"fused {call.op}: rank {heap.global_ranks[heap.rank]} (group rank {heap.rank}) waited more than "
        f"COC_TIMEOUT={call.timeout_s:g} s for rank {heap.global_ranks[peer]} (group rank {peer}) to "
        f"{signals.PHASES.get(channel, f'signal channel {channel}')} (epoch {call.epoch}); "
        f"the peer is dead, stuck, or did not make the same call")
    # The flags of a heap whose peer vanished mid-call are inconsistent: free its memory now.
    destroy_heap(heap.group, heap.device)
    _FAILED_GROUPS[id(heap.group)] = (heap.group, message)
    raise RuntimeError(message)


def push_signal(call: FusedCall, channel: int, value: int, stream: Optional[torch.cuda.Stream] = None,
                index: Optional[int] = None) -> None:
    """Set flag ``index`` (default: this rank's) of ``channel`` to ``value`` on every rank, after the
    data pushed before it.

    On GPU the flag is a host-to-device copy from pinned memory on ``stream``, queued behind the data
    copies, so it needs the copy engine only and never an SM the spinning GEMM may hold. On CPU the
    copies before it are synchronous and a one-program kernel does release stores.
    """
    heap = call.heap
    index = heap.rank if index is None else index
    if heap.device.type != "cuda":
        signals.signal_all(heap, channel, value, index)
        return
    src = torch.tensor([value], dtype=torch.int64).pin_memory()
    offset = signals.channel_offset(channel, heap.world_size) + index
    with torch.cuda.stream(stream):
        for dst in range(heap.world_size):
            # The pinned allocator records an event on this stream, so ``src`` outlives the copy.
            heap.sig_view(dst)[offset:offset + 1].copy_(src, non_blocking=True)
