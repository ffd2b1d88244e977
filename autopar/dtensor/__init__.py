"""Distributed tensors: ``ProcessMesh``, placements (torch's own), ``DistTensor`` (a ``torch.Tensor``), SPMD
rules, ``reshard``, gradient sync and pipeline stages. See docs/dtensor.md.

Module layout (imports go downwards only): ``placements``, ``mesh`` -> ``redistribute`` (local
pieces and collectives) -> ``tensor`` (the class, construction, serialization) -> ``autograd``
(nodes, reshard) -> ``ops`` (rules-based ops, one module per op family), ``aten`` (what reaches
``__torch_dispatch__``) -> ``grad_sync``, ``pipeline``, ``interop``.
"""

from . import aten as _aten  # noqa: F401  (registers the __torch_dispatch__ handlers)
from . import ops as _ops  # noqa: F401  (registers the __torch_function__ handlers)
from .autograd import reshard
from .grad_sync import attach_local_grads, sync_gradients
from .interop import from_dtensor, to_dtensor
from .mesh import ProcessMesh
from .pipeline import is_clipped, stage_meshes, to_stage
from .placements import Partial, Placement, Replicate, Shard
from .tensor import DistTensor, shard_tensor

__all__ = [
    "DistTensor",
    "Partial",
    "Placement",
    "ProcessMesh",
    "Replicate",
    "Shard",
    "attach_local_grads",
    "from_dtensor",
    "is_clipped",
    "reshard",
    "shard_tensor",
    "stage_meshes",
    "sync_gradients",
    "to_dtensor",
    "to_stage",
]
