"""autopar: tensor-parallel layers and distributed tensors on top of the overlapped ops in ``kernels``."""

import kernels as _kernels

if not hasattr(_kernels, "all_gather_matmul"):
    # Another distribution's 'kernels' package replaced CoC's (kernels/name_clash.py explains).
    raise ImportError(
        f"autopar needs CoC's 'kernels' package, but 'import kernels' gave {_kernels.__file__}: another "
        "distribution with the import name 'kernels' (such as Hugging Face's) overwrote it. Reinstall coc-overlap "
        "in an environment without it"
    )

from .dtensor import (
    DistTensor,
    Partial,
    Placement,
    ProcessMesh,
    Replicate,
    Shard,
    attach_local_grads,
    from_dtensor,
    is_clipped,
    reshard,
    shard_tensor,
    stage_meshes,
    sync_gradients,
    to_dtensor,
    to_stage,
)
from .tp import (
    CocColwiseParallel,
    CocRowwiseParallel,
    CocSequenceParallel,
    ColumnParallelLinear,
    ParallelConfig,
    QuantizedRowParallelLinear,
    RowParallelLinear,
    hf_tp_plan,
    mark_sequence_parallel,
    parallelize_hf,
    patch_megatron,
    quantize_row_parallel_linear,
    sequence_parallel_grad_hooks,
    sum_sequence_parallel_grads,
    unpatch_megatron,
)
from .tp.fp8 import Fp8Recipe
from .tp.hf_registry import register_hf as register_hf
from .tp.hf_registry import unregister_hf as unregister_hf

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
    "CocColwiseParallel",
    "CocRowwiseParallel",
    "CocSequenceParallel",
    "ColumnParallelLinear",
    "Fp8Recipe",
    "hf_tp_plan",
    "mark_sequence_parallel",
    "parallelize_hf",
    "sequence_parallel_grad_hooks",
    "sum_sequence_parallel_grads",
    "ParallelConfig",
    "QuantizedRowParallelLinear",
    "RowParallelLinear",
    "patch_megatron",
    "quantize_row_parallel_linear",
    "unpatch_megatron",
]
