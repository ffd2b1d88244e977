"""``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load``) of strided shards (packed weights) writes and reads
each rank's elements at their true place in the global tensor.

DCP asks every DTensor in a state dict for its chunks through the checkpoint protocol torch defines
(``torch.distributed._checkpointable._Checkpointable``: ``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), and ``DTensor`` answers with one chunk at the single offset
``compute_local_shape_and_global_offset`` gives. A ``_StridedShard`` (the packed q/k/v of GPT-2's ``c_attn``, a
fused gate/up) is not one box: rank r owns the r-th piece of every packed block, so both ranks' chunks start where
torch puts them and overlap (``dcp.save`` fails validating the global plan: "overlapping chunks"), and a load
would read the wrong rows.

:func:`install` wraps those three ``DTensor`` methods once per process. A DTensor whose placements hold a
``_StridedShard`` and whose local tensor is several boxes of the global tensor is described as those boxes: one
write item / chunk per box (for ``c_attn`` at W=2, rank r: columns ``[b*n/3 + r*n/6, b*n/3 + (r+1)*n/6)`` of
each block b of the ``n`` packed output features), and ``__get_tensor_shard__`` returns the narrow view of the
local tensor that box is, so DCP's writer saves it and its reader copies into it in place. Which global indices a
rank holds along each dim comes from the placement itself (``distribute_tensor`` of an index vector, with no
communication), as :mod:`autopar.tp.hf_load` reads shards. Every other DTensor, a strided one that is one box
included (FSDP2 + TP), goes to torch's own methods unchanged. The checkpoint's metadata then describes the full
tensor exactly, so it loads at any world size, into one process too (``dcp.load`` into a full state dict,
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``). Where torch no longer has those methods,
``install`` warns that such saves are unchecked rather than pretending to fix them.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from .hf_load import index_runs

try:  # private, stable since 2.5
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None

try:  # public dataclasses of DCP's planner API
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
except ImportError:  # pragma: no cover
    ChunkStorageMetadata = None

# The protocol methods and their parameters (self first) as torch's DTensor defines them.
_PROTOCOL = {
    "__create_write_items__": ["self", "fqn", "object"],
    "__create_chunk_list__": ["self"],
    "__get_tensor_shard__": ["self", "index"],
}

# One box of the global tensor a rank holds: its global offsets, sizes, and where it starts in the local tensor.
_Box = tuple[torch.Size, torch.Size, tuple[int, ...]]


def _held(size: int, dim: int, ndim: int, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    """The global indices along ``dim`` this rank's local tensor holds, in local order: the placements that shard
    ``dim``, in mesh order, distribute an index vector exactly as they distribute the tensor."""
    along: list[Placement] = []
    for p in placements:
        if _StridedShard is not None and isinstance(p, _StridedShard) and p.dim % ndim == dim:
            along.append(_StridedShard(0, split_factor=p.split_factor))
        elif isinstance(p, Shard) and not isinstance(p, _StridedShard) and p.dim % ndim == dim:
            along.append(Shard(0))
        else:
            along.append(Replicate())
    return distribute_tensor(torch.arange(size), mesh, along, src_data_rank=None).to_local().cpu()


@functools.lru_cache(maxsize=1024)
def _boxes_for(shape: torch.Size, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> tuple[_Box, ...]:
    """Every box of the global tensor this rank holds: the product over dims of the runs of consecutive held
    indices (the coordinate is this process's, fixed per mesh, so shape, mesh and placements are the key)."""
    per_dim = []
    for dim in range(len(shape)):
        runs, local = [], 0
        for start, length in index_runs(_held(shape[dim], dim, len(shape), mesh, placements)):
            runs.append((start, length, local))
            local += length
        per_dim.append(runs)
    return tuple(
        (torch.Size(r[0] for r in combo), torch.Size(r[1] for r in combo), tuple(r[2] for r in combo))
        for combo in itertools.product(*per_dim)
    )


def _boxes(dt: DTensor) -> tuple[_Box, ...] | None:
    """This rank's boxes of a strided DTensor that is more than one box; None where torch's own one-chunk answer
    is right (no ``_StridedShard``, one box, an empty shard) or not ours to give (Partial, which torch refuses; a
    local tensor with its own protocol; a rank outside the mesh)."""
    placements = tuple(dt.placements)
    if _StridedShard is None or not any(isinstance(p, _StridedShard) for p in placements):
        return None
    if any(isinstance(p, Partial) for p in placements) or hasattr(dt._local_tensor, "__create_write_items__"):
        return None
    if dt.device_mesh.get_coordinate() is None or dt._local_tensor.numel() == 0:
        return None
    boxes = _boxes_for(dt.shape, dt.device_mesh, placements)
    return boxes if len(boxes) > 1 else None


def _view(local: torch.Tensor, box: _Box) -> torch.Tensor:
    _, sizes, starts = box
    for dim, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        local = local.narrow(dim, start, size)
    return local


def _with_boxes_write(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_write_items(self: DTensor, fqn: str, object: Any) -> Any:
        boxes = _boxes(self)
        if boxes is None:
            return original(self, fqn, object)
        properties = TensorProperties.create_from_tensor(self.to_local())
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes), properties=properties, size=self.size()
                ),
            )
            for offsets, sizes, _ in boxes
        ]

    create_write_items._coc_strided = True
    return create_write_items


def _with_boxes_chunks(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_chunk_list(self: DTensor) -> Any:
        boxes = _boxes(self)
        if boxes is None:
            return original(self)
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in boxes]

    create_chunk_list._coc_strided = True
    return create_chunk_list


def _with_boxes_shard(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_tensor_shard(self: DTensor, index: Any) -> torch.Tensor:
        boxes = _boxes(self)
        if boxes is None:
            return original(self, index)
        # DCP names a chunk by its global offsets (index.index is a hint into the list the planner saw)
        hint = getattr(index, "index", None)
        if hint is not None and 0 <= hint < len(boxes) and boxes[hint][0] == index.offset:
            return _view(self.to_local(), boxes[hint])
        for box in boxes:
            if box[0] == index.offset:
                return _view(self.to_local(), box)
        raise ValueError(
            f"autopar: no chunk of the strided DTensor {index.fqn!r} starts at {index.offset} on this rank "
            f"(its chunks start at {[list(b[0]) for b in boxes]})"
        )

    get_tensor_shard._coc_strided = True
    return get_tensor_shard


_WRAPPERS = {
    "__create_write_items__": _with_boxes_write,
    "__create_chunk_list__": _with_boxes_chunks,
    "__get_tensor_shard__": _with_boxes_shard,
}


def _known(method: Any, parameters: list[str]) -> bool:
    return callable(method) and list(inspect.signature(method).parameters) == parameters


def install() -> bool:
    """Make ``dcp.save`` / ``dcp.load`` place strided shards right (idempotent). Returns whether the correction
    is in place; warns when torch's checkpoint protocol changed so that it cannot be."""
    methods = {name: DTensor.__dict__.get(name) for name in _PROTOCOL}
    if all(getattr(m, "_coc_strided", False) for m in methods.values()):
        return True
    known = ChunkStorageMetadata is not None and all(_known(methods[n], p) for n, p in _PROTOCOL.items())
    if _StridedShard is None or not known:
        warnings.warn(
            "autopar: this torch's DTensor checkpoint protocol differs from the one autopar corrects; "
            "torch.distributed.checkpoint (dcp.save / dcp.load) of packed (strided) weights is unchecked: gather "
            "them (get_model_state_dict with StateDictOptions(full_state_dict=True)) and save the full state dict",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    for name, wrap in _WRAPPERS.items():
        if not getattr(methods[name], "_coc_strided", False):
            setattr(DTensor, name, wrap(methods[name]))
    return True
