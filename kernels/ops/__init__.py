"""The ops, one module per op family: its public functions, call value, implementations per backend and table entry
(:class:`kernels.protocol.OpSpec`); the table of every op is :data:`kernels.ops.table.OPS`.

* :mod:`.gemm`: the dense GEMM family's call value, operands and validation, shared by its patterns
  :mod:`.all_gather`, :mod:`.reduce_scatter`, :mod:`.all_reduce` (with the RMSNorm epilogue) and :mod:`.matmul`
  (local);
* :mod:`.all_reduce_rmsnorm` (the decode path's layer end) and :mod:`.norm` (the epilogue both norm ops share);
* :mod:`.grouped_matmul` (local, rows grouped by expert);
* :mod:`.moe`: the mixture-of-experts ops, tensor-parallel (:mod:`.moe.tp`) and expert-parallel (:mod:`.moe.ep`,
  :mod:`.moe.ep_gemm`), their routing, layout, payloads and autograd.
"""
