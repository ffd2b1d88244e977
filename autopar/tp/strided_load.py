"""Full state dicts broadcast from rank 0 into strided shards (packed weights) land where they belong.

``set_model_state_dict`` / ``set_optimizer_state_dict`` with ``StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True)`` hand every rank the full tensor, then torch's private
``torch.distributed._state_dict_utils._distribute_tensors`` keeps ``full[offset : offset + local]`` with the one
offset ``compute_local_shape_and_global_offset`` returns. A ``_StridedShard`` (the packed q/k/v of GPT-2's
``c_attn``, a fused gate/up) is not one contiguous range: rank r owns the r-th piece of every packed block. Without
this module the packed weights and their optimizer moments load silently wrong (a tiny GPT-2's logits 0.37 off).

:func:`install` wraps that function once per process: after torch's slicing, each key whose DTensor has a
``_StridedShard`` placement is overwritten with the local shard ``distribute_tensor(full, mesh, placements,
src_data_rank=None)`` computes from the same full tensor (every rank holds it, so no communication). The other
keys are left exactly as torch made them. Where torch's internals no longer have that function, ``install`` warns
that such loads are unchecked rather than pretending to fix them. It also installs :mod:`autopar.tp.strided_dcp`
(``dcp.save`` / ``dcp.load`` of the same strided shards), so every style that makes one corrects both.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from . import strided_dcp

try:  # private, stable since 2.5
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None

_EXPECTED_PARAMETERS = ["local_state_dict", "keys", "device", "pg"]


def _strided(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], DTensor)
        and any(isinstance(p, _StridedShard) for p in value[0].placements)
    )


def _with_strided_shards(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def distribute(local_state_dict: dict[str, Any], keys: list[str], device: torch.device, pg: Any = None) -> None:
        pending = {key: local_state_dict[key] for key in keys if _strided(local_state_dict.get(key))}
        original(local_state_dict, keys, device, pg)
        for key, (like, full) in pending.items():
            right = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
            local_state_dict[key].to_local().copy_(right)

    distribute._coc_strided = True
    return distribute


def install() -> bool:
    """Make broadcast-from-rank-0 full state dict loads place strided shards right (idempotent). Returns whether
    the correction is in place; warns when torch's internals changed so that it cannot be. The DCP correction
    (:func:`autopar.tp.strided_dcp.install`) is installed beside it and warns on its own."""
    strided_dcp.install()
    try:
        from torch.distributed import _state_dict_utils as utils
    except ImportError:  # pragma: no cover
        utils = None
    original = getattr(utils, "_distribute_tensors", None)
    if original is not None and getattr(original, "_coc_strided", False):
        return True
    known = original is not None and list(inspect.signature(original).parameters) == _EXPECTED_PARAMETERS
    if _StridedShard is None or not known:
        warnings.warn(
            "autopar: this torch's state-dict internals differ from the ones autopar corrects; a full state dict "
            "loaded with StateDictOptions(broadcast_from_rank0=True) into packed (strided) weights is unchecked: "
            "load with full_state_dict=True alone (every rank passes the full dict)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    utils._distribute_tensors = _with_strided_shards(original)
    return True
