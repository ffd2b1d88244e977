"""Local-piece redistribution: the collectives behind ``reshard``, on plain torch tensors.

This module knows nothing of ``DistTensor`` (it is imported by it, never the reverse).

Transition table along one mesh dim (``W`` ranks, ``i`` this rank's coordinate), with uneven
shards in ``torch.chunk`` order (pieces of ``ceil(n / W)``, trailing ones short or empty):

========== ====================================================================================
S(d)->R    all-gather: pad the local piece to ``ceil(n / W)`` rows, ``all_gather_into_tensor``, trim
P->R       all-reduce (``avg``: sum, then divide by W; ``max``/``min``: MAX/MIN)
P->S(d)    reduce-scatter: pad to ``W * ceil(n / W)``, ``reduce_scatter_tensor``, trim (max/min:
           all-reduce, then slice)
R->S(d)    local slice, no communication
S(a)->S(b) all-to-all: split along b, pad every piece, ``all_to_all_single``, trim, concat along a
R->P       sum: coordinate 0 keeps the value, the others hold zeros; avg/max/min: all keep it
S->P, P->P S->R->P and P->R->P
========== ====================================================================================

N-D meshes change one mesh dim at a time: first every mesh dim whose shard goes away (S->R or
S->S), then the others, so a tensor dim is never sharded by two mesh dims at once. Across meshes
(pipeline stages) see :func:`move_across_meshes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels import comm as kernel_comm

from .mesh import ProcessMesh
from .placements import REPLICATE, Partial, Placement, Replicate, Shard, chunk_bounds

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(frozen=True)
class MeshAxis:
    """One mesh dim as its collectives see it: the process group along it, its size and this rank's
    coordinate on it."""

    group: object
    world: int
    index: int


def local_shape(
    global_shape: Sequence[int], mesh: ProcessMesh, placements: Sequence[Placement], coord: Sequence[int] | None = None
) -> list[int]:
    """Shape of the local piece at mesh coordinate ``coord`` (default: this rank's)."""
    coord = mesh.my_coordinate if coord is None else coord
    shape = list(global_shape)
    for m, p in enumerate(placements):
        if type(p) is Shard:
            s, e = chunk_bounds(global_shape[p.dim], mesh.shape[m], coord[m])
            shape[p.dim] = e - s
    return shape


def _pad_dim0(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros((rows,) + tuple(x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def all_gather(x: torch.Tensor, dim: int, size: int, axis: MeshAxis) -> torch.Tensor:
    """S(dim)->R along one mesh dim; ``size`` is the global length of ``dim``."""
    world = axis.world
    c = -(-size // world)
    xt = _pad_dim0(x.movedim(dim, 0), c)
    out = xt.new_empty((c * world,) + tuple(xt.shape[1:]))
    kernel_comm.all_gather(out, xt, axis.group)
    # Short and empty pieces are all at the end (torch.chunk), so the data is the first `size` rows.
    return out[:size].movedim(0, dim)


def all_reduce(x: torch.Tensor, reduce_type: str, axis: MeshAxis) -> torch.Tensor:
    """P->R along one mesh dim."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=_REDUCE_OPS[reduce_type], group=axis.group)
    if reduce_type == "avg":
        out.div_(axis.world)
    return out


def reduce_scatter(x: torch.Tensor, dim: int, reduce_type: str, axis: MeshAxis) -> torch.Tensor:
    """P->S(dim) along one mesh dim."""
    size, world = x.shape[dim], axis.world
    s, e = chunk_bounds(size, world, axis.index)
    if reduce_type in ("max", "min"):
        return all_reduce(x, reduce_type, axis).narrow(dim, s, e - s)
    c = -(-size // world)
    xt = _pad_dim0(x.movedim(dim, 0), c * world)
    out = xt.new_empty((c,) + tuple(xt.shape[1:]))
    kernel_comm.reduce_scatter(out, xt, axis.group)
    if reduce_type == "avg":
        out.div_(world)
    return out[: e - s].movedim(0, dim)


def local_slice(x: torch.Tensor, dim: int, axis: MeshAxis) -> torch.Tensor:
    """R->S(dim): no communication."""
    s, e = chunk_bounds(x.shape[dim], axis.world, axis.index)
    return x.narrow(dim, s, e - s)


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, src_size: int, axis: MeshAxis) -> torch.Tensor:
    """S(src_dim)->S(dst_dim) along one mesh dim, uneven pieces padded to a common size."""
    world = axis.world
    ca = -(-src_size // world)
    dst_size = x.shape[dst_dim]
    cb = -(-dst_size // world)
    xa = x.movedim(src_dim, 0)
    dst_pos = dst_dim if dst_dim > src_dim else dst_dim + 1
    # Block r of the send buffer: my rows along src_dim (padded to ca), rank r's piece of dst_dim
    # (padded to cb); one equal-sized block per peer is what all_to_all_single exchanges.
    send = xa.new_zeros((world, ca) + tuple(xa.shape[1:dst_pos]) + (cb,) + tuple(xa.shape[dst_pos + 1 :]))
    for r in range(world):
        s, e = chunk_bounds(dst_size, world, r)
        piece = xa.narrow(dst_pos, s, e - s)
        send[r].narrow(0, 0, xa.shape[0]).narrow(dst_pos, 0, e - s).copy_(piece)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=axis.group)
    s, e = chunk_bounds(dst_size, world, axis.index)
    parts = []
    for r in range(world):
        rs, re_ = chunk_bounds(src_size, world, r)
        parts.append(recv[r].narrow(0, 0, re_ - rs).narrow(dst_pos, 0, e - s))
    return torch.cat(parts, 0).movedim(0, src_dim)


def replicate_to_partial(x: torch.Tensor, reduce_type: str, index: int) -> torch.Tensor:
    if reduce_type == "sum" and index != 0:
        return torch.zeros_like(x)
    return x


def _step(
    x: torch.Tensor, global_shape: Sequence[int], mesh: ProcessMesh, step: tuple[int, Placement, Placement]
) -> torch.Tensor:
    """One step ``(mesh_dim, from, to)`` of :func:`plan` on the local piece."""
    m, src, dst = step
    if mesh.shape[m] == 1:
        # One rank along this dim: every placement holds the whole value (and there is no group).
        return x
    axis = MeshAxis(mesh.get_group(m), mesh.shape[m], mesh.my_coordinate[m])
    ts, td = type(src), type(dst)
    if ts is Shard and td is Replicate:
        return all_gather(x, src.dim, global_shape[src.dim], axis)
    if ts is Shard and td is Shard:
        return all_to_all(x, src.dim, dst.dim, global_shape[src.dim], axis)
    if ts is Partial and td is Replicate:
        return all_reduce(x, src.reduce_op, axis)
    if ts is Partial and td is Shard:
        return reduce_scatter(x, dst.dim, src.reduce_op, axis)
    if ts is Replicate and td is Shard:
        return local_slice(x, dst.dim, axis)
    if ts is Replicate and td is Partial:
        return replicate_to_partial(x, dst.reduce_op, axis.index)
    raise ValueError(f"cannot reshard {src!r} -> {dst!r} on mesh dim {m}")


def plan(src: Sequence[Placement], dst: Sequence[Placement]) -> list[tuple[int, Placement, Placement]]:
    """Ordered single-mesh-dim steps ``(mesh_dim, from, to)`` turning ``src`` into ``dst``."""
    cur = list(src)
    steps: list[tuple[int, Placement, Placement]] = []

    def sharded_elsewhere(d: int, m: int) -> bool:
        return any(type(p) is Shard and p.dim == d for k, p in enumerate(cur) if k != m)

    for m, (s, d) in enumerate(zip(src, dst, strict=False)):
        if type(s) is Shard and s != d:
            if type(d) is Shard and not sharded_elsewhere(d.dim, m):
                steps.append((m, s, d))
                cur[m] = d
            else:
                steps.append((m, s, REPLICATE))
                cur[m] = REPLICATE
    for m, d in enumerate(dst):
        s = cur[m]
        if s == d:
            continue
        if type(s) is Partial and type(d) is Partial:
            steps.append((m, s, REPLICATE))
            s = REPLICATE
        steps.append((m, s, d))
        cur[m] = d
    return steps


def redistribute_local(
    x: torch.Tensor, global_shape: Sequence[int], mesh: ProcessMesh, src: Sequence[Placement], dst: Sequence[Placement]
) -> torch.Tensor:
    """The local piece of the tensor at placements ``dst``, given the piece at ``src``."""
    for step in plan(src, dst):
        x = _step(x, global_shape, mesh, step)
    return x


def check_placements_reachable(src: Sequence[Placement], dst: Sequence[Placement]) -> None:
    for m, (s, d) in enumerate(zip(src, dst, strict=False)):
        if type(d) is Partial and type(s) is Partial and s.reduce_op != d.reduce_op and s.reduce_op in ("max", "min"):
            raise ValueError(
                f"cannot reshard {list(src)} -> {list(dst)}: mesh dim {m} would turn "
                f"{s!r} into {d!r}, which needs the reduced value first; reshard to "
                f"Replicate() and then to {d!r}"
            )


# -- cross-mesh moves (pipeline stages) ----------------------------------------------------------


def move_across_meshes(
    x: torch.Tensor | None,
    src_mesh: ProcessMesh,
    dst_mesh: ProcessMesh,
    *,
    recv_shape: Sequence[int] | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """Send the local piece of every coordinate of ``src_mesh`` to ``dst_mesh``.

    Same mesh shape: flat position ``i`` of ``src_mesh`` sends to flat position ``i`` of
    ``dst_mesh`` (placements carry over unchanged). Different shapes: the tensor is Replicate on
    both, and destination ``j`` receives from source ``j % |src|``. Pieces are received on
    ``device`` (the data's device, which clipped ranks' placeholders carry). Returns the received piece on
    destination ranks and None elsewhere. Every send is matched by exactly one receive in program
    order, and ranks in both meshes use non-blocking ops so nothing deadlocks.
    """
    me = dist.get_rank()
    n_src = src_mesh.size
    ops = []
    out = None
    for j, dst_rank in enumerate(dst_mesh.process_ids):
        src_rank = src_mesh.process_ids[j % n_src]
        if src_rank == me and dst_rank == me:
            out = x.clone()
        elif src_rank == me:
            ops.append(dist.P2POp(dist.isend, x.contiguous(), dst_rank))
        elif dst_rank == me:
            out = torch.empty(tuple(recv_shape), dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, out, src_rank))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out
