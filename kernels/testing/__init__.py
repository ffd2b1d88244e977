"""The testing toolkit shared by tests/, bench/ (gpu-check included) and the demo.

* :mod:`~kernels.testing.ranks`: the one rank spawner, pooled per ``(world, backend, device)``
  (gloo ranks on CPU under the Triton interpreter, processes sharing a GPU, NCCL one GPU per rank),
  bounded by timeouts, reporting ranks that raise, hang or die;
* :mod:`~kernels.testing.reference`: input builders, the fp64 reference of the ops, the one
  tolerance rule (derived from dtype, k and W) and :func:`assert_close`;
* :mod:`~kernels.testing.fp8`: the same for the FP8 ops (inputs, the fp64 reference of the
  dequantized inputs and the bound of ``kernels.fp8.numerics``);
* :mod:`~kernels.testing.heap`: heap presizing and scrambling before a checked call;
* :mod:`~kernels.testing.program_order`: run an interpreted launch's programs in another order.
* :mod:`~kernels.testing.compile`: a ``torch.compile`` backend with Inductor's graph passes and no code
  generation (tests of graph rewrites);
* :mod:`~kernels.testing.calls`: a counter of the backend runs behind the registered operators, a
  recorder of the registered-operator calls the public functions make, and the outcomes (named errors) of calls.

docs/testing.md describes how tests use it.
"""

from kernels.testing.calls import BACKEND_ENVS, backend_calls, environment, operator_calls, outcomes
from kernels.testing.heap import heap_device, presize, scramble
from kernels.testing.ranks import REPO_ROOT, RankFailure, assert_no_errors, close_pools, run_ranks
from kernels.testing.reference import (
    OPS,
    assert_close,
    make_inputs,
    quantized_weights,
    reference,
    row_norm_bound,
    rows_of,
    seeded_randn,
    tolerance,
)

__all__ = [
    "OPS",
    "REPO_ROOT",
    "RankFailure",
    "assert_close",
    "assert_no_errors",
    "BACKEND_ENVS",
    "backend_calls",
    "close_pools",
    "environment",
    "heap_device",
    "make_inputs",
    "operator_calls",
    "outcomes",
    "presize",
    "quantized_weights",
    "reference",
    "row_norm_bound",
    "rows_of",
    "run_ranks",
    "scramble",
    "seeded_randn",
    "tolerance",
]
