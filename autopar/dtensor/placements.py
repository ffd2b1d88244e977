"""Placements of a distributed tensor along one mesh dim: ``Shard(dim)``, ``Replicate()``, ``Partial()``.

A DistTensor carries one placement per mesh dim. The Paddle-style views are derived from them:
``dims_mapping[tensor_dim]`` is the mesh dim sharding that tensor dim (-1 when none) and
``partial_status`` maps a mesh dim to its pending reduce type. A tensor dim may be sharded by at most
one mesh dim (what ``dims_mapping`` can express); uneven shards follow ``torch.chunk``.
"""

from __future__ import annotations

from collections.abc import Sequence

REDUCE_TYPES = ("sum", "avg", "max", "min")


class Placement:
    """Base class; placements are immutable, hashable values (they key the rule cache)."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


class Shard(Placement):
    """The tensor dim ``dim`` is split over the mesh dim in ``torch.chunk`` order."""

    __slots__ = ("dim",)

    def __init__(self, dim: int):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"Shard(dim): dim must be an int, got {dim!r}")
        object.__setattr__(self, "dim", dim)

    def __setattr__(self, name, value):
        raise AttributeError("Shard is immutable")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __reduce__(self):
        return (Shard, (self.dim,))

    def __eq__(self, other: object) -> bool:
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(("S", self.dim))

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


class Replicate(Placement):
    """Every rank along the mesh dim holds the whole (along this mesh dim) tensor."""

    __slots__ = ()

    def is_replicate(self) -> bool:
        return True

    def __reduce__(self):
        return (Replicate, ())

    def __eq__(self, other: object) -> bool:
        return type(other) is Replicate

    def __hash__(self) -> int:
        return hash("R")

    def __repr__(self) -> str:
        return "Replicate()"


class Partial(Placement):
    """The value is the reduction (``reduce_type``) of the local tensors along the mesh dim."""

    __slots__ = ("reduce_type",)

    def __init__(self, reduce_type: str = "sum"):
        if reduce_type not in REDUCE_TYPES:
            raise ValueError(f"Partial(reduce_type): reduce_type must be one of {REDUCE_TYPES}, got {reduce_type!r}")
        object.__setattr__(self, "reduce_type", reduce_type)

    def __setattr__(self, name, value):
        raise AttributeError("Partial is immutable")

    def is_partial(self) -> bool:
        return True

    def __reduce__(self):
        return (Partial, (self.reduce_type,))

    def __eq__(self, other: object) -> bool:
        return type(other) is Partial and other.reduce_type == self.reduce_type

    def __hash__(self) -> int:
        return hash(("P", self.reduce_type))

    def __repr__(self) -> str:
        return f"Partial({self.reduce_type!r})" if self.reduce_type != "sum" else "Partial()"


REPLICATE = Replicate()
PARTIAL_SUM = Partial("sum")

PlacementsLike = Sequence[Placement]


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
        if not isinstance(p, Placement):
            raise TypeError(f"placements[{mesh_dim}] must be Shard/Replicate/Partial, got {p!r}")
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
    return {m: p.reduce_type for m, p in enumerate(placements) if type(p) is Partial}


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
    return tuple(out)


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of piece ``index`` when ``size`` is split like ``torch.chunk(parts)``.

    torch.chunk uses pieces of ceil(size / parts); trailing pieces may be short or empty.
    """
    c = -(-size // parts) if size else 0
    start = min(index * c, size)
    return start, min(start + c, size)
