"""``ProcessMesh``: an N-D array of global ranks with named dims, and its communication subgroups.

Creating a subgroup (``torch.distributed.new_group``) is collective over the default group: every
rank must create the same groups in the same order, including ranks that are not members. A mesh
therefore creates the subgroups of all its dims eagerly in its constructor, which every rank runs
(every rank builds the same model and meshes), and never lazily inside an op, where a clipped
pipeline rank would not take part and the job would hang. Groups are cached per rank list, so
meshes sharing a row or column share its group.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

_GROUPS: dict[tuple[int, ...], Any] = {}


def _nested_shape(data: Any) -> tuple[list[int], list[int]]:
    if isinstance(data, torch.Tensor):
        return list(data.shape), [int(v) for v in data.flatten().tolist()]
    try:
        import numpy as np

        if isinstance(data, np.ndarray):
            return list(data.shape), [int(v) for v in data.flatten().tolist()]
    except ImportError:
        pass
    if isinstance(data, (list, tuple)):
        if len(data) == 0:
            raise ValueError("ProcessMesh(mesh): mesh must not be empty")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in data):
            return [len(data)], list(data)
        subs = [_nested_shape(v) for v in data]
        if any(s[0] != subs[0][0] for s in subs):
            raise ValueError(f"ProcessMesh(mesh): ragged nested list {data!r}")
        return [len(data)] + subs[0][0], [r for s in subs for r in s[1]]
    raise TypeError(f"ProcessMesh(mesh): expected a nested list of ints, got {type(data).__name__}")


def _group_for(ranks: tuple[int, ...]) -> Any:
    group = _GROUPS.get(ranks)
    if group is None:
        world = dist.get_world_size()
        group = dist.group.WORLD if ranks == tuple(range(world)) else dist.new_group(list(ranks))
        _GROUPS[ranks] = group
    return group


class ProcessMesh:
    """N-D mesh of global ranks. ``ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])``."""

    __slots__ = (
        "shape",
        "process_ids",
        "dim_names",
        "_strides",
        "_coord",
        "_groups",
        "_key",
        "_my_rank",
        "__weakref__",
    )

    def __init__(self, mesh: Sequence | torch.Tensor, dim_names: Sequence[str] | None = None):
        shape, ids = _nested_shape(mesh)
        if len(set(ids)) != len(ids):
            raise ValueError(f"ProcessMesh(mesh): duplicate ranks in {ids}")
        if any(r < 0 for r in ids):
            raise ValueError(f"ProcessMesh(mesh): negative rank in {ids}")
        if dim_names is None:
            dim_names = [f"d{i}" for i in range(len(shape))]
        dim_names = list(dim_names)
        if len(dim_names) != len(shape):
            raise ValueError(
                f"ProcessMesh(dim_names): {len(dim_names)} names {dim_names} for a {len(shape)}-D mesh of shape {shape}"
            )
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"ProcessMesh(dim_names): duplicate names in {dim_names}")
        self.shape = tuple(shape)
        self.process_ids = tuple(ids)
        self.dim_names = tuple(dim_names)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        self._strides = tuple(strides)
        self._key = (self.shape, self.process_ids)
        self._my_rank = dist.get_rank() if dist.is_initialized() else 0
        if dist.is_initialized() and max(ids) >= dist.get_world_size():
            raise ValueError(f"ProcessMesh(mesh): rank {max(ids)} does not exist in a world of {dist.get_world_size()}")
        self._coord = self.coordinate(self._my_rank) if self._my_rank in self.process_ids else None
        self._groups: list[Any] = [None] * len(shape)
        if dist.is_initialized():
            self._create_groups()
        _LIVE[(self.shape, self.process_ids, self.dim_names)] = self

    def _create_groups(self) -> None:
        # Every rank walks every group of every dim in the same order: new_group is collective.
        for d, size in enumerate(self.shape):
            if size == 1:
                continue
            for ranks in self.dim_groups(d):
                if list(ranks) != sorted(ranks):
                    # torch orders a group's members by global rank; collectives then return
                    # pieces in that order, which must be the mesh coordinate order.
                    raise ValueError(
                        f"ProcessMesh: ranks along mesh dim {d} must increase, got {list(ranks)} in mesh {self}"
                    )
                group = _group_for(tuple(ranks))
                if self._coord is not None and self._my_rank in ranks:
                    self._groups[d] = group

    # -- geometry -------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.process_ids)

    def get_dim_size(self, dim: int | str) -> int:
        return self.shape[self._dim(dim)]

    def _dim(self, dim: int | str) -> int:
        if isinstance(dim, str):
            if dim not in self.dim_names:
                raise ValueError(f"mesh dim name {dim!r} not in {list(self.dim_names)}")
            return self.dim_names.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise ValueError(f"mesh dim {dim} out of range for a {self.ndim}-D mesh")
        return dim % self.ndim

    def __contains__(self, rank: int) -> bool:
        return rank in self.process_ids

    def coordinate(self, rank: int) -> tuple[int, ...]:
        if rank not in self.process_ids:
            raise ValueError(f"rank {rank} is not in mesh {self}")
        flat = self.process_ids.index(rank)
        return tuple((flat // s) % n for s, n in zip(self._strides, self.shape, strict=False))

    def rank_at(self, coord: Sequence[int]) -> int:
        return self.process_ids[sum(c * s for c, s in zip(coord, self._strides, strict=False))]

    def dim_groups(self, dim: int | str) -> list[tuple[int, ...]]:
        """Rank lists along mesh dim ``dim``, one per coordinate of the other dims, in order."""
        d = self._dim(dim)
        others = [range(n) if i != d else [0] for i, n in enumerate(self.shape)]
        out = []
        for base in itertools.product(*others):
            coord = list(base)
            ranks = []
            for i in range(self.shape[d]):
                coord[d] = i
                ranks.append(self.rank_at(coord))
            out.append(tuple(ranks))
        return out

    # -- this rank's view -------------------------------------------------------------------------
    @property
    def my_coordinate(self) -> tuple[int, ...] | None:
        """This process's coordinate, or None when it is outside the mesh (a clipped rank)."""
        return self._coord

    def get_group(self, dim: int | str) -> Any:
        """The subgroup of this rank along ``dim`` (None for a size-1 dim or a rank outside)."""
        return self._groups[self._dim(dim)]

    def get_submesh(self, dim: int | str, index: int) -> ProcessMesh:
        """The (ndim-1)-D mesh at ``index`` along ``dim`` (e.g. a pipeline stage). Collective."""
        d = self._dim(dim)
        coords = itertools.product(*[range(n) for n in self.shape])
        shape = [n for i, n in enumerate(self.shape) if i != d]
        ranks = [self.rank_at(c) for c in coords if c[d] == index]
        nested: Any = ranks
        for n in reversed(shape[1:]):
            nested = [nested[i : i + n] for i in range(0, len(nested), n)]
        names = [n for i, n in enumerate(self.dim_names) if i != d]
        if not shape:
            return ProcessMesh(ranks, dim_names=["d0"])
        return ProcessMesh(nested, dim_names=names)

    def __getitem__(self, index: int) -> ProcessMesh:
        return self.get_submesh(0, index)

    def tolist(self) -> Any:
        """The ranks as a nested list of the mesh's shape."""
        nested: Any = list(self.process_ids)
        for n in reversed(self.shape[1:]):
            nested = [nested[i : i + n] for i in range(0, len(nested), n)]
        return nested

    def __reduce__(self):
        # Process groups do not pickle; an unpickled mesh is rebuilt from its ranks and names.
        return (rebuild_mesh, (self.tolist(), list(self.dim_names)))

    def __deepcopy__(self, memo: dict) -> ProcessMesh:
        # A mesh names process groups, which are shared, never copied.
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessMesh) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return (
            f"ProcessMesh(shape={list(self.shape)}, process_ids={list(self.process_ids)}, "
            f"dim_names={list(self.dim_names)})"
        )


_LIVE: weakref.WeakValueDictionary[tuple, ProcessMesh] = weakref.WeakValueDictionary()


def rebuild_mesh(ranks: Any, dim_names: list[str]) -> ProcessMesh:
    """Unpickling target. Reuses a live mesh with the same ranks and names; otherwise builds one,
    which creates its process groups (collective over the default group, as any ``ProcessMesh``):
    every rank must then load the same objects in the same order."""
    shape, ids = _nested_shape(ranks)
    key = (tuple(shape), tuple(ids), tuple(dim_names))
    mesh = _LIVE.get(key)
    if mesh is None:
        mesh = ProcessMesh(ranks, dim_names)
    return mesh
