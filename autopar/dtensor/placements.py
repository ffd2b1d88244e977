"""Placements of a distributed tensor along one mesh dim: PyTorch's own ``Shard(dim)``,
``Replicate()`` and ``Partial(reduce_op)`` from ``torch.distributed.tensor``.

autopar defines no placement classes: ``autopar.Shard is torch.distributed.tensor.Shard`` (and so
for ``Replicate``, ``Partial``, ``Placement``), so one set of values describes a DistTensor and a
DTensor and nothing converts between two vocabularies of the same names. A DistTensor accepts
exactly those three types (not torch's internal subclasses such as ``_StridedShard`` or
``_MaskPartial``, which encode layouts ``dims_mapping`` cannot express), and ``Partial`` with the
reduce ops in ``REDUCE_TYPES``.

A DistTensor carries one placement per mesh dim. The Paddle-style views are derived from them:
``dims_mapping[tensor_dim]`` is the mesh dim sharding that tensor dim (-1 when none) and
``partial_status`` maps a mesh dim to its pending reduce op. A tensor dim may be sharded by at most
one mesh dim (what ``dims_mapping`` can express); uneven shards follow ``torch.chunk``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["Partial", "Placement", "Replicate", "Shard"]

# The reduce ops a DistTensor implements (torch's Partial also takes "product" and bitwise ones).
REDUCE_TYPES = ("sum", "avg", "max", "min")

REPLICATE = Replicate()
PARTIAL_SUM = Partial("sum")

PlacementsLike = Sequence[Placement]


def check_placement(p: object, where: str) -> None:
    """Refuse what a DistTensor cannot hold, naming ``where`` (e.g. ``placements[1]``)."""
    t = type(p)
    if t is Shard or t is Replicate:
        return
    if t is Partial:
        if p.reduce_op not in REDUCE_TYPES:
            raise ValueError(
                f"{where}={p!r}: a DistTensor's Partial reduce op must be one of {list(REDUCE_TYPES)}, "
                f"got {p.reduce_op!r}"
            )
        return
    if isinstance(p, Placement):
        raise ValueError(
            f"{where}={p!r}: a DistTensor takes torch.distributed.tensor's Shard, Replicate and Partial, "
            f"not {t.__name__}"
        )
    raise TypeError(f"{where} must be a torch.distributed.tensor Shard/Replicate/Partial, got {p!r}")


def normalize_placements(
    placements: PlacementsLike | Placement, mesh_ndim: int, tensor_ndim: int
) -> tuple[Placement, ...]:
    """Validate ``placements`` for a mesh of ``mesh_ndim`` dims and a tensor of ``tensor_ndim`` dims.

    Negative shard dims are normalized; missing trailing entries are Replicate (as DTensor).
    """
    if isinstance(placements, Placement):
        placements = (placements,)
    placements = tuple(placements)
    if len(placements) > mesh_ndim:
        raise ValueError(
            f"placements {list(placements)} has {len(placements)} entries but the mesh has {mesh_ndim} dim(s)"
        )
    out = []
    sharded: dict[int, int] = {}
    for mesh_dim, p in enumerate(placements):
        check_placement(p, f"placements[{mesh_dim}]")
        if type(p) is Shard:
            d = p.dim + tensor_ndim if p.dim < 0 else p.dim
            if not 0 <= d < tensor_ndim:
                raise ValueError(f"placements[{mesh_dim}]={p!r} is out of range for a tensor with {tensor_ndim} dim(s)")
            if d in sharded:
                raise ValueError(
                    f"tensor dim {d} is sharded on mesh dims {sharded[d]} and {mesh_dim}; "
                    f"a tensor dim may be sharded by at most one mesh dim"
                )
            sharded[d] = mesh_dim
            p = Shard(d) if d != p.dim else p
        out.append(p)
    out.extend([REPLICATE] * (mesh_ndim - len(out)))
    return tuple(out)


def to_dims_mapping(placements: Sequence[Placement], tensor_ndim: int) -> list[int]:
    mapping = [-1] * tensor_ndim
    for mesh_dim, p in enumerate(placements):
        if type(p) is Shard:
            mapping[p.dim] = mesh_dim
    return mapping


def to_partial_status(placements: Sequence[Placement]) -> dict[int, str]:
    return {m: p.reduce_op for m, p in enumerate(placements) if type(p) is Partial}


def from_dims_mapping(
    dims_mapping: Sequence[int], mesh_ndim: int, partial_status: dict[int, str] | None = None
) -> tuple[Placement, ...]:
    """Inverse of the two views: Paddle's ``dims_mapping`` + ``partial_status`` to placements."""
    out: list[Placement] = [REPLICATE] * mesh_ndim
    for tensor_dim, mesh_dim in enumerate(dims_mapping):
        if mesh_dim >= 0:
            if out[mesh_dim] != REPLICATE:
                raise ValueError(f"dims_mapping {list(dims_mapping)} maps two tensor dims to mesh dim {mesh_dim}")
            out[mesh_dim] = Shard(tensor_dim)
    for mesh_dim, rt in (partial_status or {}).items():
        if out[mesh_dim] != REPLICATE:
            raise ValueError(f"mesh dim {mesh_dim} is both sharding a tensor dim and Partial")
        out[mesh_dim] = Partial(rt)
        check_placement(out[mesh_dim], f"partial_status[{mesh_dim}]")
    return tuple(out)


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of piece ``index`` when ``size`` is split like ``torch.chunk(parts)``.

    torch.chunk uses pieces of ceil(size / parts); trailing pieces may be short or empty.
    """
    c = -(-size // parts) if size else 0
    start = min(index * c, size)
    return start, min(start + c, size)
