"""FP8 (float8_e4m3fn / e5m2 payloads with fp32 scales) variants of the fused ops, and quantization.

* :func:`quantize_fp8` / :func:`dequantize_fp8` (``quantize``; Triton kernel in ``quantize_triton``);
* :func:`all_gather_scaled_matmul`, :func:`scaled_matmul_reduce_scatter`,
  :func:`scaled_matmul_all_reduce`, :func:`scaled_matmul` (``ops``), registered as ``torch.ops.coc.*``
  (``library``) over the ``sequential`` (reference) and ``chunked`` backends and the fused kernels of
  ``kernels/fused/*_fp8.py``;
* ``scales``: formats, layouts, validation; ``numerics``: the error bounds the tests check.

docs/fp8.md has the layouts, the numerics and the recipe of the FP8 linears.
"""

from .ops import all_gather_scaled_matmul, scaled_matmul, scaled_matmul_all_reduce, scaled_matmul_reduce_scatter
from .quantize import dequantize_fp8, quantize_fp8, quantize_fp8_reference
from .scales import BLOCK, EPS, FP8_DTYPES, FP8_MAX

__all__ = [
    "BLOCK",
    "EPS",
    "FP8_DTYPES",
    "FP8_MAX",
    "all_gather_scaled_matmul",
    "dequantize_fp8",
    "quantize_fp8",
    "quantize_fp8_reference",
    "scaled_matmul",
    "scaled_matmul_all_reduce",
    "scaled_matmul_reduce_scatter",
]
