"""Benchmarks of the fused / overlapped tensor-parallel ops, and a performance model.

Run ``python -m bench --help``. Sub-packages by job: ``harness`` (the suites of configs/bench/*.yaml and their
cases, rank launching, do_bench-style timing across ranks, the reports), ``model`` (predicted times from GEMM
time and the link model of configs/links.yaml). Modules: ``runner`` (what each rank does), ``single``
(single-GPU fixed costs).
"""
