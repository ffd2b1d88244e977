"""Symmetric heap on POSIX shared memory: mapping, growth, permissions, no leak in /dev/shm."""

import os
import signal
import stat
import time

import pytest
import torch
import torch.distributed as dist

from kernels.heap import shm
from kernels.testing import run_ranks


def _own_segments(pid: int) -> list[str]:
    prefix = f"{shm.SEGMENT_PREFIX}{pid}-"
    return [name for name in os.listdir(shm.SHM_DIR) if name.startswith(prefix)]


def _heap_body(rank: int, world: int) -> dict:
    from kernels.heap import destroy_heap, get_heap, peek_heap

    group = dist.new_group(list(range(world)))
    dev = torch.device("cpu")
    heap = get_heap(group, dev, 1000, 16)
    assert heap.data_bytes >= 1000 and heap.data_bytes % 4096 == 0 and heap.sig_words == 16
    segments_alive = _own_segments(os.getpid())
    heap.data_view(rank, torch.int32, (4,))[:] = torch.arange(4, dtype=torch.int32) + 100 * rank
    heap.sig_view(rank)[2] = rank + 7
    dist.barrier(group)
    seen = [heap.data_view(p, torch.int32, (4,)).tolist() for p in range(world)]
    flags = [int(heap.sig_view(p)[2]) for p in range(world)]
    # The pointer table holds the very addresses the views use.
    ptrs_ok = all(
        int(heap.data_ptrs[p]) == heap.data_view(p, torch.uint8, (1,)).data_ptr()
        and int(heap.sig_ptrs[p]) == heap.sig_view(p).data_ptr()
        for p in range(world)
    )
    same = get_heap(group, dev, 500, 8) is heap
    grown = get_heap(group, dev, heap.data_bytes + 1, 16)
    growth = (grown is not heap, heap.closed, grown.data_bytes == 2 * heap.data_bytes, grown.calls)
    with pytest.raises(ValueError, match="does not fit"):
        grown.data_view(rank, torch.float32, (grown.data_bytes,))
    dist.barrier(group)
    destroy_heap(group)
    return {
        "segments_alive": segments_alive,
        "seen": seen,
        "flags": flags,
        "ptrs_ok": ptrs_ok,
        "same": same,
        "growth": growth,
        "gone": peek_heap(group, dev) is None,
        "segments_after": _own_segments(os.getpid()),
    }


def test_heap_maps_peers_grows_and_leaves_no_segment():
    for world in (2, 3):
        results = run_ranks(_heap_body, world)
        for r in results:
            assert r["seen"] == [[100 * p + i for i in range(4)] for p in range(world)]
            assert r["flags"] == [p + 7 for p in range(world)]
            assert r["ptrs_ok"] and r["same"] and r["gone"]
            assert r["growth"] == (True, True, True, 0)
            # Unlinked as soon as every peer mapped it: nothing in /dev/shm even while the heap lives.
            assert r["segments_alive"] == [] and r["segments_after"] == []


def test_segment_mode_is_0600_and_name_unguessable():
    old = os.umask(0)  # the mode must not depend on a permissive umask
    try:
        name = shm.segment_name()
        mapping = shm.create_segment(name, 4096)
    finally:
        os.umask(old)
    try:
        mode = stat.S_IMODE(os.stat(os.path.join(shm.SHM_DIR, name)).st_mode)
        assert mode == 0o600, oct(mode)
        assert len(name.rsplit("-", 1)[1]) == 32  # 128 random bits
        assert name != shm.segment_name()
        with pytest.raises(FileExistsError):
            shm.create_segment(name, 4096)
    finally:
        mapping.close()
        shm.unlink_segment(name)
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))


def _proc_gone(pid: int) -> bool:
    """True once ``pid`` has exited. A zombie awaiting its parent counts as gone; the parent (the fork server)
    may also reap it while its status file is read, which then raises ProcessLookupError."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except (FileNotFoundError, ProcessLookupError):
        return True


def _killed_body(rank: int, world: int, pid_file: str) -> None:
    """Every rank maps the heap; rank 1 is SIGKILLed, rank 0 checks that nothing of either is left in
    /dev/shm, records both pids and is SIGKILLed too (the test checks again after it)."""
    import json

    from kernels.heap import get_heap

    group = dist.new_group(list(range(world)))
    get_heap(group, torch.device("cpu"), 1 << 16, 8)
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=group)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not _proc_gone(pids[1]):
        assert time.monotonic() < deadline, f"rank 1 (pid {pids[1]}) still alive 60 s after SIGKILL"
        time.sleep(0.05)
    leftover = {pid: _own_segments(pid) for pid in pids}
    with open(pid_file, "w") as f:
        json.dump({"pids": pids, "leftover_after_rank1": leftover}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def test_killed_ranks_leak_no_segment(tmp_path):
    import json

    pid_file = str(tmp_path / "pids.json")
    assert run_ranks(_killed_body, 2, pid_file, allow_dead=True, timeout=120) == [None, None]
    with open(pid_file) as f:
        record = json.load(f)
    assert all(not names for names in record["leftover_after_rank1"].values()), record
    assert all(_own_segments(pid) == [] for pid in record["pids"]), record
