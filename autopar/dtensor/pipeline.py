"""Pipeline stages as sub-meshes, with the non-computation clip.

Every rank builds the same model and runs the same program. Stage ``s``'s parameters and ops live
on ``stages[s]``; activations cross stages with :func:`autopar.reshard` to the next stage's mesh
(send/recv), and that reshard's backward sends the gradient back. On a rank outside a stage, the
stage's ops only infer placements and global shapes and return uninitialized DistTensors (no
storage), so ``loss.backward()`` can run everywhere: it does work only where there is data.

Ops whose output shape depends on the data (``nonzero``, ``masked_select``, ...) have no rule and
raise ``NotImplementedError``; a clipped rank could not know their shape.
"""

from __future__ import annotations

from collections.abc import Sequence

from .autograd import reshard
from .mesh import ProcessMesh
from .placements import Placement
from .tensor import DistTensor


def stage_meshes(mesh: ProcessMesh, pp_dim: int | str = 0) -> list[ProcessMesh]:
    """The sub-meshes of ``mesh`` along its pipeline dim ``pp_dim``, stage 0 first. Collective."""
    return [mesh.get_submesh(pp_dim, i) for i in range(mesh.get_dim_size(pp_dim))]


def to_stage(x: DistTensor, stage_mesh: ProcessMesh, placements: Sequence[Placement]) -> DistTensor:
    """Send an activation to the next stage: ``reshard`` across meshes (differentiable)."""
    return reshard(x, stage_mesh, placements)


def is_clipped(x: DistTensor) -> bool:
    """True on a rank that holds no data for ``x`` (outside its mesh)."""
    return not x.is_initialized()
