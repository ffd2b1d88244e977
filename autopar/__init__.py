"""autopar: tensor-parallel layers and distributed tensors on top of the overlapped ops in ``kernels``."""

from .linear import ColumnParallelLinear, RowParallelLinear
from .megatron import patch_megatron, unpatch_megatron
from .parallel_config import ParallelConfig
from .quantized import QuantizedRowParallelLinear, quantize_row_parallel_linear
