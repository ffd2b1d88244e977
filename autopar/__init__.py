"""autopar: tensor-parallel layers and distributed tensors on top of the overlapped ops in ``kernels``."""

from .linear import ColumnParallelLinear, RowParallelLinear
from .megatron import patch_megatron, unpatch_megatron
from .parallel_config import ParallelConfig
from .quantized import QuantizedRowParallelLinear, quantize_row_parallel_linear
from .mesh import ProcessMesh
from .placements import Partial, Placement, Replicate, Shard
from .dist_tensor import DistTensor, shard_tensor
from .reshard import reshard
from .grad_sync import attach_local_grads, sync_gradients
from .pipeline import is_clipped, stage_meshes, to_stage
