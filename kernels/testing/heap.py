"""Heap set-up for correctness checks: presize it, and scramble its data before a call.

A fused call that reads a peer's slot before the peer wrote it returns stale bytes. Scrambling the
heap with random values before each call turns such a read into a wrong result (a fresh or reused
heap could hold the right values by accident), and presizing keeps a call from growing (and
zeroing) the heap the scramble filled.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def heap_device(device: str | torch.device) -> torch.device:
    """The key the ops' heap is cached under: ``x.device``, which for CUDA always carries its index
    (a bare ``"cuda"`` would find, and scramble, no heap or a different one)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def presize(group: Any, device: str | torch.device, nbytes: int = 1 << 20) -> None:
    """Create ``group``'s heap on ``device`` with ``nbytes`` of data (collective over the group)."""
    from kernels.fused import signals
    from kernels.heap import get_heap

    get_heap(group, heap_device(device), nbytes, signals.sig_words(dist.get_world_size(group)))


def scramble(group: Any, device: str | torch.device) -> int:
    """Fill this rank's heap data with random values; the bytes scrambled (0: no heap yet).

    Collective: the barriers keep every peer out of the heap meanwhile, none still in the previous
    call, none starting the next before all have scrambled.
    """
    from kernels.heap import peek_heap

    dev = heap_device(device)
    dist.barrier(group)
    heap = peek_heap(group, dev)
    if heap is not None:
        heap.data_view(heap.rank, torch.float32, (heap.data_bytes // 4,)).normal_()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    dist.barrier(group)
    return 0 if heap is None else heap.data_bytes
