"""The table of every op: registered operator name -> its :class:`kernels.protocol.OpSpec` (call class, schema,
fake and the backends it really implements). Written out here, not filled by imports; a test checks it against
``torch.ops.coc`` and docs/api.md.

=================================  ===========================================================  ==================
registered operator                public functions                                             backends
=================================  ===========================================================  ==================
coc::all_gather_matmul             all_gather_matmul, all_gather_scaled_matmul,                 seq, chunked, fused
                                   quantized_all_gather_matmul
coc::matmul_reduce_scatter         matmul_reduce_scatter, scaled_matmul_reduce_scatter,         seq, chunked, fused
                                   quantized_matmul_reduce_scatter
coc::matmul_all_reduce             matmul_all_reduce, scaled_matmul_all_reduce,                 seq, chunked, fused
                                   quantized_matmul_all_reduce
coc::matmul_all_reduce_rmsnorm     the same three with ``residual=`` and ``norm_weight=``        seq, fused
coc::matmul                        scaled_matmul (local)                                        seq, fused
coc::all_reduce_rmsnorm            all_reduce_rmsnorm                                           seq, fused
coc::grouped_matmul                grouped_matmul (local)                                       seq, fused
coc::all_gather_grouped_matmul     all_gather_grouped_matmul                                    seq, chunked, fused
coc::grouped_matmul_reduce_scatter grouped_matmul_reduce_scatter                                seq, chunked, fused
coc::moe_dispatch                  moe_dispatch                                                 seq, chunked, fused
coc::moe_combine                   moe_combine                                                  seq, chunked, fused
coc::moe_dispatch_grouped_matmul   moe_dispatch_grouped_matmul                                  seq, chunked, fused
=================================  ===========================================================  ==================
"""

from __future__ import annotations

from collections.abc import Mapping

from ..protocol import OpSpec
from . import all_gather, all_reduce, all_reduce_rmsnorm, grouped_matmul, matmul, reduce_scatter
from .moe import ep, ep_gemm, tp

OPS: Mapping[str, OpSpec] = {
    "all_gather_matmul": all_gather.SPEC,
    "matmul_reduce_scatter": reduce_scatter.SPEC,
    "matmul_all_reduce": all_reduce.SPEC,
    "matmul_all_reduce_rmsnorm": all_reduce.NORM_SPEC,
    "matmul": matmul.SPEC,
    "all_reduce_rmsnorm": all_reduce_rmsnorm.SPEC,
    "grouped_matmul": grouped_matmul.SPEC,
    "all_gather_grouped_matmul": tp.GATHER_SPEC,
    "grouped_matmul_reduce_scatter": tp.SCATTER_SPEC,
    "moe_dispatch": ep.DISPATCH_SPEC,
    "moe_combine": ep.COMBINE_SPEC,
    "moe_dispatch_grouped_matmul": ep_gemm.SPEC,
}
