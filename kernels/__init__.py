"""Fused and overlapped communication-computation operators (docs/api.md section 1).

Each op takes ``x`` with any number of leading dims (communication is along dim 0, or the
``gather_dim`` / ``scatter_dim`` given) and ``weight`` in ``torch.nn.functional.linear`` layout
``[n, k]`` (the all-gathers also take a list of weights: one gather, one output each), and returns a
tensor with the leading dims restored. ``backend=None`` resolves from the COC_* environment
(``kernels.config``); every backend gives the result of ``"sequential"`` within floating-point
tolerance. The ops are forward-only building blocks: the autopar linears wrap them in autograd
Functions.

One implementation per communication pattern (``kernels.ops``: all_gather, reduce_scatter, all_reduce),
with the operand format a parameter (``kernels.format``): plain, FP8 (``*_scaled_*``) and int8 weights
(``quantized_*``). Each public function validates, admits the call across the ranks
(``kernels.callcheck``), chooses the backend (``kernels.dispatch``) and makes one call to its pattern's
registered torch operator (``torch.ops.coc.*``), so the ops trace whole under
``torch.compile(fullgraph=True)``: one opaque call per op in the graph.
"""

from __future__ import annotations

import torch.distributed as dist

from . import inductor_pass, name_clash
from .config import CocConfig, get_config
from .fp8 import dequantize_fp8, quantize_fp8
from .inductor_pass import disable_inductor_pass, enable_inductor_pass, use_inductor_pass
from .ops.all_gather import all_gather_matmul, all_gather_scaled_matmul, quantized_all_gather_matmul
from .ops.all_reduce import matmul_all_reduce, quantized_matmul_all_reduce, scaled_matmul_all_reduce
from .ops.all_reduce_rmsnorm import all_reduce_rmsnorm
from .ops.grouped_matmul import grouped_matmul, grouped_matmul_reference
from .ops.matmul import scaled_matmul
from .ops.moe import (
    MoeRouting,
    all_gather_grouped_matmul,
    all_gather_grouped_matmul_reference,
    grouped_matmul_reduce_scatter,
    grouped_matmul_reduce_scatter_reference,
)
from .ops.moe_ep import moe_check_overflow, moe_combine, moe_combine_reference, moe_dispatch, moe_dispatch_reference
from .ops.moe_ep_gemm import moe_dispatch_grouped_matmul, moe_dispatch_grouped_matmul_reference
from .ops.moe_ep_routing import MoeDispatchHandle
from .ops.norm import NormOutputs
from .ops.reduce_scatter import matmul_reduce_scatter, quantized_matmul_reduce_scatter, scaled_matmul_reduce_scatter
from .quant import quantize_weight

# Before anything runs: another installed 'kernels' distribution would have mixed its files with ours.
name_clash.check(__path__[0])
# COC_INDUCTOR_PASS=1: compiled tensor-parallel models get the coc ops with no code change (docs/inductor.md).
inductor_pass.enable_from_environment()

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "get_config",
    "CocConfig",
    "quantize_weight",
    "quantized_all_gather_matmul",
    "quantized_matmul_reduce_scatter",
    "quantized_matmul_all_reduce",
    "check_errors",
    "enable_inductor_pass",
    "disable_inductor_pass",
    "use_inductor_pass",
    "quantize_fp8",
    "dequantize_fp8",
    "all_gather_scaled_matmul",
    "scaled_matmul_reduce_scatter",
    "scaled_matmul_all_reduce",
    "scaled_matmul",
    "all_reduce_rmsnorm",
    "NormOutputs",
    "grouped_matmul",
    "grouped_matmul_reference",
    "all_gather_grouped_matmul",
    "all_gather_grouped_matmul_reference",
    "grouped_matmul_reduce_scatter",
    "grouped_matmul_reduce_scatter_reference",
    "MoeRouting",
    "moe_dispatch",
    "moe_dispatch_reference",
    "moe_dispatch_grouped_matmul",
    "moe_dispatch_grouped_matmul_reference",
    "moe_combine",
    "moe_combine_reference",
    "MoeDispatchHandle",
    "moe_check_overflow",
]


def check_errors(group: dist.ProcessGroup | None = None) -> None:
    """Raise the ``RuntimeError`` of a fused call that failed and was not reported yet.

    A fused call queues its kernels and returns without waiting for the device; a wait that timed
    out or a peer that made a different call is recorded by the kernels in host memory, and
    reported by the next fused call on the group or by this function (for ``group``, or every
    group when None), naming the op, this rank, the peer and what was awaited. It reads host
    memory only: call it after ``torch.cuda.synchronize()`` to cover every call made so far.
    Nothing to report (or no fused call ever made) returns None.
    """
    import sys

    # Without a fused call the fused package (and Triton) need not be imported at all.
    if "kernels.fused.runtime" in sys.modules:
        sys.modules["kernels.fused.runtime"].check_errors(group)
