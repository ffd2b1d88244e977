"""FP8 (float8_e4m3fn / e5m2 payloads with fp32 scales): quantization, scale layouts and numerics.

* :func:`quantize_fp8` / :func:`dequantize_fp8` (``quantize``; Triton kernel in ``quantize_triton``);
* ``scales``: formats, layouts and the validation of FP8 operands; ``numerics``: the error bounds the
  tests check.

The FP8 ops (``all_gather_scaled_matmul``, ``scaled_matmul_reduce_scatter``, ``scaled_matmul_all_reduce``,
``scaled_matmul``) are the FP8 format of the ops of ``kernels.ops`` (``kernels.format``). docs/fp8.md has
the layouts, the numerics and the recipe of the FP8 linears.
"""

from .quantize import dequantize_fp8, quantize_fp8, quantize_fp8_reference
from .scales import BLOCK, EPS, FP8_DTYPES, FP8_MAX

__all__ = ["BLOCK", "EPS", "FP8_DTYPES", "FP8_MAX", "dequantize_fp8", "quantize_fp8", "quantize_fp8_reference"]
