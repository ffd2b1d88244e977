"""CPU backend of the symmetric heap: POSIX shared-memory segments mapped by every rank of a host.

Lifecycle of a segment (the name is unguessable, the file mode 0600):

1. each rank creates ``/dev/shm/coc-heap-<pid>-<128 random bits>`` and maps it;
2. names are exchanged with ``all_gather_object`` and each rank maps every peer's segment;
3. a second ``all_gather_object`` confirms that every rank mapped everything (or reports who failed);
4. each rank unlinks its own segment at once. From then on the memory lives only as long as the
   mappings, so a crashed or killed job leaks nothing in /dev/shm; the window between 1 and 4 is a
   few collective round trips.

Under ``TRITON_INTERPRET=1`` the kernels read the spin timeout's clock from the signal pad: while a
fused call is in progress (:meth:`ShmHeap.arm_clock`), a daemon thread writes the milliseconds
elapsed since the heap was created into word ``CLOCK_WORD`` of this rank's pad every 2 ms (the
interpreter has no timer instruction). Between calls the thread sleeps.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import threading
import time

import torch
import torch.distributed as dist

from .base import SymmetricHeap, Verdict

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "coc-heap-"
CLOCK_WORD = 0
_CLOCK_PERIOD_S = 0.002


def segment_name() -> str:
    """A fresh segment name: a fixed prefix, this pid (so tests can find a process's segments) and 128 random bits."""
    return f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"


def create_segment(name: str, nbytes: int) -> mmap.mmap:
    """Create ``/dev/shm/<name>`` with mode 0600 (never an existing file) and map ``nbytes`` of it."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # The umask can only narrow the mode; fchmod makes 0600 explicit whatever the umask is.
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def open_segment(name: str, nbytes: int) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise RuntimeError(f"shared-memory segment {name} has {size} bytes, expected {nbytes}")
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


class _Clock(threading.Thread):
    """Writes elapsed milliseconds into one int64 word while armed, until stopped."""

    def __init__(self, address: int):
        super().__init__(name="coc-heap-clock", daemon=True)
        self._word = ctypes.c_int64.from_address(address)
        self._t0 = time.monotonic()
        self._stop_event = threading.Event()
        self._armed = threading.Event()
        self.tick()

    def tick(self) -> None:
        # An aligned 8-byte store is atomic on every platform torch supports, so a kernel never
        # reads a torn value.
        self._word.value = int((time.monotonic() - self._t0) * 1000)

    def run(self) -> None:
        while True:
            self._armed.wait()
            if self._stop_event.wait(_CLOCK_PERIOD_S):
                return
            self.tick()

    def arm(self, on: bool) -> None:
        if on:
            # Fresh before the first kernel of the call reads it.
            self.tick()
            self._armed.set()
        else:
            self._armed.clear()

    def stop(self) -> None:
        self._stop_event.set()
        self._armed.set()
        self.join()


class ShmHeap(SymmetricHeap):
    """Symmetric heap over POSIX shared memory (CPU tensors; ranks on one host)."""

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
        super().__init__(group, device, data_bytes, sig_words)
        self._maps: list[mmap.mmap] = []
        name = segment_name()
        own = create_segment(name, self.total_bytes)
        try:
            infos: list = [None] * self.world_size
            dist.all_gather_object(infos, self.exchanged(name, descriptor), group=group)
            try:
                self.judge(infos, verdict)
            except BaseException:
                own.close()
                raise
            maps: list[mmap.mmap] = []
            error = ""
            try:
                for peer, (host, peer_name, _, _) in enumerate(infos):
                    if peer == self.rank:
                        maps.append(own)
                    elif host != infos[self.rank][0]:
                        raise RuntimeError(
                            f"rank {self.global_ranks[peer]} is on host {host}, not {infos[self.rank][0]}"
                        )
                    else:
                        maps.append(open_segment(peer_name, self.total_bytes))
            except (OSError, RuntimeError) as e:
                error = f"rank {self.global_ranks[self.rank]}: {e}"
            # Every rank reports before anyone raises, so a failure on one rank cannot leave the
            # others waiting in a collective.
            errors: list = [None] * self.world_size
            dist.all_gather_object(errors, error, group=group)
        finally:
            unlink_segment(name)
        failed = [e for e in errors if e]
        if failed:
            for m in maps:
                if m is not own:
                    m.close()
            own.close()
            raise RuntimeError("symmetric heap: could not map the peers' shared memory: " + "; ".join(failed))
        self._maps = maps
        self._finish([torch.frombuffer(m, dtype=torch.uint8) for m in maps])
        self._clock = _Clock(self._raw[self.rank].data_ptr() + data_bytes + 8 * CLOCK_WORD)
        self._clock.start()

    def arm_clock(self, on: bool) -> None:
        self._clock.arm(on)

    def _release(self) -> None:
        self._clock.stop()
        self.data_ptrs = self.sig_ptrs = torch.empty(0, dtype=torch.int64)
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                # A tensor view escaped (e.g. kept by a caller); the mapping is then released
                # when the last view dies instead.
                pass
        self._maps = []
