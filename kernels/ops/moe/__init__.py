"""Mixture-of-experts ops: tensor-parallel (:mod:`.tp`: all-gather + grouped GEMM, grouped GEMM + reduce-scatter)
and expert-parallel (:mod:`.ep`: dispatch / combine; :mod:`.ep_gemm`: the dispatch fused with the first expert
GEMM), with their routing (:mod:`.routing`), expert-parallel layout and movement (:mod:`.layout`), FP8 payloads
(:mod:`.payload`) and autograd (:mod:`.autograd`)."""
