"""Fused and overlapped communication-computation operators (docs/api.md section 1).

Each op takes ``x`` with any number of leading dims (communication is along dim 0, or the
``gather_dim`` / ``scatter_dim`` given) and ``weight`` in ``torch.nn.functional.linear`` layout
``[n, k]`` (the all-gathers also take a list of weights: one gather, one output each), and returns a
tensor with the leading dims restored. ``backend=None`` resolves from the COC_* environment
(``kernels.config``); every backend gives the result of ``"sequential"`` within floating-point
tolerance. The dense GEMM ops, the decode norm and the local grouped GEMM are forward-only building blocks
(the autopar linears wrap them in autograd Functions); the MoE ops are differentiable in their plain operands.

Every public function goes the same way (``kernels.protocol``): validate this rank's arguments into one call value,
admit the call collectively on every call (a rank's local error, a call that differs between ranks: the same named
error on every rank), choose the backend among those its op really has, and run its implementation, through the
registered torch operator (``torch.ops.coc.*``) where torch needs one (``torch.compile(fullgraph=True)`` traces one
opaque call per op). The table of every op: ``kernels.ops.table.OPS``.
"""

from __future__ import annotations

import torch.distributed as dist

from . import inductor, name_clash
from .config import CocConfig, get_config
from .fp8 import dequantize_fp8, quantize_fp8
from .inductor import disable_inductor_pass, enable_inductor_pass, use_inductor_pass
from .ops.all_gather import all_gather_matmul, all_gather_scaled_matmul, quantized_all_gather_matmul
from .ops.all_reduce import matmul_all_reduce, quantized_matmul_all_reduce, scaled_matmul_all_reduce
from .ops.all_reduce_rmsnorm import all_reduce_rmsnorm
from .ops.grouped_matmul import grouped_matmul
from .ops.matmul import scaled_matmul
from .ops.moe.ep import moe_check_overflow, moe_combine, moe_dispatch
from .ops.moe.ep_gemm import moe_dispatch_grouped_matmul
from .ops.moe.layout import MoeDispatchHandle
from .ops.moe.routing import MoeRouting
from .ops.moe.tp import all_gather_grouped_matmul, grouped_matmul_reduce_scatter
from .ops.norm import NormOutputs
from .ops.reduce_scatter import matmul_reduce_scatter, quantized_matmul_reduce_scatter, scaled_matmul_reduce_scatter
from .ops.table import OPS
from .quant import quantize_weight

# Before anything runs: another installed 'kernels' distribution would have mixed its files with ours.
name_clash.check(__path__[0])
# COC_INDUCTOR_PASS=1: compiled tensor-parallel models get the coc ops with no code change (docs/inductor.md).
inductor.enable_from_environment()

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
    "all_gather_grouped_matmul",
    "grouped_matmul_reduce_scatter",
    "MoeRouting",
    "moe_dispatch",
    "moe_dispatch_grouped_matmul",
    "moe_combine",
    "MoeDispatchHandle",
    "moe_check_overflow",
    "OPS",
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
