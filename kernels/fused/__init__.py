"""Fused backend: Triton kernels that read and write peer memory through a symmetric heap.

One module per pattern, each taking one call and its operands (:mod:`kernels.ops.gemm`), for every
operand format (:mod:`kernels.format`): :func:`all_gather.run`, :func:`scatter.run` (reduce-scatter),
:func:`all_reduce.run` and :func:`matmul.run` (local); the ops layer (``kernels/ops``) calls them as the
``"fused"`` backend. :func:`unavailable_reason` says whether they can run on a group; :func:`check_errors`
reports failed calls. See ``docs/fused.md`` for the design, limits and fallbacks.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from ..heap import cupy_install_hint, import_cupy
from . import (
    interpreter_compat,  # noqa: F401  (repairs of the Triton interpreter, see the module)
    runtime,
)
from .runtime import check_errors, resolve_group, triton_interpreted, world_size

__all__ = ["unavailable_reason", "check_errors"]

# Values keep the group alive so its id cannot be reused by a later group while cached.
_REASONS: dict[tuple[int, str], tuple[dist.ProcessGroup, str | None]] = {}


def _locality_reason(infos: list[tuple[str | None, str, int, tuple[int, ...]]]) -> str | None:
    """Can every rank map every peer's memory?

    ``infos``: per rank (local reason, host, GPU index, GPU indices it has no peer access to). The
    answer depends on ``infos`` alone, which every rank holds, so all ranks reach the same verdict
    even when peer access is one-directional.
    """
    local = next((r for r, _, _, _ in infos if r), None)
    if local is not None:
        return local
    hosts = sorted({host for _, host, _, _ in infos})
    if len(hosts) > 1:
        return f"the group spans {len(hosts)} hosts ({', '.join(hosts)}); peer memory needs one host"
    for _, _, index, no_access in infos:
        for _, _, peer_index, _ in infos:
            if peer_index in no_access:
                return f"GPU {index} has no peer access to GPU {peer_index}"
    return None


def unavailable_reason(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """None when the fused kernels can run on ``group`` and ``device``, else why not (for the fallback warning).

    The first call for a (group, device) exchanges host names and local reasons (one collective over ``group``); every
    rank of the group must make it, as every rank makes the op call itself. The answer is cached. While compiling (a
    trace-time backend choice, the Inductor pass) it is this rank's local answer, neither exchanged nor cached: no
    collective may run inside a compile.
    """
    group = resolve_group(group)
    if world_size(group) == 1:
        return (
            None
            if device.type == "cuda" or triton_interpreted()
            else ("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before kernels is imported)")
        )
    key = (id(group), str(device))
    if key in _REASONS:
        return _REASONS[key][1]
    compiling = torch.compiler.is_compiling()
    if runtime.capturing(device):
        # The answer needs a collective (and then the heap's creation, more): neither can be captured.
        runtime.refuse_capture("call", None, 0)
    reason: str | None = None
    if device.type == "cuda":
        try:
            import_cupy()
        except ImportError:
            reason = f"CuPy is not installed ({cupy_install_hint()}) and is needed for CUDA IPC handles"
        if triton_interpreted():
            reason = "TRITON_INTERPRET=1 is set, so Triton cannot run kernels on CUDA tensors"
    elif device.type == "cpu":
        if not triton_interpreted():
            reason = "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before kernels is imported)"
        elif not os.path.isdir("/dev/shm"):
            reason = "no /dev/shm for POSIX shared memory on this system"
    else:
        reason = f"no symmetric heap backend for device type {device.type!r}"
    index, no_access = -1, ()
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        no_access = tuple(
            j
            for j in range(torch.cuda.device_count())
            if j != index and not torch.cuda.can_device_access_peer(index, j)
        )
    if compiling:
        # Never a collective while compiling: a rank whose compile hits a cache, or compiles at another moment,
        # would leave its peers waiting in it. The local answer, not kept: the compiled graph's calls are admitted
        # when they run, where ranks that chose differently raise the same named error, and the heap's creation
        # names a peer on another host.
        return reason
    # Every rank takes part in the exchange even when it already knows its own answer, and all
    # ranks adopt the first reason any rank found, so they all choose the same backend.
    infos: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(infos, (reason, socket.gethostname(), index, no_access), group=group)
    reason = _locality_reason(infos)
    _REASONS[key] = (group, reason)
    return reason
