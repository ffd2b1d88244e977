"""Symmetric heap: one same-sized buffer plus a signal pad per rank of a process group.

Every rank of a group allocates ``data_bytes + sig_bytes`` bytes, the handles are exchanged once with
``torch.distributed.all_gather_object`` and every rank maps every peer's allocation. The result is

* ``data_ptrs`` / ``sig_ptrs``: int64 tensors ``[W]`` on the buffers' device holding each rank's base
  address as seen from this process (what the Triton kernels index);
* ``data_view(peer, dtype, shape, offset)`` / ``sig_view(peer)``: torch tensors over peer memory
  (what host-side copies use).

Backends: :mod:`kernels.heap.shm` (POSIX shared memory, CPU tensors, used under ``TRITON_INTERPRET=1``)
and :mod:`kernels.heap.cuda_ipc` (CuPy CUDA IPC handles). Heaps are cached per (group, device) and
grown on demand by :func:`get_heap`; growth is collective, so every rank must request sizes derived
from shapes all ranks share (which the fused ops do: their sizes depend only on the global shapes).
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist

from .base import CallMismatch, SymmetricHeap, Verdict, cupy_install_hint, import_cupy

__all__ = [
    "SymmetricHeap",
    "CallMismatch",
    "get_heap",
    "peek_heap",
    "heaps_of",
    "retire_heap",
    "group_health",
    "heap_bytes",
    "mark_failed",
    "reset_group",
    "destroy_heap",
    "destroy_all_heaps",
    "cupy_install_hint",
    "import_cupy",
]


_HEAPS: dict[tuple[int, str], tuple[object, SymmetricHeap]] = {}
# Heaps dropped after a failed call (a slow peer may still store into them), or grown while a CUDA
# graph may still replay launches that address them (``SymmetricHeap.captured``): kept mapped, and
# still read by ``heaps_of`` so a replayed call's failure is reported, until destroy_heap /
# destroy_all_heaps frees them.
_RETIRED: list[tuple[object, SymmetricHeap]] = []
# Groups (and devices) whose heap this rank retired after a failure it raised: the next admission of a fused call
# on the group has every rank retire its heap too, so the ranks rebuild together (kernels.protocol.admission).
_FAILED: dict[tuple[int, str], tuple[object, str]] = {}
HEALTHY, FAILED, RETIRED = 0, 1, 2


def _key(group: dist.ProcessGroup, device: torch.device) -> tuple[int, str]:
    # ProcessGroup objects are not weak-referenceable; the group is kept alive in the cache entry
    # so its id cannot be reused by another group while the heap exists.
    return id(group), str(device)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def peek_heap(group: dist.ProcessGroup, device: torch.device) -> SymmetricHeap | None:
    """The cached heap of ``group`` on ``device`` or None (no collective)."""
    entry = _HEAPS.get(_key(group, device))
    return None if entry is None else entry[1]


def heaps_of(group: dist.ProcessGroup | None) -> list[SymmetricHeap]:
    """The cached heaps of ``group`` on every device (of every group when None), then its retired
    heaps; no collective."""
    current = [heap for (gid, _), (_, heap) in list(_HEAPS.items()) if group is None or gid == id(group)]
    return current + [heap for g, heap in _RETIRED if group is None or g is group]


def _drop(group: object, heap: SymmetricHeap) -> None:
    """Free ``heap``, or retire it if a CUDA graph captured calls on it."""
    if heap.captured:
        _RETIRED.append((group, heap))
    else:
        heap.close()


def get_heap(
    group: dist.ProcessGroup,
    device: torch.device,
    data_bytes: int,
    sig_words: int,
    *,
    descriptor: object = None,
    verdict: Verdict | None = None,
) -> SymmetricHeap:
    """The group's heap on ``device`` with at least ``data_bytes`` of data and ``sig_words`` int64 flags.

    Collective only when the heap is created or grown: every rank of ``group`` must call with the
    same sizes in the same order. Growth at least doubles, so a sequence of growing shapes costs a
    logarithmic number of collectives. A grown heap starts with zeroed signal pads: its epoch (held
    in the pad, :mod:`kernels.fused.signals`) restarts at zero on every rank at once.

    ``descriptor`` travels with the handle exchange; ``verdict`` judges every rank's and a
    disagreement raises :class:`CallMismatch` on every rank before anything is mapped (the heap
    is then neither created nor grown, and the old one stays).
    """
    key = _key(group, device)
    entry = _HEAPS.get(key)
    old = None if entry is None else entry[1]
    if old is not None and old.data_bytes >= data_bytes and old.sig_words >= sig_words:
        return old
    align = (1 << 21) if device.type == "cuda" else 4096
    size = _round_up(max(data_bytes, 2 * old.data_bytes if old is not None else 0, align), align)
    words = max(sig_words, old.sig_words if old is not None else 0)
    if old is not None and device.type == "cuda":
        # In-flight kernels of the previous call may still touch the old heap; the collective in
        # the constructor below then tells every rank that all peers are past that point too.
        torch.cuda.synchronize(device)
    if device.type == "cuda":
        from .cuda_ipc import CudaIpcHeap

        heap: SymmetricHeap = CudaIpcHeap(group, device, size, words, descriptor=descriptor, verdict=verdict)
    elif device.type == "cpu":
        from .shm import ShmHeap

        heap = ShmHeap(group, device, size, words, descriptor=descriptor, verdict=verdict)
    else:
        raise ValueError(f"device: no symmetric heap backend for device type {device.type!r}")
    _HEAPS[key] = (group, heap)
    if old is not None:
        _drop(group, old)
    return heap


def _ours(group: dist.ProcessGroup, device: torch.device | None, gid: int, dev: str) -> bool:
    return gid == id(group) and (device is None or dev == str(device))


def retire_heap(group: dist.ProcessGroup, device: torch.device) -> None:
    """Stop using the heap of ``group`` on ``device`` but keep it mapped (retired) until
    :func:`destroy_heap` or exit. Local, no collective.

    The fused path's teardown after a failed call: a peer that is slow rather than gone may still
    store into this rank's memory (its call check passed before this rank gave up), and freeing
    memory that a peer still maps is undefined behaviour in CUDA; a graph that captured a call on
    the heap may still be replayed (its calls then find the failure and skip their work).
    """
    for key in list(_HEAPS):
        if _ours(group, device, *key):
            _RETIRED.append(_HEAPS.pop(key))


def group_health(group: dist.ProcessGroup | None, device: torch.device) -> tuple[int, str]:
    """This rank's state of ``group``'s heap on ``device``, for the admission: ``(HEALTHY, "")`` (or no heap);
    ``(FAILED, message)``: the kernels recorded a failure the host has not raised yet (a GPU learns of it after
    the call returned); ``(RETIRED, message)``: this rank retired the heap after raising a failure. Local."""
    group = group if group is not None else dist.group.WORLD
    for heap in _heaps_on(group, device):
        message = heap.unreported_failure()
        if message is not None:
            return FAILED, message
    failed = _FAILED.get(_key(group, device))
    return (RETIRED, failed[1]) if failed is not None else (HEALTHY, "")


def heap_bytes(group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The data bytes of ``group``'s live heap on ``device``, 0 without one: what every rank of the group must hold
    alike before a fused call (the admission compares it, :mod:`kernels.protocol.admission`). Local."""
    heap = peek_heap(group if group is not None else dist.group.WORLD, device)
    return 0 if heap is None else heap.data_bytes


def _heaps_on(group: dist.ProcessGroup, device: torch.device) -> list[SymmetricHeap]:
    """The live and retired heaps of ``group`` on ``device`` (a retired one may still record a failure: a kernel
    running late, a replayed CUDA graph)."""
    return [heap for heap in heaps_of(group) if str(heap.device) == str(device)]


def mark_failed(group: dist.ProcessGroup, device: torch.device, message: str) -> None:
    """Retire ``group``'s heap on ``device`` after this rank raised ``message``, and remember it for the next
    admission (:func:`group_health`). Local."""
    retire_heap(group, device)
    _FAILED[_key(group, device)] = (group, message)


def reset_group(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Retire ``group``'s heap on ``device`` (kept mapped) and forget its failure: what every rank does at the same
    admission, so that the next fused call creates a new heap on every rank at once. Local."""
    group = group if group is not None else dist.group.WORLD
    retire_heap(group, device)
    # Every rank raised or saw what the group's heaps recorded at this admission: not raised again.
    for heap in _heaps_on(group, device):
        heap.failure_reported = True
    _FAILED.pop(_key(group, device), None)


def destroy_heap(group: dist.ProcessGroup, device: torch.device | None = None) -> None:
    """Unmap and free the heap(s) of ``group`` (all devices when ``device`` is None), retired ones
    included. Local, no collective.

    Safe only when no peer will write into this rank's memory anymore (e.g. after a barrier, or
    once the peers are gone), and no CUDA graph that captured a call on the group will be replayed.
    """
    for key in list(_HEAPS):
        if _ours(group, device, *key):
            _HEAPS.pop(key)[1].close()
    for entry in [e for e in _RETIRED if _ours(group, device, id(e[0]), str(e[1].device))]:
        _RETIRED.remove(entry)
        entry[1].close()
    for key in [k for k in _FAILED if _ours(group, device, *k)]:
        del _FAILED[key]


def destroy_all_heaps() -> None:
    """Free every cached and retired heap of this process (registered at exit)."""
    while _HEAPS:
        _HEAPS.popitem()[1][1].close()
    while _RETIRED:
        _RETIRED.pop()[1].close()
    _FAILED.clear()


atexit.register(destroy_all_heaps)
