"""Tensor parallelism, Megatron-compatible: the column- and row-parallel linears, their autograd
Functions, ``patch_megatron``, the w8A16 row-parallel layer and ``ParallelConfig``.

Layout: ``comm`` (process groups and collectives), ``wgrad`` (weight gradient), ``options`` (the
Functions' one options value), ``operands`` (the plain operand format), ``fp8`` (the FP8 recipe, the
other operand format), ``functions`` (the four autograd Functions), ``forward`` (the forwards shared with
patched Megatron modules), ``layers`` (the modules), ``megatron``, ``quantized``, ``parallel_config``;
``styles`` (ParallelStyles for torch's ``parallelize_module`` on the same Functions), ``shared_gather``
(one all-gather for sibling column linears), ``hf`` (transformers' tp_plan strings mapped to them) and
``hf_sizes`` (the sizes such a plan splits, checked against the mesh size).
"""

from .comm import resolve_tp_group
from .convert import mark_sequence_parallel, sequence_parallel_grad_hooks, sum_sequence_parallel_grads
from .forward import column_parallel_forward, row_parallel_forward
from .fp8 import Fp8Recipe
from .functions import (
    ColumnParallelLinearFunction,
    ColumnParallelLinearSPFunction,
    RowParallelLinearFunction,
    RowParallelLinearSPFunction,
)
from .hf import coc_style, full_state_dict, hf_tp_plan, parallelize_hf, tied_weights_to_keep
from .layers import ColumnParallelLinear, RowParallelLinear
from .megatron import is_megatron_patched, patch_megatron, unpatch_megatron
from .options import LinearOptions
from .parallel_config import ParallelConfig
from .quantized import QuantizedRowParallelLinear, quantize_row_parallel_linear
from .styles import CocColwiseParallel, CocRowwiseParallel, CocSequenceParallel, share_input_gather

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ColumnParallelLinearFunction",
    "ColumnParallelLinearSPFunction",
    "RowParallelLinearFunction",
    "RowParallelLinearSPFunction",
    "Fp8Recipe",
    "LinearOptions",
    "column_parallel_forward",
    "row_parallel_forward",
    "resolve_tp_group",
    "patch_megatron",
    "unpatch_megatron",
    "is_megatron_patched",
    "ParallelConfig",
    "QuantizedRowParallelLinear",
    "quantize_row_parallel_linear",
    "CocColwiseParallel",
    "CocRowwiseParallel",
    "CocSequenceParallel",
    "coc_style",
    "full_state_dict",
    "hf_tp_plan",
    "parallelize_hf",
    "share_input_gather",
    "tied_weights_to_keep",
    "mark_sequence_parallel",
    "sequence_parallel_grad_hooks",
    "sum_sequence_parallel_grads",
]
