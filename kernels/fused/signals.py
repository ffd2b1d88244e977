"""Signals between ranks of a symmetric heap: layout of the pad, bounded waits, release stores.

Pad layout (int64 words of each rank's signal pad; ``W`` = world size)::

    word 0            clock (CPU heaps: ms since heap creation, written by a host thread)
    word 1            error code of this rank's last failed wait (0 = none), written by this rank only
    DONE  + src       epoch of the last call ``src`` finished (it no longer reads its heap for it)
    AG    + src * AG_MAX_SPLITS + c
                      epoch whose chunk ``c`` of its input shard ``src`` has pushed into this
                      rank's gather buffer
    RS    + src       cumulative count of partial-product tiles ``src`` has pushed to this rank
    AR    + src       cumulative count of reduced-row tiles ``src`` (their owner) has pushed here

Flags are never reset: ``DONE``/``AG`` carry the call's epoch (``heap.epoch``, the same on every
rank) and ``RS``/``AR`` are counters whose cumulative target every rank computes from the shapes.
A writer pushes into a peer's heap for call ``e`` only after seeing the peer's ``DONE >= e - 1``,
so a fast rank can never overwrite data or flags a slow peer is still reading (no host barrier).

Every wait spins on this rank's own pad (peers write remotely, spins stay local) with acquire
loads and gives up after ``timeout`` ticks: nanoseconds of ``%globaltimer`` on GPU, milliseconds of
the pad clock under the interpreter. A timed-out wait stores an error code naming the phase and
the peer into word 1; later waits see the error and return at once, so a dead peer costs one
timeout, not one per wait. The host reads word 1 after the call and raises.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Word 0 is the clock (``kernels.heap.shm.CLOCK_WORD``); the kernels address words 0 and 1 of the
# pad directly, so these two positions are fixed.
ERROR_WORD = 1
HEADER_WORDS = 8

CH_DONE = 0
CH_AG = 1
CH_RS = 2
CH_AR = 3
NUM_CHANNELS = 4
# Most chunks an all-gather shard is split into (one flag each); the AG channel is this many
# times wider than the others.
AG_MAX_SPLITS = 8

PHASES = {
    CH_DONE: "finish its previous fused call",
    CH_AG: "push its input shard",
    CH_RS: "push its partial products",
    CH_AR: "push its reduced rows",
}


def _channel_width(channel: int, world_size: int) -> int:
    return world_size * (AG_MAX_SPLITS if channel == CH_AG else 1)


def sig_words(world_size: int) -> int:
    return HEADER_WORDS + sum(_channel_width(c, world_size) for c in range(NUM_CHANNELS))


def channel_offset(channel: int, world_size: int) -> int:
    return HEADER_WORDS + sum(_channel_width(c, world_size) for c in range(channel))


def decode_error(code: int, world_size: int) -> tuple[int, int]:
    """``(channel, peer)`` of an error code stored by :func:`wait_signal` (kernels store
    ``1 + peer + world_size * channel``)."""
    return (code - 1) // world_size, (code - 1) % world_size


@triton.jit
def _now(clock_ptr, USE_GLOBALTIMER: tl.constexpr):
    if USE_GLOBALTIMER:
        t = tl.extra.cuda.globaltimer()
    else:
        t = tl.load(clock_ptr, volatile=True)
    return t


@triton.jit
def peer_ptr(table_ptr, peer, ELEM: tl.constexpr):
    """Pointer to ``peer``'s region from an int64 address table."""
    return tl.load(table_ptr + peer).to(tl.pointer_type(ELEM))


@triton.jit
def wait_signal(flag_ptr, target, pad_ptr, timeout, code, USE_GLOBALTIMER: tl.constexpr):
    """Spin until ``*flag_ptr >= target`` (acquire); False on timeout or an earlier error of this rank.

    Every value that decides the loop comes from a scalar atomic, which Triton executes on one
    thread and broadcasts, so all threads of the program leave the loop together (a thread left
    behind would deadlock on the broadcasts' barriers). The clock is read per thread and only
    decides what the compare-and-swap on the error word writes: the broadcast result of that swap
    ends the loop one iteration later, uniformly.
    """
    err_ptr = pad_ptr + 1
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    err = tl.atomic_add(err_ptr, 0, sem="relaxed", scope="sys")
    t0 = _now(pad_ptr, USE_GLOBALTIMER)
    zero = err * 0
    while (value < target) & (err == 0):
        value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        expired = (_now(pad_ptr, USE_GLOBALTIMER) - t0 >= timeout) & (value < target)
        # The first failure wins (compare with 0), so the host names the peer actually missing.
        # atomic_cas does not convert its operands, hence int64 ones built from ``zero``.
        err = tl.atomic_cas(err_ptr, zero, tl.where(expired, zero + code, zero), sem="relaxed", scope="sys")
    # Every thread of the program must see the data the flag guards, not only the one that spun.
    tl.debug_barrier()
    return value >= target


@triton.jit
def send_signal(flag_ptr, value):
    """Release-store ``value``: all stores this program made before become visible first."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def add_signal(flag_ptr, increment):
    """Release-add ``increment`` (counter flags)."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, increment, sem="release", scope="sys")


@triton.jit
def _wait_all_kernel(sig_tab_ptr, rank, offset, target, timeout, channel,
                     WORLD: tl.constexpr, USE_GLOBALTIMER: tl.constexpr):
    pad = peer_ptr(sig_tab_ptr, rank, tl.int64)
    for src in tl.static_range(WORLD):
        if src != rank:
            wait_signal(pad + offset + src, target, pad, timeout, 1 + src + WORLD * channel, USE_GLOBALTIMER)


@triton.jit
def _signal_all_kernel(sig_tab_ptr, index, offset, value, WORLD: tl.constexpr):
    for dst in tl.static_range(WORLD):
        pad = peer_ptr(sig_tab_ptr, dst, tl.int64)
        send_signal(pad + offset + index, value)


def wait_all(heap, channel: int, target: int, timeout: int, use_globaltimer: bool) -> None:
    """Wait (in a one-program kernel) until every peer's ``channel`` flag in this pad reaches ``target``."""
    w = heap.world_size
    _wait_all_kernel[(1,)](heap.sig_ptrs, heap.rank, channel_offset(channel, w), target, timeout, channel,
                           WORLD=w, USE_GLOBALTIMER=use_globaltimer)


def signal_all(heap, channel: int, value: int, index: int | None = None) -> None:
    """Release-store ``value`` into flag ``index`` (default: this rank's) of ``channel`` on every rank."""
    w = heap.world_size
    index = heap.rank if index is None else index
    _signal_all_kernel[(1,)](heap.sig_ptrs, index, channel_offset(channel, w), value, WORLD=w)
