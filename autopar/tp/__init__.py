"""Tensor parallelism, Megatron-compatible: the column- and row-parallel linears, their autograd
Functions, ``patch_megatron``, the w8A16 row-parallel layer and ``ParallelConfig``.

Layout: ``comm`` (process groups and collectives), ``wgrad`` (weight gradient), ``functions`` (the
four autograd Functions), ``forward`` (the forwards shared with patched Megatron modules),
``layers`` (the modules), ``megatron``, ``quantized``, ``parallel_config``.
"""

from .comm import resolve_tp_group
from .forward import column_parallel_forward, row_parallel_forward
from .functions import (
    ColumnParallelLinearFunction,
    ColumnParallelLinearSPFunction,
    RowParallelLinearFunction,
    RowParallelLinearSPFunction,
)
from .layers import ColumnParallelLinear, RowParallelLinear
from .megatron import is_megatron_patched, patch_megatron, unpatch_megatron
from .parallel_config import ParallelConfig
from .quantized import QuantizedRowParallelLinear, quantize_row_parallel_linear

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ColumnParallelLinearFunction",
    "ColumnParallelLinearSPFunction",
    "RowParallelLinearFunction",
    "RowParallelLinearSPFunction",
    "column_parallel_forward",
    "row_parallel_forward",
    "resolve_tp_group",
    "patch_megatron",
    "unpatch_megatron",
    "is_megatron_patched",
    "ParallelConfig",
    "QuantizedRowParallelLinear",
    "quantize_row_parallel_linear",
]
