"""The performance model: PREDICTED times, never measurements (reports label them so).

``dense``: the link model (``configs/links.yaml``, or fitted to collective-only timings), the GPU roofline and
the schedules of the dense tensor-parallel ops (``python -m bench.model.dense`` prints the bf16 / FP8 table);
``moe``: the mixture-of-experts ops on the same link models and schedules; ``decode``: the decode path's
all-reduce + residual + RMSNorm. The benchmarks put these predictions beside what they measure.
"""
