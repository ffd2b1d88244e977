"""The backend-independent part of a symmetric heap: peer tables, views and per-call bookkeeping."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

# Judges the descriptors every rank brought to a heap's creation: None when they agree, else the
# error message (the same on every rank, since every rank judges the same gathered list).
Verdict = Callable[[Sequence[object]], str | None]


def cupy_install_hint() -> str:
    """How to install the CuPy wheel matching torch's CUDA (CuPy ships one wheel per CUDA major)."""
    major = (torch.version.cuda or "12").split(".")[0]
    extra = "cuda13" if major == "13" else "cuda12"
    return f"pip install coc-overlap[{extra}] (CuPy for CUDA {major}: cupy-cuda{major}x)"


def import_cupy() -> Any:
    """``cupy`` from whichever wheel provides it (cupy-cuda12x or -13x); else an ImportError naming the wheel."""
    try:
        import cupy
    except ImportError as e:
        raise ImportError(f"CUDA IPC heaps need CuPy: {cupy_install_hint()}") from e
    return cupy


class CallMismatch(RuntimeError):
    """The ranks creating a heap described different calls; every rank raised it, nothing was created."""


class SymmetricHeap:
    """Mapped buffers of every rank of ``group``; a backend fills :attr:`_raw` and calls :meth:`_finish`.

    Each rank's allocation is ``data_bytes`` of data followed by ``sig_words`` int64 signal words,
    zeroed. The call epoch lives in the signal pad, on the device (:mod:`kernels.fused.signals`);
    ``calls`` counts only the calls the host opened on the heap (a replayed CUDA graph opens none).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, data_bytes: int, sig_words: int):
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self.data_bytes = data_bytes
        self.sig_words = sig_words
        self.calls = 0
        # Set once a call on this heap was captured into a CUDA graph: the graph holds its raw
        # addresses, so growth retires it (kept mapped) instead of freeing it (a failure retires
        # every heap).
        self.captured = False
        # Set once the fused path raised the failure recorded on this heap (a retired captured
        # heap stays readable by check_errors, which must not raise it again).
        self.failure_reported = False
        self.closed = False
        # The CUDA stream of the last eager fused call on this heap (kernels.fused.runtime orders the
        # next call after it when it comes from another stream).
        self.last_stream: torch.cuda.Stream | None = None
        # Host memory the kernels write a failure into (set up by the heap's user, see kernels.fused.runtime).
        self.error_record: torch.Tensor | None = None
        self.error_view: object | None = None
        # The message of a failure the kernels recorded and the host has not raised yet, else None: installed by
        # the heap's user (kernels.fused.runtime), which knows the record's layout; read by every call's admission.
        self.unreported_failure: Callable[[], str | None] = lambda: None
        self._raw: list[torch.Tensor] = []
        self.data_ptrs = torch.empty(0, dtype=torch.int64)
        self.sig_ptrs = torch.empty(0, dtype=torch.int64)

    @property
    def total_bytes(self) -> int:
        return self.data_bytes + 8 * self.sig_words

    def judge(self, infos: Sequence[tuple], verdict: Verdict | None) -> None:
        """Raise :class:`CallMismatch` if the gathered ``infos`` (each rank's ``(host, handle, descriptor,
        (data_bytes, sig_words))``) disagree: ``verdict`` on the descriptors, then the sizes.

        Called by every rank right after the handle exchange, before anything is mapped or a second
        collective is entered, so all ranks raise at the same point and none is left waiting. A heap whose
        ranks hold different sizes must never be made: the next call that fits on one rank and not on another
        would send one rank alone into the growth collective while its peers wait in a kernel.
        """
        message = verdict([info[2] for info in infos]) if verdict is not None else None
        if message is not None:
            raise CallMismatch(message)
        sizes = [info[3] for info in infos]
        if any(size != sizes[0] for size in sizes):
            ranks = zip(self.global_ranks, sizes, strict=True)
            shown = ", ".join(f"rank {r}: {d} data bytes, {w} signal words" for r, (d, w) in ranks)
            raise CallMismatch(
                f"symmetric heap: the ranks asked for heaps of different sizes ({shown}); a fused op sized its heap "
                "from a rank's own shapes, where every rank must ask for the same"
            )

    def exchanged(self, handle: object, descriptor: object) -> tuple:
        """This rank's entry of the handle exchange (what :meth:`judge` reads)."""
        return (socket.gethostname(), handle, descriptor, (self.data_bytes, self.sig_words))

    def _finish(self, raw: list[torch.Tensor]) -> None:
        """Take the per-rank uint8 views (``total_bytes`` each) and build the pointer tables."""
        self._raw = raw
        base = [t.data_ptr() for t in raw]
        self.data_ptrs = torch.tensor(base, dtype=torch.int64).to(self.device)
        self.sig_ptrs = torch.tensor([p + self.data_bytes for p in base], dtype=torch.int64).to(self.device)

    def data_view(self, peer: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """``peer``'s data region from byte ``offset`` as a tensor of ``shape``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        end = offset + numel * itemsize
        if offset % itemsize or end > self.data_bytes:
            raise ValueError(
                f"data_view: {numel} x {dtype} at offset {offset} does not fit the heap ({self.data_bytes} bytes)"
            )
        return self._raw[peer][offset:end].view(dtype).view(shape)

    def sig_view(self, peer: int) -> torch.Tensor:
        """``peer``'s signal pad as an int64 tensor ``[sig_words]``."""
        return self._raw[peer][self.data_bytes : self.total_bytes].view(torch.int64)

    def arm_clock(self, on: bool) -> None:
        """Keep the pad clock running (``on``) for the duration of a call; GPU kernels use
        ``%globaltimer`` and need no clock, so this does nothing unless a backend overrides it."""

    def close(self) -> None:
        """Drop the mappings (backends release their resources in :meth:`_release`)."""
        if self.closed:
            return
        self.closed = True
        self._raw = []
        self._release()

    def _release(self) -> None:
        raise NotImplementedError
