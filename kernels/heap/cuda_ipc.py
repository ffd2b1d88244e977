"""CUDA backend of the symmetric heap: one ``cudaMalloc`` per rank shared through CUDA IPC handles (CuPy).

The allocation is made with ``cupy.cuda.runtime.malloc`` rather than a memory pool, because an IPC
handle names a whole ``cudaMalloc`` block: a pooled sub-allocation would map at the wrong address.
Peers open the handles with ``cudaIpcMemLazyEnablePeerAccess``; processes sharing one GPU work too.
Tensors over the raw addresses are made through ``__cuda_array_interface__``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import SymmetricHeap, Verdict, import_cupy

_LAZY_ENABLE_PEER_ACCESS = 1


class _CudaArray:
    """A minimal ``__cuda_array_interface__`` exporter for ``nbytes`` bytes at ``ptr``."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _as_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``ptr``, never a copy.

    ``torch.as_tensor`` with a ``device`` is zero-copy only where torch hands the device down to
    ``from_blob``; otherwise it copies, and the pointer table would then name private copies
    nobody else writes (every wait would time out). The check makes that a clear error instead.
    """
    t = torch.as_tensor(_CudaArray(ptr, nbytes), device=device)
    if t.data_ptr() != ptr:
        raise RuntimeError(
            f"symmetric heap: torch {torch.__version__} copied the CUDA IPC mapping at {ptr:#x} "
            f"into {t.data_ptr():#x} instead of viewing it; peer memory cannot be shared"
        )
    return t


class CudaIpcHeap(SymmetricHeap):
    """Symmetric heap over CUDA IPC (ranks on one host with peer access, or sharing one GPU)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        data_bytes: int,
        sig_words: int,
        *,
        descriptor: object = None,
        verdict: Verdict | None = None,
    ):
        cupy = import_cupy()

        super().__init__(group, device, data_bytes, sig_words)
        self._runtime = cupy.cuda.runtime
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._opened: list[int] = []
        with cupy.cuda.Device(index):
            self._own = self._runtime.malloc(self.total_bytes)
            self._runtime.memset(self._own, 0, self.total_bytes)
            self._runtime.deviceSynchronize()
            handle = bytes(self._runtime.ipcGetMemHandle(self._own))
            infos: list = [None] * self.world_size
            dist.all_gather_object(infos, self.exchanged(handle, descriptor), group=group)
            try:
                self.judge(infos, verdict)
            except BaseException:
                self._release()
                raise
            ptrs: list[int] = []
            error = ""
            try:
                for peer, (host, peer_handle, _, _) in enumerate(infos):
                    if peer == self.rank:
                        ptrs.append(self._own)
                    elif host != infos[self.rank][0]:
                        raise RuntimeError(f"rank {self.global_ranks[peer]} is on host {host}")
                    else:
                        ptr = self._runtime.ipcOpenMemHandle(peer_handle, _LAZY_ENABLE_PEER_ACCESS)
                        self._opened.append(ptr)
                        ptrs.append(ptr)
            except Exception as e:  # CuPy raises CUDARuntimeError, which has no common base to name
                error = f"rank {self.global_ranks[self.rank]}: {e}"
            errors: list = [None] * self.world_size
            dist.all_gather_object(errors, error, group=group)
        failed = [e for e in errors if e]
        if failed:
            self._release()
            raise RuntimeError("symmetric heap: could not open the peers' CUDA IPC handles: " + "; ".join(failed))
        self._finish([_as_tensor(p, self.total_bytes, self.device) for p in ptrs])

    def _release(self) -> None:
        self.data_ptrs = self.sig_ptrs = torch.empty(0, dtype=torch.int64)
        for ptr in self._opened:
            self._runtime.ipcCloseMemHandle(ptr)
        self._opened = []
        if self._own:
            self._runtime.free(self._own)
            self._own = 0
