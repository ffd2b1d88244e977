"""``python -m bench --mode gpu-check``: one command that turns a GPU machine into a correctness and speed report.

``driver`` (the sections, their budgets and processes, the report; loaded into the gpu-marked pytest run as its
plugin), ``env`` (the environment section), and the speed section's rows: ``speed`` (the dense ops at W = 1,
:mod:`bench.dense.single`), ``moe`` (the MoE ops at W = 1) and ``decode`` (the decode path's fused calls).
"""
