"""A sharded model's parameters read straight from a safetensors checkpoint, each rank reading its shards only.

:func:`load_shards` fills a model that :func:`autopar.parallelize_hf` sharded while its parameters were on the
meta device (``with torch.device("meta"): model = AutoModelForCausalLM.from_config(config)``): for every
parameter it reads from the checkpoint the elements this rank's DTensor holds (the global indices along the
sharded dim come from the placement itself, ``distribute_tensor`` of an index vector, so ``Shard``,
``_StridedShard`` (packed q/k/v) and uneven shards all read exactly what ``distribute_tensor`` would keep) and
replaces the parameter with the local tensor on the mesh's device. Nothing but the local shards is allocated:
the file is read with positioned reads into the shard's buffer (no memory map, whose touched pages would count
as the process's), row segment by row segment for a dim other than 0.

The checkpoint is a directory written by ``save_pretrained`` (``model.safetensors`` or a sharded one with
``model.safetensors.index.json``) or a ``.safetensors`` file; its keys must be the model's state-dict keys (a
tied parameter is found under any of its names). Non-persistent buffers left on the meta device (rotary
``inv_freq``) are created on the device and initialized by the model's own ``_init_weights``, as
``from_pretrained`` does.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

try:  # private, stable since 2.5
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _Entry:
    """One tensor of a safetensors file: where its bytes are, its dtype and shape."""

    def __init__(self, path: Path, start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.path, self.start, self.dtype, self.shape = path, start, dtype, shape


def _read_header(path: Path) -> dict[str, _Entry]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    base = 8 + size
    entries = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"load_shards: {path} stores {key} as {meta['dtype']}, which autopar cannot read")
        entries[key] = _Entry(path, base + meta["data_offsets"][0], _DTYPES[meta["dtype"]], tuple(meta["shape"]))
    return entries


def checkpoint_entries(checkpoint: str | os.PathLike) -> dict[str, _Entry]:
    """Every tensor of the checkpoint by key (a file, or a directory with one file or an index of files)."""
    path = Path(checkpoint)
    if path.is_file():
        return _read_header(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        entries: dict[str, _Entry] = {}
        for name in files:
            entries.update(_read_header(path / name))
        return entries
    single = path / "model.safetensors"
    if single.is_file():
        return _read_header(single)
    raise FileNotFoundError(
        f"load_shards: {path} holds neither model.safetensors nor model.safetensors.index.json (save the model "
        "with save_pretrained, safe_serialization on)"
    )


def index_runs(indices: torch.Tensor) -> Iterator[tuple[int, int]]:
    """``(start, length)`` of each run of consecutive values in a 1-D index vector."""
    values = indices.tolist()
    start = prev = None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            yield start, prev - start + 1
            start = prev = v
    if start is not None:
        yield start, prev - start + 1


def _held_indices(param: DTensor) -> tuple[int | None, torch.Tensor | None]:
    """``(dim, global indices along it)`` of the elements this rank's shard holds; ``(None, None)`` when
    replicated. The placement distributes an index vector exactly as it distributes the parameter."""
    mesh = param.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"load_shards: a 1-D tensor-parallel mesh is needed, got a {mesh.ndim}-D one")
    (placement,) = param.placements
    if isinstance(placement, Replicate):
        return None, None
    if _StridedShard is not None and isinstance(placement, _StridedShard):
        along0 = _StridedShard(0, split_factor=placement.split_factor)
    elif isinstance(placement, Shard):
        along0 = Shard(0)
    else:
        raise ValueError(f"load_shards: parameters placed {placement} cannot be read from a full checkpoint")
    dim = placement.dim % param.dim()
    size = param.shape[dim]
    held = distribute_tensor(torch.arange(size), mesh, [along0], src_data_rank=None).to_local()
    return dim, held.cpu()


def _read(entry: _Entry, dim: int | None, held: torch.Tensor | None) -> torch.Tensor:
    """The checkpoint tensor's elements at ``held`` along ``dim`` (all of it for None), in its stored dtype."""
    shape = entry.shape
    if dim is None:
        local_shape, outer, runs = shape, 1, [(0, shape[0] if shape else 1)]
        dim = 0
    else:
        local_shape = shape[:dim] + (len(held),) + shape[dim + 1 :]
        outer, runs = math.prod(shape[:dim]), list(index_runs(held))
    inner = math.prod(shape[dim + 1 :]) * entry.dtype.itemsize
    out = torch.empty(local_shape, dtype=entry.dtype)
    buffer = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else memoryview(b"")
    pos = 0
    size_d = shape[dim] if shape else 1
    with open(entry.path, "rb", buffering=0) as f:
        for o in range(outer):
            for start, length in runs:
                nbytes = length * inner
                offset = entry.start + (o * size_d + start) * inner
                got = os.preadv(f.fileno(), [buffer[pos : pos + nbytes]], offset) if nbytes else 0
                if got != nbytes:
                    raise OSError(f"load_shards: short read of {entry.path} at byte {offset} ({got} of {nbytes})")
                pos += nbytes
    return out


def _aliases(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """Every (module, attribute, qualified name) under which each parameter object is reachable (ties)."""
    out: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((module, name, f"{prefix}.{name}" if prefix else name))
    return out


def load_shards(model: nn.Module, checkpoint: str | os.PathLike, *, device: torch.device) -> None:
    """Replace every parameter of ``model`` (plain or a 1-D-mesh DTensor) with this rank's part of the
    checkpoint's tensor, on ``device``, in the parameter's dtype (module docstring)."""
    entries = checkpoint_entries(checkpoint)
    for aliases in _aliases(model).values():
        module, attr, _ = aliases[0]
        param = module._parameters[attr]
        key = next((q for _, _, q in aliases if q in entries), None)
        if key is None:
            names = ", ".join(q for _, _, q in aliases)
            raise KeyError(f"load_shards: the checkpoint {checkpoint} has no tensor for {names}")
        entry = entries[key]
        if entry.shape != tuple(param.shape):
            raise ValueError(
                f"load_shards: {key} is {list(entry.shape)} in the checkpoint, {list(param.shape)} in the model"
            )
        if isinstance(param, DTensor):
            dim, held = _held_indices(param)
            local = _read(entry, dim, held).to(device=device, dtype=param.dtype)
            value = DTensor.from_local(
                local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
        else:
            value = _read(entry, None, None).to(device=device, dtype=param.dtype)
        new = nn.Parameter(value, requires_grad=param.requires_grad)
        for owner, name, _ in aliases:
            owner._parameters[name] = new
    _materialize_buffers(model, entries, device)


def _materialize_buffers(model: nn.Module, entries: dict[str, _Entry], device: torch.device) -> None:
    """Buffers on the meta device: persistent ones from the checkpoint; non-persistent ones created on ``device``
    and filled by the model's ``_init_weights`` (their modules hold no parameters: rotary embeddings)."""
    for prefix, module in model.named_modules():
        meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        refill = False
        for name in meta:
            key = f"{prefix}.{name}" if prefix else name
            if name not in module._non_persistent_buffers_set and key in entries:
                module._buffers[name] = _read(entries[key], None, None).to(device=device)
                continue
            if module._parameters or not callable(getattr(model, "_init_weights", None)):
                raise ValueError(
                    f"load_shards: buffer {key} is on the meta device and neither in the checkpoint nor rebuilt by "
                    "the model's _init_weights; build the model with its buffers on a real device"
                )
            module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
            refill = True
        if refill:
            model._init_weights(module)
