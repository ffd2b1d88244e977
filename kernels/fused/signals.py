"""Signals between ranks of a symmetric heap: layout of the pad, bounded waits, release stores.

Pad layout (int64 words of each rank's signal pad; ``W`` = world size)::

    word 0            clock (CPU heaps: ms since heap creation, written by a host thread)
    word 1            error code of this rank's first failed wait or check (0 = none), this rank only
    word 2            address of this rank's host error record (pinned host memory on GPU)
    word 3            epoch of this rank's call in progress: the number of calls made on this heap,
                      advanced on the device by the call check (below)
    word 4            the call's wait bound in clock ticks (error records carry it)
    MINE .. MINE + 15 this rank's descriptor of the call in progress (error records carry it)
    DONE  + src       epoch of the last call ``src`` finished (it no longer reads its heap for it)
    AG    + src * AG_MAX_SPLITS + c
                      epoch whose chunk ``c`` of its input shard ``src`` has pushed into this
                      rank's gather buffer
    RS    + (epoch % 2) * W + src
                      count of partial-product tiles ``src`` has pushed to this rank in call ``epoch``
    AR    + (epoch % 2) * W + src
                      count of reduced-row tiles ``src`` (their owner) has pushed here in ``epoch``
    DESC  + (src * 2 + epoch % 2) * DESC_SLOT
                      ``src``'s call descriptor for ``epoch``: word 0 the epoch (stored last, with
                      release), words 1.. the descriptor of :func:`kernels.protocol.check_words`

No kernel takes the epoch from the host, and the counter targets it takes are per-call tile counts
fixed by the shapes. The epoch lives in word 3: the call check, the first kernel of every call,
increments it and every later kernel of the call reads it there. The counters come in two banks
by epoch parity, and the call check of ``e`` zeroes this rank's bank ``e % 2``. So the launches of
a call are the same from one call to the next (same kernels, same arguments), and a CUDA graph
that captured them replays correctly any number of times, in stream order with eager calls on the
same heap.

``DONE``/``AG``/``DESC`` carry the epoch (the same on every rank, since every rank makes the same
calls) and are never reset. Every call starts with :func:`check_call`: each rank zeroes its own
counter bank of the call, stores its descriptor into every peer's pad and waits for every peer's descriptor of the
same epoch, so a rank passes the check of call ``e`` only once every peer has finished its
stream's work of call ``e - 1`` (its check kernel of ``e`` is queued after it). Nothing is pushed
into a peer before that, which is the whole flow control; there is no host barrier per call.

Why zeroing a bank neither loses an increment nor keeps a stale one: rank ``r`` zeroes bank
``e % 2`` in its check of ``e``; that bank last counted call ``e - 2``. Every peer ``p`` made its
increments of ``e - 2`` before its stream finished ``e - 2`` and so before it published its
descriptor of ``e - 1``, which ``r``'s check of ``e - 1`` acquired, earlier in ``r``'s stream than
the zeroing. This holds even when ``r``'s host abandoned call ``e - 1`` between launches (an
exception after its check), when the peers' increments of ``e - 1`` may still be arriving: they
go to the other bank. One bank would not do: a slow peer's late increment of ``e - 1`` could land
after the zero and satisfy a wait of ``e`` early. A peer increments bank ``e % 2`` for call ``e``
only after acquiring ``r``'s descriptor of ``e``, which ``r`` release-stores after the zeroing, so
every increment of ``e`` is ordered after the zero.

Why a descriptor slot is never overwritten before it is read: rank ``p`` writes its slot of parity
``e % 2`` in rank ``r``'s pad at epoch ``e``; that slot was last written at epoch ``e - 2``. ``p``
reaches epoch ``e`` only after passing its check of ``e - 1``, which needs ``r``'s descriptor of
``e - 1``, which ``r`` stores only after its check of ``e - 2`` (the one reading the slot) finished.

Every wait spins on this rank's own pad (peers write remotely, spins stay local) and gives up after
``timeout`` ticks: nanoseconds of ``%globaltimer`` on GPU, milliseconds of the pad clock under the
interpreter. A failed wait or check stores an error code naming the phase and the peer into word 1
(first failure wins) and into the host error record, which the host reads without synchronizing
(:mod:`kernels.fused.runtime`). Later waits see the error and return at once, later pushes and the
``DONE`` signal are skipped, and the outputs of the call are filled with NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Word 0 is the clock (``kernels.heap.shm.CLOCK_WORD``); the kernels address the header words
# directly, so these positions are fixed.
ERROR_WORD = 1
RECORD_WORD = 2
EPOCH_WORD = 3
TIMEOUT_WORD = 4
# Descriptor words the call check takes (kernels.protocol.call.CHECK_FIELDS, padded), and words per descriptor
# slot: the epoch and the descriptor words, rounded up to a power of two (one tl.arange, and one
# lane of the check's single warp per word).
DESC_WORDS = 17
DESC_SLOT = 32
# This rank's descriptor of the call in progress, laid out as a slot (word MINE_WORD unused).
MINE_WORD = 8
HEADER_WORDS = MINE_WORD + DESC_SLOT

CH_DONE = 0
CH_AG = 1
CH_RS = 2
CH_AR = 3
CH_DESC = 4
NUM_CHANNELS = 5
# Error codes are ``1 + peer + W * phase``; a descriptor that differs from this rank's is phase
# MISMATCH (no signal channel of that number exists).
MISMATCH = NUM_CHANNELS
# Most chunks an all-gather shard is split into (one flag each); the AG channel is this many
# times wider than the others.
AG_MAX_SPLITS = 8
# Host error record: code, epoch of the failed call, the peer's descriptor (mismatch only; word i
# of the slot at RECORD_DESC - 1 + i) and this rank's (at RECORD_MINE - 1 + i), which names the op.
RECORD_CODE, RECORD_EPOCH, RECORD_DESC = 0, 1, 2
RECORD_MINE = RECORD_DESC + DESC_SLOT
# The wait bound (clock ticks) the failed call ran with: a replayed graph keeps its capture's.
RECORD_TIMEOUT = RECORD_MINE + DESC_SLOT
RECORD_WORDS = RECORD_TIMEOUT + 1
# Upper bound of the spin back-off (ns): how late a waiter may notice a flag.
MAX_BACKOFF_NS = 512

# The same constants as seen from inside kernels (Triton reads only constexpr globals).
_ERROR = tl.constexpr(ERROR_WORD)
_RECORD = tl.constexpr(RECORD_WORD)
# The call check runs as one warp: see the epoch update in _check_call_kernel.
CHECK_CALL_WARPS = 1
_EPOCH = tl.constexpr(EPOCH_WORD)
_TIMEOUT = tl.constexpr(TIMEOUT_WORD)
_MINE = tl.constexpr(MINE_WORD)
_SLOT = tl.constexpr(DESC_SLOT)
_PHASE_DESC = tl.constexpr(CH_DESC)
_PHASE_MISMATCH = tl.constexpr(MISMATCH)
_REC_CODE = tl.constexpr(RECORD_CODE)
_REC_EPOCH = tl.constexpr(RECORD_EPOCH)
_REC_DESC = tl.constexpr(RECORD_DESC)
_REC_MINE = tl.constexpr(RECORD_MINE)
_REC_TIMEOUT = tl.constexpr(RECORD_TIMEOUT)
_MAX_BACKOFF = tl.constexpr(MAX_BACKOFF_NS)

PHASES = {
    CH_DONE: "finish its previous fused call",
    CH_AG: "push its input shard",
    CH_RS: "push its partial products",
    CH_AR: "push its reduced rows",
    CH_DESC: "publish its call descriptor (start the same fused call)",
}
# The ops whose channels carry something else than the dense patterns' (kernels.fused.moe_ep): a timeout names
# what the late peer had not done in that op, not in an all-gather or reduce-scatter it does not run.
OP_PHASES = {
    "moe_dispatch": {
        CH_AG: "publish its per-expert token counts",
        CH_RS: "write its tokens' rows into this rank's heap",
    },
    "moe_combine": {CH_RS: "publish its experts' output rows"},
}


def phase_text(op: str, phase: int) -> str:
    """What a peer had not done when a wait of ``op`` in ``phase`` timed out (the error message's words)."""
    return OP_PHASES.get(op, {}).get(phase) or PHASES.get(phase, f"signal phase {phase}")


def _channel_width(channel: int, world_size: int) -> int:
    if channel == CH_AG:
        return world_size * AG_MAX_SPLITS
    if channel == CH_DESC:
        return world_size * 2 * DESC_SLOT
    if channel in (CH_RS, CH_AR):
        return 2 * world_size  # two banks, by epoch parity
    return world_size


def sig_words(world_size: int) -> int:
    return HEADER_WORDS + sum(_channel_width(c, world_size) for c in range(NUM_CHANNELS))


def channel_offset(channel: int, world_size: int) -> int:
    return HEADER_WORDS + sum(_channel_width(c, world_size) for c in range(channel))


def decode_error(code: int, world_size: int) -> tuple[int, int]:
    """``(phase, peer)`` of an error code (kernels store ``1 + peer + world_size * phase``); phase is a
    channel for a timed-out wait, :data:`MISMATCH` for a peer whose descriptor differs."""
    return (code - 1) // world_size, (code - 1) % world_size


@triton.jit
def _now(clock_ptr, USE_GLOBALTIMER: tl.constexpr):
    if USE_GLOBALTIMER:
        t = tl.extra.cuda.globaltimer()
    else:
        t = tl.load(clock_ptr, volatile=True)
    return t


@triton.jit
def _sleep(ns):
    """``nanosleep`` (sm_70+): a spinning thread yields its issue slots to the SM's other warps."""
    tl.inline_asm_elementwise(
        "nanosleep.u32 $1;\n\tmov.u32 $0, 0;", "=r,r", [ns], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def peer_ptr(table_ptr, peer, ELEM: tl.constexpr):
    """Pointer to ``peer``'s region from an int64 address table, declared 16-byte aligned.

    Every table entry is a heap base (data region or signal pad): 2 MiB aligned on CUDA, page
    aligned on CPU (``kernels.heap``). Without the hint a pointer loaded from memory has alignment 1
    to the compiler, and every access through it is one element per instruction (no vector
    loads/stores, no cp.async pipelining of GEMM operands). Offsets added to it are analysed as
    usual, so an odd row length still yields narrow, correct accesses.
    """
    return tl.multiple_of(tl.load(table_ptr + peer).to(tl.pointer_type(ELEM)), 16)


@triton.jit
def claim_error(pad_ptr, code):
    """Store ``code`` in the error word unless an earlier failure did; True if this call stored it.

    The caller that wins completes the host record with :func:`publish_error` (after writing any
    extra words), so the record always describes the failure held by the error word.
    """
    zero = tl.full((), 0, tl.int64)
    # Only this GPU's kernels write the error word: GPU scope is enough. The returned value is
    # broadcast to every thread, so the caller's branch on it is uniform.
    old = tl.atomic_cas(pad_ptr + _ERROR, zero, zero + code, sem="relaxed", scope="gpu")
    return old == 0


@triton.jit
def publish_error(pad_ptr, code):
    """Write the epoch and this rank's descriptor of the call, then (release, system scope) the code,
    into the host error record: the host names the failed call from the record alone, so a call
    replayed from a CUDA graph, which the host never saw, is named as well as an eager one."""
    record = tl.load(pad_ptr + _RECORD).to(tl.pointer_type(tl.int64))
    tl.store(record + _REC_EPOCH, tl.load(pad_ptr + _EPOCH))
    tl.store(record + _REC_TIMEOUT, tl.load(pad_ptr + _TIMEOUT))
    idx = tl.arange(0, _SLOT)
    words = idx >= 1
    tl.store(record + _REC_MINE - 1 + idx, tl.load(pad_ptr + _MINE + idx, mask=words, other=0), mask=words)
    tl.debug_barrier()
    tl.atomic_xchg(record + _REC_CODE, tl.full((), 0, tl.int64) + code, sem="release", scope="sys")


@triton.jit
def call_epoch(pad_ptr):
    """The epoch of the call in progress, which its call check stored (stream order makes it visible)."""
    return tl.load(pad_ptr + _EPOCH)


@triton.jit
def counter(pad_ptr, offset, src, WORLD: tl.constexpr):
    """Offset of ``src``'s counter in this call's bank of the channel at ``offset`` (RS or AR)."""
    return offset + (call_epoch(pad_ptr) % 2) * WORLD + src


@triton.jit
def failed(pad_ptr):
    """Whether an earlier wait or check of this rank failed (uniform across the program's threads)."""
    return tl.atomic_add(pad_ptr + _ERROR, 0, sem="relaxed", scope="gpu") != 0


@triton.jit
def wait_signal(flag_ptr, target, pad_ptr, timeout, code, USE_GLOBALTIMER: tl.constexpr):
    """Spin until ``*flag_ptr >= target`` (acquire); False on timeout or an earlier error of this rank.

    The spin holds no barrier and no atomic: each thread polls the flag and the error word with
    volatile loads, reads its clock and (GPU) sleeps with an exponential back-off, and leaves on its
    own. Threads may leave at different iterations (their clocks differ by nanoseconds), which is
    harmless because nothing inside the loop synchronizes them. The verdict after the loop comes
    from one scalar acquire atomic on the flag and one relaxed atomic read of the error word (each
    executed once, broadcast to every thread, so the result and the branches on it are uniform):
    a flag at its target with the error word set is a failure too, so a rank whose call check
    failed stores nothing into peers. Only on a failure is the error word claimed with a
    compare-and-swap.
    """
    value = tl.load(flag_ptr, volatile=True)
    err = tl.load(pad_ptr + _ERROR, volatile=True)
    t0 = _now(pad_ptr, USE_GLOBALTIMER)
    alive = t0 == t0
    delay = tl.full((), 32, tl.int32)
    while (value < target) & (err == 0) & alive:
        if USE_GLOBALTIMER:
            _sleep(delay)
            delay = tl.minimum(delay * 2, _MAX_BACKOFF)
        value = tl.load(flag_ptr, volatile=True)
        err = tl.load(pad_ptr + _ERROR, volatile=True)
        alive = _now(pad_ptr, USE_GLOBALTIMER) - t0 < timeout
    ok = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys") >= target
    # A flag already at its target says nothing of this rank's own state: after a failed check (or
    # another program's timeout) the caller must not store into peers, whose previous call may still
    # be reading the slots or whose counter bank this call's check never saw zeroed.
    ok = ok & (failed(pad_ptr) == 0)
    if ok == 0:
        # A timeout, or an earlier failure of this rank (then the swap finds the word taken).
        if claim_error(pad_ptr, code):
            publish_error(pad_ptr, code)
    # Every thread of the program must see the data the flag guards, not only the one that acquired.
    tl.debug_barrier()
    return ok


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


@triton.jit(
    do_not_specialize=[
        "rank",
        "timeout",
        "must_agree",
        "d0",
        "d1",
        "d2",
        "d3",
        "d4",
        "d5",
        "d6",
        "d7",
        "d8",
        "d9",
        "d10",
        "d11",
        "d12",
        "d13",
        "d14",
        "d15",
        "d16",
    ]
)
def _check_call_kernel(
    sig_tab_ptr,
    rank,
    timeout: tl.int64,
    must_agree: tl.int64,
    d0: tl.int64,
    d1: tl.int64,
    d2: tl.int64,
    d3: tl.int64,
    d4: tl.int64,
    d5: tl.int64,
    d6: tl.int64,
    d7: tl.int64,
    d8: tl.int64,
    d9: tl.int64,
    d10: tl.int64,
    d11: tl.int64,
    d12: tl.int64,
    d13: tl.int64,
    d14: tl.int64,
    d15: tl.int64,
    d16: tl.int64,
    WORLD: tl.constexpr,
    DESC_LEN: tl.constexpr,
    DESC_OFFSET: tl.constexpr,
    COUNTERS_OFFSET: tl.constexpr,
    COUNTERS: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
):
    pad = peer_ptr(sig_tab_ptr, rank, tl.int64)
    # The epoch advances here, on the device, so a replayed graph advances it too. Every later
    # kernel of the call reads the word after this one finished (stream order). Within this launch
    # every thread loads the word and one thread stores it: the launch is one program of one warp
    # (CHECK_CALL_WARPS), and the barrier orders every lane's load before the store, so no lane can
    # read the advanced epoch and wait on the wrong descriptor slot. One warp also keeps the
    # mismatch sums below uniform: tl.sum is a warp shuffle there, so no lane branches apart.
    epoch = tl.load(pad + _EPOCH) + 1
    tl.debug_barrier()
    tl.store(pad + _EPOCH, epoch)
    tl.store(pad + _TIMEOUT, timeout)
    idx = tl.arange(0, _SLOT)
    words = (idx >= 1) & (idx <= DESC_LEN)
    mine = tl.zeros((_SLOT,), dtype=tl.int64)
    mine = tl.where(idx == 1, d0, mine)
    mine = tl.where(idx == 2, d1, mine)
    mine = tl.where(idx == 3, d2, mine)
    mine = tl.where(idx == 4, d3, mine)
    mine = tl.where(idx == 5, d4, mine)
    mine = tl.where(idx == 6, d5, mine)
    mine = tl.where(idx == 7, d6, mine)
    mine = tl.where(idx == 8, d7, mine)
    mine = tl.where(idx == 9, d8, mine)
    mine = tl.where(idx == 10, d9, mine)
    mine = tl.where(idx == 11, d10, mine)
    mine = tl.where(idx == 12, d11, mine)
    mine = tl.where(idx == 13, d12, mine)
    mine = tl.where(idx == 14, d13, mine)
    mine = tl.where(idx == 15, d14, mine)
    mine = tl.where(idx == 16, d15, mine)
    mine = tl.where(idx == 17, d16, mine)
    tl.store(pad + _MINE + idx, mine, mask=words)
    compared = words & (((must_agree >> tl.maximum(idx - 1, 0).to(tl.int64)) & 1) != 0)
    parity = epoch % 2
    if failed(pad) == 0:
        # This call's counter bank restarts at zero (the module docstring says why no increment is
        # lost or kept); the release of the descriptor below orders the zeroes before any peer's
        # increment. Lanes [0, W) are the RS bank, [W, 2W) the AR bank (channels 2W apart).
        lanes = tl.arange(0, COUNTERS)
        bank = COUNTERS_OFFSET + parity * WORLD + (lanes % WORLD) + (lanes // WORLD) * (2 * WORLD)
        tl.store(pad + bank, tl.zeros((COUNTERS,), dtype=tl.int64), mask=lanes < 2 * WORLD)
        for dst in tl.static_range(WORLD):
            if dst != rank:
                slot = peer_ptr(sig_tab_ptr, dst, tl.int64) + DESC_OFFSET + (rank * 2 + parity) * _SLOT
                tl.store(slot + idx, mine, mask=words)
                send_signal(slot, epoch)
        for src in tl.static_range(WORLD):
            if src != rank:
                slot = pad + DESC_OFFSET + (src * 2 + parity) * _SLOT
                if wait_signal(slot, epoch, pad, timeout, 1 + src + WORLD * _PHASE_DESC, USE_GLOBALTIMER):
                    theirs = tl.load(slot + idx, mask=words, other=0)
                    if tl.sum((compared & (theirs != mine)).to(tl.int32), axis=0) > 0:
                        code = 1 + src + WORLD * _PHASE_MISMATCH
                        if claim_error(pad, code):
                            record = tl.load(pad + _RECORD).to(tl.pointer_type(tl.int64))
                            tl.store(record + _REC_DESC - 1 + idx, theirs, mask=words)
                            publish_error(pad, code)


@triton.jit
def _poison(out_ptr, n, BLOCK: tl.constexpr, INTEGER: tl.constexpr):
    """``out[0:n]`` (the programs share it, strided) set to what no result holds, the same for each output of a
    failed call: all-ones bits for an ``INTEGER`` output, NaN for a float one (``_finish_call_kernel``)."""
    step = tl.num_programs(0) * BLOCK
    for start in range(tl.program_id(0) * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        if INTEGER:
            tl.store(out_ptr + offs, -1, mask=offs < n)
        else:
            tl.store(out_ptr + offs, float("nan"), mask=offs < n)


@triton.jit(do_not_specialize=["rank", "n0", "n1"])
def _finish_call_kernel(
    sig_tab_ptr,
    out0_ptr,
    n0,
    out1_ptr,
    n1,
    rank,
    WORLD: tl.constexpr,
    DONE_OFFSET: tl.constexpr,
    OUTPUTS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTEGER0: tl.constexpr,
    INTEGER1: tl.constexpr,
):
    # INTEGER0, INTEGER1: out0, out1 is an integer output (packed FP8 rows and their scales travel as bytes): it
    # gets all-ones bits, a NaN in every float format a byte row unpacks to (fp32, e4m3fn, e5m2); a float one NaN.
    pid = tl.program_id(0)
    pad = peer_ptr(sig_tab_ptr, rank, tl.int64)
    epoch = call_epoch(pad)
    if failed(pad):
        # A wait or the check failed: no peer may be told this rank is done (it skipped pushes
        # peers count on), and no output may look like a result.
        if OUTPUTS > 0:
            _poison(out0_ptr, n0, BLOCK, INTEGER0)
            if OUTPUTS > 1:
                _poison(out1_ptr, n1, BLOCK, INTEGER1)
    elif pid == 0:
        for dst in tl.static_range(WORLD):
            send_signal(peer_ptr(sig_tab_ptr, dst, tl.int64) + DONE_OFFSET + rank, epoch)


def check_call(heap, descriptor: tuple[int, ...], must_agree: int, timeout: int, use_globaltimer: bool) -> None:
    """Advance the heap's epoch, zero this rank's counters, publish this rank's descriptor to every
    peer and compare theirs (one program)."""
    w = heap.world_size
    if len(descriptor) > DESC_WORDS:
        raise ValueError(f"descriptor: {len(descriptor)} words, the check kernel takes at most {DESC_WORDS}")
    # RS and AR are adjacent channels of two banks each: one masked store zeroes a bank of both.
    assert channel_offset(CH_AR, w) == channel_offset(CH_RS, w) + 2 * w
    _check_call_kernel[(1,)](
        heap.sig_ptrs,
        heap.rank,
        timeout,
        must_agree,
        # Unused words are padding (DESC_LEN masks them out of the slot).
        *descriptor,
        *([0] * (DESC_WORDS - len(descriptor))),
        WORLD=w,
        DESC_LEN=len(descriptor),
        DESC_OFFSET=channel_offset(CH_DESC, w),
        COUNTERS_OFFSET=channel_offset(CH_RS, w),
        COUNTERS=triton.next_power_of_2(2 * w),
        USE_GLOBALTIMER=use_globaltimer,
        num_warps=CHECK_CALL_WARPS,
    )


_SIGNED = {torch.uint8: torch.int8}


def finish_call(heap, outputs: tuple, programs: int) -> None:
    """Signal ``DONE = epoch`` to every rank, or, if a wait or the check of this rank failed, skip
    that and fill ``outputs`` (contiguous tensors, at most two) with NaN, an integer one with all-ones bits (-1;
    as bytes, NaN in fp32, e4m3fn and e5m2)."""
    w = heap.world_size
    outs = [o for o in outputs if o is not None and o.numel() > 0]
    # Signed views: -1 is then all ones in the output's own width.
    outs = [o.view(_SIGNED[o.dtype]) if o.dtype in _SIGNED else o for o in outs]
    integer = tuple(not o.is_floating_point() for o in outs) + (False,) * (2 - len(outs))
    if len(outs) > 2:
        raise ValueError(f"outputs: at most 2 tensors, got {len(outs)}")
    padded = outs + [heap.sig_ptrs] * (2 - len(outs))
    sizes = [o.numel() for o in outs] + [0] * (2 - len(outs))
    _finish_call_kernel[(programs,)](
        heap.sig_ptrs,
        padded[0],
        sizes[0],
        padded[1],
        sizes[1],
        heap.rank,
        WORLD=w,
        DONE_OFFSET=channel_offset(CH_DONE, w),
        OUTPUTS=len(outs),
        BLOCK=1024,
        INTEGER0=integer[0],
        INTEGER1=integer[1],
    )
