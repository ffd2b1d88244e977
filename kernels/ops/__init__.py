"""The ops, one module per communication pattern, each holding its public functions (one per operand format),
its registered operator and its implementation per backend.

=====================  ==========================================================  ===========================
pattern                public functions                                            registered operator
=====================  ==========================================================  ===========================
all_gather             all_gather_matmul, all_gather_scaled_matmul,                coc::all_gather_matmul
                       quantized_all_gather_matmul
reduce_scatter         matmul_reduce_scatter, scaled_matmul_reduce_scatter,        coc::matmul_reduce_scatter
                       quantized_matmul_reduce_scatter
all_reduce             matmul_all_reduce, scaled_matmul_all_reduce,                coc::matmul_all_reduce
                       quantized_matmul_all_reduce
matmul                 scaled_matmul (local, no communication)                     coc::matmul
all_reduce_rmsnorm     all_reduce_rmsnorm (no GEMM: the decode path's layer end)   coc::all_reduce_rmsnorm
grouped_matmul         grouped_matmul (local, rows grouped by expert)              coc::grouped_matmul
moe                    all_gather_grouped_matmul, grouped_matmul_reduce_scatter    coc::all_gather_grouped_matmul,
                       (tensor-parallel experts)                                   coc::grouped_matmul_reduce_scatter
=====================  ==========================================================  ===========================

:data:`TABLE` (``kernels.call.IMPLEMENTATIONS``, which each pattern module fills at import) maps each
pattern to its implementations by backend (``sequential``: the reference, ``chunked``, ``fused``): the
registered operators and the tuner look an implementation up there, in one place.
"""

from ..call import IMPLEMENTATIONS as TABLE
from . import all_gather, all_reduce, all_reduce_rmsnorm, matmul, reduce_scatter

__all__ = ["TABLE", "all_gather", "all_reduce", "all_reduce_rmsnorm", "matmul", "reduce_scatter"]
