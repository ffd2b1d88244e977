"""autopar: tensor-parallel layers and distributed tensors on top of the overlapped ops in ``kernels``."""

from .tp import (ColumnParallelLinear, ParallelConfig, QuantizedRowParallelLinear, RowParallelLinear,
                 patch_megatron, quantize_row_parallel_linear, unpatch_megatron)
from .dtensor import (DistTensor, Partial, Placement, ProcessMesh, Replicate, Shard,
                      attach_local_grads, from_dtensor, is_clipped, reshard, shard_tensor,
                      stage_meshes, sync_gradients, to_dtensor, to_stage)
